"""One layer of stored blocks, read where they lie in host memory, written into paged K/V.

The load path's transfer: the blocks a request loads lie scattered in a host arena, and
layer ``i`` of a block is one contiguous ``[2, kv_heads, block_tokens, head_dim]`` range
(K then V). ``load_layer`` writes that layer of every block into the engine's pages in one
call. On CUDA it is one kernel launch that reads the host memory directly over the host link
(the arena registered with CUDA and mapped, passed as a :class:`DeviceReadable`),
so there is no staging copy, no copy per block and no Python loop over blocks; elsewhere the
torch reference copies each page's rows (one copy per byte). Layouts::

    source:  the memory the blocks lie in: a flat uint8 tensor, or a DeviceReadable range
    offsets: [num_blocks] int64 byte offset of each block's layer slice from source's start
    k, v:    [num_pages, kv_heads, page_tokens, head_dim] views of one layer's pages, any
             strides (head_dim's must be 1 for the kernel), in the stored dtype
    pages:   [num_blocks, pages_per_block] int64 page of each part of each block; -1 leaves
             that page alone (the engine computes it)

``block_tokens = pages_per_block * page_tokens``. The kernel copies 4-byte words, so a token
row (``head_dim`` elements) must be a whole number of words and the offsets 4-byte aligned.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

__all__ = ["DeviceReadable", "load_layer", "load_layer_reference", "load_layer_triton"]

WORD = 4  # bytes the kernel moves at once per lane
MAX_TILE_TOKENS = 64


class DeviceReadable(Protocol):
    """Memory a kernel can read that is no tensor: host memory registered with CUDA and
    mapped, named by its address (``kvstore.client.tensors.HostMapped``)."""

    @property
    def dtype(self) -> torch.dtype: ...

    def data_ptr(self) -> int: ...


@triton.jit  # type: ignore[untyped-decorator]
def _load_layer_kernel(  # type: ignore[no-untyped-def]
    src_ptr,  # host memory, int32 words
    offsets_ptr,  # [num_blocks] int64 word offsets of each block's layer slice
    pages_ptr,  # [num_blocks, pages_per_block] int64, -1: skip
    k_ptr,  # [num_pages, kv_heads, page_tokens, ROW] int32 words, strided
    v_ptr,
    k_stride_page,
    k_stride_head,
    k_stride_token,
    v_stride_page,
    v_stride_head,
    v_stride_token,
    num_kv_heads,
    page_tokens,
    pages_per_block,
    ROW: tl.constexpr,  # words per token row
    BLOCK_W: tl.constexpr,  # ROW padded to a power of two
    BLOCK_T: tl.constexpr,  # tokens per program
):
    tiles = tl.cdiv(page_tokens, BLOCK_T)
    part = tl.program_id(0) // tiles  # block * pages_per_block + page of the block
    tokens = (tl.program_id(0) % tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
    is_v = tl.program_id(1)
    page = tl.load(pages_ptr + part)
    block = part // pages_per_block
    first = (part % pages_per_block) * page_tokens  # the page's first token in the block
    block_tokens = pages_per_block * page_tokens
    source = tl.load(offsets_ptr + block) + (is_v * num_kv_heads * block_tokens + first) * ROW
    words = tl.arange(0, BLOCK_W)[None, :]
    written = tl.where(page >= 0, page_tokens, 0)  # tokens of the page to write
    mask = (tokens < written)[:, None] & (words < ROW)
    if is_v == 0:
        dst = k_ptr + page * k_stride_page + tokens[:, None] * k_stride_token + words
        stride_head = k_stride_head
    else:
        dst = v_ptr + page * v_stride_page + tokens[:, None] * v_stride_token + words
        stride_head = v_stride_head
    rows = src_ptr + source + tokens[:, None] * ROW + words
    for head in range(num_kv_heads):
        values = tl.load(rows + head * block_tokens * ROW, mask=mask)
        tl.store(dst + head * stride_head, values, mask=mask)


def load_layer_triton(
    source: torch.Tensor | DeviceReadable,
    offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
) -> None:
    """Triton: writes one layer of every block into its pages (see the module docstring).

    Args:
        source: Where the blocks lie: registered host memory (:class:`DeviceReadable`) or a
            flat uint8 tensor on k's device (a CPU one under the Triton interpreter).
        offsets: ``[num_blocks]`` int64 byte offsets, on k's device.
        k: ``[num_pages, kv_heads, page_tokens, head_dim]``, head_dim contiguous.
        v: Same shape and dtype as k.
        pages: ``[num_blocks, pages_per_block]`` int64 on k's device, -1 to skip.

    Raises:
        ValueError: A shape, dtype, stride or alignment does not fit.
    """
    row_bytes = _check(offsets, k, v, pages)
    if k.stride(3) != 1 or v.stride(3) != 1 or row_bytes % WORD:
        raise ValueError(
            f"the kernel moves whole {WORD}-byte words of contiguous token rows: head_dim "
            f"strides ({k.stride(3)}, {v.stride(3)}) must be 1 and a row ({row_bytes} B) "
            f"a multiple of {WORD} B"
        )
    num_blocks, pages_per_block = pages.shape
    if num_blocks == 0:
        return
    k_words, v_words = k.view(torch.int32), v.view(torch.int32)
    if isinstance(source, torch.Tensor):
        source = source.view(torch.int32)
    row, page_tokens = row_bytes // WORD, k.size(2)
    block_t = min(MAX_TILE_TOKENS, triton.next_power_of_2(page_tokens))
    grid = (num_blocks * pages_per_block * triton.cdiv(page_tokens, block_t), 2)
    _load_layer_kernel[grid](
        source,
        offsets // WORD,
        pages,
        k_words,
        v_words,
        *k_words.stride()[:3],
        *v_words.stride()[:3],
        k.size(1),
        page_tokens,
        pages_per_block,
        ROW=row,
        BLOCK_W=triton.next_power_of_2(row),
        BLOCK_T=block_t,
    )


def load_layer_reference(
    source: torch.Tensor,
    offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
) -> None:
    """Torch reference of :func:`load_layer_triton`: ``source`` a flat uint8 CPU tensor.

    Each run of consecutive pages a block goes to is one ``copy_`` of K's and one of V's
    rows, straight from the source into the pages (one copy per byte; a block whose pages
    follow each other is two copies).
    """
    _check(offsets, k, v, pages)
    if source.dtype != torch.uint8 or source.dim() != 1:
        raise ValueError(f"source must be a flat uint8 tensor, got {source.dtype} {source.shape}")
    _, heads, page_tokens, head_dim = k.shape
    per_block = pages.size(1)
    # [2, pages_per_block, kv_heads, page_tokens, head_dim] of one block's layer
    block_shape = (2, heads, per_block, page_tokens, head_dim)
    layer_bytes = k.element_size() * 2 * heads * per_block * page_tokens * head_dim
    for offset, targets in zip(offsets.tolist(), pages.tolist(), strict=True):
        block = source[offset : offset + layer_bytes].view(k.dtype).view(block_shape)
        block = block.transpose(1, 2)
        for first, page, count in _page_runs(targets):
            k[page : page + count].copy_(block[0, first : first + count])
            v[page : page + count].copy_(block[1, first : first + count])


def _page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """``(first part, first page, count)`` of each run of consecutive pages (-1 skipped):
    [4, 5, -1, 9] -> [(0, 4, 2), (3, 9, 1)]."""
    runs: list[tuple[int, int, int]] = []
    for index, page in enumerate(pages):
        if page < 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == index and runs[-1][1] + runs[-1][2] == page:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((index, page, 1))
    return runs


def load_layer(
    source: torch.Tensor | DeviceReadable,
    offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
) -> None:
    """One layer of every block into its pages: the kernel for pages on CUDA, the torch
    reference for pages on the CPU (see :func:`load_layer_triton`)."""
    if k.is_cuda:
        load_layer_triton(source, offsets, k, v, pages)
    elif isinstance(source, torch.Tensor):
        load_layer_reference(source, offsets, k, v, pages)
    else:
        raise ValueError("pages on the CPU take their blocks from a CPU tensor")


def _check(offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor) -> int:
    """Bytes of one token row; raises ValueError naming what does not fit."""
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(
            f"k and v must be [num_pages, kv_heads, page_tokens, head_dim] alike, got "
            f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
        )
    if pages.dim() != 2 or pages.dtype != torch.int64 or offsets.shape != pages.shape[:1]:
        raise ValueError(
            f"pages must be [num_blocks, pages_per_block] int64 and offsets [num_blocks], "
            f"got {tuple(pages.shape)} {pages.dtype} and {tuple(offsets.shape)}"
        )
    return k.size(3) * k.element_size()
