"""Waiting in tests for something another process does: ``wait_for(predicate, timeout)``
polls every 0.1 s and fails the test when ``timeout`` seconds pass first; ``until`` does the
same on an event loop, for a coroutine predicate (``within`` seconds)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

__all__ = ["until", "wait_for"]


def wait_for(predicate: Callable[[], object], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


async def until(predicate: Callable[[], Awaitable[object]], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
