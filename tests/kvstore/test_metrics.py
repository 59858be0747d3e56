"""The daemon's own metrics that are not counters of the store: the event loop's lag."""

from __future__ import annotations

import asyncio
import time

from prometheus_client.registry import CollectorRegistry

from kvstore.metrics import LAG_BUCKETS, LoopLag
from tests.support.waiting import until

LAG = "kvstore_event_loop_lag_seconds"


async def test_a_blocked_loop_shows_as_one_lag_as_long_as_the_block() -> None:
    """A loop held for ``block`` seconds makes the monitor's next wake-up that late, less
    at most the interval it was already asleep for: one observation of at least
    ``block - interval``; an idle loop adds none that large."""
    registry = CollectorRegistry(auto_describe=False)
    monitor = LoopLag(registry, interval=0.01)
    task = asyncio.create_task(monitor.run())

    def value(suffix: str, **labels: str) -> float:
        return registry.get_sample_value(LAG + suffix, labels) or 0.0

    async def observed(count: float) -> bool:
        return value("_count") > count

    block = 0.3
    big = max(b for b in LAG_BUCKETS if b <= block - monitor.interval)  # 0.25 s
    await until(lambda: observed(3))  # a few idle turns first
    idle = value("_count") - value("_bucket", le=str(big))
    count, total = value("_count"), value("_sum")
    time.sleep(block)  # noqa: ASYNC251  (holds the loop, as a long step of the store would)
    await until(lambda: observed(count))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert value("_sum") - total >= block - monitor.interval
    assert value("_count") - value("_bucket", le=str(big)) >= idle + 1  # one that large
