"""Waiting in tests for something another process does: ``wait_for(predicate, timeout)``
polls every 0.1 s and fails the test when ``timeout`` seconds pass first."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_for"]


def wait_for(predicate: Callable[[], object], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)
