"""Page-granular arena allocator: non-overlapping slots of ``[0, capacity)``, no I/O.

The host tier places every blob of its shared-memory arena through this allocator. Offsets
must stay put while a blob lives (other processes read them in place), so nothing is ever
moved: the design keeps fragmentation harmless instead.

Design:

* Requests are rounded up to whole pages; the page count is the request's *size class*.
* A class is served from *slabs*: runs of ``max(1, slab_bytes // class_bytes)`` equal slots
  (fewer when free space is short). Blobs of one class pack together, so freeing them leaves
  holes that the next blob of that class fills exactly.
* Slabs are carved from a list of free page extents sorted by address, first fit, and an
  empty slab gives its extent back at once, merged with its free neighbours: the space of a
  class that empties becomes available to every other class.
* A slab of ``n``-page slots starts at a multiple of ``n`` pages whenever such a place exists.
  Hence whenever only one class ``n`` is live and every carve found an aligned place, the free
  pages are whole aligned ``n``-page blocks, and ``floor(capacity / (n * page))`` blobs of that
  class always fit whatever the order of allocations and frees. A history that only ever used
  one class always finds aligned places. If no aligned place exists (other classes in the
  way) the carve falls back to any place with room rather than fail.

Cost per operation: ``O(log slabs)`` to take or return a slot of an open slab; ``O(extents)``
to carve a slab (only when every slab of the class is full). No loop runs per page.

Primitives:

1. ``ArenaAllocator(capacity_bytes, page_bytes=..., slab_bytes=...)``.
2. ``allocate(length)`` -> a :class:`Slot`, or ``None`` when there is no room (a value: the
   caller evicts and retries).
3. ``free(slot)`` gives the slot's pages back; a slot that is not live raises ``ValueError``.
4. ``used_bytes`` (live slots, rounded to pages) ``<= capacity_bytes``, ``slot_bytes(length)``.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import collector

MIB = 1024 * 1024
DEFAULT_SLAB_BYTES = 64 * MIB
MIN_SLABS = 16  # a default slab is at most 1/16 of the arena, so small arenas mix classes


@dataclass(frozen=True, slots=True)
class Slot:
    """A byte range of the arena holding one blob.

    Attributes:
        offset: First byte, from the start of the arena; a multiple of the page size.
        length: Bytes of the blob. The slot owns ``length`` rounded up to whole pages.
    """

    offset: int
    length: int

    @property
    def end(self) -> int:
        """One past the blob's last byte."""
        return self.offset + self.length


@dataclass(slots=True)
class _Slab:
    """``num_slots`` slots of ``slot_pages`` pages each, from page ``start``."""

    start: int
    slot_pages: int
    num_slots: int
    live: int = 0
    next_unused: int = 0
    freed: list[int] = field(default_factory=list)  # heap of slot indices given back

    @property
    def num_pages(self) -> int:
        return self.slot_pages * self.num_slots

    @property
    def full(self) -> bool:
        return self.live == self.num_slots

    def take(self) -> int:
        """Returns the first page of a free slot (the lowest freed one, else a fresh one)."""
        if self.freed:
            index = heapq.heappop(self.freed)
        else:
            index = self.next_unused
            self.next_unused += 1
        self.live += 1
        return self.start + index * self.slot_pages

    def give(self, page: int) -> None:
        heapq.heappush(self.freed, (page - self.start) // self.slot_pages)
        self.live -= 1


class _FreeExtents:
    """Free page runs sorted by start; a returned run merges with its free neighbours."""

    def __init__(self, num_pages: int) -> None:
        self._starts = [0]
        self._length = {0: num_pages}
        self._start_by_end = {num_pages: 0}

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((start, self._length[start]) for start in self._starts)

    def take(self, start: int, pages: int) -> None:
        """Removes ``[start, start + pages)``, which must lie inside one free extent."""
        extent = self._starts[bisect.bisect_right(self._starts, start) - 1]
        end = extent + self._length[extent]
        self._remove(extent)
        if extent < start:
            self._add(extent, start - extent)
        if start + pages < end:
            self._add(start + pages, end - start - pages)

    def give(self, start: int, pages: int) -> None:
        """Adds ``[start, start + pages)`` back, merged with the extents touching it."""
        end = start + pages
        if end in self._length:
            pages += self._length[end]
            self._remove(end)
        before = self._start_by_end.get(start)
        if before is not None:
            pages += start - before
            start = before
            self._remove(before)
        self._add(start, pages)

    def place(self, slot_pages: int, max_slots: int) -> tuple[int, int] | None:
        """Finds where to carve a slab: ``(first page, number of slots)`` or ``None``.

        Prefers, in order: the first aligned place for ``max_slots`` slots, the aligned place
        with the most slots, the first unaligned place for ``max_slots``, the unaligned place
        with the most slots.
        """
        aligned = loose = (0, 0)
        for start, length in self:
            first = -(-start // slot_pages) * slot_pages
            slots = min(max_slots, max(0, start + length - first) // slot_pages)
            if slots == max_slots:
                return first, slots
            if slots > aligned[1]:
                aligned = (first, slots)
            slots = min(max_slots, length // slot_pages)
            if slots > loose[1]:
                loose = (start, slots)
        best = aligned if aligned[1] else loose
        return best if best[1] else None

    def _add(self, start: int, pages: int) -> None:
        bisect.insort(self._starts, start)
        self._length[start] = pages
        self._start_by_end[start + pages] = start

    def _remove(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._start_by_end[start + self._length.pop(start)]


def _check_args(capacity_bytes: int, page_bytes: int, slab_bytes: int | None) -> None:
    if page_bytes <= 0 or page_bytes & (page_bytes - 1):
        raise ValueError(f"page_bytes must be a positive power of two, got {page_bytes}")
    if capacity_bytes < page_bytes:
        raise ValueError(
            f"capacity_bytes must be at least page_bytes ({page_bytes}), got {capacity_bytes}"
        )
    if slab_bytes is not None and slab_bytes <= 0:
        raise ValueError(f"slab_bytes must be positive, got {slab_bytes}")


class ArenaAllocator:
    """Hands out page-aligned, non-overlapping slots of an arena of ``capacity_bytes``.

    Args:
        capacity_bytes: Size of the arena; only whole pages are used.
        page_bytes: Allocation granule, a power of two.
        slab_bytes: Target size of a slab. Defaults to 64 MiB or 1/16 of the arena, whichever
            is smaller; never more than the arena.

    Raises:
        ValueError: A bad argument, named with its value.
    """

    def __init__(
        self, capacity_bytes: int, *, page_bytes: int = 4096, slab_bytes: int | None = None
    ) -> None:
        _check_args(capacity_bytes, page_bytes, slab_bytes)
        if slab_bytes is None:
            slab_bytes = min(DEFAULT_SLAB_BYTES, capacity_bytes // MIN_SLABS)
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        self._slab_pages = max(1, min(slab_bytes, capacity_bytes) // page_bytes)
        self._free = _FreeExtents(self.num_pages)
        self._slabs: dict[int, _Slab] = {}  # by first page
        self._open: dict[int, list[int]] = {}  # slot pages -> sorted starts of non-full slabs
        self._live: dict[int, _Slab] = {}  # first page of a live slot -> its slab
        self._used_pages = 0

    @property
    def capacity_bytes(self) -> int:
        """Bytes that slots may cover: the arena rounded down to whole pages."""
        return self.num_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes covered by live slots, each rounded up to whole pages."""
        return self._used_pages * self.page_bytes

    @property
    def num_live(self) -> int:
        """Number of live slots."""
        return len(self._live)

    def slot_bytes(self, length: int) -> int:
        """Bytes a blob of ``length`` occupies: whole pages, at least one."""
        return self._pages_for(length) * self.page_bytes

    def allocate(self, length: int) -> Slot | None:
        """Reserves a slot for ``length`` bytes.

        Args:
            length: Bytes of the blob; zero still takes one page.

        Returns:
            The slot, or ``None`` when there is no room for it now.

        Raises:
            ValueError: ``length`` is negative.
        """
        if length < 0:
            raise ValueError(f"length must be non-negative, got {length}")
        pages = self._pages_for(length)
        slab = self._open_slab(pages) if pages <= self.num_pages else None
        if slab is None:
            return None
        page = slab.take()
        if slab.full:
            self._close_slab(slab)
        slot = Slot(page * self.page_bytes, length)
        # Slots hold ints, and _live holds slabs that refer to nothing else: no cycles for
        # the garbage collector to find there, so it never walks a slot per block.
        collector.untrack(slot)
        collector.insert(self._live, page, slab)
        self._used_pages += pages
        return slot

    def free(self, slot: Slot) -> None:
        """Gives a live slot back; its slab's extent returns to the free list once empty.

        Raises:
            ValueError: ``slot`` is not live (never allocated, or already freed).
        """
        page, rest = divmod(slot.offset, self.page_bytes)
        slab = None if rest else self._live.get(page)
        if slab is None or slab.slot_pages != self._pages_for(slot.length):
            raise ValueError(f"slot is not allocated: {slot}")
        del self._live[page]
        was_full = slab.full
        slab.give(page)
        self._used_pages -= slab.slot_pages
        if slab.live == 0:
            self._retire(slab)
        elif was_full:
            bisect.insort(self._open.setdefault(slab.slot_pages, []), slab.start)

    def free_extents(self) -> Iterator[tuple[int, int]]:
        """The free runs no slab covers, as ``(offset, length)`` in bytes, by offset."""
        return ((start * self.page_bytes, pages * self.page_bytes) for start, pages in self._free)

    def hold(self, offset: int, length: int) -> None:
        """Takes ``[offset, offset + length)``, page-aligned and inside one free extent, out
        of the free runs until :meth:`unhold` (no slot is carved there meanwhile); it does
        not count as used."""
        self._free.take(offset // self.page_bytes, length // self.page_bytes)

    def unhold(self, offset: int, length: int) -> None:
        self._free.give(offset // self.page_bytes, length // self.page_bytes)

    def _pages_for(self, length: int) -> int:
        return max(1, -(-length // self.page_bytes))

    def _open_slab(self, pages: int) -> _Slab | None:
        starts = self._open.get(pages)
        if starts:
            return self._slabs[starts[0]]
        return self._carve(pages)

    def _carve(self, pages: int) -> _Slab | None:
        place = self._free.place(pages, max(1, self._slab_pages // pages))
        if place is None:
            return None
        start, num_slots = place
        self._free.take(start, pages * num_slots)
        slab = _Slab(start, pages, num_slots)
        # A slab refers to ints and a list of ints: hidden from the collector, it leaves the
        # map of live slots untracked as slots are allocated (see allocate).
        collector.untrack(slab)
        collector.insert(self._slabs, start, slab)
        bisect.insort(self._open.setdefault(pages, []), start)
        return slab

    def _close_slab(self, slab: _Slab) -> None:
        """Takes a slab off its class's open list (it is full or gone)."""
        starts = self._open[slab.slot_pages]
        index = bisect.bisect_left(starts, slab.start)
        if index < len(starts) and starts[index] == slab.start:
            del starts[index]

    def _retire(self, slab: _Slab) -> None:
        self._close_slab(slab)
        del self._slabs[slab.start]
        self._free.give(slab.start, slab.num_pages)
