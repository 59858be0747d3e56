"""The engine's paged KV bookkeeping: which pages a sequence owns, and how a step finds them.

The pool itself (``[num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]``) and
the slot arithmetic come from ``kvstore.kernels.paged``; this module holds the host side:

- ``PageAllocator``: ``can_allocate(num_pages)`` then ``allocate(num_pages)`` hand out page
  ids; ``free(pages)`` gives a holder's pages back. With ``retain_pages`` > 0 it is the
  HBM level of the hierarchy: a full page whose KV is exact for a token prefix is
  ``publish``-ed under that prefix's key (``page_keys``), stays in the pool when its last
  holder frees it (up to ``retain_pages`` such idle pages, least recently used evicted
  first), and ``share(keys)`` maps the leading resident pages of a new request into it
  (a holder more, no copy). Full pages are never written again, so sharing needs no copy on
  write; a partial page is always private. ``allocate`` takes free pages first, then evicts
  idle ones: least recently used first, but pages under keys given to ``protect`` (the
  prompts of queued requests: scheduler-aware eviction) only when no other idle page is
  left.
- ``pages_for(num_tokens, page_tokens)``: how many pages a run of tokens fills.
- ``AttentionBatch``: the addressing of one forward step (positions, slots, lengths, block
  tables), built by ``prefill_batch`` (one sequence's new tokens after a cached prefix) or
  ``decode_batch`` (the one newest token of each of several sequences).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvstore.kernels.paged import slot_mapping


def pages_for(num_tokens: int, page_tokens: int) -> int:
    """Pages that ``num_tokens`` tokens fill, the last one possibly in part."""
    return -(-num_tokens // page_tokens)


class PageAllocator:
    """Hands out the page ids ``0 .. num_pages - 1`` of one pool, and keeps up to
    ``retain_pages`` idle pages resident under their keys for ``share``."""

    def __init__(self, num_pages: int, *, retain_pages: int = 0) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if not 0 <= retain_pages <= num_pages:
            raise ValueError(f"retain_pages must be in 0..{num_pages}, got {retain_pages}")
        self.num_pages = num_pages
        self.retain_pages = retain_pages
        self._free: deque[int] = deque(range(num_pages))
        self._holders: dict[int, int] = {}  # page -> holders; every page in use is here
        self._key_of: dict[int, bytes] = {}  # resident pages (held or idle) -> key
        self._page_of: dict[bytes, int] = {}  # key -> its resident page
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, no holder; LRU first
        self._protected: frozenset[bytes] = frozenset()  # keys queued requests will share
        self.shared_pages = 0  # pages handed out by share (HBM hits)
        self.evicted_pages = 0  # idle resident pages given up (room, or over retain_pages)

    @property
    def num_free_pages(self) -> int:
        """Pages no sequence holds: free ones and idle resident ones (evicted on demand)."""
        return len(self._free) + len(self._idle)

    @property
    def num_resident_pages(self) -> int:
        """Pages under a key, held or idle."""
        return len(self._key_of)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether ``allocate(num_pages)`` would succeed now."""
        return num_pages <= self.num_free_pages

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages for one holder: free ones, then the least recently used
        idle resident ones (their keys are forgotten).

        Raises:
            ValueError: Fewer than ``num_pages`` are free or idle.
        """
        if not self.can_allocate(num_pages):
            raise ValueError(
                f"{num_pages} pages asked for, {self.num_free_pages} of {self.num_pages} are free"
            )
        while len(self._free) < num_pages:
            self._evict_idle()
        pages = [self._free.popleft() for _ in range(num_pages)]
        for page in pages:
            self._holders[page] = 1
        return pages

    def share(self, keys: Sequence[bytes]) -> list[int]:
        """The resident pages of the leading ``keys``, each with one holder more (stopping
        at the first key not resident)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            self._idle.pop(page, None)
            self._holders[page] = self._holders.get(page, 0) + 1
            pages.append(page)
        self.shared_pages += len(pages)
        return pages

    def publish(self, pages: Sequence[int], keys: Sequence[bytes]) -> int:
        """Make held, full ``pages`` resident under ``keys`` (pairwise: page ``i`` holds
        exactly the KV of the prefix ``keys[i]`` names). A page already resident, or a key
        another page holds, is left as it is. Returns the pages newly resident."""
        if not self.retain_pages:
            return 0
        published = 0
        for page, key in zip(pages, keys, strict=False):
            if page not in self._holders:
                raise ValueError(f"page {page} is not held: only a holder publishes")
            if page in self._key_of or key in self._page_of:
                continue
            self._key_of[page], self._page_of[key] = key, page
            published += 1
        return published

    def free(self, pages: Sequence[int]) -> None:
        """One holder gives ``pages`` back: a page without holders becomes idle when it is
        resident (the least recently used idle pages past ``retain_pages`` are evicted),
        else free.

        Raises:
            ValueError: A page is not currently held.
        """
        unknown = [page for page in pages if page not in self._holders]
        if unknown:
            raise ValueError(f"pages {unknown} are not allocated")
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page]:
                continue
            del self._holders[page]
            if page in self._key_of:
                self._idle[page] = None
            else:
                self._free.append(page)
        while len(self._idle) > self.retain_pages:
            self._evict_idle()

    def protect(self, keys: Iterable[bytes]) -> None:
        """Idle pages under ``keys`` are evicted last, after every other idle page (the
        prompts of requests waiting to run); replaces the keys given before."""
        self._protected = frozenset(keys)

    def holders(self, page: int) -> int:
        """How many sequences hold ``page`` now (0: free or idle)."""
        return self._holders.get(page, 0)

    def _evict_idle(self) -> None:
        """Evicts the least recently used idle page no queued request will share, or the
        least recently used idle page when every one is protected."""
        page = next(iter(self._idle))
        if self._protected:
            page = next((p for p in self._idle if self._key_of[p] not in self._protected), page)
        del self._idle[page]
        del self._page_of[self._key_of.pop(page)]
        self._free.append(page)
        self.evicted_pages += 1


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
