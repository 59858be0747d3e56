"""Starting every worker thread of the loop's default executor before a test counts objects.

The executor starts a thread per call only while none is idle, up to its limit
(``min(32, cpus + 4)``), so how many run after some file work depends on timing and on the
machine. Each thread brings a few dozen objects the cyclic collector tracks; a test that
counts them (``collector.tracked_entries()``) starts them all first.
"""

from __future__ import annotations

import asyncio
import threading

MOST_WORKERS = 32  # the default executor's limit on any machine


async def start_every_worker() -> None:
    """Blocks ``MOST_WORKERS`` calls in the default executor at once (each one it cannot hand
    to an idle thread starts a new thread, up to its limit), then lets them all finish."""
    loop = asyncio.get_running_loop()
    release = threading.Event()
    calls = [loop.run_in_executor(None, release.wait) for _ in range(MOST_WORKERS)]
    release.set()
    await asyncio.gather(*calls)
