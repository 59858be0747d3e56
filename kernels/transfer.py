"""One layer of stored blocks, read where they lie in host memory, written into paged K/V.

The load path's transfer: the blocks a request loads lie scattered in a host arena, and
layer ``i`` of a block is one contiguous ``[2, block_tokens, kv_heads, head_dim]`` range
(K then V; the tokens of one page are one contiguous range of each). ``load_layer`` writes
that layer of every block into the engine's pages in one call. On CUDA it is one kernel
launch that reads the host memory directly over the host link (the arena registered with
CUDA and mapped, passed as a :class:`DeviceReadable`), so there is no staging copy, no copy
per block and no Python loop over blocks; elsewhere the
torch reference copies each run of consecutive pages (one copy per byte, contiguous on
both sides when the pages are). Layouts::

    source:  the memory the blocks lie in: a flat uint8 tensor, or a DeviceReadable range
    offsets: [num_blocks] int64 byte offset of each block's layer slice from source's start
    k, v:    [num_pages, page_tokens, kv_heads, head_dim] views of one layer's pages, any
             strides (head_dim's must be 1 for the kernel), in the stored dtype
    pages:   [num_blocks, pages_per_block] int64 page of each part of each block; -1 leaves
             that page alone (the engine computes it)

``block_tokens = pages_per_block * page_tokens``. The kernel copies 4-byte words, so a token
row (``head_dim`` elements) must be a whole number of words and the offsets 4-byte aligned.

``gather_pages`` is the way back on the CPU, for a save: whole pages of every layer of our
engine's pool into blocks in the stored layout, one copy per run of consecutive pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import triton
import triton.language as tl

__all__ = [
    "DeviceReadable",
    "LayerCopies",
    "gather_pages",
    "load_layer",
    "load_layer_reference",
    "load_layer_triton",
]

WORD = 4  # bytes the kernel moves at once per lane
MAX_TILE_ROWS = 64  # (token, head) rows a program moves: 8 KiB of bf16 rows of 64


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
    k_ptr,  # [num_pages, page_tokens, kv_heads, ROW] int32 words, strided
    v_ptr,
    k_stride_page,
    k_stride_token,
    k_stride_head,
    v_stride_page,
    v_stride_token,
    v_stride_head,
    num_kv_heads,
    page_tokens,
    pages_per_block,
    ROW: tl.constexpr,  # words per (token, head) row
    BLOCK_W: tl.constexpr,  # ROW padded to a power of two
    BLOCK_R: tl.constexpr,  # rows per program
):
    # A page of K (or V) is page_tokens * kv_heads rows, one contiguous range of the source
    # (token-major); a program reads BLOCK_R of them and writes each where its token and
    # head go in the page's (strided) view.
    page_rows = page_tokens * num_kv_heads
    tiles = tl.cdiv(page_rows, BLOCK_R)
    part = tl.program_id(0) // tiles  # block * pages_per_block + page of the block
    rows = (tl.program_id(0) % tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    is_v = tl.program_id(1)
    page = tl.load(pages_ptr + part)
    block = part // pages_per_block
    first = (part % pages_per_block) * page_tokens  # the page's first token in the block
    block_tokens = pages_per_block * page_tokens
    source = tl.load(offsets_ptr + block) + (is_v * block_tokens + first) * num_kv_heads * ROW
    words = tl.arange(0, BLOCK_W)[None, :]
    written = tl.where(page >= 0, page_rows, 0)  # rows of the page to write
    mask = (rows < written)[:, None] & (words < ROW)
    token, head = rows // num_kv_heads, rows % num_kv_heads
    if is_v == 0:
        dst = k_ptr + page * k_stride_page + token * k_stride_token + head * k_stride_head
    else:
        dst = v_ptr + page * v_stride_page + token * v_stride_token + head * v_stride_head
    values = tl.load(src_ptr + source + rows[:, None] * ROW + words, mask=mask)
    tl.store(dst[:, None] + words, values, mask=mask)


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
        k: ``[num_pages, page_tokens, kv_heads, head_dim]``, head_dim contiguous.
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
    row, page_tokens = row_bytes // WORD, k.size(1)
    page_rows = page_tokens * k.size(2)
    block_r = min(MAX_TILE_ROWS, triton.next_power_of_2(page_rows))
    grid = (num_blocks * pages_per_block * triton.cdiv(page_rows, block_r), 2)
    _load_layer_kernel[grid](
        source,
        offsets // WORD,
        pages,
        k_words,
        v_words,
        *k_words.stride()[:3],
        *v_words.stride()[:3],
        k.size(2),
        page_tokens,
        pages_per_block,
        ROW=row,
        BLOCK_W=triton.next_power_of_2(row),
        BLOCK_R=block_r,
    )


def load_layer_reference(
    source: torch.Tensor,
    offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
) -> None:
    """Torch reference of :func:`load_layer_triton`: ``source`` a flat uint8 CPU tensor.

    Each run of consecutive pages a block goes to is one copy of its rows, K and V together
    when ``k`` and ``v`` are two halves of one tensor (the engine's pool, vLLM's split
    layout), straight from the source into the pages (one copy per byte; a block whose pages
    follow each other is one copy): :class:`LayerCopies` for this one layer.
    """
    _check(offsets, k, v, pages)
    LayerCopies(source, offsets.tolist(), k, pages).write(0, k, v)


class LayerCopies:
    """The torch reference's work for every layer of one load, planned once: ``pages``
    (``[num_blocks, pages_per_block]`` int64) take blocks whose layer-0 slice lies at byte
    ``offsets[b]`` of ``source`` (a flat uint8 CPU tensor), layer ``i``'s ``i * layer_bytes``
    further. The checks, the page runs and the element offsets are worked out here, so
    :meth:`write` is a view per run and one ``torch._foreach_copy_`` call (a Python
    ``copy_`` each cost ~10 us beside a ~35 us copy of 512 KiB).

    Args:
        source: The memory the blocks lie in.
        offsets: Byte offset of each block's layer-0 slice.
        k: One layer's K pages ``[num_pages, page_tokens, kv_heads, head_dim]`` (their shape
            and dtype; every layer written must be alike).
        pages: ``[num_blocks, pages_per_block]`` int64, -1 where the engine computes.
        layer_bytes: Bytes from one layer's slice of a block to the next.

    Raises:
        ValueError: ``source`` is not a flat uint8 tensor, or an offset or ``layer_bytes``
            is not a multiple of the item size.
    """

    def __init__(
        self,
        source: torch.Tensor,
        offsets: list[int],
        k: torch.Tensor,
        pages: torch.Tensor,
        layer_bytes: int = 0,
    ) -> None:
        if source.dtype != torch.uint8 or source.dim() != 1:
            raise ValueError(
                f"source must be a flat uint8 tensor, got {source.dtype} {source.shape}"
            )
        item = k.element_size()
        if any(offset % item for offset in offsets) or layer_bytes % item:
            raise ValueError(f"offsets must be multiples of the {k.dtype} item size ({item} B)")
        self.num_blocks = len(offsets)
        self._typed = source[: source.numel() // item * item].view(k.dtype)
        self._shape, self._dtype = k.shape, k.dtype
        _, page_tokens, heads, head_dim = k.shape
        self._per_block = pages.size(1)
        self._page = page_tokens * heads * head_dim  # elements of one page of K (or V)
        self._rows = ((self._page, heads * head_dim, head_dim, 1), (page_tokens, heads, head_dim))
        self._layer_items = layer_bytes // item
        # (first element of the run in the source, its first page, pages in the run)
        runs = [
            (offset // item + first * self._page, at, count)
            for offset, block_runs in zip(offsets, _runs(pages), strict=True)
            for first, at, count in block_runs
        ]
        self._groups = _strided_groups(runs)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, pair: torch.Tensor | None = None
    ) -> None:
        """Layer ``layer`` of every block into its pages of ``k`` and ``v`` (``pair``: both
        as one ``[2, num_pages, ...]`` view, when the caller has it; else it is looked for).

        Raises:
            ValueError: ``k`` or ``v`` is not shaped like the ``k`` the plan was made for.
        """
        self.write_layers([(layer, k, v, pair)])

    def write_layers(
        self, layers: Sequence[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]]
    ) -> None:
        """:meth:`write` of each ``(layer, k, v, pair)``, all in one ``_foreach_copy_`` call
        (a small load: one call, one release of the GIL, for all its layers).

        Raises:
            ValueError: a ``k`` or ``v`` is not shaped like the ``k`` the plan was made for.
        """
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for layer, k, v, pair in layers:
            self._views(layer, k, v, pair, targets, sources)
        torch._foreach_copy_(targets, sources)

    def _views(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        pair: torch.Tensor | None,
        targets: list[torch.Tensor],
        sources: list[torch.Tensor],
    ) -> None:
        """Appends layer ``layer``'s copies: page views to ``targets``, arena views to
        ``sources``."""
        if k.shape != self._shape or v.shape != self._shape or k.dtype != self._dtype:
            raise ValueError(
                f"k and v must be {list(self._shape)} {self._dtype}, got {list(k.shape)} "
                f"{k.dtype} and {list(v.shape)} {v.dtype}"
            )
        shift, typed, rows = layer * self._layer_items, self._typed, self._rows
        both = _as_pair(k, v) if pair is None else pair
        v_apart = self._per_block * self._page  # from a block's K to its V, in elements
        # A block's layer: [2, pages_per_block, page_tokens, kv_heads, head_dim]; a group is
        # `runs` runs of `count` pages, `apart` elements from one to the next in the source.
        for start, at, count, runs, apart in self._groups:
            pages = (runs, count, *rows[1])
            strides = (apart, *rows[0])
            if both is not None:
                source = typed.as_strided((2, *pages), (v_apart, *strides), start + shift)
                sources.append(source)
                target = both.narrow(1, at, runs * count)
                targets.append(target.view(2, runs, count, *target.shape[2:]))
                continue
            for part, half in enumerate((k, v)):
                at_part = start + shift + part * v_apart
                sources.append(typed.as_strided(pages, strides, at_part))
                target = half.narrow(0, at, runs * count)
                targets.append(target.view(runs, count, *target.shape[1:]))


def _as_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[2, num_pages, ...]``: K at 0 and V at 1, one view of their common storage; None
    when they are not two equally strided halves of one tensor."""
    if k.stride() != v.stride() or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    apart = v.storage_offset() - k.storage_offset()
    return k.as_strided((2, *k.shape), (apart, *k.stride()), k.storage_offset())


def _strided_groups(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """Runs ``(source element, first page, count)`` gathered into ``(source element, first
    page, count, runs, apart)``: consecutive runs of the same length whose pages follow each
    other and whose sources lie the same distance apart are one strided copy. Blocks the
    arena holds one after another (a put of a chain) into pages that follow each other (a
    new request's) make one group, so small blocks cost a layer one view, not one each:
    [(0, 4, 1), (100, 5, 1), (200, 6, 1), (250, 9, 1)] -> [(0, 4, 1, 3, 100), (250, 9, 1, 1, 0)].
    """
    groups: list[tuple[int, int, int, int, int]] = []
    for start, at, count in runs:
        if groups:
            first, first_at, length, runs_in, apart = groups[-1]
            follows = length == count and first_at + runs_in * count == at
            step = start - first - (runs_in - 1) * apart  # from the group's last run
            if follows and step > 0 and (runs_in == 1 or step == apart):
                groups[-1] = (first, first_at, length, runs_in + 1, step)
                continue
        groups.append((start, at, count, 1, 0))
    return groups


def _runs(pages: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """:func:`_page_runs` of every block (one run each when its pages follow each other)."""
    return [_page_runs(block) for block in pages.tolist()]


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


def gather_pages(kv_pool: torch.Tensor, pages: torch.Tensor, out: torch.Tensor) -> None:
    """Whole pages of every layer into blocks in the stored layout (the way back of a load,
    for a save): block ``b`` of ``out`` gets pages ``pages[b]`` of every layer.

    One copy per run of consecutive pages covers every layer, K and V; all of them go in one
    ``torch._foreach_copy_`` call (for 512 MiB, 0.05 s here against 0.5 s for the per-token
    indexing of the slot-based ``save_blocks`` reference).

    Args:
        kv_pool: ``[num_layers, 2, num_pages, page_tokens, kv_heads, head_dim]``, the last
            three dims contiguous.
        pages: ``[num_blocks, pages_per_block]`` int64 (CPU), every page a valid one.
        out: ``[num_blocks, num_layers, 2, pages_per_block * page_tokens, kv_heads,
            head_dim]``, same dtype and device, written in place.

    Raises:
        ValueError: A shape, dtype or page does not fit (the message names it).
    """
    layers, _, num_pages, page_tokens, heads, head_dim = kv_pool.shape
    num_blocks, per_block = pages.shape
    shape = (num_blocks, layers, 2, per_block * page_tokens, heads, head_dim)
    if tuple(out.shape) != shape or out.dtype != kv_pool.dtype or out.device != kv_pool.device:
        raise ValueError(
            f"out must be {list(shape)} {kv_pool.dtype} on {kv_pool.device}, got "
            f"{list(out.shape)} {out.dtype} on {out.device}"
        )
    if num_blocks and not bool(((pages >= 0) & (pages < num_pages)).all()):
        raise ValueError(f"pages must be in 0..{num_pages - 1}, got {pages.tolist()}")
    parts = out.view(*shape[:3], per_block, page_tokens, heads, head_dim)
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for block, runs in enumerate(_runs(pages)):
        for first, at, count in runs:
            targets.append(parts[block, :, :, first : first + count])
            sources.append(kv_pool[:, :, at : at + count])
    torch._foreach_copy_(targets, sources)


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
            f"k and v must be [num_pages, page_tokens, kv_heads, head_dim] alike, got "
            f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
        )
    if pages.dim() != 2 or pages.dtype != torch.int64 or offsets.shape != pages.shape[:1]:
        raise ValueError(
            f"pages must be [num_blocks, pages_per_block] int64 and offsets [num_blocks], "
            f"got {tuple(pages.shape)} {pages.dtype} and {tuple(offsets.shape)}"
        )
    return k.size(3) * k.element_size()
