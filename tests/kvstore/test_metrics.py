"""The daemon's metrics: the store's counters, declared once, and the event loop's lag."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

from prometheus_client.registry import CollectorRegistry

from kvstore.client.wire import Stats
from kvstore.index import BlockMeta
from kvstore.metrics import LAG_BUCKETS, LoopLag, StatsCollector
from kvstore.policies import eviction_policy, write_policy
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.service import ServiceStats
from kvstore.store import BlockStore, PutStatus, StoreTier
from kvstore.tiers.host import HostTier
from kvstore.wire.blocks import ROOT_KEY, BlockLayout
from kvstore.wire.results import COUNTERS, StoreStats
from tests.support.waiting import until

LAG = "kvstore_event_loop_lag_seconds"
LAYOUT = BlockLayout(num_layers=1, num_kv_heads=1, block_tokens=16, head_dim=64, dtype="float16")


def test_every_counter_has_a_field_in_the_stats_the_reply_and_the_clients_stats() -> None:
    for fields in (dataclasses.fields(StoreStats), dataclasses.fields(Stats)):
        assert set(COUNTERS) <= {field.name for field in fields}
    assert set(COUNTERS) <= set(pb.StatsResponse.DESCRIPTOR.fields_by_name)


async def test_prometheus_exports_every_counter_with_the_stores_value() -> None:
    """A put, a dedup put, a hit and a miss move the store's counters; a scrape shows each
    counter the store declares, with the value its stats give."""
    namespace, meta = b"n" * 32, BlockMeta(b"n" * 32, LAYOUT.block_tokens, LAYOUT)
    host = StoreTier(HostTier(64 * LAYOUT.payload_bytes), None, write_policy("write_through", 1))
    async with BlockStore([host], eviction=eviction_policy("lru")) as store:
        key, payload = b"k" * 32, os.urandom(LAYOUT.payload_bytes)
        assert await store.put(key, ROOT_KEY, meta, payload) is PutStatus.STORED
        assert await store.put(key, ROOT_KEY, meta, payload) is PutStatus.DEDUP
        assert await store.get(key, namespace) is not None
        assert await store.get(b"m" * 32, namespace) is None
        stats = store.stats()
        snapshot = ServiceStats(stats, lookups=0, lookup_hit_blocks=0, prefetches_in_flight=0,
                                prefetches_dropped=0)  # fmt: skip
        collector = StatsCollector(lambda: snapshot, asyncio.get_running_loop())
        families = await asyncio.to_thread(lambda: list(collector.collect()))
    exported = {family.name: family.samples[0].value for family in families if family.samples}
    for name in COUNTERS:
        assert exported[f"kvstore_{name}"] == getattr(stats, name), name
    assert (stats.puts, stats.dedup_puts, stats.gets, stats.misses) == (1, 1, 2, 1)


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
