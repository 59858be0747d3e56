"""The engine's paged KV bookkeeping: which pages a sequence owns, and how a step finds them.

The pool itself (``[num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]``) and
the slot arithmetic come from ``kvstore.kernels.paged``; this module holds the host side:

- ``PageAllocator``: ``can_allocate(num_pages)`` then ``allocate(num_pages)`` hand out page
  ids; ``free(pages)`` returns them. No sharing between sequences: prefix reuse is the
  store's job, through the connector.
- ``pages_for(num_tokens, page_tokens)``: how many pages a run of tokens fills.
- ``AttentionBatch``: the addressing of one forward step (positions, slots, lengths, block
  tables), built by ``prefill_batch`` (one sequence's new tokens after a cached prefix) or
  ``decode_batch`` (the one newest token of each of several sequences).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.kernels.paged import slot_mapping


def pages_for(num_tokens: int, page_tokens: int) -> int:
    """Pages that ``num_tokens`` tokens fill, the last one possibly in part."""
    return -(-num_tokens // page_tokens)


class PageAllocator:
    """Hands out the page ids ``0 .. num_pages - 1`` of one pool."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used: set[int] = set()

    @property
    def num_free_pages(self) -> int:
        """Pages not held by any sequence."""
        return len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether ``allocate(num_pages)`` would succeed now."""
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` free pages.

        Raises:
            ValueError: Fewer than ``num_pages`` are free.
        """
        if not self.can_allocate(num_pages):
            raise ValueError(
                f"{num_pages} pages asked for, {len(self._free)} of {self.num_pages} are free"
            )
        pages = [self._free.popleft() for _ in range(num_pages)]
        self._used.update(pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return pages taken by ``allocate``.

        Raises:
            ValueError: A page is not currently allocated.
        """
        unknown = [page for page in pages if page not in self._used]
        if unknown:
            raise ValueError(f"pages {unknown} are not allocated")
        self._used.difference_update(pages)
        self._free.extend(pages)


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """Where one forward step's tokens sit in the pool and what each one attends to.

    ``cu_seqlens_q`` is None for a decode step (one query per sequence, in batch order).
    ``dense_lens`` is set when no sequence has a cached prefix: the new tokens are each
    sequence's whole KV, so attention may run densely on them (``model.DENSE_PREFILL``).
    """

    positions: torch.Tensor  # [num_tokens] int64, RoPE positions of the new tokens
    slots: torch.Tensor  # [num_tokens] int64, where their K/V are written
    seq_lens: torch.Tensor  # [batch] int32, KV tokens per sequence including the new ones
    block_tables: torch.Tensor  # [batch, max_pages] int32
    cu_seqlens_q: torch.Tensor | None  # [batch + 1] int32 query offsets; None: decode
    max_query_len: int
    # Prefill from scratch: each sequence's length (= its query count), on the host; else None.
    dense_lens: tuple[int, ...] | None = None


def prefill_batch(
    pages: Sequence[int], start: int, num_tokens: int, page_tokens: int, device: torch.device
) -> AttentionBatch:
    """Tokens ``start .. start + num_tokens - 1`` of one sequence, after a cached prefix of
    ``start`` tokens already in its pages."""
    table = torch.tensor(pages, dtype=torch.int32, device=device)  # [num_pages]
    end = start + num_tokens
    return AttentionBatch(
        positions=torch.arange(start, end, device=device),
        slots=slot_mapping(table, start, num_tokens, page_tokens),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
        block_tables=table[None],
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens,
        dense_lens=None if start else (num_tokens,),
    )


def decode_batch(
    page_lists: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    page_tokens: int,
    device: torch.device,
) -> AttentionBatch:
    """The last token of each sequence, sequence b holding ``seq_lens[b]`` tokens (the new
    one included) in pages ``page_lists[b]``."""
    max_pages = max(len(pages) for pages in page_lists)
    # Unused table entries must still be valid page ids; the kernels never read them.
    rows = [[*pages, *[0] * (max_pages - len(pages))] for pages in page_lists]
    positions = [seq_len - 1 for seq_len in seq_lens]
    slots = [
        pages[position // page_tokens] * page_tokens + position % page_tokens
        for pages, position in zip(page_lists, positions, strict=True)
    ]
    return AttentionBatch(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slots=torch.tensor(slots, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(rows, dtype=torch.int32, device=device),
        cu_seqlens_q=None,
        max_query_len=1,
    )
