"""Copies in worker threads that outlive a cancelled caller, and whole reads of a descriptor.

- ``run_to_completion(call)`` runs ``call`` in a worker thread; a caller cancelled meanwhile
  still waits for the thread to finish before the cancellation propagates, so the buffers
  the copy reads and writes stay valid (not freed, not unmapped) until it is done;
- ``offload(size, fn, *args)``: the rule for work that computes on ``size`` bytes
  (checksums, codecs) from an event loop: inline below ``THREAD_BYTES``, else
  ``run_to_completion``. Plain copies compare their size themselves: the host tier's with
  ``COPY_THREAD_BYTES``, the client's shared-memory copies (which may take several copy
  lanes) with ``THREAD_BYTES``;
- ``pread_exactly(fd, offset, length)`` reads ``length`` bytes at ``offset`` (one ``pread``
  stops at about 2 GiB);
- ``copy_spans(spans)`` copies ``(source address, target address, length)`` spans, a large
  copy split over up to ``COPY_LANES`` threads: one thread's memcpy moves about half of what
  the memory can. A span costs no array of its own (``memmove`` through ctypes, which
  releases the GIL). The caller checks the spans and keeps their
  memory alive and mapped until it returns;
- ``copy_and_sum_spans(spans)`` copies each span as ``copy_spans`` does and returns the
  xxh3-64 of what landed in each, taken as it lands (``copy_and_sum_at``: a cache-sized
  piece copied, then summed while it is still in cache, where a copy and then a sum of the
  same bytes make two passes over memory), whole spans on each lane. The host tier's
  hashed reads and the daemon's copies into the arena use ``copy_and_sum_at`` too.

Shared by the host tier and the client's shared-memory mappings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor  # loads the executor module now, not later
from typing import TypeVar

import xxhash

__all__ = [
    "COPY_LANES",
    "COPY_THREAD_BYTES",
    "THREAD_BYTES",
    "Span",
    "copy_and_sum_at",
    "copy_and_sum_spans",
    "copy_spans",
    "offload",
    "pread_exactly",
    "run_to_completion",
]

T = TypeVar("T")
Span = tuple[int, int, int]  # (source address, target address, length)
ShareT = TypeVar("ShareT")

COPY_LANES = max(1, min(4, len(os.sched_getaffinity(0))))  # threads of one large copy, at most
LANE_BYTES = 2 << 20  # the least share of a copy worth a thread of its own
# Blocking work on fewer bytes than these runs inline on the event loop; larger work runs in a
# worker thread (numpy, xxhash and lz4 drop the GIL) while the loop turns. Work that computes
# on the bytes (checksums, codecs: 1 MiB of lz4 is ~1 ms) goes to a thread from 1 MiB; a plain
# copy from 4 MiB (~0.4 ms at memcpy speed), since a hop to a thread and back costs more than
# a smaller copy: the host tier's puts and gets of 1-2 MiB blocks ran at 0.9-2.3x of memmove
# inline and 0.2-0.6x in a thread (benchmarks/tiers.py, same run).
THREAD_BYTES = 1 << 20
COPY_THREAD_BYTES = 4 << 20
# Copied, then summed while still in cache: 512 KiB ran 6.4-7.2 GB/s on two lanes here,
# 256 KiB 4.9-6.2, 1-2 MiB no better (256 MiB from memory to memory, 2026-12-07).
SUM_CHUNK_BYTES = 512 << 10
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool)


def copy_spans(spans: Sequence[Span], lanes: int | None = None) -> None:
    """``memmove(target, source, length)`` for each span, cut into up to ``lanes`` (default
    ``COPY_LANES``) equal shares of at least ``LANE_BYTES``, one copied on this thread and the
    others in a pool. Returns once every share is copied (also when one fails, whose error it
    then raises).

    Nothing is checked here: every span must lie in memory that stays mapped, readable at
    the source and writable at the target, until this returns.
    """
    total = sum(span[2] for span in spans)
    lanes = min(COPY_LANES if lanes is None else lanes, total // LANE_BYTES)
    if lanes < 2:
        _move_share(spans)
        return
    _in_lanes(_span_shares(spans, -(-total // lanes)), _move_share)


def copy_and_sum_spans(spans: Sequence[Span], lanes: int | None = None) -> list[int]:
    """:func:`copy_spans`, and the xxh3-64 of each span's target as it landed: the spans (each
    a whole block) dealt out in order to up to ``lanes`` threads of about equal bytes."""
    total = sum(span[2] for span in spans)
    lanes = min(COPY_LANES if lanes is None else lanes, total // LANE_BYTES, len(spans))
    sums = [0] * len(spans)
    numbered = list(enumerate(spans))

    def share(part: Sequence[tuple[int, Span]]) -> None:
        for index, (src, dst, length) in part:
            sums[index] = copy_and_sum_at(src, dst, length)

    if lanes < 2:
        share(numbered)
    else:
        _in_lanes(_whole_shares(numbered, -(-total // lanes)), share)
    return sums


def copy_and_sum_at(source: int, target: int, length: int) -> int:
    """Copies ``length`` bytes from address ``source`` to address ``target`` and returns the
    xxh3-64 of what landed there, ``SUM_CHUNK_BYTES`` at a time (copied, then summed while
    still in cache), without the GIL. Nothing is checked (see :func:`copy_spans`)."""
    digest = xxhash.xxh3_64()
    if length == 0:
        return digest.intdigest()
    landed = memoryview((ctypes.c_char * length).from_address(target)).cast("B")
    move = ctypes.memmove
    for start in range(0, length, SUM_CHUNK_BYTES):
        step = min(SUM_CHUNK_BYTES, length - start)
        move(target + start, source + start, step)
        digest.update(landed[start : start + step])
    return digest.intdigest()


def _whole_shares(items: Sequence[tuple[int, Span]], size: int) -> list[list[tuple[int, Span]]]:
    """The items in consecutive shares of about ``size`` bytes, none cut."""
    shares: list[list[tuple[int, Span]]] = [[]]
    filled = 0
    for item in items:
        if filled >= size:
            shares.append([])
            filled = 0
        shares[-1].append(item)
        filled += item[1][2]
    return shares


def _in_lanes(shares: Sequence[ShareT], copy: Callable[[ShareT], None]) -> None:
    """``copy`` of the first share on this thread and of the others in the copy pool; returns
    once every share is copied (also when one fails, whose error it then raises)."""
    pool = _copy_pool()
    futures = [pool.submit(copy, share) for share in shares[1:]]
    try:
        copy(shares[0])
    finally:
        concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def _span_shares(spans: Sequence[Span], size: int) -> list[list[Span]]:
    """The spans cut into consecutive shares of ``size`` bytes (the last one: the rest)."""
    shares: list[list[Span]] = [[]]
    room = size
    for src, dst, length in spans:
        start = 0
        while start < length:
            if room == 0:
                shares.append([])
                room = size
            step = min(length - start, room)
            shares[-1].append((src + start, dst + start, step))
            room -= step
            start += step
    return shares


def _move_share(spans: Sequence[Span]) -> None:
    move = ctypes.memmove
    for src, dst, length in spans:
        move(dst, src, length)


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


async def offload(size: int, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)`` inline when it works on fewer than ``THREAD_BYTES`` bytes, in a
    worker thread otherwise (:func:`run_to_completion`: a cancelled caller waits for it)."""
    if size < THREAD_BYTES:
        return fn(*args, **kwargs)
    return await run_to_completion(functools.partial(fn, *args, **kwargs))
