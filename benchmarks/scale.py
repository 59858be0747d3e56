"""The store at scale: evicting puts, lookups during eviction, stats, index memory per block,
many clients of one daemon, and LMCache's CPU backend beside kvstore.

    python -m benchmarks.scale [--sizes 2000,20000] [--chain 16,512] [--puts 2000]
                               [--lookups 200] [--block-bytes 4096] [--clients 1,4,16]
                               [--client-mb 32] [--rounds 5] [--lmcache-python PATH]
                               [--lmcache-mb 512] [--sections eviction,memory,clients,lmcache]
                               [--json FILE]

Sections, each printed as a table, in this order:

- eviction (the first table): each size is a host-only ``BlockStore`` whose tier holds
  exactly that many ``--block-bytes`` blocks, filled with chains of ``--chain`` keys, then:
  ``--puts`` more blocks (new chains of the same length) into the full tier, each one
  evicting, against the same number of puts into a tier with room for them (the limit: the
  same code without eviction, measured in the same run); ``--lookups`` lookups of a held
  512-key chain (p50, p99) while another task runs evicting puts, against the same lookups
  on the idle store; ``store.stats()`` latency (p50 of 200 calls) with the tier full.
- memory: the largest size filled again (each chain length, in a fresh interpreter each),
  measured twice: the growth of the process's anonymous resident memory (``RssAnon``; the
  payloads live in the tier's memfd arena, counted apart as ``RssShmem``) and, in a second
  fill under ``tracemalloc``, the Python allocations the store holds, by the file that made
  them. Both per block held. Then the cost of one full garbage collection: of the process
  with its modules loaded and an empty store, and with the store full after the start-up
  objects were frozen out of collections as the daemon does (``collector.freeze``), beside
  the objects the collector tracks per block.
- clients: a real daemon (as ``daemon.py`` starts it: host tier only, a unix socket) and
  1, 4 and 16 (``--clients``) clients of it at once in this process, each with its own
  connection, shm session and chain of ``--client-mb`` MiB in 2 MiB blocks: the aggregate
  GB/s of their puts and of their gets into preallocated tensors, over shared memory and
  streamed, each beside the same path with one client. One client's streams also run beside
  ``raw_grpc.py``'s grpc.aio bytes streams of the same chunks (the limit of ``daemon.py``).
- lmcache: LMCache's own engine storing and retrieving ``--lmcache-mb`` MiB in its CPU
  backend (``lmcache_row.py``, run by the Python of a venv that holds LMCache), beside
  kvstore's in-process ``BlockStore`` put and get of the same bytes in the same 32 MiB
  blocks, and the one-client shm figures of the clients section. Without that venv the row
  is skipped with a line that says how to make it.

Everything but the daemon (and the memory section's child) runs on one uvloop event loop, as
in the daemon. Only calls are
timed; the bytes read back are checked between them. There are no targets for the eviction
and memory tables yet: they are the baseline of issue 12. The clients table carries the
issue's goals (16 shm clients >= 1.0x one client; streams >= 0.9x raw gRPC) as pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy
import torch
import uvloop

from kvstore.client import AsyncKVStoreClient, WriteStatus
from kvstore.defaults import tune_allocator
from kvstore.index import BlockMeta
from kvstore.policies import eviction_policy, write_policy
from kvstore.store import Block, BlockStore, StoreTier
from kvstore.tiers import collector
from kvstore.tiers.host import HostTier
from kvstore.wire.blocks import BlockLayout

from .daemon import Chain, Timed, clocked, model_for, paired, percentiles_ms, raw_ops, servers
from .raw_grpc import RawClient
from .tiers import GB, MIB, Step, expect, progress, run_rounds

HERE = Path(__file__).resolve().parent
NAMESPACE = b"s" * 32
ROOT = b"\0" * 32
SECTIONS = ("eviction", "memory", "clients", "lmcache")


# Blocks and stores ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """The blocks of a run: ``size`` bytes each (one layer, one KV head, 16 float16 tokens),
    the meta every put names, one random payload, and the host tier's allocation granule
    (the block size rounded up to a power of two, 4 KiB at most: a 256-byte block takes 256
    bytes of arena, not a page)."""

    size: int
    meta: BlockMeta
    payload: bytes
    page_bytes: int

    @classmethod
    def of(cls, size: int) -> Shape:
        layout = BlockLayout(num_layers=1, num_kv_heads=1, block_tokens=16, head_dim=size // 64,
                             dtype="float16")  # fmt: skip
        page = min(4096, 1 << (size - 1).bit_length())
        return cls(size, BlockMeta(NAMESPACE, 16, layout), os.urandom(size), page)

    @property
    def slot_bytes(self) -> int:
        return -(-self.size // self.page_bytes) * self.page_bytes


def host_store(capacity: int, page_bytes: int) -> BlockStore:
    """A host-only store (LRU, evicting only when full, no background maintenance)."""
    tier = StoreTier(HostTier(capacity, page_bytes=page_bytes), None,
                     write_policy("write_through", 1))  # fmt: skip
    return BlockStore(
        [tier],
        eviction=eviction_policy("lru"),
        high_watermark=1.0,
        low_watermark=1.0,
        maintenance_interval=3600.0,
    )


def store_of(shape: Shape, blocks: int) -> BlockStore:
    """A store whose tier holds exactly ``blocks`` blocks of ``shape``."""
    return host_store(blocks * shape.slot_bytes, shape.page_bytes)


def key_of(tag: bytes, index: int) -> bytes:
    return tag + index.to_bytes(8, "big") + b"\0" * (32 - len(tag) - 8)


async def put_chains(
    store: BlockStore, shape: Shape, blocks: int, chain: int, tag: bytes
) -> list[list[bytes]]:
    """Puts ``blocks`` blocks as chains of ``chain`` keys; returns the chains' keys."""
    chains: list[list[bytes]] = []
    for start in range(0, blocks, chain):
        parent, keys = ROOT, []
        for index in range(start, min(start + chain, blocks)):
            key = key_of(tag, index)
            await store.put(key, parent, shape.meta, shape.payload)
            keys.append(key)
            parent = key
        chains.append(keys)
    return chains


# Eviction, lookups and stats -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    blocks: int
    chain: int
    put_us: float  # mean, evicting
    limit_put_us: float  # mean, with room
    ratio: float
    worst_put_ms: float
    lookup_p50_ms: float
    lookup_p99_ms: float
    idle_lookup_p50_ms: float
    idle_lookup_p99_ms: float
    stats_p50_ms: float


async def timed_puts(
    store: BlockStore, shape: Shape, count: int, chain: int, tag: bytes
) -> list[float]:
    seconds: list[float] = []
    for start in range(0, count, chain):
        parent = ROOT
        for index in range(start, min(start + chain, count)):
            key = key_of(tag, index)
            began = time.perf_counter()
            await store.put(key, parent, shape.meta, shape.payload)
            seconds.append(time.perf_counter() - began)
            parent = key
    return seconds


async def lookup_latencies(store: BlockStore, keys: Sequence[bytes], calls: int) -> list[float]:
    """Each lookup's time from the moment it is asked for, through whatever else the loop
    runs first (a put evicting), to its answer: what a client's call sees of a stall."""
    seconds: list[float] = []
    for _ in range(calls):
        began = time.perf_counter()
        await asyncio.sleep(0)  # the request waits its turn on the loop
        await store.lookup(keys, NAMESPACE)
        seconds.append(time.perf_counter() - began)
    return seconds


async def bench(shape: Shape, blocks: int, chain: int, puts: int, lookups: int) -> Row:
    async with store_of(shape, blocks + puts) as roomy:  # the limit: the same puts, no eviction
        roomy.register_namespace(NAMESPACE, "t")
        await put_chains(roomy, shape, blocks, chain, b"A")
        gc.collect()  # each timed phase starts with no full collection due (see memory_row)
        limit = await timed_puts(roomy, shape, puts, chain, b"B")
    async with store_of(shape, blocks) as full:
        full.register_namespace(NAMESPACE, "t")
        await put_chains(full, shape, blocks, chain, b"A")
        gc.collect()
        evicting = await timed_puts(full, shape, puts, chain, b"C")
        # The newest chain, 512 keys (or all of it), is held: look it up.
        probe_keys = min(512, blocks // 4)
        probe = (await put_chains(full, shape, probe_keys, probe_keys, b"P"))[0]
        gc.collect()
        idle = await lookup_latencies(full, probe, lookups)
        churn = asyncio.create_task(timed_puts(full, shape, 10**9, chain, b"D"))
        try:
            busy = await lookup_latencies(full, probe, lookups)
        finally:
            churn.cancel()
            await asyncio.gather(churn, return_exceptions=True)
        stats = []
        for _ in range(200):
            began = time.perf_counter()
            full.stats()
            stats.append(time.perf_counter() - began)
    put_us, limit_us = statistics.fmean(evicting) * 1e6, statistics.fmean(limit) * 1e6
    (busy_p50, busy_p99), (idle_p50, idle_p99) = percentiles_ms(busy), percentiles_ms(idle)
    return Row(
        blocks=blocks,
        chain=chain,
        put_us=put_us,
        limit_put_us=limit_us,
        ratio=put_us / limit_us,
        worst_put_ms=max(evicting) * 1e3,
        lookup_p50_ms=busy_p50,
        lookup_p99_ms=busy_p99,
        idle_lookup_p50_ms=idle_p50,
        idle_lookup_p99_ms=idle_p99,
        stats_p50_ms=percentiles_ms(stats)[0],
    )


def markdown(header: Sequence[str], body: Sequence[Sequence[str]], text: Sequence[str] = ()) -> str:
    """A markdown table: the columns named in ``text`` align left, the others right."""
    rule = "|" + "|".join("---" if name in text else "---:" for name in header) + "|"
    lines = ["| " + " | ".join(cells) + " |" for cells in [header, *body]]
    return "\n".join([lines[0], rule, *lines[1:]])


def eviction_table(rows: Sequence[Row]) -> str:
    header = ("blocks", "chain", "evicting put us", "put with room us (limit)", "ratio",
              "worst put ms", "lookup p50/p99 ms while evicting", "idle lookup p50/p99 ms",
              "stats p50 ms")  # fmt: skip
    body = [
        (str(r.blocks), str(r.chain), f"{r.put_us:.0f}", f"{r.limit_put_us:.0f}",
         f"{r.ratio:.1f}x", f"{r.worst_put_ms:.1f}", f"{r.lookup_p50_ms:.2f} / "
         f"{r.lookup_p99_ms:.2f}", f"{r.idle_lookup_p50_ms:.2f} / {r.idle_lookup_p99_ms:.2f}",
         f"{r.stats_p50_ms:.3f}")
        for r in rows
    ]  # fmt: skip
    return markdown(header, body)


# Index memory per block ----------------------------------------------------------------------

# Where the store's Python allocations come from, by the file that made them.
PARTS = {"kvstore/index.py": "index", "kvstore/policies.py": "policy", "<string>": "node fields",
         "kvstore/tiering.py": "placement", "kvstore/store.py": "store", "tiers/": "host tier",
         "benchmarks/": "keys", "asyncio/": "asyncio (recycled)"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class MemoryRow:
    """Memory the store holds per block beyond the payload, the tier full."""

    blocks: int
    chain: int
    block_bytes: int
    rss_anon_per_block: float | None  # RssAnon growth (None: no /proc)
    arena_per_block: float | None  # RssShmem growth: the payloads, in the memfd arena
    traced_per_block: float  # tracemalloc: live Python allocations the store made
    parts: dict[str, float]  # traced bytes per block, by PARTS (then "other")
    gc_objects_per_block: float  # objects the cyclic garbage collector tracks
    gc_empty_ms: float  # one full collection (gc.collect()), the store empty, median of 3
    gc_full_ms: float  # ... the store full, start-up objects frozen (as in the daemon)


def resident() -> dict[str, int]:
    """``RssAnon`` and ``RssShmem`` of this process in bytes (empty where /proc has none)."""
    gc.collect()
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        fields = (line.split() for line in status if line.startswith(("RssAnon", "RssShmem")))
        return {name.rstrip(":"): int(kib) * 1024 for name, kib, *_ in fields}
    return {}


def part_of(filename: str) -> str:
    name = filename.replace(os.sep, "/")
    return next((part for where, part in PARTS.items() if where in name), "other")


async def held(shape: Shape, blocks: int, chain: int) -> BlockStore:
    """A started store of ``blocks`` blocks, full (the caller closes it)."""
    store = store_of(shape, blocks)
    await store.start()
    store.register_namespace(NAMESPACE, "t")
    await put_chains(store, shape, blocks, chain, b"M")  # the keys are the store's alone
    gc.collect()
    return store


def full_collection() -> tuple[float, int]:
    """Milliseconds of a full ``gc.collect()`` (median of 3), and the objects it tracks."""
    seconds = []
    for _ in range(3):
        began = time.perf_counter()
        gc.collect()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds) * 1e3, len(gc.get_objects())


async def memory_row(shape: Shape, blocks: int, chain: int) -> MemoryRow:
    """The store of ``blocks`` blocks filled twice: RSS and full collections first, then
    under tracemalloc."""
    empty_ms, _ = full_collection()
    collector.freeze()  # as the daemon does once its store has started
    (_, empty_objects), before = full_collection(), resident()
    store = await held(shape, blocks, chain)
    after, (full_ms, full_objects) = resident(), full_collection()
    await store.aclose()
    gc.unfreeze()
    del store
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.take_snapshot()
        store = await held(shape, blocks, chain)
        diff = tracemalloc.take_snapshot().compare_to(start, "filename")
    finally:
        tracemalloc.stop()
    await store.aclose()
    parts: Counter[str] = Counter()
    for stat in diff:
        parts[part_of(stat.traceback[0].filename)] += stat.size_diff / blocks

    def grew(name: str) -> float | None:
        return (after[name] - before[name]) / blocks if name in before else None

    return MemoryRow(blocks, chain, shape.size, grew("RssAnon"), grew("RssShmem"),
                     sum(parts.values()), dict(parts.most_common()),
                     (full_objects - empty_objects) / blocks, empty_ms, full_ms)  # fmt: skip


def memory_in_child(block_bytes: int, blocks: int, chain: int) -> MemoryRow:
    """``memory_row`` in a fresh interpreter, whose heap has not grown and shrunk before (a
    fill after another reuses the freed memory unseen by RSS)."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return MemoryRow(**pool.submit(child_memory, block_bytes, blocks, chain).result())


def child_memory(block_bytes: int, blocks: int, chain: int) -> dict[str, object]:
    tune_allocator()  # as in the parent (and the daemon)
    return asdict(uvloop.run(memory_row(Shape.of(block_bytes), blocks, chain)))


def memory_table(rows: Sequence[MemoryRow]) -> str:
    header = ("blocks", "chain", "block bytes", "RssAnon B/block", "arena B/block (payload)",
              "traced B/block", "gc objects/block", "full gc ms, empty / full (frozen start)",
              "traced by part, B/block")  # fmt: skip

    def opt(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    def parts(row: MemoryRow) -> str:
        return ", ".join(f"{part} {size:.0f}" for part, size in row.parts.items() if size >= 1)

    body = [
        (str(r.blocks), str(r.chain), str(r.block_bytes), opt(r.rss_anon_per_block),
         opt(r.arena_per_block), f"{r.traced_per_block:.0f}", f"{r.gc_objects_per_block:.1f}",
         f"{r.gc_empty_ms:.0f} / {r.gc_full_ms:.0f}", parts(r))
        for r in rows
    ]  # fmt: skip
    return markdown(header, body, text=header[-1:])


# Many clients of one daemon ------------------------------------------------------------------

CLIENT_BLOCK = 2 * MIB  # Llama-3-8B-like blocks of 16 tokens, as daemon.py's first size
STAGING_BYTES = 64 * MIB  # per shm client: two 32 MiB put batches in flight
GOALS = {"shm": 1.0, "stream": 0.9}  # least x 1 client (shm), least x raw gRPC (stream)


@dataclass(frozen=True, slots=True)
class ClientRow:
    """The aggregate throughput of ``clients`` clients at once on one path."""

    path: str  # shm, stream, or raw gRPC
    op: str
    clients: int
    client_bytes: int
    gbps: float
    one_client_gbps: float  # the same path and op with one client, in the same rounds
    raw_gbps: float | None  # one client's raw grpc.aio stream of the same op (stream rows)

    @property
    def scaling(self) -> float:
        return self.gbps / self.one_client_gbps

    @property
    def vs_raw(self) -> float | None:
        return None if self.raw_gbps is None else self.gbps / self.raw_gbps

    @property
    def verdict(self) -> str:
        if self.path == "shm" and self.clients > 1:
            return "pass" if self.scaling >= GOALS["shm"] else "fail"
        if self.path == "stream" and self.vs_raw is not None:
            return "pass" if self.vs_raw >= GOALS["stream"] else "fail"
        return "info"


def at_once(clients: Sequence[AsyncKVStoreClient], chains: Sequence[Chain]) -> tuple[Timed, Timed]:
    """Every client's ``put`` of its chain (deleted first) and ``get`` of it into its ``out``,
    all at once: each returns the seconds from the calls to the last answer."""
    pairs = list(zip(clients, chains, strict=True))
    blocks = {id(chain): list(chain.blocks) for chain in chains}
    outs = {id(chain): list(chain.out) for chain in chains}
    what = f"{clients[0].data_plane} x {len(pairs)}"

    async def put() -> float:
        await asyncio.gather(*(client.delete(c.namespace, c.keys) for client, c in pairs))
        calls = [client.put(c.namespace, c.keys, blocks[id(c)]) for client, c in pairs]
        statuses, spent = await clocked(asyncio.gather(*calls))
        stored = [status == WriteStatus.STORED for batch in statuses for status in batch]
        expect(all(stored) and len(stored) == sum(len(c.keys) for c in chains), f"{what}: put")
        return spent

    async def get() -> float:
        for chain in chains:
            chain.out.zero_()
        calls = [client.get(c.namespace, c.keys, out=outs[id(c)]) for client, c in pairs]
        found, spent = await clocked(asyncio.gather(*calls))
        expect([len(f) for f in found] == [len(c.keys) for c in chains], f"{what}: get missed")
        expect(all(torch.equal(c.out, c.blocks) for c in chains), f"{what}: got other bytes")
        return spent

    return put, get


def alone(name: str, op: Timed) -> Step:
    """One round of ``op`` alone."""

    async def step() -> dict[str, float]:
        return {name: await op()}

    return step


async def connected(
    stack: contextlib.AsyncExitStack, address: str, count: int
) -> tuple[list[AsyncKVStoreClient], list[AsyncKVStoreClient]]:
    """``count`` shm clients and ``count`` streaming clients, each with its own connection."""
    shm, stream = [], []
    for _ in range(count):
        client = AsyncKVStoreClient(address, timeout=60, staging_bytes=STAGING_BYTES)
        shm.append(await stack.enter_async_context(client))
        expect(client.data_plane == "shm", "a client has no shm session")
        client = AsyncKVStoreClient(address, use_shm=False, timeout=60)
        stream.append(await stack.enter_async_context(client))
    return shm, stream


async def bench_clients(counts: Sequence[int], client_bytes: int, rounds: int) -> list[ClientRow]:
    block = min(CLIENT_BLOCK, client_bytes)
    most, client_bytes = max(counts), client_bytes // block * block
    chains = [Chain.random(model_for(block), client_bytes // block) for _ in range(most)]
    scratch = Path(tempfile.mkdtemp(prefix="kvs-scale-"))  # short: a unix socket path
    arena_bytes = 2 * most * client_bytes + 64 * MIB
    try:
        async with servers(scratch, arena_bytes) as up, contextlib.AsyncExitStack() as stack:
            shm, stream = await connected(stack, up.daemon, most)
            raw = RawClient(up.raw, up.max_message_bytes)
            stack.push_async_callback(raw.channel.close)
            raw_put, raw_get = raw_ops(raw, chains[0], shm[0].server_info.chunk_bytes)
            steps: list[Step] = []
            for n in counts:
                shm_put, shm_get = at_once(shm[:n], chains[:n])
                stream_put, stream_get = at_once(stream[:n], chains[:n])
                steps += [alone(f"shm put {n}", shm_put), alone(f"shm get {n}", shm_get)]
                if n == 1:  # one client's streams beside the raw streams, in turns
                    steps += [paired("stream put 1", stream_put, "raw put", raw_put)]
                    steps += [paired("stream get 1", stream_get, "raw get", raw_get)]
                else:
                    steps += [alone(f"stream put {n}", stream_put)]
                    steps += [alone(f"stream get {n}", stream_get)]
            timed = (await run_rounds(rounds, steps)).rounds
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return client_rows(timed, counts, client_bytes)


def client_rows(
    timed: dict[str, list[float]], counts: Sequence[int], client_bytes: int
) -> list[ClientRow]:
    def gbps(name: str, n: int) -> float:
        return n * client_bytes / statistics.median(timed[name]) / GB

    rows = []
    for path in ("shm", "stream"):
        for verb, op in (("put", "put"), ("get", "get (out=)")):
            raw = gbps(f"raw {verb}", 1) if path == "stream" else None
            if raw is not None:
                rows.append(ClientRow("raw gRPC", op, 1, client_bytes, raw, raw, None))
            one = gbps(f"{path} {verb} 1", 1)
            rows += [ClientRow(path, op, n, client_bytes, gbps(f"{path} {verb} {n}", n), one,
                               raw) for n in counts]  # fmt: skip
    return rows


def clients_table(rows: Sequence[ClientRow]) -> str:
    header = ("path", "op", "clients", "MiB each", "aggregate GB/s", "x 1 client",
              "raw gRPC GB/s (1 client)", "x raw", "goal", "pass/fail")  # fmt: skip

    def goal(row: ClientRow) -> str:
        if row.path == "shm" and row.clients > 1:
            return f">= {GOALS['shm']:g}x 1 client"
        return f">= {GOALS['stream']:g}x raw" if row.vs_raw is not None else "-"

    body = [
        (r.path, r.op, str(r.clients), f"{r.client_bytes / MIB:g}", f"{r.gbps:.2f}",
         f"{r.scaling:.2f}x", "-" if r.raw_gbps is None else f"{r.raw_gbps:.2f}",
         "-" if r.vs_raw is None else f"{r.vs_raw:.2f}x", goal(r), r.verdict)
        for r in rows
    ]  # fmt: skip
    return markdown(header, body, text=("path", "op", "goal", "pass/fail"))


# LMCache beside kvstore ----------------------------------------------------------------------

LMCACHE_VENV = HERE.parent / "build" / "lmcache-venv" / "bin" / "python"
LMCACHE_SETUP = ("python -m venv build/lmcache-venv && build/lmcache-venv/bin/pip install "
                 "lmcache==0.5.6 torch==2.13.0")  # fmt: skip
LMCACHE_LAYOUT = BlockLayout(num_layers=32, num_kv_heads=8, block_tokens=256, head_dim=128,
                             dtype="float16")  # fmt: skip  # lmcache_row.py's 32 MiB chunk


@dataclass(frozen=True, slots=True)
class StoreRow:
    """One system storing and reading back the same KV bytes."""

    system: str
    path: str
    total_bytes: int
    block_bytes: int
    store_gbps: float
    retrieve_gbps: float


def lmcache_python(chosen: str | None) -> Path | None:
    """The flag, else ``KVSTORE_LMCACHE_PYTHON``, else the venv under build/ if it exists."""
    chosen = chosen or os.environ.get("KVSTORE_LMCACHE_PYTHON")
    if chosen:
        return Path(chosen)
    return LMCACHE_VENV if LMCACHE_VENV.exists() else None


def lmcache_row(python: Path | None, mib: int, rounds: int) -> tuple[StoreRow | None, str]:
    """LMCache's figures from ``lmcache_row.py`` run by ``python``; or None and why not."""
    if python is None:
        return None, f"LMCache row skipped: no venv; make one with `{LMCACHE_SETUP}`"
    command = [str(python), "-P", str(HERE / "lmcache_row.py"), "--mib", str(mib)]
    command += ["--rounds", str(rounds)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONHASHSEED": "0"})  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"LMCache row skipped: {python}: {error}"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"LMCache row skipped: {python} exited {done.returncode}: {tail}"
    got = json.loads(lines[-1])
    path = f"engine store / retrieve, CPU backend, {got['threads']} copy thread"
    system, sizes = f"LMCache {got['lmcache']}", (got["bytes"], got["chunk_bytes"])
    return StoreRow(system, path, *sizes, got["store_gbps"], got["retrieve_gbps"]), ""


async def kvstore_row(mib: int, rounds: int) -> StoreRow:
    """``BlockStore.put`` and ``get`` of ``mib`` MiB in LMCache's chunks, in-process: the
    median of ``rounds`` rounds after one warm-up, each putting new keys."""
    size = LMCACHE_LAYOUT.payload_bytes
    count = max(1, mib * MIB // size)
    meta = BlockMeta(NAMESPACE, LMCACHE_LAYOUT.block_tokens, LMCACHE_LAYOUT)
    blocks = torch.randn(count, size // 2, dtype=torch.float16).view(torch.uint8)
    views = [block.numpy().data for block in blocks]
    put_s, get_s = [], []
    async with host_store(2 * count * size, 4096) as store:
        for turn in range(rounds + 1):
            keys = [key_of(b"L%d" % turn, i) for i in range(count)]
            began = time.perf_counter()
            for key, view in zip(keys, views, strict=True):
                await store.put(key, ROOT, meta, view)
            put_s.append(time.perf_counter() - began)
            got, began = [], time.perf_counter()
            for key in keys:
                got.append(await store.get(key, NAMESPACE))
            get_s.append(time.perf_counter() - began)
            expect(same_bytes(got, blocks), "the in-process store returned other bytes")
            for key in keys:
                await store.delete(key, NAMESPACE)
    total = count * size
    rates = [total / statistics.median(seconds[1:]) / GB for seconds in (put_s, get_s)]
    return StoreRow("kvstore", "BlockStore put / get (new bytes), in-process", total, size, *rates)


def same_bytes(got: Sequence[Block | None], blocks: torch.Tensor) -> bool:
    def holds(block: Block | None, expected: torch.Tensor) -> bool:
        data = None if block is None else numpy.frombuffer(block.payload, dtype=numpy.uint8)
        return data is not None and numpy.array_equal(data, expected.numpy())

    return all(holds(block, row) for block, row in zip(got, blocks, strict=True))


def shm_rows(rows: Sequence[ClientRow]) -> list[StoreRow]:
    """The one-client shm figures of the clients section, as a row of this table."""
    one = {row.op: row for row in rows if row.path == "shm" and row.clients == 1}
    if not one:
        return []
    put, get = one["put"], one["get (out=)"]
    return [StoreRow("kvstore", "daemon, 1 shm client: put / get (out=)", put.client_bytes,
                     min(CLIENT_BLOCK, put.client_bytes), put.gbps, get.gbps)]  # fmt: skip


def store_table(rows: Sequence[StoreRow]) -> str:
    header = ("system", "path", "MiB", "block MiB", "store GB/s", "retrieve GB/s")
    body = [
        (r.system, r.path, f"{r.total_bytes / MIB:g}", f"{r.block_bytes / MIB:g}",
         f"{r.store_gbps:.2f}", f"{r.retrieve_gbps:.2f}")
        for r in rows
    ]  # fmt: skip
    return markdown(header, body, text=("system", "path"))


# Running and reporting -----------------------------------------------------------------------


def counts(text: str) -> list[int]:
    values = [int(value) for value in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive counts, got {text}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--sizes", type=counts, default=[2000, 20000], help="tier sizes in blocks")
    add("--chain", type=counts, default=[16, 512], help="keys per chain")
    add("--puts", type=int, default=2000, help="timed puts per size")
    add("--lookups", type=int, default=200, help="timed lookups per size")
    add("--block-bytes", type=int, default=4096, help="block size, a multiple of 64")
    add("--clients", type=counts, default=[1, 4, 16], help="clients at once (default 1,4,16)")
    add("--client-mb", type=int, default=32, help="MiB each client moves per call")
    add("--rounds", type=int, default=5, help="timed rounds, clients and LMCache sections")
    add("--lmcache-python", help="the Python of a venv with lmcache (or KVSTORE_LMCACHE_PYTHON)")
    add("--lmcache-mb", type=int, default=512, help="MiB LMCache and kvstore store, per round")
    add("--sections", default=",".join(SECTIONS), help="what to run (default: all)")
    add("--json", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    args.sections = args.sections.split(",")
    if unknown := set(args.sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    if args.block_bytes < 64 or args.block_bytes % 64:
        parser.error(f"--block-bytes must be a positive multiple of 64, got {args.block_bytes}")
    if args.client_mb < 1 or args.lmcache_mb < 32:
        parser.error("--client-mb must be at least 1 and --lmcache-mb at least 32")
    args.clients = sorted({1, *args.clients})  # every row is read against one client
    return args


@dataclass(slots=True)
class Report:
    eviction: list[Row]
    memory: list[MemoryRow]
    clients: list[ClientRow]
    stores: list[StoreRow]
    skipped: str = ""


async def measure(args: argparse.Namespace, report: Report) -> None:
    shape, wanted = Shape.of(args.block_bytes), args.sections
    for blocks in args.sizes if "eviction" in wanted else []:
        for chain in args.chain:
            with progress(f"eviction: {blocks} blocks, chains of {chain}"):
                report.eviction.append(await bench(shape, blocks, chain, args.puts, args.lookups))
    if "clients" in wanted:
        with progress(f"clients: {args.clients} x {args.client_mb} MiB"):
            report.clients = await bench_clients(args.clients, args.client_mb * MIB,
                                                 args.rounds)  # fmt: skip
    if "lmcache" in wanted:
        with progress(f"lmcache: kvstore in-process, {args.lmcache_mb} MiB"):
            report.stores.append(await kvstore_row(args.lmcache_mb, args.rounds))


def render(report: Report, args: argparse.Namespace) -> str:
    parts = []
    if report.eviction:
        parts += [f"eviction ({args.block_bytes}-byte blocks)", eviction_table(report.eviction)]
    if report.memory:
        parts += ["index memory per block held (the largest size; payloads are in the arena)",
                  memory_table(report.memory)]  # fmt: skip
    if report.clients:
        parts += [f"clients at once (2 MiB blocks; median of {args.rounds} rounds)",
                  clients_table(report.clients)]  # fmt: skip
    if "lmcache" in args.sections:
        parts += ["LMCache CPU backend beside kvstore (the same bytes)"]
        parts += [report.skipped] if report.skipped else []
        parts += [store_table(report.stores)]
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tune_allocator()  # as `kvstore serve` does: reuse freed block buffers
    report = Report([], [], [], [])
    for chain in args.chain if "memory" in args.sections else []:
        with progress(f"memory: {max(args.sizes)} blocks, chains of {chain}"):
            report.memory.append(memory_in_child(args.block_bytes, max(args.sizes), chain))
    uvloop.run(measure(args, report))
    if "lmcache" in args.sections:  # after the loop: nothing else runs beside it
        with progress(f"lmcache: LMCache, {args.lmcache_mb} MiB"):
            row, report.skipped = lmcache_row(lmcache_python(args.lmcache_python),
                                              args.lmcache_mb, args.rounds)  # fmt: skip
        report.stores[:0] = [row] if row else []
        report.stores += shm_rows(report.clients)
    print(render(report, args))
    if args.json:
        Path(args.json).write_text(json.dumps(as_json(report), indent=2) + "\n")
    return 0


def as_json(report: Report) -> dict[str, object]:
    def client(row: ClientRow) -> dict[str, object]:
        extra = {"scaling": row.scaling, "vs_raw": row.vs_raw, "pass_fail": row.verdict}
        return {**asdict(row), **extra}

    return {
        "eviction": [asdict(row) for row in report.eviction],
        "memory": [asdict(row) for row in report.memory],
        "clients": [client(row) for row in report.clients],
        "lmcache": {
            "rows": [asdict(row) for row in report.stores],
            "skipped": report.skipped or None,
        },
    }


if __name__ == "__main__":
    sys.exit(main())
