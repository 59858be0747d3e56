"""Running the modes: recompute against kvstore in the same run, then the tier sweep.

:class:`ChatBench` holds one random model and two engines on it (separate KV pools): one
that never has a connector (recompute) and one that gets a fresh ``StoreConnector`` per
store configuration. ``compare(workload, setup)`` starts a daemon on ``setup`` and runs each
turn in both modes before moving to the next, alternating which goes first, so that drift
in the machine's load falls on both alike; every turn's generated tokens must match.
``kvstore_only(workload, setup, reference)`` replays the kvstore mode alone on another
configuration and checks its tokens against the reference recompute run.

``across_nodes(workload, setup, nodes, reference)`` replays the kvstore mode on two nodes:
two daemons on ``setup`` (each its own process, socket and scratch directory; a
``redis_url`` makes them share that Redis tier) and two engines on the same model (the
store engine and a second one, separate KV pools as two machines have), each with a
connector to its own daemon. Turn ``i`` runs on node ``nodes[i]``; the nodes share the
sessions' contexts (a client re-sends its history to whichever node it reaches), so a
turn's KV can come only from its own node's tiers or from the shared one. A
:class:`NodesRun` holds the records in arrival order, the node of each and each daemon's
:class:`StoreReport`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.client import KVStoreClient, Stats
from kvstore.inference_adapter.bench.daemon import TierSetup, running_store
from kvstore.inference_adapter.bench.presets import Preset, build_model
from kvstore.inference_adapter.bench.replay import (
    IdealStore,
    Replayer,
    TurnRecord,
    check_same_outputs,
)
from kvstore.inference_adapter.bench.workloads import Workload
from kvstore.inference_adapter.connector import ConnectorStats, StoreConnector
from kvstore.inference_adapter.engine import Engine
from kvstore.inference_adapter.interfaces import Request, SamplingParams
from kvstore.inference_adapter.sessions import ChatSession
from kvstore.inference_adapter.weights import namespace_for

__all__ = ["ChatBench", "ModeRun", "NodesRun", "StoreReport"]

MODEL_NAME = "kvstore-bench-chat"
RECOMPUTE, KVSTORE = "recompute", "kvstore"


@dataclass(frozen=True, slots=True)
class StoreReport:
    """The store side of a kvstore run: its configuration and what the daemon said."""

    setup: TierSetup
    stats: Stats
    peak_rss_bytes: int | None
    connector: ConnectorStats
    payload_bytes: int  # one block's KV


@dataclass(frozen=True, slots=True)
class ModeRun:
    """One mode's records over one workload."""

    workload: str
    mode: str
    records: list[TurnRecord]
    store: StoreReport | None = None

    @property
    def label(self) -> str:
        if self.store is None:
            return self.mode
        setup = self.store.setup
        return f"{setup.name}, {setup.policy}"


@dataclass(frozen=True, slots=True)
class PoolRun:
    """The kvstore mode with the engine's pool keeping ``retain_pages`` pages resident."""

    keeps: str  # "none", "1 session", "all 8 sessions"
    retain_pages: int
    run: ModeRun


@dataclass(frozen=True, slots=True)
class NodesRun:
    """The kvstore mode on several nodes: every turn's record in arrival order, the node
    that ran it, and each node's store."""

    workload: str
    records: list[TurnRecord]
    nodes: list[int]
    stores: list[StoreReport]

    def node(self, node: int) -> ModeRun:
        """The turns ``node`` ran, with its daemon's report."""
        records = [r for r, n in zip(self.records, self.nodes, strict=True) if n == node]
        return ModeRun(self.workload, KVSTORE, records, self.stores[node])

    def all_nodes(self) -> ModeRun:
        """Every turn, without a store report (there is one per node)."""
        return ModeRun(self.workload, KVSTORE, self.records)


class ChatBench:
    """One model, two engines (three on several nodes); see the module docstring.

    On the CPU every kvstore turn must give recompute's tokens (``BenchmarkError``). On a
    device, recompute prefills densely (SDPA) and a hit's tail on the paged kernel, and a
    near tie of a random model's logits may flip a greedy token there: such turns are
    counted in ``differing_turns`` (and said on stderr) instead.
    """

    def __init__(
        self, preset: Preset, *, seed: int, scratch: Path | None = None, device: str = "cpu"
    ) -> None:
        torch.set_grad_enabled(False)
        self.preset = preset
        self.scratch = scratch
        size = preset.model
        self.model = build_model(size, seed, device)
        self.differing_turns = 0
        self.recompute_engine = self._new_engine()
        self.store_engine = self._new_engine()
        self._second_engine: Engine | None = None  # node B's, made when a run needs it
        self.namespace = namespace_for(
            self.model.config, model_name=MODEL_NAME, block_tokens=size.block_tokens
        )
        self._warm_up()

    def compare(self, workload: Workload, setup: TierSetup) -> tuple[ModeRun, ModeRun]:
        """Recompute and kvstore on ``workload``, turn by turn; (recompute, kvstore).

        Raises:
            BenchmarkError: The modes generated different tokens, or a save was lost.
        """
        recompute = self._replayer(workload)
        with self._store(workload, setup) as (connector, finish):
            kvstore = self._replayer(workload, connector, setup.lookahead)
            runs: dict[Replayer, list[TurnRecord]] = {recompute: [], kvstore: []}
            for i in range(len(workload.turns)):
                for replayer in (kvstore, recompute) if i % 2 == 0 else (recompute, kvstore):
                    runs[replayer].append(replayer.run(i))
                self._check(KVSTORE, runs[kvstore][-1:], runs[recompute][-1:])
            store = finish()
        return (
            ModeRun(workload.name, RECOMPUTE, runs[recompute]),
            ModeRun(workload.name, KVSTORE, runs[kvstore], store),
        )

    def kvstore_only(
        self,
        workload: Workload,
        setup: TierSetup,
        reference: ModeRun,
        *,
        redis_url: str | None = None,
        retain_pages: int = 0,
    ) -> ModeRun:
        """The kvstore mode alone on ``setup`` (its Redis tier on ``redis_url`` when given),
        checked against ``reference``'s tokens. ``retain_pages``: on a fresh engine whose
        pool keeps that many pages of finished requests resident (the HBM level) beside
        the one context it runs."""
        engine = self._new_engine(retain_pages) if retain_pages else self.store_engine
        if retain_pages:
            self._warm_up(engine)
        with self._store(workload, setup, engine, redis_url) as (connector, finish):
            replayer = self._replayer(workload, connector, setup.lookahead, engine)
            records = [replayer.run(i) for i in range(len(workload.turns))]
            self._check(f"kvstore ({setup.name})", records, reference.records)
            store = finish()
        return ModeRun(workload.name, KVSTORE, records, store)

    def across_nodes(
        self,
        workload: Workload,
        setup: TierSetup,
        nodes: Sequence[int],
        reference: ModeRun,
        *,
        redis_url: str | None = None,
    ) -> NodesRun:
        """The kvstore mode on two nodes, turn ``i`` on node ``nodes[i]`` (0 or 1), checked
        against ``reference``'s tokens; see the module docstring.

        Raises:
            BenchmarkError: A node generated other tokens than recompute, or lost a save.
        """
        engines = (self.store_engine, self.second_engine())
        sessions: dict[str, ChatSession] = {}
        ideal = IdealStore(self.namespace, self.store_engine.page_tokens)
        with contextlib.ExitStack() as stack:
            stores = [
                stack.enter_context(self._store(workload, setup, engine, redis_url))
                for engine in engines
            ]
            replayers = [
                Replayer(
                    _only(workload, nodes, node),
                    engine,
                    namespace=self.namespace,
                    generated=self.preset.generated,
                    connector=connector,
                    sessions=sessions,
                    ideal=ideal,
                )
                for node, (engine, (connector, _)) in enumerate(zip(engines, stores, strict=True))
            ]
            ran = [0] * len(engines)  # each node's turns so far
            records = []
            for node in nodes:
                records.append(replayers[node].run(ran[node]))
                ran[node] += 1
            self._check(f"kvstore on {len(engines)} nodes", records, reference.records)
            reports = [finish() for _, finish in stores]
        return NodesRun(workload.name, records, list(nodes), reports)

    def second_engine(self) -> Engine:
        """Node B's engine: the same model, a KV pool of its own (warmed up when made)."""
        if self._second_engine is None:
            self._second_engine = self._new_engine()
            self._warm_up(self._second_engine)
        return self._second_engine

    def _new_engine(self, retain_pages: int = 0) -> Engine:
        """An engine on the model whose pool holds one full context, and ``retain_pages``
        more that finished requests' pages may stay resident in."""
        size = self.preset.model
        pages = size.max_positions // size.block_tokens + 2 + retain_pages
        return Engine(
            self.model, num_pages=pages, page_tokens=size.block_tokens, retain_pages=retain_pages
        )

    def _replayer(
        self,
        workload: Workload,
        connector: StoreConnector | None = None,
        lookahead: int = 0,
        engine: Engine | None = None,
    ) -> Replayer:
        if engine is None:
            engine = self.recompute_engine if connector is None else self.store_engine
        return Replayer(
            workload,
            engine,
            namespace=self.namespace,
            generated=self.preset.generated,
            connector=connector,
            lookahead=lookahead,
        )

    @contextlib.contextmanager
    def _store(
        self,
        workload: Workload,
        setup: TierSetup,
        engine: Engine | None = None,
        redis_url: str | None = None,
    ) -> Iterator[tuple[StoreConnector, Callable[[], StoreReport]]]:
        """A daemon on ``setup``, a client and a connector bound to ``engine`` (the store
        engine when None)."""
        progress(f"{workload.name}: daemon on {setup.describe()}, policy {setup.policy}")
        engine = engine or self.store_engine
        with (
            running_store(setup, self.scratch, redis_url=redis_url) as daemon,
            KVStoreClient(daemon.address, retries=1, timeout=10.0, pin_arena=True) as client,
        ):
            connector = StoreConnector(
                client,
                self.namespace,
                kv_pool=engine.kv_pool,
                page_tokens=engine.page_tokens,
                rope_tables=engine.rope_tables,
            )

            def finish() -> StoreReport:
                return StoreReport(
                    setup,
                    client.stats(),
                    daemon.peak_rss_bytes(),
                    connector.stats(),
                    self.namespace.model.layout().payload_bytes,
                )

            try:
                yield connector, finish
            finally:
                connector.close()

    def _check(
        self, mode: str, records: Sequence[TurnRecord], reference: Sequence[TurnRecord]
    ) -> None:
        """:func:`check_same_outputs` on the CPU; on a device, differing turns are counted."""
        if self.model.device.type == "cpu":
            check_same_outputs(mode, records, reference)
            return
        for got, expected in zip(records, reference, strict=True):
            if got.output != expected.output:
                self.differing_turns += 1
                progress(f"{mode}: other tokens than recompute's at {got.session_id} turn "
                         f"{got.index} (on {self.model.device}: counted, not fatal)")  # fmt: skip

    def _warm_up(self, *engines: Engine) -> None:
        """One short request per engine (the first two when none are named), before any
        connector: first-call costs are paid outside the timed turns."""
        prompt = list(range(1, 2 * self.preset.model.block_tokens))
        for engine in engines or (self.recompute_engine, self.store_engine):
            engine.generate([Request("warm-up", prompt, SamplingParams(max_tokens=4))])


def _only(workload: Workload, nodes: Sequence[int], node: int) -> Workload:
    """The turns of ``workload`` that run on ``node``, in arrival order."""
    turns = tuple(t for t, n in zip(workload.turns, nodes, strict=True) if n == node)
    return Workload(workload.name, turns, workload.params)


def progress(message: str) -> None:
    """A timestamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
