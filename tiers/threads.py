"""Copies in worker threads that outlive a cancelled caller, and whole reads of a descriptor.

- ``run_to_completion(call)`` runs ``call`` in a worker thread; a caller cancelled meanwhile
  still waits for the thread to finish before the cancellation propagates, so the buffers
  the copy reads and writes stay valid (not freed, not unmapped) until it is done;
- ``pread_exactly(fd, offset, length)`` reads ``length`` bytes at ``offset`` (one ``pread``
  stops at about 2 GiB);
- ``copy_arrays(pairs)`` copies byte arrays, a large copy split over up to ``COPY_LANES``
  threads: one thread's memcpy moves about half of what the memory can (numpy copies release
  the GIL).

Shared by the host tier and the client's shared-memory mappings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor  # loads the executor module now, not later
from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["COPY_LANES", "copy_arrays", "pread_exactly", "run_to_completion"]

T = TypeVar("T")
Bytes = npt.NDArray[np.uint8]

COPY_LANES = max(1, min(4, len(os.sched_getaffinity(0))))  # threads of one large copy, at most
LANE_BYTES = 2 << 20  # the least share of a copy worth a thread of its own
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool)


def copy_arrays(pairs: Sequence[tuple[Bytes, Bytes]]) -> None:
    """``np.copyto(dst, src)`` for each ``(src, dst)`` pair of flat uint8 arrays; with at least
    ``2 * LANE_BYTES`` in all, the bytes are cut into up to ``COPY_LANES`` equal shares, one
    copied on this thread and the others in a pool. Returns once every share is copied (also
    when one fails, whose error it then raises)."""
    total = sum(src.nbytes for src, _ in pairs)
    lanes = min(COPY_LANES, total // LANE_BYTES)
    if lanes < 2:
        _copy_share(pairs)
        return
    shares = _shares(pairs, -(-total // lanes))
    pool = _copy_pool()
    futures = [pool.submit(_copy_share, share) for share in shares[1:]]
    try:
        _copy_share(shares[0])
    finally:
        concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def _shares(pairs: Sequence[tuple[Bytes, Bytes]], size: int) -> list[list[tuple[Bytes, Bytes]]]:
    """The pairs cut into consecutive shares of ``size`` bytes (the last one: the rest)."""
    shares: list[list[tuple[Bytes, Bytes]]] = [[]]
    room = size
    for src, dst in pairs:
        start, end = 0, src.nbytes
        while start < end:
            if room == 0:
                shares.append([])
                room = size
            stop = min(end, start + room)
            shares[-1].append((src[start:stop], dst[start:stop]))
            room -= stop - start
            start = stop
    return shares


def _copy_share(pairs: Sequence[tuple[Bytes, Bytes]]) -> None:
    for src, dst in pairs:
        np.copyto(dst, src)


def _copy_pool() -> ThreadPoolExecutor:
    """The copy threads of this process (a forked child makes its own: it has no threads)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        workers = max(1, COPY_LANES - 1)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="kvstore-copy")
        _pool = (os.getpid(), pool)
    return _pool[1]


def pread_exactly(fd: int, offset: int, length: int) -> bytes:
    """Reads ``length`` bytes at ``offset``.

    Raises:
        OSError: the file ends first.
    """
    parts = [os.pread(fd, length, offset)]
    done = len(parts[0])
    while done < length:
        parts.append(os.pread(fd, length - done, offset + done))
        if not parts[-1]:
            raise OSError(f"file ended at byte {offset + done} of a {length}-byte read")
        done += len(parts[-1])
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def run_to_completion(call: Callable[[], T]) -> T:
    """Runs ``call`` in a worker thread; see the module docstring."""
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
