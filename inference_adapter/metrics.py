"""The engine's Prometheus metrics: its page pool as the HBM level, and where each prompt's
KV came from. ``kvstore chat --metrics-listen HOST:PORT`` serves them; any host of an
:class:`~kvstore.inference_adapter.engine.Engine` can with :func:`serve_engine_metrics`.

- ``kvstore_engine_prompt_tokens_total{level}``: prompt tokens by where their KV came from,
  ``hbm`` (mapped from resident pages), ``host``/``ssd``/``redis`` (loaded from the
  daemon's tier), ``computed``;
- ``kvstore_engine_hbm_hit_pages_total``: pages mapped from the pool (no copy);
- ``kvstore_engine_hbm_evicted_pages_total``: idle resident pages given up;
- ``kvstore_engine_hbm_resident_pages``: pages under a key now, held or idle;
- ``kvstore_engine_hbm_retain_pages``, ``kvstore_engine_pool_pages``: the pool's sizes;
- ``kvstore_engine_hit_phase_seconds{phase}``: every store hit's timeline by phase (queue,
  lookup, lease, admit, first_layer, layers, compute, sample, total:
  :mod:`kvstore.inference_adapter.core.timeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvstore.inference_adapter.levels import LEVELS
from kvstore.metrics import serve_registry

if TYPE_CHECKING:
    from kvstore.inference_adapter.engine import Engine

__all__ = ["EngineCollector", "serve_engine_metrics"]


class EngineCollector(Collector):
    """Reads ``engine``'s counters at each scrape (plain ints: no lock needed)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine, pool = self._engine, self._engine.allocator
        tokens = CounterMetricFamily("kvstore_engine_prompt_tokens",
                                     "Prompt tokens by where their KV came from",
                                     labels=["level"])  # fmt: skip
        for level in (*LEVELS, "computed"):
            tokens.add_metric([level], engine.prompt_tokens[level])
        yield tokens
        for name, text, value in (
            ("hbm_hit_pages", "Pages mapped from the pool's resident pages", pool.shared_pages),
            ("hbm_evicted_pages", "Idle resident pages given up", pool.evicted_pages),
        ):
            yield CounterMetricFamily(f"kvstore_engine_{name}", text, value=value)
        yield engine.hit_phases.metric(
            "kvstore_engine_hit_phase_seconds", "A store hit's phases, arrival to first token"
        )
        for name, text, value in (
            ("hbm_resident_pages", "Pages under a key, held or idle", pool.num_resident_pages),
            ("hbm_retain_pages", "Idle resident pages the pool keeps at most", pool.retain_pages),
            ("pool_pages", "Pages in the pool", pool.num_pages),
        ):
            yield GaugeMetricFamily(f"kvstore_engine_{name}", text, value=value)


def serve_engine_metrics(engine: Engine, listen: str) -> tuple[Callable[[], None], int]:
    """Serves ``engine``'s metrics on ``listen`` (``host:port``; port 0 picks one). Returns
    a function that stops the endpoint, and its port.

    Raises:
        OSError: the address cannot be bound (the message names it).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return serve_registry(listen, registry)
