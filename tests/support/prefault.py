"""A slow page fault on demand: the host tier's pre-faulting stalls in its worker thread.

``StalledPrefault(monkeypatch)`` patches the arenas' ``populate``: the first chunk a tier
pre-faults stays held out of its allocator until ``release()`` (``await started()`` returns
once the worker thread holds it).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore.tiers.host import _Arena

STALL_LIMIT_S = 60.0  # a test that never releases still ends


class StalledPrefault:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._started, self._release = threading.Event(), threading.Event()
        populate = _Arena.populate

        def stalled(arena: _Arena, start: int, length: int, page_bytes: int) -> None:
            self._started.set()
            self._release.wait(STALL_LIMIT_S)
            populate(arena, start, length, page_bytes)

        monkeypatch.setattr(_Arena, "populate", stalled)

    async def started(self) -> None:
        """Returns once a chunk is held and its faulting is stalled."""
        if not await asyncio.to_thread(self._started.wait, STALL_LIMIT_S):
            raise AssertionError(f"no pre-fault chunk was held within {STALL_LIMIT_S} s")

    def release(self) -> None:
        self._release.set()
