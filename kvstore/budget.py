"""Long sweeps and many-block calls share the event loop by time: ``LoopBudget``.

A sweep over many blocks (a watermark drain, a TTL sweep, a namespace's usage or eviction)
or a call about many blocks (a 512-block Reserve, Commit or Acquire) runs on the daemon's one
event loop, and every request that arrives meanwhile waits for it to yield. Counting blocks
between yields bounds nothing (a block's eviction costs 1 us in one store and 100 us in
another, and the machine may be loaded); a time slice does. The work makes one
``LoopBudget`` and awaits ``tick()`` after each block: it yields when the slice has run out,
and starts a new slice when it gets the loop back.

The loop's other holder is the GIL: a worker thread that copies or sums blocks keeps it for
up to the interpreter's switch interval (5 ms by default) before the loop's thread may run.
The daemon sets ``THREAD_SWITCH_S`` at start.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["SLICE_S", "THREAD_SWITCH_S", "LoopBudget"]

# Seconds of work between yields. A lookup passes several loop turns through gRPC (the
# call, its message, its reply), each waiting for the slice in progress: with a writer's
# 512-block puts running, 1 ms slices put a lookup's p50 at 7.7 ms, 0.25 ms ones at 3.1 ms
# (idle 1.4 ms), the writer's evictions/s unchanged; a yield (one loop turn) costs a few us.
SLICE_S = 0.00025

# sys.setswitchinterval for the daemon: how long a worker thread may hold the GIL while the
# loop's thread waits for it. With the default 5 ms the loop's lag p99 read 2-3 ms while a
# writer's commits were summed in a thread; at 0.5 ms, <= 2 ms.
THREAD_SWITCH_S = 0.0005


class LoopBudget:
    """Yields to the event loop once ``slice_s`` seconds of work ran since the last yield."""

    __slots__ = ("_slice", "_until")

    def __init__(self, slice_s: float = SLICE_S) -> None:
        self._slice = slice_s
        self._until = time.perf_counter() + slice_s

    async def tick(self) -> None:
        """Yields when the slice has run out (a perf_counter read otherwise)."""
        if time.perf_counter() >= self._until:
            await asyncio.sleep(0)
            self._until = time.perf_counter() + self._slice
