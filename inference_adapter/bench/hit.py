"""``kvstore bench hit``: what a store hit costs beyond its bytes, phase by phase.

    kvstore bench hit [--tokens 256,2048,8192] [--cold 20] [--hits 40] [--concurrent 1,4]
                      [--block-tokens 256] [--device cpu|cuda] [--json FILE]

The connector protocol alone, as our engine runs it when it admits a request, with no model:
``num_loadable_tokens`` -> ``start_load`` -> ``wait_for_layer_load`` for every layer ->
``request_finished``, through a :class:`~kvstore.inference_adapter.connector.StoreConnector`
on a real ``kvstore serve`` (host tier), in a 1B-like geometry (16 layers, 8 KV heads of 64,
bfloat16: 32 KiB of KV a token), 256-token blocks (``--block-tokens``) on 16-token pages, one
torch thread. A writer client stores each prompt's blocks first (a prompt of ``n`` tokens is
``n`` stored tokens and one more, which the engine computes); the hits are a new client's.

In the same run, the limits a hit is held against: a ``copy_`` of the hit's bytes into the
same pool pages (from host memory laid out as stored; on CUDA, pinned), and a Health call
(one gRPC round trip; its p50 is the unit of the fixed cost).

Rows: ``cold``, the first ``--cold`` hits of the smallest prompt after the daemon started (a
new client and connector); then per prompt size, ``--hits`` hits after as many warm-up ones;
last, the smallest again with the read path's calls over gRPC instead of the shm session's
socket (the control of that choice). Each row: the hit's p50 and p90, the copy's p50, the
fixed cost (hit less copy, also in Health round trips), copy over hit, the p50 of each
phase of the hit's timeline (:mod:`~kvstore.inference_adapter.core.timeline`), and the
hand-off per layer (the layers phase less their share of the copy, per layer).
``--concurrent M`` admits M requests of the smallest size at once, as the engine admits a
batch (M lookups, M loads started, then every layer of each): the time per hit against one
at a time, and the daemon's CPU seconds per hit. Prints markdown tables; ``--json`` writes
every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvstore.client import KVStoreClient, ModelFingerprint, Namespace, block_keys
from kvstore.inference_adapter.bench.daemon import StoreProcess, TierSetup, running_store
from kvstore.inference_adapter.bench.runner import progress
from kvstore.inference_adapter.connector import StoreConnector
from kvstore.inference_adapter.core.timeline import PHASES, HitTimeline
from kvstore.inference_adapter.interfaces import Request
from kvstore.kernels.rope import RopeTables

__all__ = ["Geometry", "HitBench", "Row", "main"]

MIB = 1 << 20
PAGE_TOKENS = 16
SHOWN_PHASES = ("lookup", "lease", "admit", "first_layer", "layers")


@dataclass(frozen=True, slots=True)
class Geometry:
    """The KV's shape: 1B-like by default (Llama-3.2-1B's 16 layers of 8 KV heads of 64)."""

    num_layers: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64
    block_tokens: int = 256
    dtype: str = "bfloat16"

    def namespace(self) -> Namespace:
        fingerprint = ModelFingerprint(
            model_name="kvstore-bench-hit",
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_tokens=self.block_tokens,
            rope_theta=500000.0,
        )
        return Namespace(fingerprint, "bench-hit")

    def token_bytes(self) -> int:
        item = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * item


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the table (times in milliseconds)."""

    name: str
    tokens: int
    hits: int
    p50_ms: float
    p90_ms: float
    copy_ms: float
    fixed_ms: float  # p50 less the copy
    fixed_round_trips: float  # the same in Health round trips of this run
    copy_over_hit: float
    phases_ms: dict[str, float]  # p50 of each phase of the timeline
    # Per layer after the first: the layers phase less a layer's share of the copy_
    handoff_us: float


@dataclass(frozen=True, slots=True)
class Concurrent:
    """M requests admitted at once."""

    requests: int
    batch_ms: float  # p50 of the whole batch: M lookups to every layer of each
    per_hit_ms: float  # batch_ms / M
    over_one: float  # per_hit_ms over the single-hit p50 of the same size
    daemon_cpu_ms_per_hit: float


@dataclass(frozen=True, slots=True)
class Report:
    """Every figure of one run."""

    about: dict[str, object]
    rows: list[Row]
    concurrent: list[Concurrent]


class HitBench:
    """A daemon with the blocks of every prompt, and a connector that hits them.

    Args:
        store: The running daemon.
        geometry: The KV's shape.
        tokens: Prompt sizes to store (each ``n`` stored tokens plus one computed).
        device: Where the engine's pool lies.
        copies: How many prompts of each size (distinct tokens), for concurrent hits.
    """

    def __init__(
        self,
        store: StoreProcess,
        geometry: Geometry,
        tokens: Sequence[int],
        device: torch.device,
        copies: int = 1,
    ) -> None:
        self.store = store
        self.geometry = geometry
        self.namespace = geometry.namespace()
        self.device = device
        self.prompts = {
            (n, copy): [(n * 131 + copy * 7919 + i) % 100_000 for i in range(n + 1)]
            for n in tokens
            for copy in range(copies)
        }
        self._seq = 0
        most = max(tokens)
        self.num_pages = copies * most // PAGE_TOKENS + 16
        g = geometry
        shape = (g.num_layers, 2, self.num_pages, PAGE_TOKENS, g.num_kv_heads, g.head_dim)
        self.pool = torch.zeros(shape, dtype=getattr(torch, g.dtype), device=device)
        half = g.head_dim // 2
        tables = torch.zeros(PAGE_TOKENS, half, device=device)
        self.rope = RopeTables(tables, tables.clone())

    def store_blocks(self) -> None:
        """Puts every prompt's full blocks through a writer client of its own."""
        g = self.geometry
        dtype = getattr(torch, g.dtype)
        with KVStoreClient(self.store.address, timeout=60.0) as writer:
            for (n, copy), prompt in self.prompts.items():
                keys = block_keys(prompt, self.namespace)
                shape = (g.num_layers, 2, g.block_tokens, g.num_kv_heads, g.head_dim)
                blocks = [torch.full(shape, float(1 + (n + copy + i) % 97), dtype=dtype)
                          for i in range(len(keys))]  # fmt: skip
                writer.put(self.namespace, keys, blocks)

    @contextlib.contextmanager
    def connector(self, session_calls: bool = True) -> Iterator[StoreConnector]:
        """A new client and connector, as an engine starting up makes them (with
        ``session_calls`` off, the lookup and the lease go over gRPC)."""
        with KVStoreClient(
            self.store.address, timeout=10.0, retries=0, pin_arena=True, session_calls=session_calls
        ) as client:
            connector = StoreConnector(
                client,
                self.namespace,
                kv_pool=self.pool,
                page_tokens=PAGE_TOKENS,
                rope_tables=self.rope,
            )
            try:
                yield connector
            finally:
                connector.close()

    def hits(self, connector: StoreConnector, n: int, copies: Sequence[int]) -> list[HitTimeline]:
        """Admits one request per copy of the ``n``-token prompt at once, as the engine
        admits a batch; every layer of each loaded (and, on CUDA, synchronised)."""
        per_request = n // PAGE_TOKENS + 1
        requests = []
        for slot, copy in enumerate(copies):
            self._seq += 1
            request = Request(f"hit-{self._seq}", self.prompts[(n, copy)])
            request.timeline = HitTimeline(self.geometry.num_layers)
            requests.append((request, list(range(slot * per_request, (slot + 1) * per_request))))
        for request, _ in requests:
            request.num_loaded_tokens = connector.num_loadable_tokens(request)
        for request, pages in requests:
            connector.start_load(request, pages, request.num_loaded_tokens)
        for layer in range(self.geometry.num_layers):
            for request, _ in requests:
                if not connector.wait_for_layer_load(request, layer):
                    raise RuntimeError(f"{request.request_id}: layer {layer} did not load")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        timelines = []
        for request, _ in requests:
            assert request.timeline is not None
            request.timeline.computed = request.timeline.first_token = time.perf_counter()
            connector.request_finished(request)
            if request.num_loaded_tokens != n:
                raise RuntimeError(
                    f"{request.request_id}: loaded {request.num_loaded_tokens} of {n}"
                )
            timelines.append(request.timeline)
        return timelines

    def copy_ms(self, n: int, repeats: int) -> float:
        """p50 of one ``copy_`` of ``n`` tokens' KV into the pool's first pages."""
        g = self.geometry
        pages = n // PAGE_TOKENS
        shape = (g.num_layers, 2, pages, PAGE_TOKENS, g.num_kv_heads, g.head_dim)
        pinned = self.device.type == "cuda"
        source = torch.ones(shape, dtype=self.pool.dtype, pin_memory=pinned)
        target = self.pool[:, :, :pages]
        times = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            target.copy_(source, non_blocking=pinned)
            if pinned:
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:]) * 1000

    def health_ms(self, repeats: int) -> float:
        """p50 of a Health call (one gRPC round trip) from a connected client."""
        with KVStoreClient(self.store.address, retries=0) as client:
            times = []
            for _ in range(repeats + 10):
                start = time.perf_counter()
                client.health()
                times.append(time.perf_counter() - start)
        return statistics.median(times[10:]) * 1000


def row(
    name: str, n: int, timelines: Sequence[HitTimeline], copy_ms: float, health_ms: float
) -> Row:
    """The row of ``timelines`` (one hit each), against the limits of the same run."""
    totals = sorted(1000 * t.phases()["total"] for t in timelines)
    p50 = statistics.median(totals)
    p90 = totals[min(len(totals) - 1, int(0.9 * len(totals)))]
    phases = {
        phase: 1000 * statistics.median(t.phases().get(phase, 0.0) for t in timelines)
        for phase in PHASES
        if phase != "total"
    }
    fixed = max(0.0, p50 - copy_ms)
    layers = len(timelines[0].layers)
    per_layer = (phases["layers"] - copy_ms * (layers - 1) / layers) / max(1, layers - 1)
    return Row(name, n, len(timelines), p50, p90, copy_ms, fixed, fixed / health_ms,
               copy_ms / p50, phases, max(0.0, 1000 * per_layer))  # fmt: skip


def daemon_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process so far (0 where /proc does not say)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def render(rows: Sequence[Row], concurrent: Sequence[Concurrent], about: dict[str, object]) -> str:
    head = ("hit", "p50 ms", "p90 ms", "copy_ ms", "fixed ms", "round trips", "copy_/hit",
            *(f"{phase} ms" for phase in SHOWN_PHASES), "hand-off us/layer")  # fmt: skip
    lines = [", ".join(f"{key} {value}" for key, value in about.items()), ""]
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = (f"{r.name} {r.tokens}", f"{r.p50_ms:.2f}", f"{r.p90_ms:.2f}", f"{r.copy_ms:.2f}",
                 f"{r.fixed_ms:.2f}", f"{r.fixed_round_trips:.1f}", f"{r.copy_over_hit:.2f}",
                 *(f"{r.phases_ms[phase]:.3f}" for phase in SHOWN_PHASES),
                 f"{r.handoff_us:.0f}")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if concurrent:
        lines += ["", "| requests at once | batch p50 ms | per hit ms | per hit / one | "
                  "daemon CPU ms per hit |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
        for c in concurrent:
            lines.append(f"| {c.requests} | {c.batch_ms:.2f} | {c.per_hit_ms:.2f} | "
                         f"{c.over_one:.2f} | {c.daemon_cpu_ms_per_hit:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore bench hit", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=_ints, default=[256, 2048, 8192],
                        help="prompt sizes, multiples of 256 (%(default)s)")  # fmt: skip
    parser.add_argument("--cold", type=int, default=20, help="first hits timed (%(default)s)")
    parser.add_argument("--hits", type=int, default=40, help="timed hits per size (%(default)s)")
    parser.add_argument("--concurrent", type=_ints, default=[1, 4],
                        help="requests admitted at once (%(default)s)")  # fmt: skip
    parser.add_argument("--block-tokens", type=int, default=256,
                        help="tokens per stored block, a multiple of 16 (%(default)s)")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="the pool's device (%(default)s)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    if args.block_tokens < PAGE_TOKENS or args.block_tokens % PAGE_TOKENS:
        parser.error(f"--block-tokens must be a multiple of {PAGE_TOKENS}: {args.block_tokens}")
    geometry = Geometry(block_tokens=args.block_tokens)
    tokens = sorted(set(args.tokens))
    if min(tokens) < geometry.block_tokens or any(n % geometry.block_tokens for n in tokens):
        parser.error(f"--tokens must be multiples of {geometry.block_tokens}, got {tokens}")
    if min(args.cold, args.hits, *args.concurrent) < 1:
        parser.error("--cold, --hits and --concurrent must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run(geometry, tokens, args.cold, args.hits, args.concurrent,
                     torch.device(args.device))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    print(render(report.rows, report.concurrent, report.about), end="")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0


def run(
    geometry: Geometry,
    tokens: Sequence[int],
    cold: int,
    hits: int,
    concurrent: Sequence[int],
    device: torch.device,
) -> Report:
    """Every row of one run (see the module docstring)."""
    copies = max(concurrent)
    most = copies * max(tokens) + sum(tokens)
    host_bytes = 2 * most * geometry.token_bytes() + 64 * MIB
    with running_store(TierSetup("host", host_bytes=host_bytes)) as store:
        bench = HitBench(store, geometry, tokens, device, copies)
        progress(f"storing {len(bench.prompts)} prompts")
        bench.store_blocks()
        smallest = tokens[0]
        with bench.connector() as connector:
            progress(f"{cold} cold hits of {smallest} tokens")
            first = [bench.hits(connector, smallest, [0])[0] for _ in range(cold)]
            health = bench.health_ms(100)
            rows = [row("cold", smallest, first, bench.copy_ms(smallest, 20), health)]
            single: dict[int, float] = {}
            for n in tokens:
                progress(f"{hits} warm hits of {n} tokens")
                for _ in range(hits):  # warm-up
                    bench.hits(connector, n, [0])
                timed = [t for _ in range(hits) for t in bench.hits(connector, n, [0])]
                rows.append(row("warm", n, timed, bench.copy_ms(n, 20), health))
                single[n] = rows[-1].p50_ms
            together = [
                _concurrent(bench, connector, smallest, m, hits, single) for m in concurrent
            ]
        with bench.connector(session_calls=False) as connector:  # the control: over gRPC
            progress(f"{hits} warm hits of {smallest} tokens, the calls over gRPC")
            for _ in range(hits):  # warm-up
                bench.hits(connector, smallest, [0])
            timed = [t for _ in range(hits) for t in bench.hits(connector, smallest, [0])]
            copy = bench.copy_ms(smallest, 20)
            rows.append(row("warm, gRPC calls", smallest, timed, copy, health))
    about: dict[str, object] = {
        "device": str(device),
        "geometry": f"{geometry.num_layers} layers x {geometry.num_kv_heads} KV heads x "
        f"{geometry.head_dim} {geometry.dtype}",
        "block tokens": geometry.block_tokens,
        "page tokens": PAGE_TOKENS,
        "Health p50 ms": round(health, 3),
    }
    return Report(about, rows, together)


def _concurrent(
    bench: HitBench,
    connector: StoreConnector,
    n: int,
    m: int,
    repeats: int,
    single: dict[int, float],
) -> Concurrent:
    copies = list(range(m))
    for _ in range(3):  # warm-up
        bench.hits(connector, n, copies)
    cpu = daemon_cpu_seconds(bench.store.pid)
    batches = []
    for _ in range(repeats):
        timelines = bench.hits(connector, n, copies)
        batches.append(max(t.first_token for t in timelines) - min(t.arrived for t in timelines))
    cpu = daemon_cpu_seconds(bench.store.pid) - cpu
    batch = statistics.median(batches) * 1000
    return Concurrent(m, batch, batch / m, batch / m / single[n], 1000 * cpu / (m * repeats))


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
