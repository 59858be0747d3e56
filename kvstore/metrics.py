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
- per tier also ``kvstore_tier_read_bytes_total``, ``kvstore_tier_written_bytes_total``,
  ``kvstore_tier_failed_writes_total``;
  ``kvstore_expired_leases_total``, ``kvstore_expired_reservations_total``;
- per gRPC method (:class:`RpcMetrics`): ``kvstore_rpc_duration_seconds`` (histogram) and
  ``kvstore_rpcs_total`` by status code;
- ``kvstore_event_loop_lag_seconds`` (:class:`LoopLag`, a histogram): how late a task that
  sleeps ``LAG_INTERVAL_S`` at a time wakes, i.e. how long the loop was held by other work
  or waited for a core; ``kvstore_event_loop_held_seconds`` (a histogram), the same less the
  loop thread's wait for a core, and ``kvstore_event_loop_cpu_wait_seconds_total`` that wait
  (Linux only);
- ``kvstore_blocks``, ``kvstore_leases_active``, ``kvstore_reservations_active``,
  ``kvstore_prefetches_in_flight``, ``kvstore_uptime_seconds``, ``kvstore_build_info``
  (label ``version``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvstore import __version__
from kvstore.wire.results import COUNTERS

if TYPE_CHECKING:
    from kvstore.service import ServiceStats

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT = 5.0  # seconds a scrape waits for the event loop

# Seconds: a lookup or a small unary call takes ~0.1-1 ms, a streamed get of MiBs 1-100 ms.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
               0.5, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
# The lag monitor wakes 100 times a second: a stall of d ms lands under a wake-up with odds
# of about d/10, so stalls that recur show within a second, for 100 turns of ~10 us (0.1% of
# a core). uvloop's timers count whole milliseconds: an idle loop reads 0-1 ms of lag.
LAG_INTERVAL_S = 0.01
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0)  # fmt: skip


class StatsCollector(Collector):
    """The metrics of one snapshot, taken by ``snapshot`` on the event loop ``loop``."""

    def __init__(
        self, snapshot: Callable[[], ServiceStats], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._snapshot, self._loop = snapshot, loop

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
            "read_bytes": ("Payload bytes of the reads the tier served", CounterMetricFamily,
                           "read_bytes"),
            "written_bytes": ("Bytes written into the tier (after compression)",
                              CounterMetricFamily, "written_bytes"),
            "failed_writes": ("Block writes the tier did not take (full, or not answering)",
                              CounterMetricFamily, "failed_writes"),
        }  # fmt: skip
        for name, (doc, family, field) in per_tier.items():
            metric = family(f"kvstore_tier_{name}", doc, labels=["tier"])
            for tier in store.tiers:
                metric.add_metric([tier.name], float(getattr(tier, field)))
            yield metric
        for name in COUNTERS:
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
            "uptime_seconds": ("Seconds since the daemon started", stats.uptime_seconds),
        }  # fmt: skip
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"kvstore_{name}", doc, value=value)
        info = GaugeMetricFamily("kvstore_build_info", "The daemon's version", labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info


class RpcMetrics(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Per-method call latency and status counts of the gRPC server it intercepts (first
    in the interceptor list, so calls that authentication refuses are counted too):
    ``kvstore_rpc_duration_seconds{method}`` (a histogram; a streamed call is timed to its
    last message) and ``kvstore_rpcs_total{method,code}``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._latency = Histogram("kvstore_rpc_duration_seconds", "gRPC call latency", ["method"],
                                  buckets=RPC_BUCKETS, registry=self.registry)  # fmt: skip
        self._calls = Counter("kvstore_rpcs", "gRPC calls by status code", ["method", "code"],
                              registry=self.registry)  # fmt: skip

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rpartition("/")[2]
        codecs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}  # fmt: skip
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self.timed(method, handler.unary_unary), **codecs
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self.timed(method, handler.stream_unary), **codecs
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._timed_stream(method, handler.unary_stream), **codecs
            )
        return handler  # bidirectional streams: none in this service

    def _record(self, method: str, started: float, context: Any, failed: bool) -> None:
        code = context.code()
        name = code.name if isinstance(code, grpc.StatusCode) else ("UNKNOWN" if failed else "OK")
        self._latency.labels(method).observe(time.perf_counter() - started)
        self._calls.labels(method, name).inc()

    def timed(self, method: str, behavior: Any) -> Any:
        """``behavior`` (a unary method), its calls timed and counted under ``method``."""

        async def timed(request: Any, context: Any) -> Any:
            started, failed = time.perf_counter(), True
            try:
                reply = await behavior(request, context)
                failed = False
                return reply
            finally:
                self._record(method, started, context, failed)

        return timed

    def _timed_stream(self, method: str, behavior: Any) -> Any:
        async def timed(request: Any, context: Any) -> AsyncIterator[Any]:
            started, failed = time.perf_counter(), True
            try:
                async for message in behavior(request, context):
                    yield message
                failed = False
            finally:
                self._record(method, started, context, failed)

        return timed


class LoopLag:
    """The event loop's lag into ``kvstore_event_loop_lag_seconds`` of ``registry``:
    :meth:`run` sleeps ``interval`` seconds at a time and records how much later than asked
    it woke (never below 0), which is how long other work held the loop past that moment,
    or how long the loop's thread waited for a core.

    Where Linux says how long a thread waited, runnable, for a core
    (``/proc/thread-self/schedstat``), the loop's share is split out:
    ``kvstore_event_loop_cpu_wait_seconds_total`` counts the loop thread's wait for a core,
    and ``kvstore_event_loop_held_seconds`` records each lag less the core wait over the
    same span (never below 0): the part the daemon's own work held the loop (callbacks, the
    GIL), whatever the machine's other processes do."""

    def __init__(self, registry: CollectorRegistry, interval: float = LAG_INTERVAL_S) -> None:
        self.interval = interval
        self._lag = Histogram("kvstore_event_loop_lag_seconds",
                              "How late a timer on the event loop ran", buckets=LAG_BUCKETS,
                              registry=registry)  # fmt: skip
        self._held = Histogram("kvstore_event_loop_held_seconds",
                               "How late a timer on the event loop ran, less the loop "
                               "thread's wait for a core", buckets=LAG_BUCKETS,
                               registry=registry)  # fmt: skip
        self._cpu_wait = Counter("kvstore_event_loop_cpu_wait_seconds",
                                 "Time the event loop's thread was runnable but had no core",
                                 registry=registry)  # fmt: skip

    async def run(self) -> None:
        """Measures until cancelled (on the loop's thread: the core wait read is its own)."""
        schedstat = CoreWait.open()
        try:
            waited = schedstat.seconds() if schedstat else 0.0
            while True:
                due = time.perf_counter() + self.interval
                await asyncio.sleep(self.interval)
                lag = max(0.0, time.perf_counter() - due)
                self._lag.observe(lag)
                if schedstat:
                    now = schedstat.seconds()
                    self._cpu_wait.inc(now - waited)
                    self._held.observe(max(0.0, lag - (now - waited)))
                    waited = now
        finally:
            if schedstat:
                schedstat.close()


class CoreWait:
    """The calling thread's total wait for a core, from ``/proc/thread-self/schedstat``
    (its second field, nanoseconds spent runnable on a run queue)."""

    PATH = "/proc/thread-self/schedstat"

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def open(cls) -> CoreWait | None:
        """The calling thread's counter, or None where the kernel does not keep it."""
        try:
            fd = os.open(cls.PATH, os.O_RDONLY)
        except OSError:
            return None
        wait = cls(fd)
        try:
            wait.seconds()
        except (OSError, ValueError, IndexError):
            wait.close()
            return None
        return wait

    def seconds(self) -> float:
        return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9

    def close(self) -> None:
        os.close(self._fd)


def serve_metrics(
    listen: str,
    snapshot: Callable[[], ServiceStats],
    loop: asyncio.AbstractEventLoop,
    rpcs: RpcMetrics | None = None,
) -> tuple[Callable[[], None], int]:
    """Starts the endpoint on ``listen`` (``host:port``; port 0 picks one). Returns a
    function that stops it, and the port it listens on.

    Raises:
        OSError: the address cannot be bound (the message names it).
    """
    registry = CollectorRegistry(auto_describe=False) if rpcs is None else rpcs.registry
    registry.register(StatsCollector(snapshot, loop))
    return serve_registry(listen, registry)


def serve_registry(listen: str, registry: CollectorRegistry) -> tuple[Callable[[], None], int]:
    """Serves ``registry`` on ``listen`` (``host:port``; port 0 picks one) from a thread.
    Returns a function that stops it, and the port it listens on.

    Raises:
        OSError: the address cannot be bound (the message names it).
    """
    host, _, port = listen.rpartition(":")
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
