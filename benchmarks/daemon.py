"""Daemon throughput and lookup latency beside limits measured in the same run.

    python -m benchmarks.daemon [--sizes 2MiB,32MiB] [--blocks N] [--rounds R]
                                [--lookups L] [--json out.json]

Starts a real daemon (``python -m kvstore serve --config <temp toml>``: a host tier sized for
the run, SSD and Redis off, a unix socket in a temporary directory) and, as a second child
process, the raw gRPC server of ``raw_grpc.py``. Then, with the real client, for every block
size ``N`` blocks of KV-like bytes (``torch.randn`` float16) are moved as one key chain per
call:

- shm (``AsyncKVStoreClient(use_shm=True)``, through an shm session): ``put`` (Reserve, copy
  into the arena slots held for the session and sum each as it lands, Commit with the sums:
  the daemon reads no byte), ``get`` into preallocated, pre-faulted ``out`` tensors
  (Acquire, copy out of the read-only arena, Release), the same ``get`` by a client made with
  ``verify=True`` (each block's xxh3-64 checked against the one recorded at commit), and
  ``view`` (Acquire, zero-copy views, Release; shown for information). Limit:
  ``torch.Tensor.copy_`` of the same blocks between preallocated tensors (block i into region
  i, region i into out i), the copy the client itself runs. The checksum alone (xxh3-64 of the
  blocks, one thread) is shown as an info row.
- stream (``use_shm=False``): the Put and Get streams, ``get`` into the same ``out`` tensors.
  Limit: the raw server on a unix socket, plain bytes messages (no protobuf) of the daemon's
  ``chunk_bytes`` under its ``max_message_bytes``: a sink the same blocks are streamed to (one
  ``bytes()`` per chunk, as any sender of user memory needs) and a source of pre-cut chunks,
  each copied into the same ``out`` tensors.
- lookup of a 128K-token chain (512 keys of 256-token blocks of a 1-layer, 1-head model: 8 KiB
  blocks, put first) when the whole chain is held and when its first key misses: p50 and p99
  of ``L`` calls. Limit: a raw unary echo of a request of the same size.

Each throughput row is the median of ``R`` timed rounds after one untimed warm-up round; a
round runs each op and its limit, alternating which goes first, 50 ms apart (torch's
intra-op threads stop spinning meanwhile). Only the calls are timed:
deleting the chain before a put and checking the bytes after a get run between them. Lookup
calls take turns (held, miss, echo), after a few untimed calls of each. The machine line
includes the load average before the run: other processes on the cores skew both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import torch
import uvloop

from kvstore.client import AsyncKVStoreClient, ModelFingerprint, Namespace, WriteStatus, block_keys
from kvstore.config import Config, load_config
from kvstore.launch import kvstore_command
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.blocks import payload_checksum

from .raw_grpc import RawClient, child, raw_server_command, serving
from .tiers import (
    GB,
    MIB,
    Row,
    Step,
    cells,
    default_blocks,
    expect,
    format_size,
    machine,
    positive,
    progress,
    run_rounds,
    sizes,
)

T = TypeVar("T")
Timed = Callable[[], Awaitable[float]]  # one call, checked after its clock stops -> seconds

TARGETS = {"shm": 0.5, "stream": 0.8}  # least op / limit throughput ratio, per data plane
LOOKUP_P99_MS = 1.0
QUIET_SECONDS = 0.05  # between timed calls (see paired)
LOOKUP_KEYS, LOOKUP_BLOCK_TOKENS = 512, 256  # a 128K-token chain
WARM_UP_CALLS = 20
KV_HEADS, HEAD_DIM = 8, 128  # Llama-3-8B-like heads: 4 KiB of float16 K+V per layer and token
TOKEN_BYTES = 32 * 2 * KV_HEADS * HEAD_DIM * 2  # ... and 128 KiB for its 32 layers


# The daemon ------------------------------------------------------------------------------


def daemon_config(socket: Path, arena_bytes: int) -> str:
    """A TOML config: host tier only, on a unix socket (sizes in MiB: the parser's units)."""
    return "\n".join(
        [
            "[host]",
            f'capacity = "{-(-arena_bytes // MIB)}MiB"',
            "[ssd]",
            "enabled = false",
            "[redis]",
            "enabled = false",
            "[server]",
            f"listen = [{json.dumps(f'unix:{socket}')}]",
            f'max_staging_bytes = "{-(-arena_bytes // MIB)}MiB"',
            "",
        ]
    )


# Blocks and timing -----------------------------------------------------------------------


def model_for(size: int) -> ModelFingerprint:
    """A model whose blocks are ``size`` bytes: Llama-3-8B-like (32 layers, 8 KV heads of 128,
    float16; 2 MiB = 16 tokens, 32 MiB = 256) when ``size`` is a multiple of 128 KiB, else one
    layer, one head and one token."""
    if size % TOKEN_BYTES == 0:
        return ModelFingerprint(
            "bench-llama", 32, KV_HEADS, HEAD_DIM, "float16", block_tokens=size // TOKEN_BYTES
        )
    return ModelFingerprint("bench-flat", 1, 1, size // 4, "float16", block_tokens=1)


@dataclass(frozen=True, slots=True)
class Chain:
    """``count`` blocks of one key chain, and where the limits copy them."""

    namespace: Namespace
    keys: list[bytes]
    blocks: torch.Tensor  # [count, size] uint8, KV-like values
    regions: torch.Tensor  # [count, size] uint8, pre-faulted: the memcpy limit's arena
    out: torch.Tensor  # [count, size] uint8, pre-faulted: every get lands here

    @classmethod
    def random(cls, model: ModelFingerprint, count: int, tenant: str = "bench") -> Chain:
        namespace = Namespace(model, tenant=tenant)
        size = model.layout().payload_bytes
        tokens = torch.randint(0, 1 << 31, (count * model.block_tokens,)).tolist()
        blocks = torch.randn(count, size // 2, dtype=torch.float16).view(torch.uint8)
        regions, out = torch.ones(count, size, dtype=torch.uint8), torch.ones_like(blocks)
        return cls(namespace, block_keys(tokens, namespace), blocks, regions, out)

    @property
    def size(self) -> int:
        return self.blocks.shape[1]

    @property
    def total_bytes(self) -> int:
        return self.blocks.numel()


async def clocked(call: Awaitable[T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = await call
    return result, time.perf_counter() - start


def paired(name: str, op: Timed, limit_name: str, limit: Timed) -> Step:
    """One round of an op and its limit; every other round runs the limit first. Each call
    starts ``QUIET_SECONDS`` after the one before: torch's intra-op threads spin for a few
    milliseconds after a parallel ``copy_`` (or ``torch.equal``), and an op started then
    runs on one core (this took a 64-block shm get from 6.2 to 3.0 GB/s)."""
    turns = itertools.count()

    async def quiet(run: Timed) -> float:
        await asyncio.sleep(QUIET_SECONDS)
        return await run()

    async def step() -> dict[str, float]:
        order = [(name, op), (limit_name, limit)]
        return {n: await quiet(run) for n, run in (order[::-1] if next(turns) % 2 else order)}

    return step


# Data-plane ops ----------------------------------------------------------------------------


def client_ops(client: AsyncKVStoreClient, chain: Chain) -> tuple[Timed, Timed]:
    """``put`` of the chain (deleted first) and ``get`` of it into ``chain.out``."""
    namespace, keys, count = chain.namespace, chain.keys, len(chain.keys)
    blocks, outs, plane = list(chain.blocks), list(chain.out), client.data_plane

    async def put() -> float:
        await client.delete(namespace, keys)
        statuses, spent = await clocked(client.put(namespace, keys, blocks))
        expect(statuses == [WriteStatus.STORED] * count, f"{plane} put: {statuses}")
        return spent

    async def get() -> float:
        chain.out.numpy().fill(0)  # on this thread: no torch threads left spinning meanwhile
        found, spent = await clocked(client.get(namespace, keys, out=outs))
        expect(len(found) == count, f"{plane} get found {len(found)} of {count} blocks")
        expect(torch.equal(chain.out, chain.blocks), f"{plane} get returned other bytes")
        return spent

    return put, get


def view_op(client: AsyncKVStoreClient, chain: Chain) -> Timed:
    """``view`` of the chain: Acquire, one zero-copy view per block, Release."""

    async def view() -> float:
        start = time.perf_counter()
        async with client.view(chain.namespace, chain.keys) as views:
            found = len(views)
        spent = time.perf_counter() - start
        expect(found == len(chain.keys), f"view found {found} of {len(chain.keys)} blocks")
        return spent

    return view


def memcpy_ops(chain: Chain) -> tuple[Timed, Timed]:
    """``copy_`` of block i into region i, and of region i into out i."""

    def copies(pairs: Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]) -> Timed:
        async def run() -> float:
            start = time.perf_counter()
            for dst, src in pairs():
                dst.copy_(src)
            return time.perf_counter() - start

        return run

    into = copies(lambda: zip(chain.regions, chain.blocks, strict=True))
    out_of = copies(lambda: zip(chain.out, chain.regions, strict=True))
    return into, out_of


def raw_ops(raw: RawClient, chain: Chain, chunk_bytes: int) -> tuple[Timed, Timed]:
    """The blocks' bytes streamed to the raw sink, and as many from the raw source into out."""
    sources = [block.numpy().data for block in chain.blocks]
    targets = [out.numpy().data for out in chain.out]

    async def put() -> float:
        total, spent = await clocked(raw.put(sources, chunk_bytes))
        expect(total == chain.total_bytes, "the raw sink lost bytes")
        return spent

    async def get() -> float:
        blocks, spent = await clocked(raw.get(targets, chunk_bytes))
        expect(blocks == len(targets), f"the raw source sent {blocks} of {len(targets)} blocks")
        return spent

    return put, get


def checksum_op(chain: Chain) -> Timed:
    """xxh3-64 of every block: what ``verify=True`` adds to a get."""

    async def run() -> float:
        start = time.perf_counter()
        for block in chain.blocks:
            payload_checksum(block.numpy().data)
        return time.perf_counter() - start

    return run


@dataclass(frozen=True, slots=True)
class Clients:
    shm: AsyncKVStoreClient
    verified: AsyncKVStoreClient
    stream: AsyncKVStoreClient
    raw: RawClient
    chunk_bytes: int


@dataclass(frozen=True, slots=True)
class Versus:
    """One row's op and its limit, before they are timed."""

    path: str
    op: str
    run: Timed
    limit_name: str
    limit: Timed
    target: float | None


async def bench_size(clients: Clients, chain: Chain, rounds: int) -> list[Row]:
    shm_put, shm_get = client_ops(clients.shm, chain)
    _, verified_get = client_ops(clients.verified, chain)
    stream_put, stream_get = client_ops(clients.stream, chain)
    raw_put, raw_get = raw_ops(clients.raw, chain, clients.chunk_bytes)
    copy_in, copy_out = memcpy_ops(chain)
    memcpy = "torch copy_ into N buffers"
    grpc_raw = f"grpc.aio bytes stream, {format_size(clients.chunk_bytes)} chunks"
    shm, stream = TARGETS["shm"], TARGETS["stream"]
    pairs = [
        Versus("shm", "put", shm_put, memcpy, copy_in, shm),
        Versus("shm", "get (out=)", shm_get, memcpy, copy_out, shm),
        Versus("shm", "get (out=, verify)", verified_get, memcpy, copy_out, None),
        Versus("shm", "view (zero-copy)", view_op(clients.shm, chain), memcpy, copy_out, None),
        Versus("-", "xxh3-64 of the blocks", checksum_op(chain), memcpy, copy_out, None),
        Versus("stream", "put", stream_put, grpc_raw, raw_put, stream),
        Versus("stream", "get (out=)", stream_get, grpc_raw, raw_get, stream),
    ]
    steps = [paired(f"op {i}", v.run, f"limit {i}", v.limit) for i, v in enumerate(pairs)]
    timed = (await run_rounds(rounds, steps)).rounds
    return [
        Row(v.path, v.op, chain.size, len(chain.keys), rate(chain, timed[f"op {i}"]),
            rate(chain, timed[f"limit {i}"]), v.limit_name, v.target)
        for i, v in enumerate(pairs)
    ]  # fmt: skip


def rate(chain: Chain, seconds: Sequence[float]) -> float:
    return chain.total_bytes / statistics.median(seconds) / GB


# Lookup latency --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Latency:
    """Percentiles of one control-plane call beside a raw echo of the same request size."""

    op: str
    keys: int
    calls: int
    p50_ms: float
    p99_ms: float
    limit_p50_ms: float
    limit_p99_ms: float
    limit_name: str
    target_p99_ms: float

    @property
    def verdict(self) -> str:
        return "pass" if self.p99_ms < self.target_p99_ms else "fail"


async def bench_lookups(clients: Clients, calls: int) -> list[Latency]:
    model = ModelFingerprint("bench-lookup", 1, 1, 8, "float16", block_tokens=LOOKUP_BLOCK_TOKENS)
    chain = Chain.random(model, LOOKUP_KEYS)
    other = Chain.random(model, LOOKUP_KEYS)  # same namespace, other tokens: misses at key 0
    client, namespace = clients.shm, chain.namespace
    statuses = await client.put(namespace, chain.keys, list(chain.blocks))
    expect(statuses == [WriteStatus.STORED] * LOOKUP_KEYS, f"lookup chain put: {statuses}")
    request = pb.LookupRequest(namespace=namespace.digest(), keys=chain.keys).SerializeToString()

    def lookup(keys: list[bytes], expected: int) -> Timed:
        async def call() -> float:
            found, spent = await clocked(client.lookup(namespace, keys))
            expect(found == expected, f"lookup found {found}, expected {expected}")
            return spent

        return call

    async def echo() -> float:
        reply, spent = await clocked(clients.raw.echo(request))
        expect(len(reply) == len(request), "the raw echo lost bytes")
        return spent

    ops = {"chain held": lookup(chain.keys, LOOKUP_KEYS), "miss": lookup(other.keys, 0)}
    with progress(f"lookup x {calls}"):
        seconds = await taking_turns({**ops, "echo": echo}, calls)
    await client.delete(namespace, chain.keys)
    echo_name = f"grpc.aio unary echo, {format_size(len(request))}"
    limit = percentiles_ms(seconds["echo"])
    return [
        Latency(f"lookup ({name})", LOOKUP_KEYS, calls, *percentiles_ms(seconds[name]), *limit,
                echo_name, LOOKUP_P99_MS)
        for name in ops
    ]  # fmt: skip


async def taking_turns(ops: dict[str, Timed], calls: int) -> dict[str, list[float]]:
    """Seconds of ``calls`` calls of each op, one of each in turn, after a few untimed ones."""
    seconds: dict[str, list[float]] = {name: [] for name in ops}
    for turn in range(WARM_UP_CALLS + calls):
        for name, op in ops.items():
            spent = await op()
            if turn >= WARM_UP_CALLS:
                seconds[name].append(spent)
    return seconds


def percentiles_ms(seconds: Sequence[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return cuts[49] * 1e3, cuts[98] * 1e3


# Running and reporting -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Daemon:
    """A started ``kvstore serve`` child process, on a unix socket, perhaps not serving yet."""

    address: str
    proc: asyncio.subprocess.Process
    log: Path
    config: Config

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def serving(self) -> None:
        """Waits until the daemon serves (opens a channel: start other children first)."""
        await serving(self.proc, self.address, self.log)


@contextlib.asynccontextmanager
async def started_daemon(scratch: Path, arena_bytes: int) -> AsyncIterator[Daemon]:
    """Starts the daemon (an ``arena_bytes`` host tier, config ``daemon_config``) on a unix
    socket in ``scratch``; stops it on exit. Does not wait for it to serve: a caller starts
    its other children first (gRPC warns of forks after a channel is open), then awaits
    :meth:`Daemon.serving`."""
    config, sock, log = (scratch / name for name in ("kvstore.toml", "kvstore.sock", "daemon.log"))
    config.write_text(daemon_config(sock, arena_bytes))
    serve = kvstore_command("serve", "--config", str(config), "--log-level", "warning")
    async with child(serve, log) as proc:
        yield Daemon(f"unix:{sock}", proc, log, load_config(config))


@dataclass(frozen=True, slots=True)
class Servers:
    """The daemon and the raw server, serving: their addresses and the message-size limit."""

    daemon: str
    raw: str
    max_message_bytes: int


@contextlib.asynccontextmanager
async def servers(scratch: Path, arena_bytes: int) -> AsyncIterator[Servers]:
    """Starts the daemon (an ``arena_bytes`` host tier) and the raw server on unix sockets
    in ``scratch``, waits until both serve, and stops them on exit."""
    raw_sock, raw_log = scratch / "raw.sock", scratch / "raw.log"
    async with started_daemon(scratch, arena_bytes) as up:
        limit = up.config.server.max_message_bytes
        raw_server = raw_server_command(f"unix:{raw_sock}", limit)
        # Both children start before this process opens a channel: gRPC warns of forks after.
        async with child(raw_server, raw_log) as raw_server_proc:
            await up.serving()
            await serving(raw_server_proc, f"unix:{raw_sock}", raw_log)
            yield Servers(up.address, f"unix:{raw_sock}", limit)


async def bench_all(args: argparse.Namespace, scratch: Path) -> tuple[list[Row], list[Latency]]:
    counts = {size: args.blocks or default_blocks(size) for size in args.sizes}
    arena_bytes = 2 * max(size * count for size, count in counts.items()) + 64 * MIB
    async with servers(scratch, arena_bytes) as up:
        staging = arena_bytes // 2
        async with (
            AsyncKVStoreClient(up.daemon, timeout=60, staging_bytes=staging) as shm,
            AsyncKVStoreClient(up.daemon, timeout=60, verify=True) as verified,
            AsyncKVStoreClient(up.daemon, use_shm=False, timeout=60) as stream,
        ):
            expect(shm.data_plane == "shm", "the client has no shm session")
            raw = RawClient(up.raw, up.max_message_bytes)
            try:
                chunk = shm.server_info.chunk_bytes
                clients = Clients(shm, verified, stream, raw, chunk)
                rows = await bench_sizes(clients, counts, args.rounds)
                return rows, await bench_lookups(clients, args.lookups)
            finally:
                await raw.channel.close()


async def bench_sizes(clients: Clients, counts: dict[int, int], rounds: int) -> list[Row]:
    rows: list[Row] = []
    for size, count in counts.items():
        with progress(f"{format_size(size)} x {count}"):
            chain = Chain.random(model_for(size), count)
            rows += await bench_size(clients, chain, rounds)
            await clients.shm.delete(chain.namespace, chain.keys)
    return rows


def table(
    header: Sequence[str], body: Sequence[Sequence[str]], numeric: Collection[str] = ()
) -> list[str]:
    """A markdown table with padded columns; numeric columns (``NUMERIC`` and ``numeric``)
    align right."""
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    right = [name in NUMERIC or name in numeric for name in header]
    rule = ["-" * (w - 1) + (":" if r else "-") for w, r in zip(widths, right, strict=True)]

    def line(values: Sequence[str]) -> str:
        cols = zip(values, widths, right, strict=True)
        return "| " + " | ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in cols) + " |"

    return [line(values) for values in [header, rule, *body]]


THROUGHPUT = ("path", "op", "block size", "blocks", "GB/s", "limit GB/s", "limit name", "ratio",
              "us/block beyond", "target", "pass/fail")  # fmt: skip
LATENCY = ("op", "keys", "calls", "p50 ms", "p99 ms", "limit p50 ms", "limit p99 ms",
           "limit name", "target", "pass/fail")  # fmt: skip
NUMERIC = {"blocks", "GB/s", "limit GB/s", "ratio", "us/block beyond", "target", "keys", "calls",
           "p50 ms", "p99 ms", "limit p50 ms", "limit p99 ms"}  # fmt: skip


def throughput_cells(row: Row) -> tuple[str, ...]:
    """``cells`` with the microseconds per block beyond the limit after the ratio."""
    common = cells(row)
    return (*common[:8], f"{row.us_beyond_limit:.1f}", *common[8:])


def latency_cells(row: Latency) -> tuple[str, ...]:
    numbers = (row.p50_ms, row.p99_ms, row.limit_p50_ms, row.limit_p99_ms)
    return (row.op, str(row.keys), str(row.calls), *(f"{n:.3f}" for n in numbers),
            row.limit_name, f"p99 < {row.target_p99_ms:g} ms", row.verdict)  # fmt: skip


def render(rows: Sequence[Row], latencies: Sequence[Latency], about: dict[str, str]) -> str:
    return "\n".join(
        [
            "machine: " + ", ".join(f"{key} {value}" for key, value in about.items()),
            "method: median of timed rounds after 1 warm-up round, one call per chain of N"
            " blocks; GB/s = 1e9 bytes/s",
            "",
            *table(THROUGHPUT, [throughput_cells(row) for row in rows]),
            "",
            *table(LATENCY, [latency_cells(row) for row in latencies]),
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Daemon throughput beside memcpy and raw gRPC; lookup latency."
    )
    parser.add_argument("--sizes", default="2MiB,32MiB", type=sizes, help="default %(default)s")
    parser.add_argument("--blocks", type=positive, help="per size (default: 512 MiB, 16..64)")
    parser.add_argument("--rounds", type=positive, default=5, help="timed rounds (default 5)")
    parser.add_argument("--lookups", type=positive, default=500, help="calls (default 500)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if odd := [size for size in args.sizes if size % 4]:
        parser.error(f"block sizes must be multiples of 4 bytes, got {odd}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    about = {key: value for key, value in machine().items() if key != "redis"}
    about |= {"grpc": grpc.__version__, "load avg": f"{os.getloadavg()[0]:.2f}"}
    scratch = Path(tempfile.mkdtemp(prefix="kvs-bench-"))  # short: a unix socket path
    try:
        rows, latencies = uvloop.run(bench_all(args, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(render(rows, latencies, about))
    if args.json:
        report = {
            "machine": about,
            "rounds": args.rounds,
            "rows": [as_json(row) for row in rows],
            "latencies": [{**asdict(row), "pass_fail": row.verdict} for row in latencies],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def as_json(row: Row) -> dict[str, object]:
    fields = asdict(row)
    return {"path": fields.pop("tier"), **fields, "ratio": row.ratio,
            "us_per_block_beyond_limit": row.us_beyond_limit, "pass_fail": row.verdict}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
