"""Fused copy + RoPE between the store's staging buffer and the paged pool.

The pool holds K after RoPE. The inference adapter stores K as the pool holds it and moves
it with plain copies (``rope=None``); the rotating forms serve a caller whose staging holds K
before RoPE. Two directions, one kernel (``_copy_blocks_kernel``, ``SAVE`` picks the
direction):

- ``load_blocks``: staging -> pool. V is copied; K is rotated to ``positions``, the positions
  the tokens occupy *now* (a truncated context shifts them).
- ``save_blocks``: pool -> staging. V is copied; K is un-rotated from ``positions``, the
  positions the tokens were rotated to, so the staging buffer holds pre-RoPE K.

With ``rope=None`` both are plain copies. Layouts (see ``kvstore.kernels.paged``)::

    staging:      [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]
    kv_pool:      [num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]
    slot_mapping: [num_blocks, block_tokens] int64, the pool slot of each token, -1 to skip
    positions:    [num_blocks, block_tokens] int32/int64, each < rope.max_positions

Slots must be distinct. The kernel tiles head_dim padded to a power of two and masks the
tail lanes. The torch references (``*_reference``) do the same float32 arithmetic in the same
order, so the Triton kernels match them bit for bit; bfloat16 results are rounded to
nearest-even by hand because the Triton interpreter truncates.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvstore.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_head_dim,
    check_size,
    check_tensor,
    head_dim_tile,
)
from kvstore.kernels.paged import POOL_SHAPE
from kvstore.kernels.rope import RopeTables, apply_rope
from kvstore.kernels.tuning import Launch, Tuner, bucket

STAGING_SHAPE = "[num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]"
TOKENS_SHAPE = "[num_blocks, block_tokens]"
# Elements of K (and as many of V) one copy program moves: 16 KiB of each in 16-bit dtypes on
# CUDA; less under the interpreter, whose tests then reach several tiles per block.
COPY_TILE_ELEMENTS = 8192
COPY_TUNER = Tuner("copy_blocks")
INTERPRETER_TILE_ELEMENTS = 1024


@triton.jit
def _round_to_bf16(x):  # type: ignore[no-untyped-def]
    # float32 -> bfloat16, round to nearest even, done on the bits.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit  # type: ignore[untyped-decorator]
def _copy_blocks_kernel(  # type: ignore[no-untyped-def]
    staging_ptr,  # [num_blocks, num_layers, 2, block_tokens, num_kv_heads, HEAD_DIM]
    pool_ptr,  # [num_layers, 2, num_pages, page_tokens, num_kv_heads, HEAD_DIM]
    slots_ptr,  # [num_blocks, block_tokens] int64
    positions_ptr,  # [num_blocks, block_tokens] int
    cos_ptr,  # [max_positions, HEAD_DIM // 2] float32
    sin_ptr,  # [max_positions, HEAD_DIM // 2] float32
    staging_stride_block,
    staging_stride_layer,
    staging_stride_kv,
    pool_stride_layer,
    pool_stride_kv,
    pool_stride_page,
    block_tokens,
    page_tokens,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROTATE: tl.constexpr,
    SAVE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    # A program moves BLOCK_R (token, head) rows of one block's layer, every head of a token
    # side by side: in the staging buffer they are one contiguous run of bytes.
    tiles = tl.cdiv(block_tokens * num_kv_heads, BLOCK_R)
    block = (tl.program_id(0) // tiles).to(tl.int64)
    rows = (tl.program_id(0) % tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    layer = tl.program_id(1).to(tl.int64)
    tokens = rows // num_kv_heads
    heads = rows % num_kv_heads

    in_block = tokens < block_tokens
    token_index = block * block_tokens + tokens
    slots = tl.load(slots_ptr + token_index, mask=in_block, other=-1).to(tl.int64)
    valid = in_block & (slots >= 0)
    mask = valid[:, None]
    staging_rows = block * staging_stride_block + layer * staging_stride_layer + rows * HEAD_DIM
    pool_rows = (
        layer * pool_stride_layer
        + (slots // page_tokens) * pool_stride_page
        + ((slots % page_tokens) * num_kv_heads + heads) * HEAD_DIM
    )
    if SAVE:
        src_k = pool_ptr + pool_rows
        src_v = src_k + pool_stride_kv
        dst_k = staging_ptr + staging_rows
        dst_v = dst_k + staging_stride_kv
    else:
        src_k = staging_ptr + staging_rows
        src_v = src_k + staging_stride_kv
        dst_k = pool_ptr + pool_rows
        dst_v = dst_k + pool_stride_kv

    dims = tl.arange(0, BLOCK_D)[None, :]
    lanes = mask & (dims < HEAD_DIM)
    tl.store(dst_v[:, None] + dims, tl.load(src_v[:, None] + dims, mask=lanes), mask=lanes)
    if ROTATE:
        # Dim i pairs with dim i + HEAD_DIM // 2 of the real head_dim, not of the tile.
        half = tl.arange(0, BLOCK_D // 2)[None, :]
        half_lanes = mask & (half < HEAD_DIM // 2)
        positions = tl.load(positions_ptr + token_index, mask=valid, other=0).to(tl.int64)
        table = positions[:, None] * (HEAD_DIM // 2) + half
        cos = tl.load(cos_ptr + table, mask=half_lanes, other=0.0)
        sin = tl.load(sin_ptr + table, mask=half_lanes, other=0.0)
        if SAVE:
            sin = -sin
        x1 = tl.load(src_k[:, None] + half, mask=half_lanes, other=0.0).to(tl.float32)
        x2 = tl.load(src_k[:, None] + HEAD_DIM // 2 + half, mask=half_lanes, other=0.0)
        x2 = x2.to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        if ROUND_BF16:
            y1 = _round_to_bf16(y1)
            y2 = _round_to_bf16(y2)
        out_type = dst_k.dtype.element_ty
        tl.store(dst_k[:, None] + half, y1.to(out_type), mask=half_lanes)
        tl.store(dst_k[:, None] + HEAD_DIM // 2 + half, y2.to(out_type), mask=half_lanes)
    else:
        tl.store(dst_k[:, None] + dims, tl.load(src_k[:, None] + dims, mask=lanes), mask=lanes)


def copy_rows(block_rows: int, head_dim: int, *, cuda: bool) -> int:
    """(token, head) rows one copy program moves: about ``COPY_TILE_ELEMENTS`` elements of K
    and as many of V on CUDA, a power of two no larger than the block needs."""
    budget = COPY_TILE_ELEMENTS if cuda else INTERPRETER_TILE_ELEMENTS
    return min(budget // head_dim_tile(head_dim), int(triton.next_power_of_2(block_rows)))


def _check_copy_args(
    staging: torch.Tensor,
    kv_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    rope: RopeTables | None,
) -> None:
    check_tensor("kv_pool", kv_pool, shape=POOL_SHAPE, dtypes=FLOAT_DTYPES, contiguous_dims=3)
    device = kv_pool.device
    check_tensor(
        "staging",
        staging,
        shape=STAGING_SHAPE,
        dtypes=(kv_pool.dtype,),
        device=device,
        contiguous_dims=3,
    )
    check_size("kv_pool", kv_pool, 1, 2, "2 (k|v)")
    check_size("staging", staging, 2, 2, "2 (k|v)")
    check_size("staging", staging, 1, kv_pool.size(0), "kv_pool's num_layers")
    check_size("staging", staging, 4, kv_pool.size(4), "kv_pool's num_kv_heads")
    check_size("staging", staging, 5, kv_pool.size(5), "kv_pool's head_dim")
    check_head_dim("kv_pool", kv_pool.size(5))
    check_tensor(
        "slot_mapping",
        slot_mapping,
        shape=TOKENS_SHAPE,
        dtypes=(torch.int64,),
        device=device,
        contiguous_dims=2,
    )
    check_size("slot_mapping", slot_mapping, 0, staging.size(0), "staging's num_blocks")
    check_size("slot_mapping", slot_mapping, 1, staging.size(3), "staging's block_tokens")
    if (positions is None) != (rope is None):
        raise ValueError("positions and rope must be given together (or both left None)")
    if positions is None or rope is None:
        return
    check_tensor(
        "positions",
        positions,
        shape=TOKENS_SHAPE,
        dtypes=INDEX_DTYPES,
        device=device,
        contiguous_dims=2,
    )
    check_size("positions", positions, 0, staging.size(0), "staging's num_blocks")
    check_size("positions", positions, 1, staging.size(3), "staging's block_tokens")
    if rope.head_dim != kv_pool.size(5) or rope.cos.device != device:
        raise ValueError(
            f"rope tables (head_dim {rope.head_dim}, {rope.cos.device}) must match kv_pool "
            f"(head_dim {kv_pool.size(5)}, {device})"
        )


def _copy_blocks_triton(
    staging: torch.Tensor,
    kv_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    rope: RopeTables | None,
    *,
    save: bool,
    launch: Launch | None,
) -> None:
    _check_copy_args(staging, kv_pool, slot_mapping, positions, rope)
    num_blocks, num_layers, _, block_tokens, num_kv_heads, head_dim = staging.shape
    if num_blocks == 0:
        return
    # Without rope the kernel never reads these; any valid pointer will do.
    table = rope.cos if rope is not None else slot_mapping

    rows = block_tokens * num_kv_heads

    def run(chosen: Launch) -> None:
        block_r = chosen.block_n or copy_rows(rows, head_dim, cuda=kv_pool.is_cuda)
        grid = (num_blocks * triton.cdiv(rows, block_r), num_layers)
        _copy_blocks_kernel[grid](
            staging,
            kv_pool,
            slot_mapping,
            positions if positions is not None else slot_mapping,
            table,
            rope.sin if rope is not None else slot_mapping,
            staging.stride(0),
            staging.stride(1),
            staging.stride(2),
            kv_pool.stride(0),
            kv_pool.stride(1),
            kv_pool.stride(2),
            block_tokens,
            kv_pool.size(3),
            num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=head_dim_tile(head_dim),
            BLOCK_R=block_r,
            ROTATE=rope is not None,
            SAVE=save,
            ROUND_BF16=kv_pool.dtype == torch.bfloat16,
            # No fused multiply-add: the torch reference rounds every product, so must we.
            enable_fp_fusion=False,
            **chosen.options(),
        )

    if launch is not None:
        run(launch)
        return
    key = (kv_pool.dtype, head_dim, num_kv_heads, block_tokens, kv_pool.size(3),
           rope is not None, save, bucket(num_blocks * num_layers))  # fmt: skip
    launches = copy_launches(rows, head_dim, cuda=kv_pool.is_cuda)
    COPY_TUNER.run(key, {str(c): functools.partial(run, c) for c in launches}, kv_pool.device)


def copy_launches(block_rows: int, head_dim: int, *, cuda: bool) -> list[Launch]:
    """The copy kernel's launch settings tried on CUDA, the default first: half, twice and
    four times the default rows a program, 4 or 8 warps."""
    if not cuda:
        return [Launch()]
    rows = copy_rows(block_rows, head_dim, cuda=True)
    tried = [Launch(max(1, rows // 2), 4), Launch(rows * 2, 8), Launch(rows * 4, 8)]
    return [Launch(), *(launch for launch in tried if launch.block_n <= 2 * block_rows)]


def load_blocks_triton(
    staging: torch.Tensor,
    kv_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    rope: RopeTables | None = None,
    launch: Launch | None = None,
) -> None:
    """Triton: copy staged blocks into pool slots, rotating K to ``positions``.

    Args:
        staging: ``[num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]``,
            K before RoPE.
        kv_pool: ``[num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]``,
            written in place.
        slot_mapping: ``[num_blocks, block_tokens]`` int64, distinct slots, -1 to skip.
        positions: ``[num_blocks, block_tokens]`` int, where each token now sits.
        rope: cos/sin tables; None for a plain copy (then ``positions`` must be None too).
        launch: Rows a program and warps; None: the fastest of ``copy_launches`` for this
            shape on this GPU (:mod:`kvstore.kernels.tuning`), the default off CUDA.

    Raises:
        ValueError: A tensor has the wrong shape, dtype, layout or device.
    """
    _copy_blocks_triton(staging, kv_pool, slot_mapping, positions, rope, save=False, launch=launch)


def save_blocks_triton(
    kv_pool: torch.Tensor,
    staging: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    rope: RopeTables | None = None,
    launch: Launch | None = None,
) -> None:
    """Triton: gather pool slots into staged blocks, un-rotating K from ``positions``.

    Arguments as ``load_blocks_triton``; ``staging`` is written in place (rows whose slot
    is -1 are left as they were) and ends up holding K before RoPE.
    """
    _copy_blocks_triton(staging, kv_pool, slot_mapping, positions, rope, save=True, launch=launch)


def _copy_blocks_reference(
    staging: torch.Tensor,
    kv_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    rope: RopeTables | None,
    *,
    save: bool,
) -> None:
    _check_copy_args(staging, kv_pool, slot_mapping, positions, rope)
    blocks, tokens = (slot_mapping >= 0).nonzero(as_tuple=True)
    slots = slot_mapping[blocks, tokens]
    pages, rows = slots // kv_pool.size(3), slots % kv_pool.size(3)
    if save:
        kv = kv_pool[:, :, pages, rows]  # [num_layers, 2, num_tokens, num_kv_heads, head_dim]
    else:
        kv = staging[blocks, :, :, tokens].permute(1, 2, 0, 3, 4)
    if positions is not None and rope is not None:
        token_positions = positions[blocks, tokens][None, :, None]
        kv[:, 0] = apply_rope(kv[:, 0], token_positions, rope, inverse=save)
    if save:
        staging[blocks, :, :, tokens] = kv.permute(2, 0, 1, 3, 4)
    else:
        kv_pool[:, :, pages, rows] = kv


def load_blocks_reference(
    staging: torch.Tensor,
    kv_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    rope: RopeTables | None = None,
    launch: Launch | None = None,
) -> None:
    """Torch reference of ``load_blocks_triton`` (same arguments, same results; ``launch``
    is ignored)."""
    _copy_blocks_reference(staging, kv_pool, slot_mapping, positions, rope, save=False)


def save_blocks_reference(
    kv_pool: torch.Tensor,
    staging: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    rope: RopeTables | None = None,
    launch: Launch | None = None,
) -> None:
    """Torch reference of ``save_blocks_triton`` (same arguments, same results; ``launch``
    is ignored)."""
    _copy_blocks_reference(staging, kv_pool, slot_mapping, positions, rope, save=True)
