"""The SSD tier: one file per blob in a local directory, rebuilt from its files on restart.

Layout: ``<directory>/<first 2 hex of key>/<key hex>.blk`` holds one record; writes in flight
live in ``<directory>/tmp/``; ``<directory>/quarantine/`` keeps what start-up found in the
tier's way (moved there, never deleted, never read as records). A record is self-describing
so the tier can check itself without knowing anything about KV blocks::

    offset  size  field
    0       8     magic b"KVSSD001" (the last three digits are the format version)
    8       2     key length, uint16 little-endian
    10      2     reserved, zero
    12      8     blob length, uint64 little-endian
    20      4     crc32 of bytes 0..20 followed by the key bytes
    24      k     key
    24+k    n     blob

Primitives, in the order a tier's life uses them:

1. ``start()`` -- create the directories, delete temp files left by a crash, read every record
   header (never the blobs) to rebuild the index; drop records that are truncated, have a bad
   header or sit under another key's name; trim the oldest records if over capacity. Nothing in
   the directory makes it fail: entries where a folder of the layout belongs (a file, a
   symlink, a fifo...) and ``*.blk`` entries that are not regular files go to quarantine,
   other strangers are left alone, records that cannot be read are skipped. Symlinks are never
   followed.
2. ``put()`` -- reserve the bytes, write a temp file, fsync, ``os.replace`` it into place and
   fsync the directory: a reader sees the old blob or the new one, and a crash leaves at most a
   temp file. Writes to one key are serialised; writes to different keys run in parallel.
3. ``get()`` / ``get_range()`` -- read the header, check it, read only the requested bytes.
   A bad header found on read is a miss, and the record is deleted.
4. ``contains()``, ``contains_many()``, ``keys()``, ``usage()`` -- answered from the index.
5. ``delete()``, then ``aclose()``, which waits for writes in flight.

The blob bytes carry no checksum here: the block codec one layer up checksums every layer.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, Self, TypeVar

import aiofiles.os

from kvstore.tiers import ssd_files
from kvstore.tiers.base import (
    BlobTooLargeError,
    Buffer,
    TierClosedError,
    check_key,
    check_range,
)
from kvstore.tiers.locks import FileLock
from kvstore.tiers.ssd_files import (
    SUFFIX,
    TMP_DIR,
    encode_header,
    record_overhead,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SsdStats:
    """Counters of one SSD tier."""

    records: int
    usage_bytes: int
    capacity_bytes: int
    dropped_on_start: int
    trimmed_on_start: int
    corrupt_reads: int
    quarantined_on_start: int


class SsdTier:
    """A :class:`~kvstore.tiers.base.Tier` keeping one file per blob under ``directory``.

    Args:
        directory: Folder owned by this tier; created on ``start()``.
        capacity_bytes: Most bytes of records (headers, keys and blobs) kept on disk.
        name: Name used in logs and metrics.
        fsync: Make every put durable (file and directory fsync) before it returns.

    Raises:
        ValueError: A non-positive capacity, an empty directory or name.
    """

    def __init__(
        self, directory: str | Path, capacity_bytes: int, *, name: str = "ssd", fsync: bool = True
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ValueError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not str(directory):
            raise ValueError(f"directory must not be empty, got {directory!r}")
        if not name:
            raise ValueError(f"name must not be empty, got {name!r}")
        self.name = name
        self.directory = Path(directory)
        self.dropped_on_start = 0
        self.trimmed_on_start = 0
        self.quarantined_on_start = 0
        self.corrupt_reads = 0
        self._capacity = capacity_bytes
        self._fsync = fsync
        self._index: dict[bytes, int] = {}  # key -> record bytes on disk
        self._lock: FileLock | None = None  # held from start to aclose
        self._used = 0  # committed records + bytes reserved by puts in flight
        self._locks = _KeyLocks()
        self._writes: set[asyncio.Task[bool]] = set()
        self._seq = itertools.count()
        self._open = False

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Creates the directories and rebuilds the index from the record files.

        Entries in the tier's way are moved to ``quarantine/``, never a reason to fail.

        Raises:
            InUseError: Another daemon holds the directory (its lock file names its pid);
                nothing in it was read or changed.
            OSError: ``directory`` cannot be created or is not a readable, writable directory.
        """
        if self._open:
            return
        if self._lock is None:  # the directory is this daemon's before anything reads it
            self._lock = await _in_io_thread(ssd_files.lock_root, self.directory)
        try:
            found = await _in_io_thread(ssd_files.recover, self.directory, self._capacity)
        except BaseException:
            self._release_lock()
            raise
        self._index = found.index
        self._used = sum(found.index.values())
        self.dropped_on_start = found.dropped
        self.trimmed_on_start = found.trimmed
        self.quarantined_on_start = found.quarantined
        self._open = True
        logger.info(
            "ssd tier %s: %d records, %d bytes; dropped %d bad files, trimmed %d records, "
            "quarantined %d entries",
            self.name, len(self._index), self._used, found.dropped, found.trimmed,
            found.quarantined,
        )  # fmt: skip

    async def aclose(self) -> None:
        """Waits for the writes in flight, closes the tier and lets its directory go."""
        self._open = False
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        self._release_lock()

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def path_of(self, key: bytes) -> Path:
        """Returns the file that holds (or would hold) the record of ``key``."""
        hexkey: str = check_key(key).hex()
        return self.directory / hexkey[:2] / f"{hexkey}{SUFFIX}"

    @staticmethod
    def record_overhead(key_len: int) -> int:
        """Returns the bytes a record spends on top of its blob (header and key)."""
        return record_overhead(key_len)

    async def put(self, key: bytes, data: Buffer) -> bool:
        """Stores ``data`` under ``key``, replacing any older blob atomically.

        A put that is cancelled still finishes in the background (the usage stays exact);
        the caller must not modify ``data`` until then.

        Returns:
            ``True`` when stored; ``False`` when there is no room or the disk refused the write.

        Raises:
            BlobTooLargeError: The record is larger than the whole tier.
            TierClosedError: The tier is not started.
        """
        key = self._checked(key)
        view = memoryview(data).cast("B")
        size = record_overhead(len(key)) + view.nbytes
        if size > self._capacity:
            raise BlobTooLargeError(
                f"record of {size} bytes exceeds the capacity of tier {self.name} "
                f"({self._capacity} bytes)"
            )
        task = asyncio.create_task(self._put_locked(key, view, size), name=f"{self.name}-put")
        self._writes.add(task)
        task.add_done_callback(self._write_done)
        return await asyncio.shield(task)

    async def get(self, key: bytes) -> bytes | None:
        """Returns the blob stored under ``key``, or ``None`` on a miss."""
        key = self._checked(key)
        if key not in self._index:
            return None
        return await self._read(key, 0, None)

    async def get_range(self, key: bytes, offset: int, length: int) -> bytes | None:
        """Returns ``length`` bytes of the blob from ``offset`` (fewer at its end), or ``None``.

        Raises:
            InvalidRangeError: A negative ``offset`` or ``length``.
        """
        key = self._checked(key)
        check_range(offset, length)
        if key not in self._index:
            return None
        return await self._read(key, offset, length)

    async def contains(self, key: bytes) -> bool:
        """Returns whether ``key`` is held."""
        return self._checked(key) in self._index

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Returns one ``contains`` answer per key."""
        return [self._checked(key) in self._index for key in keys]

    async def delete(self, key: bytes) -> bool:
        """Deletes ``key``; returns whether it was held."""
        key = self._checked(key)
        async with self._locks.hold(key):
            size = self._index.pop(key, None)
            if size is None:
                return False
            self._used -= size
            await _in_io_thread(ssd_files.remove_quietly, self.path_of(key))
            return True

    def keys(self) -> Iterable[bytes]:
        """Returns a snapshot of the keys held."""
        return list(self._index)

    def usage(self) -> int:
        """Returns the bytes used on disk, counting writes in flight."""
        return self._used

    def capacity(self) -> int:
        """Returns the capacity in bytes."""
        return self._capacity

    def healthy(self) -> bool:
        """Returns whether the tier is started and not closed."""
        return self._open

    def stats(self) -> SsdStats:
        """Returns the tier's counters."""
        return SsdStats(
            records=len(self._index),
            usage_bytes=self._used,
            capacity_bytes=self._capacity,
            dropped_on_start=self.dropped_on_start,
            trimmed_on_start=self.trimmed_on_start,
            corrupt_reads=self.corrupt_reads,
            quarantined_on_start=self.quarantined_on_start,
        )

    def _checked(self, key: bytes) -> bytes:
        if not self._open:
            raise TierClosedError(f"ssd tier {self.name} is not started or already closed")
        checked: bytes = check_key(key)
        return checked

    def _write_done(self, task: asyncio.Task[bool]) -> None:
        self._writes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("ssd tier %s: put failed: %r", self.name, task.exception())

    async def _put_locked(self, key: bytes, view: memoryview, size: int) -> bool:
        async with self._locks.hold(key):
            old = self._index.get(key, 0)
            # Reserve growth before awaiting so concurrent puts cannot overshoot together;
            # a shrinking replace frees its bytes only once the new record is in place.
            grow = max(size - old, 0)
            if self._used + grow > self._capacity:
                return False
            self._used += grow
            try:
                await self._write_record(key, view)
            except OSError as exc:
                self._used -= grow
                logger.warning("ssd tier %s: write of %s failed: %s", self.name, key.hex(), exc)
                return False
            except BaseException:
                self._used -= grow
                raise
            self._used += size - old - grow
            self._index[key] = size
            return True

    async def _write_record(self, key: bytes, view: memoryview) -> None:
        tmp = self.directory / TMP_DIR / f"{key.hex()}.{os.getpid()}.{next(self._seq)}.tmp"
        # One thread hop for the whole write: each hop costs a wake-up, which for a few MiB
        # is a visible share of the put.
        header = encode_header(key, view.nbytes)
        await _in_io_thread(ssd_files.write_file, tmp, self.path_of(key), header, view, self._fsync)

    async def _read(self, key: bytes, offset: int, length: int | None) -> bytes | None:
        try:
            found = await _in_io_thread(ssd_files.read_file, self.path_of(key), key, offset, length)
        except FileNotFoundError:
            found = ssd_files.Corrupt(None, "file is missing")
        except OSError as exc:
            logger.warning("ssd tier %s: read of %s failed: %s", self.name, key.hex(), exc)
            return None
        if isinstance(found, bytes):
            return found
        await self._drop_bad(key, found.inode, found.reason)
        return None

    async def _drop_bad(self, key: bytes, inode: int | None, reason: str) -> None:
        async with self._locks.hold(key):
            # A put may have replaced the bad file since it was read: keep the new one.
            if not await _in_io_thread(ssd_files.remove_if_same, self.path_of(key), inode):
                return
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
                self.corrupt_reads += 1
                logger.warning("ssd tier %s: dropped %s: %s", self.name, key.hex(), reason)


class _KeyLocks:
    """One ``asyncio.Lock`` per key in use, forgotten when nobody holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[bytes, asyncio.Lock] = {}
        self._users: dict[bytes, int] = {}

    @asynccontextmanager
    async def hold(self, key: bytes) -> AsyncIterator[None]:
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key], self._locks[key]


P = ParamSpec("P")
R = TypeVar("R")


async def _in_io_thread(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Runs blocking file work through aiofiles' executor wrapper: one worker-thread hop for a
    whole write or read (each hop costs a wake-up, a visible share of a few-MiB block)."""
    return await aiofiles.os.wrap(functools.partial(fn, *args, **kwargs))()
