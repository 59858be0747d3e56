"""Long sweeps share the event loop by time: ``LoopBudget``.

A sweep over many blocks (a watermark drain, a TTL sweep, a namespace's usage or eviction)
runs on the daemon's one event loop, and every request that arrives meanwhile waits for
it to yield. Counting blocks between yields bounds nothing (a block's eviction costs 1 us
in one store and 100 us in another, and the machine may be loaded); a time slice does.
A sweep makes one ``LoopBudget`` and awaits ``tick()`` after each block: it yields when the
slice has run out, and starts a new slice when it gets the loop back.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["SLICE_S", "LoopBudget"]

# Seconds of work a sweep does between yields. A 512-key lookup costs the daemon about
# 0.3-0.7 ms, so a request that arrives during a sweep waits about one more such call; a
# yield (asyncio.sleep(0), one loop turn) costs about 1-2 us here, so the sweep itself
# slows by well under 1%.
SLICE_S = 0.001


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
