"""LoopBudget: long work shares one slice per loop turn and sits out turns after it.

The clock is a counter that each unit of work advances by one, so the tests count work, not
time: they hold on a loaded machine.
"""

from __future__ import annotations

import asyncio

import pytest

from kvstore import budget as budget_module
from kvstore.budget import YIELD_TURNS, LoopBudget

SLICE = 3  # units of work


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(budget_module, "perf_counter", fake)  # this module's clock only
    monkeypatch.setattr(budget_module, "_slice", [float("-inf"), 0])
    return fake


async def run_long_work(clock: Clock, units: int, log: list[str], name: str) -> None:
    budget = LoopBudget(SLICE)
    for _ in range(units):
        clock.now += 1  # one unit of work
        log.append(name)
        await budget.tick()


async def watch(log: list[str], done: asyncio.Event) -> list[int]:
    """Units of work done between two consecutive turns of this task."""
    seen, between = len(log), []
    while not done.is_set():
        await asyncio.sleep(0)
        between.append(len(log) - seen)
        seen = len(log)
    return between


async def run_with_watcher(clock: Clock, workers: int, units: int) -> tuple[list[int], list[str]]:
    log: list[str] = []
    done = asyncio.Event()
    watcher = asyncio.ensure_future(watch(log, done))
    await asyncio.sleep(0)
    await asyncio.gather(*(run_long_work(clock, units, log, f"w{i}") for i in range(workers)))
    done.set()
    return await watcher, log


async def test_long_tasks_in_flight_together_share_one_slice_a_turn(clock: Clock) -> None:
    """Four long tasks at once do about one slice of work between two turns of another task
    (the slice, plus the one unit each other task does before it sees the slice spent), not
    four slices."""
    between, log = await run_with_watcher(clock, workers=4, units=60)
    assert len(log) == 240 and set(log) == {"w0", "w1", "w2", "w3"}
    assert max(between) <= SLICE + 3, between
    assert max(between) < 4 * SLICE  # a slice per task would allow 12
    # The slices go round: no task waits for the others to finish first.
    finished = [len(log) - log[::-1].index(name) for name in ("w0", "w1", "w2", "w3")]
    assert min(finished) > len(log) * 0.6, finished


async def test_long_work_sits_out_turns_after_its_slice(clock: Clock) -> None:
    """After each slice, the watcher gets YIELD_TURNS - 1 turns in a row with no long work in
    them: a call that needs several turns passes with at most about one slice in its way."""
    between, log = await run_with_watcher(clock, workers=1, units=30)
    assert len(log) == 30
    runs, idle = [], 0
    for units in between:
        if units:
            runs.append(idle)
            idle = 0
        else:
            idle += 1
    assert len(runs) >= 30 // SLICE - 1  # the work did run in slices
    assert min(runs[1:]) >= YIELD_TURNS - 1, runs


async def test_work_alone_runs_its_slices_in_full(clock: Clock) -> None:
    """With nothing else on the loop the work still advances a full slice per burst."""
    between, _ = await run_with_watcher(clock, workers=1, units=30)
    bursts = [units for units in between if units]
    assert bursts and all(units == SLICE for units in bursts[:-1]), bursts
