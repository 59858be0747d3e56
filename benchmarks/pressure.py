"""A client's lookups while another client's puts keep the host tier evicting.

    python -m benchmarks.pressure [--sizes 20000,200000] [--lookups 300] [--put-blocks 512]
                                  [--writer-duty 1.0] [--window 100] [--json out.json]

For each size ``N`` it starts two real daemons (``python -m kvstore serve``: a host tier of
``N`` blocks of 4 KiB, SSD and Redis off, default watermarks 0.95 / 0.85, the metrics
endpoint on), fills both tiers to 90% and puts one 512-key chain in the first, the measured
one, that the looking client leases for the run (so eviction never takes it). Each daemon
has a writer (a process, its own client over shm) that puts new 512-block chains,
``--put-blocks`` blocks a put, as fast as it can (or, with ``--writer-duty d``, resting
after each put so that it works ``d`` of the time), so its tier crosses the high watermark
again and again and each commit that crosses it drains it to the low one (2K evictions a
drain at 20K blocks, 20K at 200K). Once both have begun their first drain, the looking
client (this process) times lookups of its chain, one every ``PACE_S``, in windows of
``--window`` lookups in three phases that take turns:

- idle: both writers paused between puts (a commit drains before it answers);
- loaded: the other daemon's writer puts: the same load on the machine's cores, none of it
  on the measured daemon;
- evicting: the measured daemon's writer puts, and its tier evicts.

Taking turns keeps the machine's own drift (other tenants of a shared VM) out of the
ratios: the phases sample the same minutes. It goes on until each phase holds ``--lookups``
lookups and the evicting one a drain.

Per phase: the lookups' p50 / p99 from the client; the measured daemon's event-loop lag
(``kvstore_event_loop_lag_seconds``) and its held part (``kvstore_event_loop_held_seconds``:
the lag less the loop thread's wait for a core), each as the bucket bound holding the p99
and the worst, from the bucket counts' difference summed over the phase's windows; the
evictions during it; the CPU pressure (the share of the phase in which some runnable task
on the machine waited for a core, Linux PSI). Targets: p99 evicting <= 2x loaded (what the
measured daemon's own puts and eviction add, beyond what the same work anywhere on the
machine costs), held p99 evicting <= 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
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
HELD = "kvstore_event_loop_held_seconds"  # the lag less the loop thread's wait for a core
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


def writer(address: str, first_seed: int, orders: Connection, put_blocks: int, duty: float) -> None:
    """Puts new chains; after each put it rests ``(1 - duty) / duty`` times as long as the
    put took, so that it works ``duty`` of the time. Between puts it reads ``orders``:
    ``"pause"`` is answered ``"paused"`` and the writer waits for ``"go"``; ``"stop"`` ends
    it."""
    rest = (1.0 - duty) / duty

    async def obeyed() -> bool:
        """False once told to stop; returns when the writer may put."""
        while orders.poll():
            order = orders.recv()
            if order == "stop":
                return False
            while order == "pause":  # each pause is answered, paused or not yet
                orders.send("paused")
                order = await asyncio.to_thread(orders.recv)
            if order == "stop":
                return False
        return True

    async def run() -> None:
        async with AsyncKVStoreClient(address, timeout=120) as client:
            seed = first_seed
            while True:
                chain = new_chain(seed)
                for start in range(0, CHAIN, put_blocks):
                    if not await obeyed():
                        return
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


def lag_percentile(buckets: dict[float, float], q: float) -> float:
    """The upper bound (ms) of the lag bucket holding the ``q`` quantile, from the
    cumulative bucket counts (``le`` bound in seconds -> observations); NaN if none."""
    if not buckets:
        return float("nan")
    bounds = sorted(buckets.items())
    total = bounds[-1][1]
    for bound, count in bounds:
        if count >= q * total:
            return bound * 1e3
    return float("inf")


def lag_buckets(
    before: dict[str, float], after: dict[str, float], histogram: str
) -> dict[float, float]:
    """A lag histogram's cumulative bucket counts observed between two scrapes."""
    prefix = f'{histogram}_bucket{{le="'
    return {
        float(name[len(prefix) : -2]): after[name] - before.get(name, 0.0)
        for name in after
        if name.startswith(prefix)
    }


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
    windows: int
    p50_ms: float
    p99_ms: float
    cpu_pressure: float  # share of the phase some runnable task waited for a core
    lag_p99_ms: float
    lag_worst_ms: float
    held_p99_ms: float  # NaN where the daemon's kernel does not count a thread's core wait
    held_worst_ms: float
    evictions: int
    seconds: float


@dataclass(slots=True)
class Tally:
    """One phase's windows, summed."""

    spent: list[float] = field(default_factory=list)
    windows: int = 0
    lag: dict[float, float] = field(default_factory=dict)
    held: dict[float, float] = field(default_factory=dict)
    evictions: float = 0.0
    stalled_us: int = 0
    seconds: float = 0.0

    def row(self, blocks: int, name: str) -> Phase:
        return Phase(
            blocks, name, len(self.spent), self.windows, p(self.spent, 50), p(self.spent, 99),
            self.stalled_us / 1e6 / self.seconds, lag_percentile(self.lag, 0.99),
            lag_percentile(self.lag, 1.0), lag_percentile(self.held, 0.99),
            lag_percentile(self.held, 1.0), int(self.evictions), self.seconds,
        )  # fmt: skip


async def timed_lookups(client: AsyncKVStoreClient, keys: list[bytes], calls: int) -> list[float]:
    """``calls`` timed lookups, one every ``PACE_S``."""
    spent: list[float] = []
    for _ in range(calls):
        start = time.perf_counter()
        found = await client.lookup(NAMESPACE, keys)
        took = time.perf_counter() - start
        if found != CHAIN:
            raise RuntimeError(f"the leased chain lost blocks: {found} of {CHAIN} found")
        spent.append(took)
        await asyncio.sleep(PACE_S)
    return spent


def p(values: Sequence[float], q: int) -> float:
    if len(values) < 2:
        return values[0] * 1e3 if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


async def window(
    tally: Tally, client: AsyncKVStoreClient, keys: list[bytes], calls: int, port: int
) -> None:
    """``calls`` timed lookups, with the daemon's metrics and the machine's CPU pressure
    read around them, added to ``tally``."""
    before, stalled, started = (
        await asyncio.to_thread(scrape, port),
        cpu_stalled_us(),
        time.perf_counter(),
    )
    tally.spent += await timed_lookups(client, keys, calls)
    tally.stalled_us += cpu_stalled_us() - stalled
    tally.seconds += time.perf_counter() - started
    after = await asyncio.to_thread(scrape, port)
    for histogram, summed in ((LAG, tally.lag), (HELD, tally.held)):
        for bound, count in lag_buckets(before, after, histogram).items():
            summed[bound] = summed.get(bound, 0.0) + count
    tally.evictions += after[EVICTED] - before[EVICTED]
    tally.windows += 1


@contextlib.asynccontextmanager
async def daemon(scratch: Path, blocks: int) -> AsyncIterator[tuple[str, int]]:
    sock, config, log = scratch / "kvs.sock", scratch / "kvs.toml", scratch / "daemon.log"
    port = free_port()
    config.write_text(daemon_config(sock, blocks, port))
    serve = [*kvstore_command("serve", "--config", str(config)), "--log-level", "warning"]
    async with child(serve, log) as proc:
        await serving(proc, f"unix:{sock}", log)
        yield f"unix:{sock}", port


class Writer:
    """The writer process for one daemon, and the pipe that pauses and resumes it."""

    def __init__(self, address: str, first_seed: int, put_blocks: int, duty: float) -> None:
        spawn = multiprocessing.get_context("spawn")
        self._orders, theirs = spawn.Pipe()
        self.proc = spawn.Process(
            target=writer, args=(address, first_seed, theirs, put_blocks, duty), daemon=True
        )
        self.proc.start()
        theirs.close()

    async def pause(self) -> None:
        """Returns once the writer rests between puts (a commit drains before it answers,
        so nothing of its evicts any more)."""
        self._orders.send("pause")
        if not await asyncio.to_thread(self._orders.poll, 120):
            raise RuntimeError("the writer did not pause in 120 s")
        if (answer := self._orders.recv()) != "paused":
            raise RuntimeError(f"the writer answered {answer!r} to a pause")

    def resume(self) -> None:
        self._orders.send("go")

    async def close(self) -> None:
        with contextlib.suppress(OSError):  # a writer that ended has closed its end
            self._orders.send("stop")
        await asyncio.to_thread(self.proc.join, 60)
        self._orders.close()


async def filled_daemon(
    stack: contextlib.AsyncExitStack, scratch: Path, blocks: int
) -> tuple[str, int, AsyncKVStoreClient]:
    """A daemon whose host tier is filled to ``FILL``, and a client of it."""
    await asyncio.to_thread(scratch.mkdir, exist_ok=True)
    address, port = await stack.enter_async_context(daemon(scratch, blocks))
    client = await stack.enter_async_context(
        AsyncKVStoreClient(address, timeout=120, staging_bytes=8 << 20)
    )
    await put_chains(client, 1, int(FILL * blocks) // CHAIN)
    return address, port, client


async def bench_size(
    blocks: int, calls: int, scratch: Path, put_blocks: int, duty: float, window_calls: int
) -> list[Phase]:
    filled = int(FILL * blocks) // CHAIN
    print(f"  {blocks} blocks: filling {filled} chains, twice", file=sys.stderr, flush=True)
    async with contextlib.AsyncExitStack() as stack:
        address, port, client = await filled_daemon(stack, scratch / "measured", blocks)
        other, other_port, _ = await filled_daemon(stack, scratch / "other", blocks)
        keys = new_chain(0)
        await client.put(NAMESPACE, keys, PAYLOADS)
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
        lease = await kvstore_pb2_grpc.KVStoreStub(channel).Acquire(
            pb.AcquireRequest(namespace=NAMESPACE.digest(), keys=keys, lease_seconds=3600)
        )
        if len(lease.slots) != CHAIN:
            raise RuntimeError(f"leased {len(lease.slots)} of {CHAIN} blocks")
        await timed_lookups(client, keys, WARM_UP)
        here = Writer(address, filled + 1, put_blocks, duty)
        stack.push_async_callback(here.close)
        elsewhere = Writer(other, filled + 1, put_blocks, duty)
        stack.push_async_callback(elsewhere.close)
        deadline = time.monotonic() + PHASE_LIMIT_S
        for scraped in (port, other_port):  # both tiers have begun their first drain
            while (await asyncio.to_thread(scrape, scraped)).get(EVICTED, 0) == 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("the writer's puts evicted nothing in 600 s")
                await asyncio.sleep(0.05)
        idle, loaded, evicting = Tally(), Tally(), Tally()
        deadline += PHASE_LIMIT_S
        while min(len(t.spent) for t in (idle, loaded, evicting)) < calls or not evicting.evictions:
            if time.monotonic() > deadline:
                raise RuntimeError("no drain while the writer put for 600 s")
            await here.pause()
            await elsewhere.pause()  # at once after the first round: it paused before
            await window(idle, client, keys, window_calls, port)
            elsewhere.resume()
            await window(loaded, client, keys, window_calls, port)
            await elsewhere.pause()
            here.resume()
            await window(evicting, client, keys, window_calls, port)
    return [
        idle.row(blocks, "idle"),
        loaded.row(blocks, "loaded"),
        evicting.row(blocks, "evicting"),
    ]


HEADER = ("blocks", "phase", "lookups", "windows", "p50 ms", "p99 ms", "cpu pressure",
          "x idle p99", "x loaded p99", "lag p99 / worst ms", "held p99 / worst ms",
          "evictions/s", "target", "pass/fail")  # fmt: skip


def cells(row: Phase, idle: Phase, loaded: Phase) -> tuple[str, ...]:
    ratio = row.p99_ms / loaded.p99_ms
    evicting = row.phase == "evicting"
    target = f"<= {RATIO_TARGET:g}x loaded, held <= {LAG_TARGET_MS:g} ms" if evicting else "-"
    return (str(row.blocks), row.phase, str(row.lookups), str(row.windows),
            f"{row.p50_ms:.2f}", f"{row.p99_ms:.2f}", f"{row.cpu_pressure:.0%}",
            f"{row.p99_ms / idle.p99_ms:.2f}x", f"{ratio:.2f}x",
            f"<= {row.lag_p99_ms:g} / {row.lag_worst_ms:g}",
            f"<= {row.held_p99_ms:g} / {row.held_worst_ms:g}",
            f"{row.evictions / row.seconds:.0f}", target,
            ("pass" if passed(row, loaded) else "fail") if evicting else "info")  # fmt: skip


def passed(evicting: Phase, loaded: Phase) -> bool:
    """The targets: what eviction adds to a lookup's p99 over the same load on another
    daemon, and how long the daemon's own work held its loop while it evicted (the lag
    less the loop thread's wait for a core; the whole lag where the kernel does not say)."""
    held = evicting.lag_p99_ms if math.isnan(evicting.held_p99_ms) else evicting.held_p99_ms
    return evicting.p99_ms <= RATIO_TARGET * loaded.p99_ms and held <= LAG_TARGET_MS


def render(rows: Sequence[Phase], about: dict[str, str]) -> str:
    lines = ["machine: " + ", ".join(f"{k} {v}" for k, v in about.items()), ""]
    body = []
    for row in rows:
        idle, loaded = (
            next(r for r in rows if r.blocks == row.blocks and r.phase == name)
            for name in ("idle", "loaded")
        )
        body.append(cells(row, idle, loaded))
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
    parser.add_argument("--window", type=int, default=100,
                        help="lookups in a row before the phase changes")  # fmt: skip
    parser.add_argument("--writer-duty", type=float, default=1.0,
                        help="share of the time the writer puts (1: never rests)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if not 0.0 < args.writer_duty <= 1.0:
        parser.error(f"--writer-duty must be in (0, 1], got {args.writer_duty}")
    for option, value in (("--lookups", args.lookups), ("--window", args.window)):
        if value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    about = {"cores": str(os.cpu_count()), "load avg": f"{os.getloadavg()[0]:.2f}",
             "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    scratch = Path(tempfile.mkdtemp(prefix="kvs-press-"))  # short: a unix socket path
    rows: list[Phase] = []
    try:
        for blocks in args.sizes:
            rows += uvloop.run(
                bench_size(
                    blocks,
                    args.lookups,
                    scratch,
                    args.put_blocks,
                    args.writer_duty,
                    args.window,
                )
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
