"""Tier throughput beside a limit measured in the same run, on the same machine.

    python -m benchmarks.tiers [--sizes 32MiB,2MiB] [--blocks N]
                               [--tiers host,ssd,redis,redis-cluster] [--rounds R]
                               [--pipeline P] [--dir DIR] [--json out.json]

For every block size, ``N`` blocks of KV-like bytes (``torch.randn`` float16, 32-byte keys)
are put and read back on each tier, and the same bytes are moved by the plain mechanism the
tier is built on, which is the limit the tier is compared with:

- host: ``HostTier.put`` / ``get`` / ``get_into`` against memcpy (``ctypes.memmove``, one
  thread, as the tier copies) between preallocated, pre-faulted buffers: each block into its
  own region of an ``N``-block buffer, then each region into one block-sized buffer.
- ssd: ``SsdTier.put`` (fsync on) / ``get`` against ``open().write()`` + ``os.fsync`` and
  ``open().read()`` of plain files in the same directory. Cold reads first drop the tier's
  and the plain files from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``.
- redis: ``RedisTier.put_many`` / ``get_many`` in batches of ``P`` against
  ``redis-benchmark -t set,get -d <size> -n N -r N -P P -c 1`` on the same private
  redis-server (no persistence), started on a free port and stopped at the end.
- redis-cluster: the same on a Redis Cluster (3 primaries, 3 replicas) started for each
  block size, against ``redis-benchmark --cluster --threads 1 -P ceil(P/C) -c C`` where
  ``C = min(P, 3)``: one connection per primary in one thread, each pipelining its share of a
  batch, as the tier splits a batch by primary. (``--cluster`` gives each client one primary
  and runs a thread per primary, so ``-c 1`` would load one primary only and, its two idle
  threads stopping on a 250 ms timer, round every run up to a quarter second.)

A row shows the median of ``R`` timed rounds. Host and SSD rounds run the tier op and its
limit op block by block, alternating which goes first, so that neither gains from drift or a
warm cache; redis and redis-cluster rounds run redis-benchmark, then the tier. Only the calls
are timed: the checks that every byte came back run between them. Host and both redis tiers
run one untimed warm-up round first (the SSD needs none: its reads are made cold on purpose);
the host tier's warm-up put is shown as ``put (fresh arena)``, the first write of each arena
page paying a page fault once in the life of the arena.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import ctypes
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path

import numpy
import platformdirs
import redis
import torch
import uvloop

from kvstore.defaults import tune_allocator
from kvstore.inference_adapter.bench.ports import free_port
from kvstore.inference_adapter.bench.redis_cluster import LocalCluster
from kvstore.tiers.base import Tier
from kvstore.tiers.host import HostTier
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.ssd import SsdTier
from kvstore.tiers.ssd_files import record_overhead

MIB = 1 << 20
GB = 1e9
UNITS = {"GiB": 1 << 30, "MiB": MIB, "KiB": 1 << 10, "B": 1}
# The least tier / limit throughput ratio of each tier.
TARGETS = {"host": 0.6, "ssd": 0.8, "redis": 0.4, "redis-cluster": 0.4}
BYTES_PER_SIZE = 512 * MIB  # the default block count moves about this much per size ...
MIN_BLOCKS, MAX_BLOCKS = 16, 64  # ... within these bounds
BYTES_PER_CALL = 8 * MIB  # the default redis batch holds about this much
PRIMARIES = 3  # of the local Redis Cluster, each with one replica
PAGE_BYTES = 4096

Step = Callable[[], Awaitable[dict[str, float]]]  # one round of some ops -> seconds per op


class BenchmarkError(RuntimeError):
    """A tier returned wrong bytes or refused a write: its timings would mean nothing."""


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: a tier op against its limit on the same blocks."""

    tier: str
    op: str
    block_bytes: int
    blocks: int
    gbps: float
    limit_gbps: float
    limit_name: str
    target: float | None  # least ratio to pass; None for a row shown for information

    @property
    def ratio(self) -> float:
        return self.gbps / self.limit_gbps

    @property
    def us_beyond_limit(self) -> float:
        """Microseconds per block the op spends beyond its limit (from the two rates)."""
        return self.block_bytes / 1e3 * (1 / self.gbps - 1 / self.limit_gbps)

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "info"
        return "pass" if self.ratio >= self.target else "fail"


@dataclass(frozen=True, slots=True)
class Blocks:
    """``count`` distinct blocks of ``size`` bytes, as tensors and as byte views."""

    size: int
    tensors: list[torch.Tensor]  # count x [size] uint8
    views: list[memoryview]
    arrays: list[numpy.ndarray]  # the same bytes again, for comparisons
    keys: list[bytes]

    @classmethod
    def random(cls, size: int, count: int) -> Blocks:
        halves = torch.randn(count, (size + 1) // 2, dtype=torch.float16)  # KV-like values
        tensors = list(halves.view(torch.uint8)[:, :size])
        arrays = [tensor.numpy() for tensor in tensors]
        keys = [hashlib.sha256(f"bench/{size}/{i}".encode()).digest() for i in range(count)]
        return cls(size, tensors, [memoryview(array) for array in arrays], arrays, keys)

    def holds(self, i: int, data: bytes | bytearray | memoryview | None) -> bool:
        """Whether ``data`` is block ``i``, byte for byte (vectorised: ``==`` on a memoryview
        compares item by item, slower than most tiers)."""
        if data is None:
            return False
        return bool(numpy.array_equal(numpy.frombuffer(data, dtype=numpy.uint8), self.arrays[i]))

    @property
    def total_bytes(self) -> int:
        return self.size * len(self.views)


@dataclass(frozen=True, slots=True)
class Settings:
    """How every tier is measured."""

    rounds: int  # timed rounds, after one warm-up round
    blocks: int | None  # blocks per size; None picks by size (default_blocks)
    pipeline: int | None  # blocks per redis call; None picks by size (default_pipeline)
    scratch: Path  # for the SSD files and the redis-server and cluster working directories


Op = Callable[[int], Awaitable[float]]  # acts on block i, checks the outcome -> seconds timed


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise BenchmarkError(what)


async def alternate(count: int, tier_op: Op, limit_op: Op) -> tuple[float, float]:
    """Runs both ops on every block, the tier first on even blocks and the limit first on odd
    ones, so that drift and cache warmth favour neither; returns the seconds of each."""
    spent = [0.0, 0.0]
    order = [(0, tier_op), (1, limit_op)]
    for i in range(count):
        for which, op in order if i % 2 == 0 else order[::-1]:
            spent[which] += await op(i)
    return spent[0], spent[1]


def paired(count: int, tier_name: str, tier_op: Op, limit_name: str, limit_op: Op) -> Step:
    async def step() -> dict[str, float]:
        tier_s, limit_s = await alternate(count, tier_op, limit_op)
        return {tier_name: tier_s, limit_name: limit_s}

    return step


def untimed(body: Callable[[], Awaitable[object]]) -> Step:
    async def step() -> dict[str, float]:
        await body()
        return {}

    return step


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds per op name: of the warm-up round (empty if none ran) and of each timed round."""

    warm_up: dict[str, float]
    rounds: dict[str, list[float]]


async def run_rounds(rounds: int, steps: Sequence[Step], *, warm_up: bool = True) -> Timings:
    """Runs the steps in order, once untimed to warm up (unless ``warm_up`` is false), then
    ``rounds`` times."""
    first: dict[str, float] = {}
    if warm_up:
        for step in steps:
            first |= await step()
    seconds: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        for step in steps:
            for name, spent in (await step()).items():
                seconds[name].append(spent)
    return Timings(first, seconds)


def rate(blocks: Blocks, seconds: Sequence[float]) -> float:
    return blocks.total_bytes / statistics.median(seconds) / GB


def make_row(
    tier: str, op: str, blocks: Blocks, spent: Sequence[float], limit: Sequence[float], name: str
) -> Row:
    """The median of the timed rounds of ``spent`` against that of ``limit``."""
    gbps, limit_gbps = rate(blocks, spent), rate(blocks, limit)
    return Row(tier, op, blocks.size, len(blocks.views), gbps, limit_gbps, name, TARGETS[tier])


# Tier ops, on any tier -------------------------------------------------------------------------


def tier_ops(tier: Tier, blocks: Blocks) -> tuple[Op, Op]:
    """``put`` and ``get`` of block i, each checked after its clock stops."""

    async def put(i: int) -> float:
        start = time.perf_counter()
        stored = await tier.put(blocks.keys[i], blocks.views[i])
        spent = time.perf_counter() - start
        expect(stored, f"{tier.name} refused a put")
        return spent

    async def get(i: int) -> float:
        start = time.perf_counter()
        data = await tier.get(blocks.keys[i])
        spent = time.perf_counter() - start
        expect(blocks.holds(i, data), f"{tier.name} returned other bytes")
        return spent

    return put, get


async def delete_all(tier: Tier, blocks: Blocks) -> None:
    for key in blocks.keys:
        await tier.delete(key)


# host ------------------------------------------------------------------------------------------


async def bench_host(blocks: Blocks, run: Settings) -> list[Row]:
    size, count = blocks.size, len(blocks.views)
    # The limit's buffers are faulted in up front, like an arena that has been used once.
    regions = torch.ones(count, size, dtype=torch.uint8)  # [count, size]
    out = bytearray(b"\1" * size)
    out_address = torch.frombuffer(out, dtype=torch.uint8).data_ptr()

    async def memcpy_in(i: int) -> float:
        start = time.perf_counter()
        ctypes.memmove(regions[i].data_ptr(), blocks.tensors[i].data_ptr(), size)
        return time.perf_counter() - start

    async def memcpy_out(i: int) -> float:
        start = time.perf_counter()
        ctypes.memmove(out_address, regions[i].data_ptr(), size)
        spent = time.perf_counter() - start
        expect(blocks.holds(i, out), "memmove returned other bytes")
        return spent

    async with HostTier(count * -(-size // PAGE_BYTES) * PAGE_BYTES) as tier:
        put, get = tier_ops(tier, blocks)

        async def get_into(i: int) -> float:
            start = time.perf_counter()
            length = await tier.get_into(blocks.keys[i], out)
            spent = time.perf_counter() - start
            expect(length == size and blocks.holds(i, out), "get_into returned other bytes")
            return spent

        timings = await run_rounds(
            run.rounds,
            [
                paired(count, "put", put, "in", memcpy_in),
                paired(count, "get", get, "out", memcpy_out),
                paired(count, "get_into", get_into, "out again", memcpy_out),
                untimed(lambda: delete_all(tier, blocks)),
            ],
        )
    timed, first_put = timings.rounds, [timings.warm_up["put"]]
    into_n, into_1 = "memmove into N buffers", "memmove into 1 buffer"
    fresh = make_row("host", "put (fresh arena)", blocks, first_put, timed["in"], into_n)
    faulted = make_row(
        "host",
        "put (fresh arena, pre-faulted)",
        blocks,
        [await prefaulted_puts(blocks, count * -(-size // PAGE_BYTES) * PAGE_BYTES)],
        timed["in"],
        into_n,
    )
    return [
        make_row("host", "put", blocks, timed["put"], timed["in"], into_n),
        replace(fresh, target=None),
        replace(faulted, target=None),
        make_row("host", "get", blocks, timed["get"], timed["out"], into_1),
        make_row("host", "get_into", blocks, timed["get_into"], timed["out again"], into_1),
    ]


async def prefaulted_puts(blocks: Blocks, capacity: int) -> float:
    """Seconds of one round of puts into a new arena that was pre-faulted first (the
    daemon's default: a new arena is faulted in by a worker thread before puts need it)."""
    async with HostTier(capacity, prefault=True) as tier:
        tier.arena("")  # created here: its pre-faulting starts
        await tier.prefaulted()
        put, _ = tier_ops(tier, blocks)
        return sum([await put(i) for i in range(len(blocks.views))])


# ssd -------------------------------------------------------------------------------------------


def drop_cached(paths: Sequence[Path]) -> None:
    """Drops the files' clean pages from the page cache, so that reads go to the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def file_ops(paths: Sequence[Path], blocks: Blocks) -> tuple[Op, Op]:
    """Write + fsync and read of block i as a plain file, each checked after its clock stops."""

    async def write(i: int) -> float:
        start = time.perf_counter()
        with paths[i].open("wb") as file:
            file.write(blocks.views[i])
            file.flush()
            os.fsync(file.fileno())
        return time.perf_counter() - start

    async def read(i: int) -> float:
        start = time.perf_counter()
        with paths[i].open("rb") as file:
            data = file.read()
        spent = time.perf_counter() - start
        expect(blocks.holds(i, data), "a plain file returned other bytes")
        return spent

    return write, read


async def bench_ssd(blocks: Blocks, run: Settings) -> list[Row]:
    count, root = len(blocks.views), run.scratch / "ssd"
    (root / "plain").mkdir(parents=True, exist_ok=True)
    plain = [root / "plain" / f"{i:05d}.bin" for i in range(count)]
    write, read = file_ops(plain, blocks)
    capacity = 2 * (blocks.total_bytes + count * record_overhead(64))

    async def remove_plain() -> None:
        for path in plain:
            path.unlink()

    async with SsdTier(root / "tier", capacity) as tier:
        put, get = tier_ops(tier, blocks)
        records = [tier.path_of(key) for key in blocks.keys]

        async def drop_both() -> None:
            drop_cached(plain + records)

        # No warm-up round: the page cache is dropped on purpose, and nothing else needs one.
        timings = await run_rounds(
            run.rounds,
            [
                paired(count, "put", put, "file write+fsync", write),
                untimed(drop_both),
                paired(count, "get (cold)", get, "file read, cold", read),
                paired(count, "get (warm)", get, "file read, warm", read),
                untimed(lambda: delete_all(tier, blocks)),
                untimed(remove_plain),
            ],
            warm_up=False,
        )
    timed = timings.rounds
    pairs = [("put", "file write+fsync"), ("get (cold)", "file read, cold")]
    pairs.append(("get (warm)", "file read, warm"))
    return [make_row("ssd", op, blocks, timed[op], timed[limit], limit) for op, limit in pairs]


# redis -----------------------------------------------------------------------------------------


@contextmanager
def redis_server(maxmemory: int, workdir: Path) -> Iterator[int]:
    """A private redis-server without persistence on a free port; yields the port."""
    port = free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--appendonly", "no", "--maxmemory", str(maxmemory), "--dir", str(workdir)]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while not _answers(client):
            if time.monotonic() > deadline or server.poll() is not None:
                raise BenchmarkError(f"redis-server did not answer on port {port}")
            time.sleep(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@contextmanager
def redis_cluster(workdir: Path) -> Iterator[LocalCluster]:
    """A local Redis Cluster of ``PRIMARIES`` primaries with a replica each, stopped at the end
    (also when it fails to come up: the nodes it started go too)."""
    cluster = LocalCluster(workdir, primaries=PRIMARIES, replicas=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def redis_benchmark(port: int, size: int, count: int, options: Sequence[str]) -> dict[str, float]:
    """Requests per second of ``SET`` and ``GET`` as redis-benchmark reports them; ``options``
    say how (the pipeline, the clients, cluster mode)."""
    args = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set,get"]
    args += ["-d", str(size), "-n", str(count), "-r", str(count), *options, "--csv"]
    done = subprocess.run(args, capture_output=True, text=True, check=True, timeout=600)
    quoted = [line for line in done.stdout.splitlines() if line.startswith('"')]  # no node list
    rps = {line["test"]: float(line["rps"]) for line in csv.DictReader(quoted)}
    # It times in whole milliseconds: a run within one reports "inf".
    expect(all(map(math.isfinite, rps.values())), "redis-benchmark ran under 1 ms: use more bytes")
    return rps


def batch_round(tier: RedisTier, blocks: Blocks, pipeline: int) -> Step:
    """``put_many`` then ``get_many`` of every block, ``pipeline`` blocks per call."""
    starts = range(0, len(blocks.keys), pipeline)
    items = list(zip(blocks.keys, blocks.views, strict=True))

    async def step() -> dict[str, float]:
        put_s = get_s = 0.0
        for i in starts:
            start = time.perf_counter()
            stored = await tier.put_many(items[i : i + pipeline])
            put_s += time.perf_counter() - start
            expect(all(stored), "redis refused a put")
        for i in starts:
            start = time.perf_counter()
            found = await tier.get_many(blocks.keys[i : i + pipeline])
            get_s += time.perf_counter() - start
            same = map(blocks.holds, range(i, i + len(found)), found)
            expect(all(same), "redis returned other bytes")
        return {"put": put_s, "get": get_s}

    return step


async def bench_redis(blocks: Blocks, run: Settings) -> list[Row]:
    pipeline = run.pipeline or default_pipeline(blocks.size)
    with redis_server(3 * blocks.total_bytes + 512 * MIB, run.scratch) as port:
        url, options = f"redis://127.0.0.1:{port}/0", ["-P", str(pipeline), "-c", "1"]
        return await redis_rows("redis", url, port, options, blocks, pipeline, run.rounds)


async def bench_redis_cluster(blocks: Blocks, run: Settings) -> list[Row]:
    pipeline = run.pipeline or default_pipeline(blocks.size)
    clients = min(pipeline, PRIMARIES)  # one per primary, each with its share of a batch
    options = ["--cluster", "--threads", "1", "-P", str(-(-pipeline // clients))]
    options += ["-c", str(clients)]
    with redis_cluster(run.scratch / f"redis-cluster-{blocks.size}") as cluster:
        url, port = cluster.url, cluster.ports[0]
        return await redis_rows("redis-cluster", url, port, options, blocks, pipeline, run.rounds)


async def redis_rows(
    name: str,
    url: str,
    port: int,
    options: Sequence[str],
    blocks: Blocks,
    pipeline: int,
    rounds: int,
) -> list[Row]:
    """Rounds of redis-benchmark with ``options`` on ``port``, then of the tier on ``url``, in
    batches of ``pipeline`` blocks."""
    count = len(blocks.views)

    async def benchmark_round() -> dict[str, float]:
        rps = await asyncio.to_thread(redis_benchmark, port, blocks.size, count, options)
        return {"SET": count / rps["SET"], "GET": count / rps["GET"]}

    async with RedisTier(url, 4 * blocks.total_bytes, timeout_s=60) as tier:
        steps = [benchmark_round, batch_round(tier, blocks, pipeline)]
        seconds = (await run_rounds(rounds, steps)).rounds
    limit = " ".join(["redis-benchmark", *options])
    pairs = [("put_many", "put", "SET"), ("get_many", "get", "GET")]
    return [
        make_row(name, f"{op} ({pipeline}/call)", blocks, seconds[mine], seconds[its], limit)
        for op, mine, its in pairs
    ]


# Running and reporting -------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"32MiB"`` -> 33554432; a bare number is bytes."""
    number, scale = text.strip(), 1
    for unit, unit_scale in UNITS.items():
        if number.endswith(unit):
            number, scale = number.removesuffix(unit), unit_scale
            break
    return at_least_one(int(float(number) * scale), text)


def sizes(text: str) -> list[int]:
    return [parse_size(size) for size in text.split(",")]


def positive(text: str) -> int:
    return at_least_one(int(text), text)


def at_least_one(value: int, text: str) -> int:
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def format_size(size: int) -> str:
    for unit, scale in UNITS.items():
        if size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def default_blocks(size: int) -> int:
    return min(MAX_BLOCKS, max(MIN_BLOCKS, BYTES_PER_SIZE // size))


def default_pipeline(size: int) -> int:
    # Past a few MiB a batch saves nothing, and redis-benchmark slows down with deep
    # pipelines of large values.
    return max(1, BYTES_PER_CALL // size)


BENCHES: dict[str, Callable[[Blocks, Settings], Awaitable[list[Row]]]] = {
    "host": bench_host,
    "ssd": bench_ssd,
    "redis": bench_redis,
    "redis-cluster": bench_redis_cluster,
}
TOOLS = {
    "redis": ("redis-server", "redis-benchmark"),
    "redis-cluster": ("redis-server", "redis-cli", "redis-benchmark"),
}  # what a tier's bench runs


async def bench_all(sizes: Sequence[int], tiers: Sequence[str], run: Settings) -> list[Row]:
    rows: list[Row] = []
    for size in sizes:
        count = run.blocks or default_blocks(size)
        with progress(f"{format_size(size)} x {count}: blocks"):
            blocks = Blocks.random(size, count)
        for tier in tiers:
            with progress(f"{format_size(size)} x {count}: {tier}"):
                rows += await BENCHES[tier](blocks, run)
    return rows


@contextmanager
def progress(what: str) -> Iterator[None]:
    """Says on stderr what runs and how long it took."""
    print(f"{what} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr)


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    with suppress(OSError), open("/proc/cpuinfo") as info:
        names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
        cpu = names[0] if names else cpu
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    return {
        "cores": str(os.cpu_count()),
        "cpu": cpu,
        "ram": f"{ram / (1 << 30):.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": f"{torch.__version__} ({torch.get_num_threads()} threads)",
        "redis": server.stdout.split()[2].removeprefix("v=") if server.returncode == 0 else "-",
        "date": date.today().isoformat(),
    }


def filesystem_of(path: Path) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it)."""
    best, kind, where = "", "unknown", path.resolve()
    with suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fs_type, *_ = line.split()
            if Path(point) in [where, *where.parents] and len(point) > len(best):
                best, kind = point, fs_type
    return kind


HEADER = (
    "tier", "op", "block size", "blocks", "GB/s", "limit GB/s", "limit name", "ratio", "target",
    "pass/fail",
)  # fmt: skip
RIGHT = {"blocks", "GB/s", "limit GB/s", "ratio", "target"}


def cells(row: Row) -> tuple[str, ...]:
    target = "-" if row.target is None else f">= {row.target:.1f}x"
    return (
        row.tier, row.op, format_size(row.block_bytes), str(row.blocks), f"{row.gbps:.2f}",
        f"{row.limit_gbps:.2f}", row.limit_name, f"{row.ratio:.2f}", target, row.verdict,
    )  # fmt: skip


def render(rows: Sequence[Row], about: dict[str, str], rounds: int) -> str:
    """The machine line, the method line and a markdown table with padded columns."""
    table = [HEADER, *map(cells, rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if h in RIGHT else v.ljust(w)
            for h, v, w in zip(HEADER, values, widths, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = [
        ("-" * (w - 1) + ":") if h in RIGHT else "-" * w
        for h, w in zip(HEADER, widths, strict=True)
    ]
    return "\n".join(
        [
            "machine: " + ", ".join(f"{key} {value}" for key, value in about.items()),
            f"method: median of {rounds} timed rounds (host, redis, redis-cluster: after 1"
            " warm-up round); GB/s = 1e9 bytes/s",
            "",
            line(HEADER),
            line(rule),
            *map(line, table[1:]),
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Tier throughput beside memcpy, plain file I/O and redis-benchmark."
    )
    parser.add_argument("--sizes", default="32MiB,2MiB", type=sizes, help="default %(default)s")
    parser.add_argument("--blocks", type=positive, help="per size (default: 512 MiB, 16..64)")
    parser.add_argument("--tiers", default=",".join(BENCHES), help="default %(default)s")
    parser.add_argument("--rounds", type=positive, default=3, help="timed rounds (default 3)")
    parser.add_argument("--pipeline", type=positive, help="blocks per redis call (default: 8 MiB)")
    parser.add_argument("--dir", type=Path, help="parent of the scratch directory")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    args.tiers = args.tiers.split(",")
    if unknown := set(args.tiers) - set(BENCHES):
        parser.error(f"unknown tiers {sorted(unknown)}; known: {', '.join(BENCHES)}")
    needed = dict.fromkeys(tool for tier in args.tiers for tool in TOOLS.get(tier, ()))
    if missing := [tool for tool in needed if shutil.which(tool) is None]:
        parser.error(f"{', '.join(missing)} not found; `make redis-server` installs them")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tune_allocator()  # as `kvstore serve` does: reuse freed block buffers
    parent = args.dir or Path(platformdirs.user_cache_dir("kvstore"))
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=parent))
    run = Settings(args.rounds, args.blocks, args.pipeline, scratch)
    try:
        rows = uvloop.run(bench_all(args.sizes, args.tiers, run))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    about = {**machine(), "ssd files on": filesystem_of(parent)}
    print(render(rows, about, args.rounds))
    if args.json:
        report = {"machine": about, "rounds": args.rounds, "rows": [as_json(row) for row in rows]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def as_json(row: Row) -> dict[str, object]:
    return {**asdict(row), "ratio": row.ratio, "pass_fail": row.verdict}


if __name__ == "__main__":
    sys.exit(main())
