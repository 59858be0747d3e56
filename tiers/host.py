"""Host tier: blobs in one shared-memory arena file that other processes may map.

``start()`` creates ``<directory>/kvstore-<pid>-<random hex>.arena`` (mode 0600), sizes it to
the capacity, reserves its pages up front (so a too-small ``/dev/shm`` fails here, not later
as a ``SIGBUS``) and maps it shared. :class:`~kvstore.tiers.allocator.ArenaAllocator` places
the blobs; ``aclose()`` waits for copies in flight, unmaps the arena and unlinks the file.

Primitives, beyond the :class:`~kvstore.tiers.base.Tier` contract (``put``, ``get``,
``get_range``, ``contains``, ``contains_many``, ``delete``, ``keys``, ``usage``, ...), for a
client that maps ``arena_path`` itself and moves the bytes without a copy through the daemon:

1. ``reserve(key, length)`` -> a :class:`Slot`, or ``None`` when there is no room. The space is
   held (it counts in ``usage()``) but the key stays invisible to ``get``/``contains``/``keys``.
2. The client writes the slot's bytes (``view(slot)`` in this process).
3. ``commit(key)`` -> the slot, now the visible blob; an older blob of the key is released.
   ``abort(key)`` releases the reservation instead.
4. ``locate(key)`` -> the committed slot; ``pin(key)`` / ``unpin(slot)`` around reading it in
   place keep its bytes from being reused by a later put meanwhile.
5. ``get_into(key, out)`` -> the blob's length, copied into a buffer the caller owns (no new
   allocation, so no page faults on fresh memory), or ``None`` on a miss.

``put`` is reserve + copy + commit on a private reservation, so concurrent puts of one key never
clash: the last to finish wins.

Safety: all bookkeeping runs on the event loop thread. Copies of ``COPY_IN_THREAD_BYTES`` or
more run in a worker thread that does not hold the GIL (``ctypes.memmove`` into the arena and
out of it to a caller's buffer, ``os.pread`` out of it to new bytes), and a cancelled caller
still waits for its thread to finish. A slot being read is pinned: deleting or replacing its
key defers the free to the last unpin, so no put can reuse bytes a copy is still reading.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import mmap
import os
import secrets
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import ParamSpec, Self, TypeVar

import torch

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

# Below this a copy runs inline: at memcpy speed it takes < 0.5 ms, less than handing it to a
# worker thread and waking the loop again costs on a busy machine.
COPY_IN_THREAD_BYTES = 4 * 1024 * 1024

logger = logging.getLogger(__name__)

# torch.frombuffer warns once per process that a tensor over read-only bytes could write them.
# The source tensors of put are only ever read: spend that one warning here, silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)

P = ParamSpec("P")
T = TypeVar("T")


class ReservationExistsError(TierError, ValueError):
    """``reserve`` of a key that already has a pending reservation."""


class ReservationNotFoundError(TierError, LookupError):
    """``commit`` of a key that has no pending reservation."""


class InvalidSlotError(TierError, ValueError):
    """A slot outside the arena, or ``unpin`` of a slot that is not pinned."""


class InvalidBufferError(TierError, ValueError):
    """A ``get_into`` buffer that is read-only, not contiguous or shorter than the blob."""


class HostTier:
    """A :class:`~kvstore.tiers.base.Tier` in a shared-memory arena file.

    Args:
        capacity_bytes: Size of the arena file and mapping.
        directory: Where the arena file lives; a tmpfs (``/dev/shm``) keeps it in memory.
        name: Name of the tier in logs and errors.
        page_bytes: Allocation granule, a power of two; slots start on page boundaries.
        preallocate: Reserve every page of the file at ``start()``.

    Raises:
        ValueError: A bad argument, named with its value.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        directory: str | Path = "/dev/shm",
        name: str = "host",
        page_bytes: int = 4096,
        preallocate: bool = True,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._allocator = ArenaAllocator(capacity_bytes, page_bytes=page_bytes)
        self.name = name
        self._capacity = capacity_bytes
        self._page_bytes = page_bytes
        self._directory = Path(directory)
        self._preallocate = preallocate
        self._path: Path | None = None
        self._fd = -1
        self._mmap: mmap.mmap | None = None
        self._arena: torch.Tensor | None = None  # [capacity_bytes] uint8 over the mapping
        self._closed = False
        self._committed: dict[bytes, Slot] = {}
        self._pending: dict[bytes, Slot] = {}
        self._pins: dict[int, int] = {}  # slot offset -> pin count
        self._released: dict[int, Slot] = {}  # pinned slots let go of; freed at the last unpin
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # Lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Creates, sizes and maps the arena file; a second call does nothing.

        Raises:
            TierClosedError: The tier was closed; tiers do not restart.
            OSError: The file cannot be created or its pages reserved.
        """
        if self._closed:
            raise TierClosedError(f"{self.name}: a closed tier cannot be restarted")
        if self._mmap is not None:
            return
        path = self._directory / f"kvstore-{os.getpid()}-{secrets.token_hex(8)}.arena"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, self._capacity)
            if self._preallocate:
                await _run_to_completion(functools.partial(_reserve_pages, fd, self._capacity))
            self._mmap = mmap.mmap(fd, self._capacity, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd, self._path = fd, path
        self._arena = torch.frombuffer(self._mmap, dtype=torch.uint8)
        logger.info("%s: mapped a %d-byte arena at %s", self.name, self._capacity, path)

    async def aclose(self) -> None:
        """Waits for copies in flight, then unmaps the arena and removes its file."""
        if self._closed:
            return
        self._closed = True
        await self._idle.wait()
        self._unmap()
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
        slot = self._allocate(source.nbytes)
        if slot is None:
            return False
        try:
            await self._write(slot.offset, source)
            self._require_open()
        except BaseException:
            self._release(slot)
            raise
        self._install(key, slot)
        return True

    async def get(self, key: bytes) -> bytes | None:
        """Returns a copy of the blob under ``key``, or ``None`` on a miss."""
        key = self._open_key(key)
        slot = self._committed.get(key)
        if slot is None:
            return None
        return await self._read_pinned(slot, 0, slot.length)

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
        """The arena's size in bytes."""
        return self._capacity

    def healthy(self) -> bool:
        """Always ``True``: local memory cannot become unreachable."""
        return True

    # Data plane -----------------------------------------------------------------------------

    @property
    def arena_path(self) -> Path:
        """The arena file, for other processes to map.

        Raises:
            TierClosedError: The tier is not started, or closed.
        """
        self._require_open()
        assert self._path is not None
        return self._path

    @property
    def arena_bytes(self) -> int:
        """Size of the arena file and of its mapping."""
        return self._capacity

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
        slot = self._allocate(length)
        if slot is not None:
            self._pending[key] = slot
        return slot

    def commit(self, key: bytes) -> Slot:
        """Makes the pending reservation of ``key`` its visible blob.

        An older committed blob of ``key`` is released (freed once no reader pins it).

        Raises:
            ReservationNotFoundError: ``key`` has no pending reservation.
        """
        key = self._open_key(key)
        slot = self._pending.pop(key, None)
        if slot is None:
            raise ReservationNotFoundError(f"{self.name}: key {key.hex()} is not reserved")
        self._install(key, slot)
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
        """The committed slot of ``key``, or ``None``. Pin it to read it in place safely."""
        key = self._open_key(key)
        return self._committed.get(key)

    def pin(self, key: bytes) -> Slot | None:
        """Locates ``key`` and holds its bytes (not the key) against reuse until :meth:`unpin`."""
        slot = self.locate(key)
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

    def view(self, slot: Slot) -> memoryview:
        """A writable view of the slot's bytes in the arena.

        Release it (``view.release()`` or ``with``) before :meth:`aclose`; a view still alive
        then keeps the mapping until it is garbage collected.

        Raises:
            InvalidSlotError: The slot lies outside the arena.
        """
        self._require_open()
        assert self._mmap is not None
        if slot.offset < 0 or slot.length < 0 or slot.end > self._capacity:
            raise InvalidSlotError(f"{self.name}: {slot} is outside the arena")
        with memoryview(self._mmap) as whole:
            return whole[slot.offset : slot.end]

    # Internals ------------------------------------------------------------------------------

    def _open_key(self, key: bytes) -> bytes:
        key = check_key(key)
        self._require_open()
        return key

    def _require_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"{self.name}: tier is closed")
        if self._mmap is None:
            raise TierClosedError(f"{self.name}: tier is not started")

    def _allocate(self, length: int) -> Slot | None:
        if length < 0:
            raise InvalidRangeError(f"length must be non-negative, got {length}")
        if self._allocator.slot_bytes(length) > self._allocator.capacity_bytes:
            raise BlobTooLargeError(
                f"{self.name}: a blob of {length} bytes cannot fit in {self._capacity} bytes"
            )
        return self._allocator.allocate(length)

    def _install(self, key: bytes, slot: Slot) -> None:
        old = self._committed.get(key)
        self._committed[key] = slot
        if old is not None:
            self._release(old)

    def _release(self, slot: Slot) -> None:
        if self._closed:
            return
        if slot.offset in self._pins:
            self._released[slot.offset] = slot
        else:
            self._allocator.free(slot)

    def _pin(self, slot: Slot) -> None:
        self._pins[slot.offset] = self._pins.get(slot.offset, 0) + 1

    def _unpin(self, slot: Slot) -> None:
        count = self._pins.pop(slot.offset, 0) - 1
        if count > 0:
            self._pins[slot.offset] = count
            return
        released = self._released.pop(slot.offset, None)
        if released is not None and not self._closed:
            self._allocator.free(released)

    async def _read_pinned(self, slot: Slot, start: int, stop: int) -> bytes:
        assert self._mmap is not None
        offset, length = slot.offset + start, stop - start
        if length < COPY_IN_THREAD_BYTES:
            return self._mmap[offset : offset + length]  # no await: nothing can intervene
        self._pin(slot)
        try:
            return await self._in_thread(_pread_exactly, self._fd, offset, length)
        finally:
            self._unpin(slot)

    async def _read_pinned_into(self, slot: Slot, target: memoryview) -> None:
        assert self._mmap is not None and self._arena is not None
        if slot.length < COPY_IN_THREAD_BYTES:
            with memoryview(self._mmap) as whole:
                target[:] = whole[slot.offset : slot.end]
            return
        self._pin(slot)
        try:
            await self._in_thread(_copy_out_of, self._arena, slot.offset, target)
        finally:
            self._unpin(slot)

    async def _write(self, offset: int, source: memoryview) -> None:
        assert self._mmap is not None and self._arena is not None
        if source.nbytes < COPY_IN_THREAD_BYTES:
            self._mmap[offset : offset + source.nbytes] = source
        else:
            await self._in_thread(_copy_into, self._arena, offset, source)

    async def _in_thread(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Runs a copy in a worker thread; ``aclose`` waits until every such copy is done."""
        self._inflight += 1
        self._idle.clear()
        try:
            return await _run_to_completion(functools.partial(fn, *args, **kwargs))
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def _unmap(self) -> None:
        self._arena = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                logger.warning("%s: arena views still alive; unmapped when released", self.name)
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            logger.info("%s: removed arena %s", self.name, self._path)


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


def _reserve_pages(fd: int, length: int) -> None:
    """Allocates every page of the file now, so that a full tmpfs fails here, not as SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, length)
    except OSError as error:
        raise OSError(error.errno, f"cannot reserve {length} arena bytes: {error}") from error


# Copies in worker threads are one plain memmove, which drops the GIL. Not torch ``copy_``:
# its intra-op threads form one OpenMP team per calling thread, so a pool of worker threads
# keeps several teams to wake; on a busy 2-core machine that made 2 MiB copies over 10x
# slower, and 32 MiB ones no faster.


def _copy_into(arena: torch.Tensor, offset: int, source: memoryview) -> None:
    """Copies ``source`` into ``arena`` at ``offset``."""
    _memmove(arena[offset : offset + source.nbytes], torch.frombuffer(source, dtype=torch.uint8))


def _copy_out_of(arena: torch.Tensor, offset: int, target: memoryview) -> None:
    """Copies ``target.nbytes`` arena bytes from ``offset`` into ``target``."""
    _memmove(torch.frombuffer(target, dtype=torch.uint8), arena[offset : offset + target.nbytes])


def _memmove(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copies between two contiguous uint8 tensors of one length, without the GIL."""
    if target.numel() != source.numel():
        raise ValueError(f"copy of {source.numel()} bytes into {target.numel()} bytes")
    ctypes.memmove(target.data_ptr(), source.data_ptr(), source.numel())


def _pread_exactly(fd: int, offset: int, length: int) -> bytes:
    """Reads ``length`` bytes at ``offset``; one read stops at about 2 GiB."""
    parts = [os.pread(fd, length, offset)]
    done = len(parts[0])
    while done < length:
        parts.append(os.pread(fd, length - done, offset + done))
        if not parts[-1]:
            raise OSError(f"arena ended at byte {offset + done} of a {length}-byte read")
        done += len(parts[-1])
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _run_to_completion(call: Callable[[], T]) -> T:
    """Runs ``call`` in a worker thread. A cancelled caller still waits for the thread to
    finish, so the buffers it reads and writes stay valid and reserved until then."""
    future = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait({future})
            except asyncio.CancelledError:
                continue
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what propagates
        raise
