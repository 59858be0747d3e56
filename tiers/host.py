"""Host tier: blobs in shared memory that co-located clients map, one arena per partition.

A *partition* is an opaque name a key belongs to (``partition_of(key)``; the daemon uses the
tenant, so tenants never share memory). Each partition has its own arena: an anonymous
memory file (memfd: no path under ``/dev/shm``, gone when the process dies) of
``capacity_bytes``, mapped read-write by this process. Co-located clients get two
descriptors of their partition's arena (:meth:`HostTier.arena`), sent over a unix socket by
the daemon: a read-only one, which they read leased slots through, and a read-write one,
which their puts fill reserved slots through, in place. Neither can resize the file (it is
sealed against it), and its mode is 0400, so a process of another user holding either cannot
reopen it through ``/proc``. A partition's file only ever holds that partition's bytes: a
client can write no other partition's blocks, whatever it writes in its own file.

One :class:`~kvstore.tiers.allocator.ArenaAllocator` places the blobs of every partition in
one range ``[0, capacity)``: a byte range belongs to at most one partition at a time, and
when it passes to another partition its pages are given back from the previous partition's
file (``MADV_REMOVE``). So the memory held never exceeds ``capacity_bytes`` however the
partitions take turns, and reusing a range within one partition costs no page faults.

Primitives, beyond the :class:`~kvstore.tiers.base.Tier` contract (``put``, ``get``,
``get_range``, ``contains``, ``contains_many``, ``delete``, ``keys``, ``usage``, ...):

1. ``reserve(key, length)`` -> a :class:`Slot`, or ``None`` when there is no room. The space is
   held (it counts in ``usage()``) but the key stays invisible to ``get``/``contains``/``keys``.
2. The owner writes the slot's bytes (``view(slot)``).
3. ``commit(key)`` -> the slot, now the visible blob; a key that is already committed cannot
   be committed over (``SlotExistsError``). ``abort(key)`` releases the reservation instead.
4. ``locate(key)`` -> the committed slot; ``pin(key)`` / ``unpin(slot)`` around every use of
   its bytes outside this tier (a lease, a view) keep them from being freed or reused: a
   deleted or replaced blob's slot is freed only at its last unpin.
5. ``get_into(key, out)`` -> the blob's length, copied into a buffer the caller owns.
6. ``arena(partition)`` -> :class:`ArenaHandle` (id, size, read-only and read-write
   descriptors). ``hold(slot)`` keeps a reserved slot's range from being freed while a
   client may still write it (undone by ``unpin``): a reservation that expires or is aborted
   meanwhile gives its range back only then.
7. ``keep_pages(partition)`` / ``release_pages(partition)`` around the life of a client
   mapping that CUDA registered: while any keep lasts, no range of that partition's arena is
   given back (``MADV_REMOVE``) when it passes to another partition. A registration holds the
   pages it found; given back and later refilled, the range would have new pages that the
   device never sees, so it would read stale bytes. Such an arena keeps its pages instead:
   each kept partition may hold up to ``capacity_bytes`` (a registration faults in the whole
   arena anyway), on top of the tier's own bound.

``put`` is reserve + copy + commit on a private reservation; a put of a committed key
replaces it (the old slot is freed at its last unpin).

Safety: all bookkeeping runs on the event loop thread. Copies of ``COPY_THREAD_BYTES`` or
more run in a worker thread that does not hold the GIL, and a cancelled caller still waits
for its thread to finish.
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import fcntl
import functools
import logging
import mmap
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, Self, TypeVar

import numpy as np
import numpy.typing as npt
import xxhash

from kvstore.wire.threads import (
    COPY_THREAD_BYTES,
    copy_and_sum_at,
    pread_exactly,
    run_to_completion,
)

from . import collector
from .allocator import ArenaAllocator, Slot
from .base import (
    BlobTooLargeError,
    Buffer,
    InvalidRangeError,
    TierClosedError,
    TierError,
    check_key,
    check_range,
)

PREFAULT_CHUNK_BYTES = 16 * 1024 * 1024  # faulted in per worker-thread call, at most ...
PREFAULT_CHUNK_SHARE = 16  # ... and at most 1/16 of the tier
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")
Bytes = npt.NDArray[np.uint8]


def _madvise(mapping: Bytes, start: int, length: int, advice: int) -> None:
    """``madvise`` of ``[start, start + length)`` of a mapping, through ctypes, which lets go
    of the GIL meanwhile (``mmap.madvise`` holds it: faulting in 16 MiB held the daemon's
    event loop for ~7 ms, and a fresh arena's pre-faulting stalled every call for seconds).

    Raises:
        OSError: what the system answered.
    """
    if _LIBC.madvise(mapping.ctypes.data + start, length, advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.madvise.restype = ctypes.c_int


class ReservationExistsError(TierError, ValueError):
    """``reserve`` of a key that already has a pending reservation."""


class ReservationNotFoundError(TierError, LookupError):
    """``commit`` of a key that has no pending reservation."""


class SlotExistsError(TierError, ValueError):
    """``commit`` of a key that already has a committed blob."""


class InvalidSlotError(TierError, ValueError):
    """A slot outside the arena, or ``unpin`` of a slot that is not pinned."""


class InvalidBufferError(TierError, ValueError):
    """A ``get_into`` buffer that is read-only, not contiguous or shorter than the blob."""


@dataclass(frozen=True, slots=True)
class ArenaHandle:
    """One partition's arena as a client maps it.

    Attributes:
        partition: The partition's name.
        arena_id: 16 random bytes naming this arena (a restarted daemon has new ones).
        size: Bytes of the arena file.
        fd: A read-only descriptor of the file, owned by the tier (send or dup it).
        writer_fd: A read-write descriptor of the same file, owned by the tier: for the
            partition's own writers, which fill the slots reserved for them in place.
    """

    partition: str
    arena_id: bytes
    size: int
    fd: int
    writer_fd: int = -1


class _Arena:
    """A memfd of ``size`` bytes, mapped read-write here; sealed against resizing."""

    def __init__(self, partition: str, size: int, number: int) -> None:
        self.partition = partition
        self.arena_id = secrets.token_bytes(16)
        self.fd = os.memfd_create(f"kvstore-arena-{number}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.reader_fd = -1
        self.keeps = 0  # client registrations alive: while > 0, no page is given back
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            # A read-only open of the same file, for clients; then mode 0400, so that another
            # user holding it cannot reopen it writable through /proc.
            self.reader_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
            os.fchmod(self.fd, 0o400)
            self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED)
        except BaseException:
            self.close()
            raise
        self.bytes: Bytes = np.frombuffer(self.map, dtype=np.uint8)

    def handle(self) -> ArenaHandle:
        return ArenaHandle(self.partition, self.arena_id, len(self.map), self.reader_fd, self.fd)

    def populate(self, start: int, length: int, page_bytes: int) -> None:
        """Faults in (allocates, writable) the pages of ``[start, start + length)``; blocks
        (without the GIL): run it in a worker thread."""
        try:
            _madvise(self.bytes, start, length, MADV_POPULATE_WRITE)
        except OSError:  # an older kernel: write a byte of every page instead
            self.bytes[start : start + length : page_bytes] = 0

    def punch(self, start: int, length: int) -> None:
        """Gives the pages of ``[start, start + length)`` back to the system (reads: zeros)."""
        try:
            _madvise(self.bytes, start, length, mmap.MADV_REMOVE)
        except OSError as error:  # the memory stays held; nothing reads it
            logger.warning("arena %s: cannot release %d bytes: %s", self.partition, length, error)

    def close(self) -> None:
        if getattr(self, "map", None) is not None:
            self.bytes = np.empty(0, dtype=np.uint8)
            try:
                self.map.close()
            except BufferError:
                logger.warning(
                    "arena %s: views still alive; unmapped when released", self.partition
                )
        for fd in (self.fd, self.reader_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.reader_fd = -1


class _Residency:
    """Byte ranges that were freed but whose pages an arena still holds: ``[start, end)`` ->
    the arena holding them. Ranges never overlap (a range has one owner at a time)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._end: dict[int, int] = {}
        self._owner: dict[int, _Arena] = {}
        self._start_by_end: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def left(self, start: int, end: int, arena: _Arena) -> None:
        """``arena`` freed ``[start, end)`` but keeps its pages."""
        before = self._start_by_end.get(start)
        if before is not None and self._owner[before] is arena:
            self._remove(before)
            start = before
        if end in self._end and self._owner[end] is arena:
            after = self._end[end]
            self._remove(end)
            end = after
        self._add(start, end, arena)

    def gap(self, start: int, end: int) -> tuple[int, int] | None:
        """The first part of ``[start, end)`` no arena holds, as ``(start, end)``."""
        index = max(0, bisect.bisect_right(self._starts, start) - 1)
        while start < end:
            if index >= len(self._starts) or self._starts[index] >= end:
                return start, end
            s, e = self._starts[index], self._end[self._starts[index]]
            if e <= start:
                index += 1
                continue
            if s > start:
                return start, s
            start, index = e, index + 1
        return None

    def claim(self, start: int, end: int, arena: _Arena) -> list[tuple[_Arena, int, int]]:
        """``arena`` takes ``[start, end)``; returns the parts other arenas still hold."""
        others: list[tuple[_Arena, int, int]] = []
        index = max(0, bisect.bisect_right(self._starts, start) - 1)
        while index < len(self._starts) and self._starts[index] < end:
            s = self._starts[index]
            e, owner = self._end[s], self._owner[s]
            if e <= start:
                index += 1
                continue
            self._remove(s)
            if s < start:
                self._add(s, start, owner)
                index += 1
            if e > end:
                self._add(end, e, owner)
            if owner is not arena:
                others.append((owner, max(s, start), min(e, end)))
        return others

    def _add(self, start: int, end: int, arena: _Arena) -> None:
        bisect.insort(self._starts, start)
        self._end[start] = end
        self._owner[start] = arena
        self._start_by_end[end] = start

    def _remove(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._start_by_end[self._end.pop(start)]
        del self._owner[start]


class HostTier:
    """A :class:`~kvstore.tiers.base.Tier` in shared-memory arenas, one per partition.

    Args:
        capacity_bytes: Bytes of blobs the tier holds, all partitions together; also the
            size of each arena file (memory is only used where blobs are).
        name: Name of the tier in logs and errors.
        page_bytes: Allocation granule, a power of two; slots start on page boundaries.
        partition_of: A key's partition; by default every key is in partition ``""``. It may
            also be set as the attribute of that name before the first put.
        prefault: Fault in each new arena's free pages in a worker thread, a chunk at a
            time, so that puts do not pay the first touch (a page fault per page, 0.02x of
            memcpy for a large block). Only pages no other arena holds, so the memory held
            stays within ``capacity_bytes``.

    Raises:
        ValueError: A bad argument, named with its value.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        name: str = "host",
        page_bytes: int = 4096,
        partition_of: Callable[[bytes], str] | None = None,
        prefault: bool = False,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._allocator = ArenaAllocator(capacity_bytes, page_bytes=page_bytes)
        self.name = name
        self._capacity = capacity_bytes
        self._page_bytes = page_bytes
        self.partition_of: Callable[[bytes], str] = partition_of or (lambda _key: "")
        self._arenas: dict[str, _Arena] = {}
        self._started = False
        self._closed = False
        self._committed: dict[bytes, Slot] = {}
        self._pending: dict[bytes, Slot] = {}
        self._owner: dict[int, _Arena] = {}  # slot offset -> the arena of every live slot
        self._resident = _Residency()
        self._pins: dict[int, int] = {}  # slot offset -> pin count
        self._released: dict[int, Slot] = {}  # pinned slots let go of; freed at the last unpin
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._prefault = prefault
        self._prefaults: set[asyncio.Task[int]] = set()
        self._holds = 0  # pre-fault chunks held out of the allocator now
        self._unheld = asyncio.Event()
        self._unheld.set()

    # Lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Opens the tier; arenas are created on first use. A second call does nothing.

        Raises:
            TierClosedError: The tier was closed; tiers do not restart.
        """
        if self._closed:
            raise TierClosedError(f"{self.name}: a closed tier cannot be restarted")
        self._started = True

    async def aclose(self) -> None:
        """Waits for copies in flight, then unmaps and closes every arena."""
        if self._closed:
            return
        self._closed = True
        for task in self._prefaults:
            task.cancel()
        await asyncio.gather(*self._prefaults, return_exceptions=True)
        await self._idle.wait()
        for arena in self._arenas.values():
            arena.close()
        logger.info("%s: closed %d arenas", self.name, len(self._arenas))
        self._arenas, self._owner = {}, {}
        self._committed, self._pending, self._pins, self._released = {}, {}, {}, {}
        self._allocator = ArenaAllocator(self._capacity, page_bytes=self._page_bytes)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # Tier contract --------------------------------------------------------------------------

    async def put(self, key: bytes, data: Buffer) -> bool:
        """Stores ``data`` under ``key``, replacing an older blob atomically.

        Returns:
            ``True`` when stored, ``False`` when there is no room (an older blob stays).

        Raises:
            InvalidKeyError: ``key`` is not 1..64 bytes.
            BlobTooLargeError: ``data`` can never fit in the arena.
            TierClosedError: The tier is not started, or closed during the copy.
        """
        key = self._open_key(key)
        source = _byte_view(data)
        slot = self._allocate(key, source.nbytes)
        while slot is None and await self.wait_unheld():
            slot = self._allocate(key, source.nbytes)
        if slot is None:
            return False
        try:
            await self._write(slot, source)
            self._require_open()
        except BaseException:
            self._release(slot)
            raise
        old = self._committed.get(key)
        collector.insert(self._committed, key, slot)
        if old is not None:
            self._release(old)
        return True

    async def get(self, key: bytes) -> bytes | None:
        """Returns a copy of the blob under ``key``, or ``None`` on a miss."""
        key = self._open_key(key)
        slot = self._committed.get(key)
        if slot is None:
            return None
        return await self._read_pinned(slot, 0, slot.length)

    async def get_hashed(self, key: bytes) -> tuple[bytes | memoryview, int] | None:
        """A copy of the blob under ``key`` and the xxh3-64 of that copy, or ``None`` on a
        miss. The copy and the hash run in one pass (a chunk hashed while the copy has it in
        cache): a large blob comes back as a read-only view of a new buffer, not ``bytes``,
        whose pages the kernel would otherwise copy at half the speed."""
        key = self._open_key(key)
        slot = self._committed.get(key)
        if slot is None:
            return None
        arena = self._owner[slot.offset]
        if slot.length < COPY_THREAD_BYTES:
            blob = arena.map[slot.offset : slot.end]  # no await: nothing can intervene
            return blob, xxhash.xxh3_64_intdigest(blob)
        self._pin(slot)
        try:
            source = arena.bytes[slot.offset : slot.end]
            return await self._in_thread(_copy_hashed, source)
        finally:
            self._unpin(slot)

    async def get_range(self, key: bytes, offset: int, length: int) -> bytes | None:
        """Returns ``length`` bytes from ``offset`` (fewer at the end), or ``None`` on a miss.

        Raises:
            InvalidRangeError: ``offset`` or ``length`` is negative.
        """
        key = self._open_key(key)
        check_range(offset, length)
        slot = self._committed.get(key)
        if slot is None:
            return None
        start = min(offset, slot.length)
        return await self._read_pinned(slot, start, min(slot.length, start + length))

    async def get_into(self, key: bytes, out: bytearray | memoryview) -> int | None:
        """Copies the blob under ``key`` to the start of ``out``; the rest of ``out`` is untouched.

        Returns:
            The blob's length, or ``None`` on a miss.

        Raises:
            InvalidBufferError: ``out`` is read-only, not contiguous or shorter than the blob
                (nothing is copied).
        """
        key = self._open_key(key)
        target = _writable_view(out)
        slot = self._committed.get(key)
        if slot is None:
            return None
        if target.nbytes < slot.length:
            raise InvalidBufferError(
                f"{self.name}: a {target.nbytes}-byte buffer cannot hold {slot.length} bytes"
            )
        await self._read_pinned_into(slot, target[: slot.length])
        return slot.length

    async def contains(self, key: bytes) -> bool:
        """Whether a committed blob is stored under ``key``."""
        key = self._open_key(key)
        return key in self._committed

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One :meth:`contains` answer per key."""
        self._require_open()
        return [check_key(key) in self._committed for key in keys]

    async def delete(self, key: bytes) -> bool:
        """Removes the blob under ``key``; ``False`` when there was none."""
        key = self._open_key(key)
        slot = self._committed.pop(key, None)
        if slot is None:
            return False
        self._release(slot)
        return True

    def keys(self) -> Iterable[bytes]:
        """The keys of the committed blobs (a snapshot)."""
        return list(self._committed)

    def usage(self) -> int:
        """Bytes of allocated space (committed, reserved, pinned), rounded to pages."""
        return self._allocator.used_bytes

    def capacity(self) -> int:
        """The tier's size in bytes, all partitions together."""
        return self._capacity

    def healthy(self) -> bool:
        """Always ``True``: local memory cannot become unreachable."""
        return True

    # Data plane -----------------------------------------------------------------------------

    def slot_bytes(self, length: int) -> int:
        """The space a blob of ``length`` bytes takes (whole pages)."""
        return self._allocator.slot_bytes(length)

    def fits(self, length: int) -> bool:
        """Whether a blob of ``length`` bytes can ever fit (with the tier empty)."""
        return self._allocator.slot_bytes(length) <= self._allocator.capacity_bytes

    def arena(self, partition: str) -> ArenaHandle:
        """The arena of ``partition`` (created now if it has none yet), for clients to map.

        Raises:
            TierClosedError: The tier is not started, or closed.
        """
        self._require_open()
        return self._arena(partition).handle()

    def keep_pages(self, partition: str) -> None:
        """A client registered ``partition``'s arena with CUDA: its pages are never given
        back until the matching :meth:`release_pages`."""
        self._arena(partition).keeps += 1

    def release_pages(self, partition: str) -> None:
        """Ends one :meth:`keep_pages`."""
        arena = self._arena(partition)
        arena.keeps = max(0, arena.keeps - 1)

    def kept(self, partition: str) -> int:
        """How many :meth:`keep_pages` of ``partition`` are in force."""
        return self._arena(partition).keeps

    def reserve(self, key: bytes, length: int) -> Slot | None:
        """Holds space for a blob of ``length`` bytes, invisible until :meth:`commit`.

        Returns:
            The slot to write, or ``None`` when there is no room.

        Raises:
            ReservationExistsError: ``key`` already has a pending reservation.
            BlobTooLargeError: ``length`` can never fit in the arena.
            InvalidRangeError: ``length`` is negative.
        """
        key = self._open_key(key)
        if key in self._pending:
            raise ReservationExistsError(f"{self.name}: key {key.hex()} is already reserved")
        slot = self._allocate(key, length)
        if slot is not None:
            self._pending[key] = slot
        return slot

    def commit(self, key: bytes) -> Slot:
        """Makes the pending reservation of ``key`` its visible blob.

        Raises:
            ReservationNotFoundError: ``key`` has no pending reservation.
            SlotExistsError: ``key`` is committed already (the reservation stays pending).
        """
        key = self._open_key(key)
        if key in self._committed:
            raise SlotExistsError(f"{self.name}: key {key.hex()} is already committed")
        slot = self._pending.pop(key, None)
        if slot is None:
            raise ReservationNotFoundError(f"{self.name}: key {key.hex()} is not reserved")
        collector.insert(self._committed, key, slot)
        return slot

    def abort(self, key: bytes) -> bool:
        """Frees the pending reservation of ``key``; ``False`` when there was none."""
        key = self._open_key(key)
        slot = self._pending.pop(key, None)
        if slot is None:
            return False
        self._release(slot)
        return True

    def locate(self, key: bytes) -> Slot | None:
        """The committed slot of ``key``, or ``None``. Pin it to use it outside the tier."""
        key = self._open_key(key)
        return self._committed.get(key)

    def pin(self, key: bytes) -> Slot | None:
        """Locates ``key`` and holds its bytes (not the key) against reuse until :meth:`unpin`."""
        slot = self.locate(key)
        if slot is not None:
            self._pin(slot)
        return slot

    def pin_block(self, key: bytes) -> Slot | None:
        """:meth:`pin` for a key the caller took from its own records (a block id), so not
        checked again: a fraction of the cost, for a read that leases many blocks."""
        if self._closed or not self._started:
            self._require_open()
        slot = self._committed.get(key)
        if slot is not None:
            self._pin(slot)
        return slot

    def unpin(self, slot: Slot) -> None:
        """Undoes one :meth:`pin`.

        Raises:
            InvalidSlotError: ``slot`` is not pinned.
        """
        self._require_open()
        if slot.offset not in self._pins:
            raise InvalidSlotError(f"{self.name}: slot at offset {slot.offset} is not pinned")
        self._unpin(slot)

    def hold(self, slot: Slot) -> None:
        """Pins a live slot (reserved or committed) by its range, not its key: a client writes
        it in place, so its range must not pass to another blob, whatever happens to the
        reservation, until :meth:`unpin`."""
        self._require_open()
        if self._owner.get(slot.offset) is None:
            raise InvalidSlotError(f"{self.name}: slot at offset {slot.offset} is not live")
        self._pin(slot)

    def pinned(self, slot: Slot) -> int:
        """How many pins hold ``slot``."""
        return self._pins.get(slot.offset, 0)

    def view(self, slot: Slot) -> memoryview:
        """A writable view of a live slot's bytes in its arena.

        Release it (``view.release()`` or ``with``) before :meth:`aclose`; a view still alive
        then keeps the mapping until it is garbage collected.

        Raises:
            InvalidSlotError: The slot is not live, or lies outside the arena.
        """
        self._require_open()
        with memoryview(self._arena_of(slot).map) as whole:
            return whole[slot.offset : slot.end]

    def views(self, slots: Sequence[Slot]) -> list[memoryview]:
        """:meth:`view` of each of ``slots`` (one view of each arena, sliced: 512 views cost
        0.2 ms of the loop, not 1.5); release every one of them."""
        self._require_open()
        wholes: dict[int, memoryview] = {}
        views: list[memoryview] = []
        try:
            for slot in slots:
                arena = self._arena_of(slot)
                whole = wholes.get(id(arena))
                if whole is None:
                    whole = wholes[id(arena)] = memoryview(arena.map)
                views.append(whole[slot.offset : slot.end])
        except BaseException:
            for view in views:
                view.release()
            raise
        finally:
            for whole in wholes.values():
                whole.release()  # the slices hold the mapping on their own
        return views

    # Internals ------------------------------------------------------------------------------

    def _arena_of(self, slot: Slot) -> _Arena:
        arena = self._owner.get(slot.offset)
        if arena is None or slot.length < 0 or slot.end > self._capacity:
            raise InvalidSlotError(f"{self.name}: {slot} is not a live slot of the arena")
        return arena

    def _open_key(self, key: bytes) -> bytes:
        key = check_key(key)
        self._require_open()
        return key

    def _require_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"{self.name}: tier is closed")
        if not self._started:
            raise TierClosedError(f"{self.name}: tier is not started")

    def _arena(self, partition: str) -> _Arena:
        arena = self._arenas.get(partition)
        if arena is None:
            arena = self._arenas[partition] = _Arena(partition, self._capacity, len(self._arenas))
            logger.info("%s: new %d-byte arena #%d", self.name, self._capacity, len(self._arenas))
            if self._prefault:
                self._start_prefault(arena)
        return arena

    def _start_prefault(self, arena: _Arena) -> None:
        try:
            task = asyncio.get_running_loop().create_task(self._prefault_arena(arena))
        except RuntimeError:  # no loop (a synchronous caller): the pages fault on first use
            return
        self._prefaults.add(task)
        task.add_done_callback(self._prefaults.discard)

    async def wait_unheld(self) -> bool:
        """Waits until no pre-fault chunk is held out of the allocator; whether one was, so
        that an allocation that failed may succeed now. Call it before evicting to make room:
        space held for a few milliseconds of faulting is not a full tier."""
        if not self._holds:
            return False
        await self._unheld.wait()
        return True

    async def prefaulted(self) -> None:
        """Waits until the arenas' pre-faulting is done (for tests and benchmarks)."""
        await asyncio.gather(*self._prefaults, return_exceptions=True)

    async def _prefault_arena(self, arena: _Arena) -> int:
        """Faults in, for ``arena``, the free pages no arena holds; returns the bytes. Each
        chunk is held out of the allocator while a worker thread faults it (no slot lands
        there meanwhile), then left to ``arena`` as resident free space. A chunk is taken
        only while more than half the tier is free, but puts may fill the rest while it
        faults: a put that then finds no other room waits for the chunk (a reserve's caller
        does so through :meth:`wait_unheld`) rather than fail or evict."""
        faulted = 0
        while not self._closed and (span := self._unheld_free_span()) is not None:
            start, length = span
            self._allocator.hold(start, length)
            self._holds += 1
            self._unheld.clear()
            try:
                await self._in_thread(arena.populate, start, length, self._page_bytes)
            finally:
                self._allocator.unhold(start, length)
                self._holds -= 1
                if not self._holds:
                    self._unheld.set()
            if self._closed:
                break
            self._resident.left(start, start + length, arena)
            faulted += length
        logger.info("%s: pre-faulted %d bytes of arena %r", self.name, faulted, arena.partition)
        return faulted

    def _unheld_free_span(self) -> tuple[int, int] | None:
        """A chunk of free space whose pages no arena holds, while over half the tier is
        free."""
        allocator = self._allocator
        if 2 * allocator.used_bytes >= allocator.capacity_bytes:
            return None
        chunk = max(
            self._page_bytes, min(PREFAULT_CHUNK_BYTES, self._capacity // PREFAULT_CHUNK_SHARE)
        )
        chunk -= chunk % self._page_bytes
        for offset, length in allocator.free_extents():
            gap = self._resident.gap(offset, offset + length)
            if gap is not None:
                start, end = gap
                return start, min(end - start, chunk)
        return None

    def _allocate(self, key: bytes, length: int) -> Slot | None:
        if length < 0:
            raise InvalidRangeError(f"length must be non-negative, got {length}")
        if not self.fits(length):
            raise BlobTooLargeError(
                f"{self.name}: a blob of {length} bytes cannot fit in {self._capacity} bytes"
            )
        arena = self._arena(self.partition_of(key))
        slot = self._allocator.allocate(length)
        if slot is None:
            return None
        end = slot.offset + self._allocator.slot_bytes(length)
        for other, start, stop in self._resident.claim(slot.offset, end, arena):
            if not other.keeps:  # a registered mapping must keep seeing the same pages
                other.punch(start, stop - start)
        # Per-slot maps of untracked slots and of arenas (which refer to no slot map): kept
        # out of the garbage collector's walks (see kvstore.tiers.collector).
        collector.insert(self._owner, slot.offset, arena)
        return slot

    def _release(self, slot: Slot) -> None:
        if self._closed:
            return
        if slot.offset in self._pins:
            self._released[slot.offset] = slot
        else:
            self._free(slot)

    def _free(self, slot: Slot) -> None:
        arena = self._owner.pop(slot.offset)
        self._allocator.free(slot)
        end = slot.offset + self._allocator.slot_bytes(slot.length)
        self._resident.left(slot.offset, end, arena)

    def _pin(self, slot: Slot) -> None:
        self._pins[slot.offset] = self._pins.get(slot.offset, 0) + 1

    def _unpin(self, slot: Slot) -> None:
        count = self._pins.pop(slot.offset, 0) - 1
        if count > 0:
            self._pins[slot.offset] = count
            return
        released = self._released.pop(slot.offset, None)
        if released is not None and not self._closed:
            self._free(released)

    async def _read_pinned(self, slot: Slot, start: int, stop: int) -> bytes:
        arena = self._owner[slot.offset]
        offset, length = slot.offset + start, stop - start
        if length < COPY_THREAD_BYTES:
            return arena.map[offset : offset + length]  # no await: nothing can intervene
        self._pin(slot)
        try:
            return await self._in_thread(pread_exactly, arena.fd, offset, length)
        finally:
            self._unpin(slot)

    async def _read_pinned_into(self, slot: Slot, target: memoryview) -> None:
        arena = self._owner[slot.offset]
        if slot.length < COPY_THREAD_BYTES:
            with memoryview(arena.map) as whole:
                target[:] = whole[slot.offset : slot.end]
            return
        self._pin(slot)
        try:
            source = arena.bytes[slot.offset : slot.end]
            await self._in_thread(np.copyto, np.frombuffer(target, dtype=np.uint8), source)
        finally:
            self._unpin(slot)

    async def _write(self, slot: Slot, source: memoryview) -> None:
        arena = self._owner[slot.offset]
        if source.nbytes < COPY_THREAD_BYTES:
            arena.map[slot.offset : slot.offset + source.nbytes] = source
        else:
            target = arena.bytes[slot.offset : slot.offset + source.nbytes]
            await self._in_thread(np.copyto, target, np.frombuffer(source, dtype=np.uint8))

    async def _in_thread(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Runs a copy in a worker thread; ``aclose`` waits until every such copy is done."""
        self._inflight += 1
        self._idle.clear()
        try:
            return await run_to_completion(functools.partial(fn, *args, **kwargs))
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()


def _copy_hashed(source: npt.NDArray[np.uint8]) -> tuple[memoryview, int]:
    """A copy of ``source`` in a new buffer, and its xxh3-64, taken as it lands
    (:func:`~kvstore.wire.threads.copy_and_sum_at`; runs without the GIL)."""
    copy = np.empty(source.nbytes, dtype=np.uint8)
    digest = copy_and_sum_at(source.ctypes.data, copy.ctypes.data, source.nbytes)
    return copy.data.toreadonly(), digest


def _byte_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of ``data`` (a copy only if it is not contiguous)."""
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _writable_view(out: bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``out`` that writes land in, or :class:`InvalidBufferError`."""
    view = memoryview(out)
    if view.readonly or not view.c_contiguous:
        raise InvalidBufferError("get_into needs a writable, contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
