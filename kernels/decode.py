"""Decode attention: one new query token per sequence over a paged KV cache, split-K.

Sequence b has ``seq_lens[b] >= 1`` tokens of KV in the cache, its new token's included (the
caller writes it first). Its one query attends to all of them. Query heads are a multiple of
KV heads (GQA); one program serves all query heads of a KV head, so each K/V tile is read
once per group.

::

    q:            [batch, num_heads, head_dim]
    k_cache:      [num_pages, page_tokens, num_kv_heads, head_dim]
    v_cache:      [num_pages, page_tokens, num_kv_heads, head_dim]
    seq_lens:     [batch] int32
    block_tables: [batch, max_pages] int32
    -> out:       [batch, num_heads, head_dim], q's dtype

Long contexts are split: ``_decode_split_kernel`` runs ``num_splits`` programs per (sequence,
KV head), each over one contiguous share of the keys, and writes a partial output and its
log-sum-exp (float32); ``_decode_reduce_kernel`` merges the shares. Both tile head_dim
padded to a power of two and mask the tail lanes. The torch reference is prefill attention
with one query per sequence.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvstore.kernels._checks import head_dim_tile
from kvstore.kernels.attention import (
    LOG2_E,
    attend_pages,
    check_attention_args,
    dot_options,
    prefill_attention_reference,
    tile_sizes,
)
from kvstore.kernels.tuning import Launch, Tuner, bucket

MAX_SPLITS = 16
DECODE_TUNER = Tuner("decode_attention")
_MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows; small groups are padded


@triton.jit  # type: ignore[untyped-decorator]
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [batch, num_heads, HEAD_DIM]
    k_ptr,  # [num_pages, page_tokens, num_kv_heads, HEAD_DIM]
    v_ptr,  # [num_pages, page_tokens, num_kv_heads, HEAD_DIM], k_ptr's strides
    part_out_ptr,  # [batch, num_heads, num_splits, HEAD_DIM] float32
    part_lse_ptr,  # [batch, num_heads, num_splits] float32, log2 domain
    seq_lens_ptr,  # [batch] int32
    block_tables_ptr,  # [batch, max_pages] int32
    scale_log2,  # softmax scale * log2(e)
    q_stride_batch,
    q_stride_head,
    cache_stride_page,
    cache_stride_token,
    cache_stride_head,
    table_stride,
    page_tokens,
    num_heads,
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    share = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * share
    end = tl.minimum(start + share, seq_len)

    group_rows = tl.arange(0, BLOCK_H)
    row_ok = group_rows < GROUP
    heads = kv_head * GROUP + group_rows
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = seq * q_stride_batch + heads * q_stride_head
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    table = block_tables_ptr + seq * table_stride
    # The query sits at position seq_len - 1: every key of the sequence is visible, no mask.
    acc, l_i, m_i = attend_pages(
        tl.zeros([BLOCK_H, BLOCK_D], tl.float32),
        tl.zeros([BLOCK_H], tl.float32),
        tl.full([BLOCK_H], float("-inf"), tl.float32),
        q,
        tl.full([BLOCK_H], seq_len - 1, tl.int32),
        k_ptr,
        v_ptr,
        table,
        kv_head.to(tl.int64) * cache_stride_head,
        cache_stride_page,
        cache_stride_token,
        page_tokens,
        start,
        end,
        scale_log2,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        DOT_FP32,
        DOT_PRECISION,
        False,
    )

    # An empty share (short sequence, many splits) leaves l_i = 0: weight zero in the merge.
    has_keys = l_i > 0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    part_rows = (seq * num_heads + heads) * num_splits + split
    tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)
    tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], out, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,  # [batch, num_heads, num_splits, HEAD_DIM] float32
    part_lse_ptr,  # [batch, num_heads, num_splits] float32, log2 domain
    out_ptr,  # [batch, num_heads, HEAD_DIM] contiguous
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # batch * num_heads + head
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + splits, mask=split_ok, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))  # the first share always holds keys
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    parts = tl.load(
        part_out_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def decode_launches(dtype: torch.dtype, *, cuda: bool) -> list[Launch]:
    """The split kernel's launch settings tried on CUDA, the default first (key tiles of 32,
    64 or 128 keys, 4 or 8 warps, 2 or 3 pipeline stages); float32 keeps its tiles small."""
    if not cuda:
        return [Launch()]
    if dtype == torch.float32:
        return [Launch(), Launch(16, 4, 2), Launch(32, 8, 2)]
    return [Launch(), Launch(32, 4, 2), Launch(64, 4, 2), Launch(64, 8, 3), Launch(128, 8, 2),
            Launch(128, 4, 3)]  # fmt: skip


def default_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough programs to fill the GPU, without splitting short batches needlessly."""
    if device.type != "cuda":
        return 2
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, -(-programs // max(1, batch * num_kv_heads))))


def _check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float | None,
) -> float:
    batch = q.size(0) if isinstance(q, torch.Tensor) and q.dim() == 3 else 0
    shape = "[batch, num_heads, head_dim]"
    return check_attention_args(
        q, k_cache, v_cache, seq_lens, block_tables, q_shape=shape, batch=batch, scale=scale
    )


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """Triton: attention of each sequence's one new query over all its cached tokens.

    Args:
        q: ``[batch, num_heads, head_dim]``, float16, bfloat16 or float32.
        k_cache: ``[num_pages, page_tokens, num_kv_heads, head_dim]``, q's dtype and device.
        v_cache: Same, V.
        seq_lens: ``[batch]`` int32, each >= 1.
        block_tables: ``[batch, max_pages]`` int32.
        scale: Softmax scale, ``1/sqrt(head_dim)`` when None.
        num_splits: Shares each sequence's keys are split into (1..MAX_SPLITS); chosen from
            the batch and the GPU when None.
        launch: Key tiles, warps and stages of the split kernel; None: the fastest of
            ``decode_launches`` for this shape on this GPU (:mod:`kvstore.kernels.tuning`),
            the default off CUDA.

    Returns:
        ``[batch, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: An argument has the wrong shape, dtype, layout or device.
    """
    scale = _check_decode_args(q, k_cache, v_cache, seq_lens, block_tables, scale)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.size(2)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, q.device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise ValueError(f"num_splits must be an int, got {num_splits!r}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    part_out = torch.empty(
        (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads

    def split(launch: Launch) -> None:
        _decode_split_kernel[(batch, num_kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            part_out,
            part_lse,
            seq_lens,
            block_tables,
            scale * LOG2_E,
            q.stride(0),
            q.stride(1),
            *k_cache.stride()[:3],
            block_tables.stride(0),
            k_cache.size(1),
            num_heads,
            num_splits,
            GROUP=group,
            BLOCK_H=max(_MIN_GROUP_ROWS, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim,
            BLOCK_D=head_dim_tile(head_dim),
            BLOCK_N=launch.block_n or tile_sizes(q)[1],
            **launch.options(),
            **dot_options(q),
        )

    page_tokens = k_cache.size(1)
    key = (q.dtype, head_dim, group, page_tokens, bucket(batch), num_splits,
           bucket(block_tables.size(1) * page_tokens))  # fmt: skip
    if launch is not None:
        split(launch)
    else:
        launches = {
            str(c): functools.partial(split, c) for c in decode_launches(q.dtype, cuda=q.is_cuda)
        }
        DECODE_TUNER.run(key, launches, q.device)
    _decode_reduce_kernel[(batch * num_heads,)](
        part_out,
        part_lse,
        out,
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=head_dim_tile(head_dim),
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """Torch reference of ``decode_attention_triton``; ``num_splits`` and ``launch`` are
    ignored.

    Raises:
        ValueError: As the Triton version, or a sequence length below 1.
    """
    scale = _check_decode_args(q, k_cache, v_cache, seq_lens, block_tables, scale)
    if bool((seq_lens < 1).any()):
        raise ValueError("seq_lens must all be >= 1 (the new token's KV is in the cache)")
    batch = q.size(0)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return prefill_attention_reference(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_query_len=1, scale=scale
    )
