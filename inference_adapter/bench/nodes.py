"""Two nodes behind a load balancer without affinity: ``kvstore bench chat --nodes 2``.

Each node is a daemon (its own process, socket and scratch directory) with a host tier of
the main setup's size (a fraction of the working set, at least two contexts) and no SSD,
and an engine of its own on the bench's model (separate KV pools, as two machines have)
with a connector to its daemon. The nodes share one Redis tier, under the same key prefix
and written through at every put, so that each finds the blocks the other stored:

- ``--shared-redis server`` (the default): one private ``redis-server``;
- ``--shared-redis cluster``: a local Redis Cluster of three primaries without replicas
  (:class:`~kvstore.inference_adapter.bench.redis_cluster.LocalCluster`), seed-node URL;
- ``--shared-redis none``: no Redis; each node has only its host tier (the control).

Sessions bounce as a balancer without affinity would send them: turn ``N`` of the ``k``-th
session to arrive runs on node ``(k + N) % 2`` (:func:`bounce`), so every turn after the
first runs on the other node than the turn before it and can reuse that turn's KV only
through Redis. The comparison (:func:`run_nodes`) replays each workload twice more after its
recompute and main kvstore runs: one node on the nodes' tiers (same Redis kind; what
bouncing costs is the difference) and the two nodes, both checked token for token against
recompute. Hit rates count against one unbounded store shared by both nodes.

It is a flag, not part of the default run: it adds two kvstore replays per workload (two to
three minutes on the default preset, on two cores).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.inference_adapter.bench.daemon import MIB, TierSetup, redis_server
from kvstore.inference_adapter.bench.presets import Preset, main_setup, unique_kv_bytes
from kvstore.inference_adapter.bench.redis_cluster import LocalCluster
from kvstore.inference_adapter.bench.runner import (
    RECOMPUTE,
    ChatBench,
    ModeRun,
    NodesRun,
    StoreReport,
    progress,
)
from kvstore.inference_adapter.bench.workloads import Workload

__all__ = [
    "NODE_NAMES",
    "SHARED",
    "NodesComparison",
    "bounce",
    "node_setup",
    "run_nodes",
    "shared_redis",
]

SHARED = {
    "server": "one redis-server",
    "cluster": "a Redis Cluster (3 primaries, no replicas)",
    "none": "nothing (no Redis: each node alone)",
}
NODE_NAMES = "AB"


def bounce(workload: Workload, nodes: int = 2) -> list[int]:
    """The node of every turn: turn ``N`` of the ``k``-th session to arrive (from 0) on
    ``(k + N) % nodes``."""
    order: dict[str, int] = {}
    return [
        (order.setdefault(turn.session_id, len(order)) + turn.index) % nodes
        for turn in workload.turns
    ]


def node_setup(workload: Workload, preset: Preset, shared: str) -> TierSetup:
    """One node's tiers: the main setup's host tier, no SSD, and (unless ``shared`` is
    ``none``) a Redis tier of ``4 * W`` written through at every put; LRU, no hints."""
    host = main_setup(workload, preset).host_bytes
    if shared == "none":
        return TierSetup("host only", host_bytes=host)
    redis = max(4 * unique_kv_bytes(workload, preset), 4 * MIB)
    return TierSetup("host+Redis", host_bytes=host, redis_bytes=redis, redis_policy="write_through")


@contextlib.contextmanager
def shared_redis(shared: str, scratch: Path | None, maxmemory: int) -> Iterator[str | None]:
    """The Redis the nodes share, started fresh under ``scratch``: its URL (None for
    ``none``).

    Raises:
        RuntimeError: redis-server (or, for a cluster, redis-cli) is missing or did not
            start.
    """
    if shared == "none":
        yield None
        return
    workdir = Path(tempfile.mkdtemp(prefix="kvs-redis-", dir=scratch))
    try:
        if shared == "server":
            with redis_server(workdir, maxmemory) as url:
                yield url
            return
        cluster = LocalCluster(workdir, primaries=3, replicas=0)
        cluster.start()
        try:
            yield cluster.url
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class NodesComparison:
    """One workload's runs side by side: recompute, the main kvstore run (one node), one
    node on the nodes' tiers, and the two nodes."""

    workload: str
    shared: str  # a key of SHARED
    setup: TierSetup  # each node's
    recompute: ModeRun
    main: ModeRun
    single: ModeRun
    nodes: NodesRun

    def runs(self) -> list[tuple[str, ModeRun, list[StoreReport]]]:
        """Each run's label, records and daemons, in the order the tables show them."""
        two = self.nodes
        rows = [
            (RECOMPUTE, self.recompute, []),
            (f"1 node, {self.main.label}", self.main, _stores(self.main)),
            (f"1 node, {self.single.label}", self.single, _stores(self.single)),
            (f"{len(two.stores)} nodes", two.all_nodes(), two.stores),
        ]
        for node, name in enumerate(NODE_NAMES[: len(two.stores)]):
            rows.append(
                (f"{len(two.stores)} nodes: node {name}", two.node(node), [two.stores[node]])
            )
        return rows


def _stores(run: ModeRun) -> list[StoreReport]:
    return [run.store] if run.store is not None else []


def run_nodes(
    bench: ChatBench,
    workload: Workload,
    shared: str,
    recompute: ModeRun,
    main: ModeRun,
) -> NodesComparison:
    """One node on the nodes' tiers, then the two nodes, on ``workload``; both checked
    against ``recompute``'s tokens.

    Raises:
        BenchmarkError: A run generated other tokens than recompute, or lost a save.
        RuntimeError: A daemon or the Redis did not start.
    """
    setup = node_setup(workload, bench.preset, shared)
    nodes = bounce(workload)
    progress(
        f"{workload.name}: two nodes sharing {SHARED[shared]}, {nodes.count(1)} of "
        f"{len(nodes)} turns on node B"
    )
    with shared_redis(shared, bench.scratch, setup.redis_bytes or 0) as url:
        single = bench.kvstore_only(workload, setup, recompute, redis_url=url)
    with shared_redis(shared, bench.scratch, setup.redis_bytes or 0) as url:
        two = bench.across_nodes(workload, setup, nodes, recompute, redis_url=url)
    return NodesComparison(workload.name, shared, setup, recompute, main, single, two)
