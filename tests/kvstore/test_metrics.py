"""The daemon's metrics: the store's counters, declared once, and the event loop's lag."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import multiprocessing
import os
import time

import pytest
from prometheus_client.registry import CollectorRegistry

from kvstore.client.wire import Stats
from kvstore.index import BlockMeta
from kvstore.metrics import LAG_BUCKETS, CoreWait, LoopLag, StatsCollector
from kvstore.policies import eviction_policy, write_policy
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.service import ServiceStats
from kvstore.store import BlockStore, PutStatus, StoreTier
from kvstore.tiers.host import HostTier
from kvstore.wire.blocks import ROOT_KEY, BlockLayout
from kvstore.wire.results import COUNTERS, StoreStats
from tests.support.benchmarks import root_on_path
from tests.support.waiting import until

LAG = "kvstore_event_loop_lag_seconds"
HELD = "kvstore_event_loop_held_seconds"
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
    if counts_core_wait():  # a sleeping thread waits for no core: held as lag
        held = registry.get_sample_value(HELD + "_sum") or 0.0
        assert held >= block - monitor.interval


def lag_beside_hogs(seconds: float) -> dict[str, float]:
    """In a process of its own pinned to one core with two busy processes pinned beside
    it, the monitor runs ``seconds``; returns its lag and held sums and the core wait."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    hogs = [multiprocessing.get_context("fork").Process(target=spin, daemon=True) for _ in "ab"]
    for hog in hogs:
        hog.start()  # forked: pinned to the same core
    registry = CollectorRegistry(auto_describe=False)

    async def measure() -> None:
        task = asyncio.create_task(LoopLag(registry, interval=0.01).run())
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(measure())
    finally:
        for hog in hogs:
            hog.kill()
    names = (LAG + "_sum", HELD + "_sum", "kvstore_event_loop_cpu_wait_seconds_total")
    return {name: registry.get_sample_value(name) or 0.0 for name in names}


def spin() -> None:
    while True:
        pass


def counts_core_wait() -> bool:
    wait = CoreWait.open()
    if wait is not None:
        wait.close()
    return wait is not None


@pytest.mark.skipif(not counts_core_wait(), reason="the kernel keeps no schedstat")
def test_a_loop_waiting_for_a_core_counts_the_wait_apart_from_what_held_it() -> None:
    """Two busy processes on the loop's only core make its timer late although nothing on
    the loop holds it: the wait is counted, and the held histogram is spared it."""
    root_on_path()  # the spawned child imports this module to run lag_beside_hogs
    with concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        sums = pool.submit(lag_beside_hogs, 1.0).result(timeout=120)
    waited = sums["kvstore_event_loop_cpu_wait_seconds_total"]
    assert waited > 0
    assert sums[HELD + "_sum"] < sums[LAG + "_sum"]
