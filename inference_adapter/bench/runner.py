"""Running the modes: recompute against kvstore in the same run, then the tier sweep.

:class:`ChatBench` holds one random model and two engines on it (separate KV pools): one
that never has a connector (recompute) and one that gets a fresh ``StoreConnector`` per
store configuration. ``compare(workload, setup)`` starts a daemon on ``setup`` and runs each
turn in both modes before moving to the next, alternating which goes first, so that drift
in the machine's load falls on both alike; every turn's generated tokens must match.
``kvstore_only(workload, setup, reference)`` replays the kvstore mode alone on another
configuration and checks its tokens against the reference recompute run.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.client import KVStoreClient, Stats
from kvstore.inference_adapter.bench.daemon import TierSetup, running_store
from kvstore.inference_adapter.bench.presets import Preset, build_model
from kvstore.inference_adapter.bench.replay import (
    Replayer,
    TurnRecord,
    check_same_outputs,
)
from kvstore.inference_adapter.bench.workloads import Workload
from kvstore.inference_adapter.connector import ConnectorStats, StoreConnector, namespace_for
from kvstore.inference_adapter.engine import Engine
from kvstore.inference_adapter.interfaces import Request, SamplingParams

__all__ = ["ChatBench", "ModeRun", "StoreReport"]

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


class ChatBench:
    """One model, two engines; see the module docstring."""

    def __init__(self, preset: Preset, *, seed: int, scratch: Path | None = None) -> None:
        torch.set_grad_enabled(False)
        self.preset = preset
        self.scratch = scratch
        size = preset.model
        self.model = build_model(size, seed)
        pages = size.max_positions // size.block_tokens + 2
        self.recompute_engine = Engine(self.model, num_pages=pages, page_tokens=size.block_tokens)
        self.store_engine = Engine(self.model, num_pages=pages, page_tokens=size.block_tokens)
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
                check_same_outputs(KVSTORE, runs[kvstore][-1:], runs[recompute][-1:])
            store = finish()
        return (
            ModeRun(workload.name, RECOMPUTE, runs[recompute]),
            ModeRun(workload.name, KVSTORE, runs[kvstore], store),
        )

    def kvstore_only(self, workload: Workload, setup: TierSetup, reference: ModeRun) -> ModeRun:
        """The kvstore mode alone on ``setup``, checked against ``reference``'s tokens."""
        with self._store(workload, setup) as (connector, finish):
            replayer = self._replayer(workload, connector, setup.lookahead)
            records = [replayer.run(i) for i in range(len(workload.turns))]
            check_same_outputs(f"kvstore ({setup.name})", records, reference.records)
            store = finish()
        return ModeRun(workload.name, KVSTORE, records, store)

    def _replayer(
        self, workload: Workload, connector: StoreConnector | None = None, lookahead: int = 0
    ) -> Replayer:
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
        self, workload: Workload, setup: TierSetup
    ) -> Iterator[tuple[StoreConnector, Callable[[], StoreReport]]]:
        """A daemon on ``setup``, a client and a connector bound to the store engine."""
        progress(f"{workload.name}: daemon on {setup.describe()}, policy {setup.policy}")
        engine = self.store_engine
        with (
            running_store(setup, self.scratch) as daemon,
            KVStoreClient(daemon.address, retries=1, timeout=10.0) as client,
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

    def _warm_up(self) -> None:
        """One short request per engine, before any connector: first-call costs are paid
        outside the timed turns."""
        prompt = list(range(1, 2 * self.preset.model.block_tokens))
        for engine in (self.recompute_engine, self.store_engine):
            engine.generate([Request("warm-up", prompt, SamplingParams(max_tokens=4))])


def progress(message: str) -> None:
    """A timestamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
