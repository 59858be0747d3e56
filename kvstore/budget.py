"""Long sweeps and many-block calls share the event loop by time: ``LoopBudget``.

A sweep over many blocks (a watermark drain, a TTL sweep, a namespace's usage or eviction)
or a call about many blocks (a 512-block Reserve, Commit or Acquire) runs on the daemon's one
event loop, and every request that arrives meanwhile waits for it to yield. Counting blocks
between yields bounds nothing (a block's eviction costs 1 us in one store and 100 us in
another, and the machine may be loaded); a time slice does. The work makes one
``LoopBudget`` and awaits ``tick()`` after each block.

Such work runs *behind* short calls:

- every budget of the process shares one slice per loop turn: several long calls in flight
  at once (a writer pipelines its Reserves and Commits, a drain runs beside them) together
  run for about ``SLICE_S`` in a turn, not ``SLICE_S`` each (four of them made every turn
  ~1 ms long);
- once the slice has run, long work sits out ``YIELD_TURNS`` turns of the loop. A unary gRPC
  call crosses about seven turns from its arrival to its reply (the call's completion, its
  task, its message, the handler, the reply), and each used to wait for a slice: so a call
  passes with at most about one slice in its way. When nothing else runs, the turns it sits
  out are empty ones of a few microseconds.

The loop's other holder is the GIL: a worker thread that copies or sums blocks keeps it for
up to the interpreter's switch interval (5 ms by default) before the loop's thread may run.
The daemon sets ``THREAD_SWITCH_S`` at start.
"""

from __future__ import annotations

import asyncio
from time import perf_counter

__all__ = ["SLICE_S", "THREAD_SWITCH_S", "YIELD_TURNS", "LoopBudget"]

# Seconds of long work per loop turn. With a writer's 512-block puts running, 1 ms slices put
# a lookup's p50 at 7.7 ms, 0.25 ms ones at 3.1 ms (idle 1.4 ms); a yield costs a few us.
SLICE_S = 0.00025

# Loop turns long work sits out after each slice. Another client's lookup p50 beside a
# writer's 512-block puts, idle 1.1-1.6 ms: 3.0-3.2 ms sitting out 1 turn, 2.0-2.4 ms at 4,
# 1.5-2.1 ms at 8, 1.3-1.6 ms at 20 (the writer's puts slow by a tenth more at each step).
YIELD_TURNS = 8

# sys.setswitchinterval for the daemon: how long a worker thread may hold the GIL while the
# loop's thread waits for it. With the default 5 ms the loop's lag p99 read 2-3 ms while a
# writer's commits were summed in a thread; at 0.5 ms, <= 2 ms.
THREAD_SWITCH_S = 0.0005


class LoopBudget:
    """Yields to the event loop once this loop turn's slice of long work has run, and sits
    out ``YIELD_TURNS`` turns before it goes on (see the module docstring)."""

    __slots__ = ("_opened", "_slice")

    def __init__(self, slice_s: float = SLICE_S) -> None:
        self._slice = slice_s
        self._opened = False
        if perf_counter() >= _slice[0] + slice_s:  # no long work ran lately: start one
            self._open()
        # else it joins the slice in progress, or, when another call spent it, sits out
        # turns at its first tick

    async def tick(self) -> None:
        """Yields when the turn's slice has run out (a perf_counter read otherwise)."""
        if perf_counter() < _slice[0]:
            return
        seen = _slice[1]
        # The budget that opened the slice sits out one turn more, so that another one in
        # flight opens the next: the slices go round, not always to the same call.
        for _ in range(YIELD_TURNS + self._opened):
            await asyncio.sleep(0)
        self._opened = False
        if _slice[1] == seen:  # the first back: it opens the next slice, the others share it
            self._open()

    def _open(self) -> None:
        _slice[0] = perf_counter() + self._slice
        _slice[1] += 1
        self._opened = True


# The slice shared by every budget of the process: when it ends, and how many have opened (a
# daemon runs one loop; a second loop in a process only makes these yield more often).
_slice: list[float] = [float("-inf"), 0]
