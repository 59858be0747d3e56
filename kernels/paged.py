"""The paged KV layout shared by the kernels and the inference adapter.

Pool. One tensor per model holds every layer's K and V in fixed-size pages::

    kv_pool: [num_layers, 2 (k|v), num_pages, page_tokens, num_kv_heads, head_dim]

``kv_pool[layer, 0]`` and ``kv_pool[layer, 1]`` are that layer's K and V caches,
``[num_pages, page_tokens, num_kv_heads, head_dim]``; the attention kernels take these
per-layer views. The last three dims must be C-contiguous; the leading ones may have any
stride. The pool holds K *after* RoPE (what attention needs); the store holds K before it.

Block tables. Sequence b owns pages ``block_tables[b, :num_pages_b]`` (int32,
``[batch, max_pages]``, unused entries any valid page id): its token i lives in page
``block_tables[b, i // page_tokens]`` at row ``i % page_tokens``.

Slots. A slot is a flat token address, ``page * page_tokens + row``; ``slot_mapping`` tensors
(int64) name one slot per token, ``-1`` for a token to skip. ``slot_mapping`` below computes
them from a sequence's pages.

Staging buffer. Blocks as the store hands them out, layer-major, one block after another::

    staging: [num_blocks, num_layers, 2 (k|v), block_tokens, num_kv_heads, head_dim]

which is ``kvstore.wire.blocks.BlockLayout``'s raw payload with a leading block axis. Each
``(block, layer, k|v)`` slab must be C-contiguous; the block, layer and k|v strides are free,
so ``staging[:, i:i + 1]`` moves one layer. ``block_tokens`` and ``page_tokens`` are
independent: the copy kernels (``kvstore.kernels.rope``) address the pool by slot.

Primitives: ``new_kv_pool`` allocates a pool, ``slot_mapping`` addresses a run of a
sequence's tokens, ``write_tokens`` stores new tokens' K/V (already rotated) at their slots,
``gather_tokens`` reads a sequence back densely (used by the torch references).
"""

from __future__ import annotations

import torch

from kvstore.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_size, check_tensor

POOL_SHAPE = "[num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]"
CACHE_SHAPE = "[num_pages, page_tokens, num_kv_heads, head_dim]"


def new_kv_pool(
    num_layers: int,
    num_pages: int,
    page_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zeroed pool ``[num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]``."""
    shape = (num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def slot_mapping(
    pages: torch.Tensor, start: int, num_tokens: int, page_tokens: int
) -> torch.Tensor:
    """Slots of tokens ``start .. start + num_tokens - 1`` of one sequence.

    Args:
        pages: The sequence's row of the block table, ``[max_pages]`` int.
        start: Index of the first token within the sequence.
        num_tokens: How many tokens.
        page_tokens: Tokens per page.

    Returns:
        ``[num_tokens]`` int64 slots on ``pages.device``.

    Raises:
        ValueError: A bad argument, or the tokens run past the sequence's pages.
    """
    check_tensor("pages", pages, shape="[max_pages]", dtypes=INDEX_DTYPES)
    if start < 0 or num_tokens < 0 or page_tokens <= 0:
        raise ValueError(
            f"start and num_tokens must be >= 0 and page_tokens > 0, got {start}, "
            f"{num_tokens}, {page_tokens}"
        )
    if start + num_tokens > pages.numel() * page_tokens:
        raise ValueError(
            f"tokens up to {start + num_tokens} need more than the {pages.numel()} pages given"
        )
    index = torch.arange(start, start + num_tokens, device=pages.device)
    return pages.long()[index // page_tokens] * page_tokens + index % page_tokens


def check_caches(
    k_cache: torch.Tensor, v_cache: torch.Tensor, *, dtype: torch.dtype, device: torch.device
) -> None:
    """One layer's K and V caches: ``[num_pages, page_tokens, num_kv_heads, head_dim]`` each,
    with the same strides (the kernels address both with one set).

    Raises:
        ValueError: Either is not such a tensor of ``dtype`` on ``device``, or they differ.
    """
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(
            name, cache, shape=CACHE_SHAPE, dtypes=(dtype,), device=device, contiguous_dims=3
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape must equal k_cache's {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    if v_cache.stride() != k_cache.stride():  # true of two views of one pool
        raise ValueError(
            f"v_cache strides must equal k_cache's {k_cache.stride()}, got {v_cache.stride()}"
        )


def write_tokens(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store new tokens' K and V at their slots (one layer).

    Args:
        k_cache: ``[num_pages, page_tokens, num_kv_heads, head_dim]``, K after RoPE.
        v_cache: Same shape, V.
        k: ``[num_tokens, num_kv_heads, head_dim]``, already rotated.
        v: ``[num_tokens, num_kv_heads, head_dim]``.
        slots: ``[num_tokens]`` int64, distinct, each in ``0 .. num_pages * page_tokens - 1``.

    Raises:
        ValueError: A tensor has the wrong shape, dtype or device.
    """
    check_tensor("k_cache", k_cache, shape=CACHE_SHAPE, dtypes=FLOAT_DTYPES, contiguous_dims=3)
    check_caches(k_cache, v_cache, dtype=k_cache.dtype, device=k_cache.device)
    token_shape = "[num_tokens, num_kv_heads, head_dim]"
    for name, new in (("k", k), ("v", v)):
        check_tensor(name, new, shape=token_shape, dtypes=(k_cache.dtype,), device=k_cache.device)
        check_size(name, new, 1, k_cache.size(2), "num_kv_heads")
        check_size(name, new, 2, k_cache.size(3), "head_dim")
    check_tensor("slots", slots, shape="[num_tokens]", dtypes=(torch.int64,), device=k.device)
    check_size("slots", slots, 0, k.size(0), "num_tokens")
    check_size("v", v, 0, k.size(0), "num_tokens")
    pages, rows = slots // k_cache.size(1), slots % k_cache.size(1)
    k_cache[pages, rows] = k
    v_cache[pages, rows] = v


def gather_tokens(cache: torch.Tensor, pages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of one sequence, dense.

    Args:
        cache: ``[num_pages, page_tokens, num_kv_heads, head_dim]``.
        pages: The sequence's row of the block table, ``[max_pages]`` int.
        num_tokens: Tokens to read.

    Returns:
        ``[num_tokens, num_kv_heads, head_dim]``, a copy.

    Raises:
        ValueError: The sequence's pages hold fewer than ``num_tokens`` tokens.
    """
    page_tokens = cache.size(1)
    needed = -(-num_tokens // page_tokens)
    if needed > pages.numel():
        raise ValueError(f"{num_tokens} tokens need {needed} pages, the table has {pages.numel()}")
    return cache[pages[:needed].long()].flatten(0, 1)[:num_tokens]
