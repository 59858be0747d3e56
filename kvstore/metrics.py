"""Prometheus metrics: the numbers ``kvstore stats`` prints, on an HTTP endpoint.

``[metrics] listen = "host:port"`` (empty: off) serves ``/metrics`` from a thread of
``prometheus_client``. A scrape reads :meth:`KVStoreService.stats` on the event loop (the
one place the store's counters change), so it is the same snapshot ``kvstore stats`` gets.
Names follow Prometheus' conventions (``_bytes``, ``_seconds``, counters ``_total``):

- per tier (label ``tier``): ``kvstore_tier_used_bytes``, ``kvstore_tier_capacity_bytes``,
  ``kvstore_tier_blocks``, ``kvstore_tier_healthy`` (1/0), ``kvstore_tier_hits_total``,
  ``kvstore_tier_evictions_total``;
- ``kvstore_gets_total`` (every block read, shm and stream alike), ``kvstore_misses_total``,
  ``kvstore_puts_total``, ``kvstore_dedup_puts_total``, ``kvstore_promotions_total``,
  ``kvstore_demotions_total``, ``kvstore_dropped_saves_total``,
  ``kvstore_corrupt_blocks_total``, ``kvstore_corrupt_writes_total``,
  ``kvstore_lookups_total``, ``kvstore_lookup_hit_blocks_total``,
  ``kvstore_prefetches_dropped_total``;
- ``kvstore_blocks``, ``kvstore_leases_active``, ``kvstore_reservations_active``,
  ``kvstore_prefetches_in_flight``, ``kvstore_uptime_seconds``, ``kvstore_build_info``
  (label ``version``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvstore import __version__

if TYPE_CHECKING:
    from kvstore.service import ServiceStats

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT = 5.0  # seconds a scrape waits for the event loop

_COUNTERS = ("gets", "misses", "puts", "dedup_puts", "promotions", "demotions", "dropped_saves",
             "corrupt_blocks", "corrupt_writes")  # fmt: skip


class StatsCollector(Collector):
    """The metrics of one snapshot, taken by ``snapshot`` on the event loop ``loop``."""

    def __init__(
        self, snapshot: Callable[[], ServiceStats], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._snapshot, self._loop = snapshot, loop
        self._started = time.monotonic()

    def _read(self) -> ServiceStats:
        async def read() -> ServiceStats:
            return self._snapshot()

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(SCRAPE_TIMEOUT)

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        store = stats.store
        per_tier = {
            "used_bytes": ("Bytes the tier holds", GaugeMetricFamily, "usage_bytes"),
            "capacity_bytes": ("Bytes the tier may hold", GaugeMetricFamily, "capacity_bytes"),
            "blocks": ("Indexed blocks the tier holds a copy of", GaugeMetricFamily, "blocks"),
            "healthy": ("1 while the tier answers", GaugeMetricFamily, "healthy"),
            "hits": ("Block reads served from the tier", CounterMetricFamily, "hits"),
            "evictions": ("Blocks evicted from the tier", CounterMetricFamily, "evictions"),
        }
        for name, (doc, family, field) in per_tier.items():
            metric = family(f"kvstore_tier_{name}", doc, labels=["tier"])
            for tier in store.tiers:
                metric.add_metric([tier.name], float(getattr(tier, field)))
            yield metric
        for name in _COUNTERS:
            yield CounterMetricFamily(f"kvstore_{name}", name.replace("_", " "),
                                      value=getattr(store, name))  # fmt: skip
        yield CounterMetricFamily("kvstore_lookups", "Lookup calls", value=stats.lookups)
        yield CounterMetricFamily("kvstore_lookup_hit_blocks", "Blocks lookups found held",
                                  value=stats.lookup_hit_blocks)  # fmt: skip
        yield CounterMetricFamily("kvstore_prefetches_dropped", "Prefetch hints dropped",
                                  value=stats.prefetches_dropped)  # fmt: skip
        gauges = {
            "blocks": ("Blocks indexed", store.blocks),
            "leases_active": ("Leases held by clients", store.active_leases),
            "reservations_active": ("Arena reservations not yet committed",
                                    store.active_reservations),
            "prefetches_in_flight": ("Prefetch hints being carried out",
                                     stats.prefetches_in_flight),
            "uptime_seconds": ("Seconds since the daemon started serving",
                               time.monotonic() - self._started),
        }  # fmt: skip
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"kvstore_{name}", doc, value=value)
        info = GaugeMetricFamily("kvstore_build_info", "The daemon's version", labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info


def serve_metrics(
    listen: str, snapshot: Callable[[], ServiceStats], loop: asyncio.AbstractEventLoop
) -> tuple[Callable[[], None], int]:
    """Starts the endpoint on ``listen`` (``host:port``; port 0 picks one). Returns a
    function that stops it, and the port it listens on.

    Raises:
        OSError: the address cannot be bound (the message names it).
    """
    host, _, port = listen.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(snapshot, loop))
    try:
        server, thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    except OSError as error:
        raise OSError(error.errno, f"metrics.listen {listen}: {error.strerror}") from error
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(SCRAPE_TIMEOUT)

    return stop, bound
