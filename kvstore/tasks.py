"""Work that must finish once started, whatever happens to the caller.

``finish_anyway(work, pending)`` runs ``work`` as a task of its own and awaits it through
``asyncio.shield``: a caller cancelled meanwhile (a client gone, a deadline) gets its
``CancelledError`` at once, while the work goes on to a consistent end (a block stored and
indexed, or discarded with every copy it made; a copy into shared memory done before the
memory is freed). ``pending`` holds the tasks still running, for shutdown to wait on; a
failure of a task nobody awaits any more is logged, not lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["finish_anyway"]

log = logging.getLogger(__name__)
T = TypeVar("T")


async def finish_anyway(work: Coroutine[Any, Any, T], pending: set[asyncio.Task[Any]]) -> T:
    """Awaits ``work`` in a task that a cancelled caller leaves running (see the module doc)."""
    task = asyncio.ensure_future(work)
    pending.add(task)
    task.add_done_callback(_done(pending))
    return await asyncio.shield(task)


def _done(pending: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def landed(task: asyncio.Task[Any]) -> None:
        pending.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.debug("work finished after its caller left, with %r", error)

    return landed
