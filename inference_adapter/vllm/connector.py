"""``KVStoreConnector``: vLLM's V1 KV-connector API on top of the kvstore daemon.

Selected with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.inference_adapter.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "unix:/run/kvstore/kvstore.sock",
                                      "tenant": "team-a", "token_env": "KVSTORE_TOKEN"}}'

vLLM builds one instance per role. The scheduler's (:mod:`.scheduler`) looks the prompt's
block keys up when a request is considered for admission (and hints the daemon to move those
it holds below host memory up while the request waits) and plans each step's loads and
saves; the plan reaches the worker's (:mod:`.worker`) as the step's connector metadata.
Blocks are stored in kvstore's own form (layer-major, K after RoPE as vLLM holds it) under
a namespace made from the geometry of vLLM's KV cache (:mod:`.model`), whatever the
architecture; for a Llama it is the one kvstore's engine derives (``namespace_for``), so
either can read what the other saved.

At start the connector refuses, with a ``ValueError`` naming what it found, what it cannot
serve exactly (:mod:`.model`: MLA, hybrid or encoder-decoder models, a KV cache dtype other
than the model's, pipeline parallelism, separate KV-cache groups), and at
``register_kv_caches`` an unknown KV layout or a layer count that is not the model's. With
tensor parallelism every rank's worker stores its share of the heads under its own keys
(``shard_keys``), and the scheduler counts a block only once every rank holds it. A daemon
that is down at start or goes away costs cache misses only (:mod:`.link`); with
``kv_load_failure_policy: "recompute"`` a load that fails mid-step is recomputed by vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import re
import statistics
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.client import SharedLease, shard_keys
from kvstore.inference_adapter.core.timeline import BUCKETS, PHASES
from kvstore.inference_adapter.vllm.layout import layer_kv, layout_of
from kvstore.inference_adapter.vllm.link import Link
from kvstore.inference_adapter.vllm.model import model_namespace
from kvstore.inference_adapter.vllm.scheduler import (
    SchedulerSide,
    StepPlan,
    held_by_every_rank,
)
from kvstore.inference_adapter.vllm.settings import ConnectorSettings
from kvstore.inference_adapter.vllm.worker import WorkerSide

__all__ = [
    "KVStoreConnector",
    "KVStoreConnectorStats",
    "KVStoreMetadata",
    "KVStorePromMetrics",
    "model_namespace",
]

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
MAX_WAITING_HINTS = 64  # prefetch hints waiting to be sent; past this they are dropped
PHASES_KEY = "hit_phases"  # in the connector stats: the hit phases observed
HANDOFF_KEY = "handoff_waits"  # and the seconds prefill steps waited for their saves
LISTS = (PHASES_KEY, HANDOFF_KEY)  # the stats' lists of observations (the rest are counts)


@dataclass
class KVStoreMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, from the scheduler's connector to the worker's."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KVStoreConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Block counts since the last report (loaded, failed loads, queued / dropped saves),
    and under ``PHASES_KEY`` the hit phases observed meanwhile (one dict per hit part)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        lists = {key: [*self.data.get(key, ()), *other.data.get(key, ())] for key in LISTS}
        merged = Counter({k: v for k, v in self.data.items() if k not in LISTS})
        merged.update({k: v for k, v in other.data.items() if k not in LISTS})
        self.data = dict(merged)
        self.data.update({key: values for key, values in lists.items() if values})
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counts, each phase's median in milliseconds (``<phase>_p50_ms``), and the
        median wait of a prefill step for its saves (``handoff_wait_p50_ms``)."""
        reduced: dict[str, int | float] = {
            name: int(value) for name, value in sorted(self.data.items()) if name not in LISTS
        }
        waits = self.data.get(HANDOFF_KEY, ())
        if waits:
            reduced["handoff_wait_p50_ms"] = round(1000 * statistics.median(waits), 3)
        observed = self.data.get(PHASES_KEY, ())
        for phase in PHASES:
            seconds = [hit[phase] for hit in observed if phase in hit]
            if seconds:
                reduced[f"{phase}_p50_ms"] = round(1000 * statistics.median(seconds), 3)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVStorePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``kvstore_engine_hit_phase_seconds{phase}`` (a histogram per vLLM engine): each hit's
    phases as the scheduler's and the worker's connectors observed them, from the stats
    vLLM collects of both; and ``kvstore_engine_handoff_wait_seconds``: how long each step
    of a prefill instance waited for its saves' commit."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        histogram = self._histogram_cls(
            name="kvstore_engine_hit_phase_seconds",
            documentation="A store hit's phases: lookup, lease, layers loaded, ...",
            buckets=[bound for bound in BUCKETS if bound != float("inf")],
            labelnames=[*labelnames, "phase"],
        )
        self._phases = {
            engine: {phase: histogram.labels(*values, phase) for phase in PHASES}
            for engine, values in per_engine_labelvalues.items()
        }
        waits = self._histogram_cls(
            name="kvstore_engine_handoff_wait_seconds",
            documentation="How long a prefill step waited for its saves' commit (P/D hand-off)",
            buckets=[bound for bound in BUCKETS if bound != float("inf")],
            labelnames=labelnames,
        )
        self._waits = {
            engine: waits.labels(*values) for engine, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        histograms = self._phases.get(engine_idx, {})
        for hit in transfer_stats_data.get(PHASES_KEY, ()):
            for phase, seconds in hit.items():
                if phase in histograms:
                    histograms[phase].observe(seconds)
        waits = self._waits.get(engine_idx)
        if waits is not None:
            for seconds in transfer_stats_data.get(HANDOFF_KEY, ()):
                waits.observe(seconds)


class KVStoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's connector to a kvstore daemon; see the module docstring."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        self.namespace = model_namespace(vllm_config, self.settings)
        self.tp_size = self.namespace.model.tp_size
        self.block_size = vllm_config.cache_config.block_size
        self.dtype = vllm_config.model_config.dtype
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._layer_index: dict[str, int] = {}
        self._reported = Counter[str]()
        self._hints: _Hints | None = None
        self.handoff = bool(transfer.is_kv_producer) and self.settings.hands_off(
            getattr(transfer, "kv_role", None)
        )
        if role == KVConnectorRole.SCHEDULER:
            if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
                log.warning(
                    'KVStoreConnector: kv_load_failure_policy is %r; set "recompute" so a '
                    "load that fails (daemon gone mid-step) is recomputed, not an error",
                    transfer.kv_load_failure_policy,
                )
            link = self._link("scheduler", call_timeout=self.settings.lookup_timeout_s, retries=0)
            self._hints = _Hints(link, self.tp_size)

            def release(leases: Sequence[SharedLease]) -> None:
                with contextlib.suppress(Exception):  # down: the leases expire on the daemon
                    link.call(lambda c: [c.release_lease(lease.lease_id) for lease in leases])

            self._scheduler = SchedulerSide(
                self.namespace,
                self.block_size,
                lambda keys: held_by_every_rank(
                    lambda shard: link.call(lambda c: c.find(self.namespace, shard)),
                    keys,
                    self.tp_size,
                    release,
                ),
                release=release,
                prefetch=self._hints.send,
                load=bool(transfer.is_kv_consumer),
                save=bool(transfer.is_kv_producer),
                handoff=self.handoff,
            )
            link.warm()
        log.info(
            "KVStoreConnector (%s): daemon %s, tenant %r, %d tokens per block",
            role.name,
            self.settings.address,
            self.settings.tenant,
            self.namespace.model.block_tokens,
        )

    def _link(
        self,
        role: str,
        *,
        call_timeout: float,
        wait_for_connect: bool = False,
        retries: int = 3,
        pin_arena: bool = False,
    ) -> Link:
        return Link(
            self.settings.address,
            self.namespace,
            retry_s=self.settings.retry_s,
            role=role,
            call_timeout=call_timeout,
            wait_for_connect=wait_for_connect,
            token=self.settings.token(),
            use_shm=self.settings.use_shm,
            retries=retries,
            pin_arena=pin_arena,
        )

    # Scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreMetadata:
        side = self._sched()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            side.scheduled(
                new.req_id,
                new.block_ids[0],
                computed=new.num_computed_tokens + scheduled[new.req_id],
                replace=True,
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            side.scheduled(
                req_id,
                new_ids[0] if new_ids is not None else None,
                computed=cached.num_computed_tokens[i] + scheduled[req_id],
                replace=req_id in resumed,
            )
        return KVStoreMetadata(plan=side.plan_step())

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # The worker copies saved blocks out during the step: nothing holds vLLM's blocks.
        # Where the prompt's KV came from reaches the request's output (kv_transfer_params).
        # With the hand-off on (a prefill instance) the step that finished it committed its
        # saves before it ended, and the params name the prompt blocks held for the decode.
        return False, self._sched().params(request.request_id)

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on the worker's connector")
        return self._scheduler

    # Worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self.namespace.model
        names = sorted(kv_caches, key=_layer_number)
        if len(names) != model.num_layers:
            raise ValueError(
                f"vLLM registered {len(names)} KV cache layers, the model has {model.num_layers}"
            )
        layout = layout_of(kv_caches[names[0]])
        if layout == "cpu":
            check_cpu_layout(self.block_size, model.num_kv_heads, model.head_dim, self.dtype)
        layers = [
            layer_kv(
                kv_caches[name], layout, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim
            )
            for name in names
        ]
        log.info("KVStoreConnector: %d layers in the %r KV layout", len(layers), layout)
        device = layers[0].k.device
        self._layer_index = {name: index for index, name in enumerate(names)}
        link = self._link(
            "worker",
            call_timeout=max(self.settings.load_timeout_s, 10.0),
            wait_for_connect=True,
            pin_arena=self.settings.pin_arena and device.type == "cuda",
        )
        link.warm()
        self._worker = WorkerSide(
            link,
            self.namespace,
            layers,
            save_queue_blocks=self.settings.save_queue_blocks,
            load_timeout_s=self.settings.load_timeout_s,
            rank=_tp_rank(self.tp_size),
            handoff_timeout_s=self.settings.handoff_timeout_s if self.handoff else None,
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start(self._plan())

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        return metadata.plan if isinstance(metadata, KVStoreMetadata) else StepPlan()

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:
            self._work().wait_layer(index)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:
            self._work().capture(index, self._plan().saves)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.finish_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """Block counts since the last report (the worker's), and the hit phases observed
        meanwhile on this side (the scheduler's lookups, the worker's loads)."""
        data: dict[str, Any] = {}
        if self._worker is not None:
            now = self._worker.counts + self._worker.save_counts()
            data = {name: now[name] - self._reported[name] for name in now}
            self._reported = now
            observed = self._worker.take_observed()
            waits = self._worker.take_handoff_waits()
            if waits:
                data[HANDOFF_KEY] = waits
        elif self._scheduler is not None:
            now = self._scheduler.counts.copy()
            data = {name: now[name] - self._reported[name] for name in now}
            self._reported = now
            observed = self._scheduler.take_observed()
        else:
            observed = []
        stats = KVStoreConnectorStats(data={k: v for k, v in data.items() if v})
        if observed:
            stats.data[PHASES_KEY] = observed
        return None if stats.is_empty() else stats

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVStoreConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._hints is not None:
            self._hints.close()

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("register_kv_caches has not run on this connector")
        return self._worker


class _Hints:
    """Prefetch hints sent from a thread of their own, so the scheduler never waits for one;
    at most ``MAX_WAITING_HINTS`` wait (more are dropped: they are only hints)."""

    def __init__(self, link: Link, tp_size: int = 1) -> None:
        self._link = link
        self._ranks = range(tp_size)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstore-vllm-hints")
        self._room = threading.BoundedSemaphore(MAX_WAITING_HINTS)
        self.counts = Counter[str]()

    def send(self, request_id: str, keys: Sequence[bytes]) -> None:
        if not self._room.acquire(blocking=False):
            self.counts["dropped_hints"] += 1
            return
        self._thread.submit(self._send, request_id, list(keys))

    def _send(self, request_id: str, keys: list[bytes]) -> None:
        try:
            chains = [shard_keys(keys, rank) for rank in self._ranks]  # every rank's share
            self._link.call(lambda c: c.prefetch(request_id, self._link.namespace, chains))
            self.counts["sent_hints"] += 1
        except Exception as error:
            self.counts["failed_hints"] += 1
            log.debug("prefetch hint of request %s failed: %s", request_id, error)
        finally:
            self._room.release()

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _tp_rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def check_cpu_layout(block_size: int, num_kv_heads: int, head_dim: int, dtype: Any) -> None:
    """Checks, with vLLM's own CPU cache write, that the ``cpu`` layout reads K and V back.

    The CPU kernels' K layout is not a documented contract (it differs by ISA), so two
    blocks of distinct values are written the way attention writes them and read back
    through :func:`~kvstore.inference_adapter.vllm.layout.layer_kv` before anything is served.

    Raises:
        ValueError: They do not read back (this ISA lays KV out otherwise): refusing to run
            is better than storing wrong KV.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    cache = torch.zeros(2, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    k_cache, v_cache = cache.view(2, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    tokens = 2 * block_size
    # Small integers: exact in every float dtype, distinct per (token, head, dim) mod 251.
    key = (torch.arange(tokens * num_kv_heads * head_dim) % 251 + 1).to(dtype)
    key = key.view(tokens, num_kv_heads, head_dim)
    value = key.flip(0).neg()
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(tokens), isa)
    layer = layer_kv(cache, "cpu", num_kv_heads=num_kv_heads, head_dim=head_dim)
    for part, written in ((layer.k, key), (layer.v, value)):
        expected = written.view(2, block_size, num_kv_heads, head_dim)
        if not torch.equal(part, expected):
            raise ValueError(
                f"vLLM's CPU attention (ISA {isa!r}, {dtype}) lays KV out in a way "
                "KVStoreConnector does not read; it refuses to run rather than store wrong KV"
            )


def _log_like_vllm() -> None:
    """Sends kvstore's log lines through vLLM's handlers (same format, same stream), unless
    the process configured logging for kvstore itself."""
    ours = logging.getLogger("kvstore")
    if ours.handlers or logging.getLogger().handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        ours.addHandler(handler)
    if ours.handlers:
        ours.setLevel(logging.INFO)
        ours.propagate = False


def _layer_number(name: str) -> tuple[int, str]:
    match = _LAYER_INDEX.search(name)
    return (int(match.group(1)) if match else -1, name)
