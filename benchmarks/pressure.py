"""A client's lookups while another client's puts keep the host tier evicting.

    python -m benchmarks.pressure [--sizes 20000,200000] [--lookups 300] [--put-blocks 512]
                                  [--writer-duty 1.0] [--json out.json]

For each size ``N`` it starts a real daemon (``python -m kvstore serve``: a host tier of
``N`` blocks of 4 KiB, SSD and Redis off, default watermarks 0.95 / 0.85, the metrics
endpoint on), fills the tier to 90% and puts one 512-key chain that the looking client
leases for the run (so eviction never takes it). Then the looking client (this process)
times ``L`` lookups of that chain, one every ``PACE_S``, in each phase:

- idle: nothing else runs;
- evicting: a writer (a second process, its own client over shm) puts new 512-block chains,
  ``--put-blocks`` blocks a put, as fast as it can (or, with ``--writer-duty d``, resting
  after each put so that it works ``d`` of the time: on a machine of few cores a writer that
  never rests takes a core from the looking client), so the tier crosses its high watermark
  again and again and each commit that crosses it drains it to the low one (2K evictions a
  drain at 20K blocks, 20K at 200K); the phase goes on, ``L`` lookups at a time, until it
  holds at least one drain;
- idle again.

Per phase: the lookups' p50 / p99 from the client, the daemon's event-loop lag p99 and
worst bucket (``kvstore_event_loop_lag_seconds``, the bucket counts' difference over the
phase), the evictions during it, and the CPU pressure (the share of the phase in which some
runnable task on the machine waited for a core, Linux PSI). Targets:
p99 evicting <= 2x idle, lag p99 evicting <= 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Event
from pathlib import Path

import grpc
import uvloop

from kvstore.client import ROOT_KEY, AsyncKVStoreClient, ModelFingerprint, Namespace, block_keys
from kvstore.launch import kvstore_command
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc

from .raw_grpc import child, serving

BLOCK = 4096
CHAIN = 512  # keys a lookup asks for, and blocks a put carries
FILL = 0.90  # of the tier, between the low (0.85) and high (0.95) watermarks
PACE_S = 0.005  # between two timed lookups
WARM_UP = 20
RATIO_TARGET, LAG_TARGET_MS = 2.0, 2.0
MODEL = ModelFingerprint("bench-pressure", 1, 1, BLOCK // 4, "float16", block_tokens=1)
NAMESPACE = Namespace(MODEL, tenant="bench")
LAG = "kvstore_event_loop_lag_seconds"
EVICTED = 'kvstore_tier_evictions_total{tier="host"}'
PHASE_LIMIT_S = 600.0


def daemon_config(socket: Path, blocks: int, metrics_port: int) -> str:
    """The daemon's TOML (JSON's scalars and lists of strings are TOML's too)."""
    sections: dict[str, dict[str, object]] = {
        "host": {"capacity": blocks * BLOCK},
        "ssd": {"enabled": False},
        "redis": {"enabled": False},
        "server": {"listen": [f"unix:{socket}"]},
        "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
    }
    return "".join(
        f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in keys.items())
        for name, keys in sections.items()
    )


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def new_chain(seed: int) -> list[bytes]:
    tokens = [seed * CHAIN + i for i in range(CHAIN)]
    return block_keys(tokens, NAMESPACE)


PAYLOADS = [os.urandom(BLOCK)] * CHAIN  # content is not what is measured; keys differ


async def put_chains(client: AsyncKVStoreClient, first_seed: int, count: int) -> None:
    for seed in range(first_seed, first_seed + count):
        await client.put(NAMESPACE, new_chain(seed), PAYLOADS)


# The writer: a process of its own ---------------------------------------------------------


def writer(address: str, first_seed: int, stop: Event, put_blocks: int, duty: float) -> None:
    """Puts new chains until ``stop``; after each put it rests ``(1 - duty) / duty`` times
    as long as the put took, so that it works ``duty`` of the time."""
    rest = (1.0 - duty) / duty

    async def run() -> None:
        async with AsyncKVStoreClient(address, timeout=120) as client:
            seed = first_seed
            while not stop.is_set():
                chain = new_chain(seed)
                for start in range(0, CHAIN, put_blocks):
                    keys = chain[start : start + put_blocks]
                    parent = chain[start - 1] if start else ROOT_KEY
                    began = time.perf_counter()
                    await client.put(NAMESPACE, keys, PAYLOADS[: len(keys)], parent=parent)
                    if rest:
                        await asyncio.sleep((time.perf_counter() - began) * rest)
                seed += 1

    uvloop.run(run())


# Measuring ------------------------------------------------------------------------------


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def lag_percentile(before: dict[str, float], after: dict[str, float], q: float) -> float:
    """The upper bound (ms) of the lag bucket holding the ``q`` quantile over the phase."""
    prefix = f'{LAG}_bucket{{le="'
    bounds = sorted(
        (float(name[len(prefix) : -2]), after[name] - before.get(name, 0.0))
        for name in after
        if name.startswith(prefix)
    )
    total = bounds[-1][1]
    for bound, count in bounds:
        if count >= q * total:
            return bound * 1e3
    return float("inf")


def cpu_stalled_us() -> int:
    """Microseconds in which some runnable task waited for a core (Linux PSI, whole
    machine); 0 where the kernel does not say."""
    try:
        with open("/proc/pressure/cpu") as pressure:
            return int(pressure.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return 0


@dataclass(frozen=True, slots=True)
class Phase:
    blocks: int
    phase: str
    lookups: int
    p50_ms: float
    p99_ms: float
    cpu_pressure: float  # share of the phase some runnable task waited for a core
    lag_p99_ms: float
    lag_worst_ms: float
    evictions: int
    seconds: float


async def timed_lookups(
    client: AsyncKVStoreClient, keys: list[bytes], calls: int, more: Callable[[], Awaitable[bool]]
) -> list[float]:
    """At least ``calls`` timed lookups (after ``WARM_UP``), and on while ``more()`` says so
    (asked every ``calls`` lookups)."""
    spent: list[float] = []
    turn = 0
    while True:
        if turn >= WARM_UP + calls and len(spent) % calls == 0 and not await more():
            break
        turn += 1
        start = time.perf_counter()
        found = await client.lookup(NAMESPACE, keys)
        took = time.perf_counter() - start
        if found != CHAIN:
            raise RuntimeError(f"the leased chain lost blocks: {found} of {CHAIN} found")
        if turn > WARM_UP:
            spent.append(took)
        await asyncio.sleep(PACE_S)
    return spent


def p(values: Sequence[float], q: int) -> float:
    if len(values) < 2:
        return values[0] * 1e3 if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


async def phase(
    name: str, blocks: int, client: AsyncKVStoreClient, keys: list[bytes], calls: int,
    port: int,
) -> Phase:  # fmt: skip
    before, started = await asyncio.to_thread(scrape, port), time.perf_counter()
    stalled = cpu_stalled_us()

    async def no_eviction_yet() -> bool:  # an evicting phase holds a drain, however short
        if name != "evicting" or time.perf_counter() - started > PHASE_LIMIT_S:
            return False
        return (await asyncio.to_thread(scrape, port))[EVICTED] == before[EVICTED]

    spent = await timed_lookups(client, keys, calls, no_eviction_yet)
    stalled = cpu_stalled_us() - stalled
    after, seconds = await asyncio.to_thread(scrape, port), time.perf_counter() - started
    return Phase(
        blocks, name, len(spent), p(spent, 50), p(spent, 99), stalled / 1e6 / seconds,
        lag_percentile(before, after, 0.99),
        lag_percentile(before, after, 1.0), int(after[EVICTED] - before[EVICTED]), seconds,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def daemon(scratch: Path, blocks: int) -> AsyncIterator[tuple[str, int]]:
    sock, config, log = scratch / "kvs.sock", scratch / "kvs.toml", scratch / "daemon.log"
    port = free_port()
    config.write_text(daemon_config(sock, blocks, port))
    serve = [*kvstore_command("serve", "--config", str(config)), "--log-level", "warning"]
    async with child(serve, log) as proc:
        await serving(proc, f"unix:{sock}", log)
        yield f"unix:{sock}", port


async def bench_size(
    blocks: int, calls: int, scratch: Path, put_blocks: int, duty: float
) -> list[Phase]:
    async with (
        daemon(scratch, blocks) as (address, port),
        AsyncKVStoreClient(address, timeout=120, staging_bytes=8 << 20) as client,
    ):
        filled = int(FILL * blocks) // CHAIN
        print(f"  {blocks} blocks: filling {filled} chains", file=sys.stderr, flush=True)
        await put_chains(client, 1, filled)
        keys = new_chain(0)
        await client.put(NAMESPACE, keys, PAYLOADS)
        async with grpc.aio.insecure_channel(address) as channel:
            lease = await kvstore_pb2_grpc.KVStoreStub(channel).Acquire(
                pb.AcquireRequest(namespace=NAMESPACE.digest(), keys=keys, lease_seconds=3600)
            )
            if len(lease.slots) != CHAIN:
                raise RuntimeError(f"leased {len(lease.slots)} of {CHAIN} blocks")
            rows = [await phase("idle", blocks, client, keys, calls, port)]
            stop = multiprocessing.get_context("spawn").Event()
            proc = multiprocessing.get_context("spawn").Process(
                target=writer, args=(address, filled + 1, stop, put_blocks, duty), daemon=True
            )
            proc.start()
            try:
                deadline = time.monotonic() + PHASE_LIMIT_S
                while (await asyncio.to_thread(scrape, port)).get(EVICTED, 0) == 0:
                    if time.monotonic() > deadline:  # the first drain has not begun
                        raise RuntimeError("the writer's puts evicted nothing in 600 s")
                    await asyncio.sleep(0.05)
                rows.append(await phase("evicting", blocks, client, keys, calls, port))
            finally:
                stop.set()
                await asyncio.to_thread(proc.join, 60)
            rows.append(await phase("idle again", blocks, client, keys, calls, port))
    return rows


HEADER = ("blocks", "phase", "lookups", "p50 ms", "p99 ms", "cpu pressure", "x idle p99",
          "lag p99 ms", "lag worst ms", "evictions/s", "target", "pass/fail")  # fmt: skip


def cells(row: Phase, idle: Phase) -> tuple[str, ...]:
    ratio = row.p99_ms / idle.p99_ms
    evicting = row.phase == "evicting"
    target = f"<= {RATIO_TARGET:g}x, lag <= {LAG_TARGET_MS:g} ms" if evicting else "-"
    ok = ratio <= RATIO_TARGET and row.lag_p99_ms <= LAG_TARGET_MS
    return (str(row.blocks), row.phase, str(row.lookups), f"{row.p50_ms:.2f}",
            f"{row.p99_ms:.2f}", f"{row.cpu_pressure:.0%}",
            f"{ratio:.2f}x", f"<= {row.lag_p99_ms:g}", f"<= {row.lag_worst_ms:g}",
            f"{row.evictions / row.seconds:.0f}", target,
            ("pass" if ok else "fail") if evicting else "info")  # fmt: skip


def render(rows: Sequence[Phase], about: dict[str, str]) -> str:
    lines = ["machine: " + ", ".join(f"{k} {v}" for k, v in about.items()), ""]
    body = []
    for row in rows:
        idle = next(r for r in rows if r.blocks == row.blocks and r.phase == "idle")
        body.append(cells(row, idle))
    widths = [max(len(line[i]) for line in [HEADER, *body]) for i in range(len(HEADER))]
    for values in [HEADER, tuple("-" * w for w in widths), *body]:
        lines.append("| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True))
                     + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Lookup latency while the host tier evicts.")
    parser.add_argument("--sizes", default="20000,200000",
                        type=lambda text: [int(n) for n in text.split(",")])  # fmt: skip
    parser.add_argument("--lookups", type=int, default=300, help="timed lookups per phase")
    parser.add_argument("--put-blocks", type=int, default=CHAIN, help="blocks a put carries")
    parser.add_argument("--writer-duty", type=float, default=1.0,
                        help="share of the time the writer puts (1: never rests)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if not 0.0 < args.writer_duty <= 1.0:
        parser.error(f"--writer-duty must be in (0, 1], got {args.writer_duty}")
    about = {"cores": str(os.cpu_count()), "load avg": f"{os.getloadavg()[0]:.2f}",
             "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    scratch = Path(tempfile.mkdtemp(prefix="kvs-press-"))  # short: a unix socket path
    rows: list[Phase] = []
    try:
        for blocks in args.sizes:
            rows += uvloop.run(
                bench_size(blocks, args.lookups, scratch, args.put_blocks, args.writer_duty)
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    about["load avg after"] = f"{os.getloadavg()[0]:.2f}"
    print(render(rows, about))
    if args.json:
        args.json.write_text(json.dumps({"machine": about, "rows": [asdict(r) for r in rows]},
                                        indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
