"""Saves (puts) at memory speed, the daemon's CPU per GiB saved, and many writers on one daemon.

    python -m benchmarks.writers [--sizes 512KiB,8MiB] [--total 256MiB] [--rounds R]
                                 [--writers 1,2,4] [--writer-bytes 128MiB]
                                 [--writer-block 512KiB] [--json out.json]

Starts a real daemon as ``benchmarks.daemon`` does (``started_daemon``: ``kvstore serve`` on
``daemon_config``, a host tier only, a unix socket in a temporary directory) and
``max(--writers)`` writer processes (``multiprocessing``, spawn), both before this process
opens a channel. Every client is the public ``AsyncKVStoreClient(address, timeout=60,
staging_bytes=256 MiB)`` (the default window) on the shm data plane, in a namespace
without a tenant (one arena). Three measurements, each beside a limit measured in the same run:

1. put and get, per block size: ``--total`` bytes of KV-like blocks (``torch.randn`` float16)
   as one key chain per call. ``put`` (the chain deleted first, untimed), and ``get(out=)``
   into preallocated, pre-faulted tensors, every byte then compared with what was put
   (untimed; ``verified blocks`` counts them, on the put row too: the gets read what the
   puts stored). Limit: ``torch.Tensor.copy_`` of the same blocks into preallocated regions
   (and out of them for the get), as ``benchmarks.daemon``. A row is the median of
   ``--rounds`` timed rounds after one warm-up round; a round runs each op and its limit,
   alternating which goes first, 50 ms apart (``benchmarks.daemon.paired``).
2. the daemon's CPU per GiB put: after the rounds above, ``--rounds`` more puts of the same
   chain, each after an untimed delete and a 50 ms pause, each inside its own window: the
   daemon's CPU time (all its threads, read just before the put and just after it returns)
   summed over the puts and divided by the GiB they stored. Deletes fall outside every window
   (nothing is subtracted). The client's CPU (``time.process_time`` of this process) is read
   in the same windows. Before the first window the daemon is let settle (its CPU below 1%
   over 0.1 s: a new arena is pre-faulted in the background); its idle CPU rate is shown on
   the machine line, for the part of each window it could add.
   The daemon's CPU time is its process CPU clock (``clock_getcpuclockid``, nanoseconds):
   the same count as utime + stime in ``/proc/<pid>/stat`` without its 10 ms ticks (a 256
   MiB put took the daemon 60-80 ms of CPU on a 2-core VM).
3. many writers: for each ``W`` of ``--writers``, ``W`` of the writer processes, each with its
   own shm session and its own key chain (random tokens, a seed per writer) of
   ``--writer-bytes`` at ``--writer-block`` bytes a block. A put round: every writer deletes
   its chain (untimed), a 50 ms pause, then the parent releases all writers at once (one
   message on each one's pipe) and each puts its chain, timing its own put; the round lasts
   from the first writer's put start to the last one's end (``time.monotonic``, one clock
   for all processes). The limit round: the same writers each ``copy_`` its own blocks into
   its own pre-faulted regions at once, timed the same way (one torch thread per writer
   process: see ``writer_process``). Put and limit rounds alternate which goes first, 50 ms
   apart, ``--rounds`` timed rounds after a warm-up round:

       aggregate GB/s = W * writer_bytes * rounds / (sum over the timed rounds of
                        last end - first start)

   ``GB/s per writer`` is ``writer_bytes * rounds`` over the mean of the writers' summed put
   seconds; ``release to done`` sums, over the rounds, the parent's release to the last
   writer's end. The daemon's CPU per GiB is read around each put round (release to the last
   reply), the client CPU sums the writers' own CPU over their puts. After the last round
   every writer gets its chain into pre-faulted tensors and compares every byte.

The arena holds twice the most stored at once (one chain of ``--total``, or every writer's
chain) plus 64 MiB; the daemon's ``max_sessions`` must allow the writers. The machine line
includes the load average before the run: other processes on the cores skew both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import grpc
import torch
import uvloop

from kvstore.client import AsyncKVStoreClient, WriteStatus

from .daemon import (
    QUIET_SECONDS,
    TARGETS,
    THROUGHPUT,
    Chain,
    Timed,
    as_json,
    client_ops,
    clocked,
    memcpy_ops,
    model_for,
    paired,
    rate,
    started_daemon,
    table,
    throughput_cells,
)
from .tiers import (
    GB,
    MIB,
    BenchmarkError,
    Row,
    expect,
    format_size,
    machine,
    parse_size,
    positive,
    progress,
    run_rounds,
    sizes,
)

GIB = 1 << 30
WINDOW_BYTES = 256 * MIB  # every client's shm window (bytes held reserved): the default
TENANT = ""  # every namespace: none
SEED = 1000  # writer i seeds torch with SEED + i: its own tokens, so its own keys
SETTLE_SECONDS, IDLE_CPU = 0.1, 0.01  # the daemon has settled: below 1% CPU over 0.1 s
SETTLE_MOST = 30.0
MEMCPY = "torch copy_ into N buffers"


# CPU time ----------------------------------------------------------------------------------

_LIBC = ctypes.CDLL(None, use_errno=True)


def cpu_seconds(pid: int) -> float:
    """The CPU time of process ``pid`` (all its threads, user and system) so far."""
    clock = ctypes.c_int()
    if _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError(ctypes.get_errno(), f"no CPU clock for process {pid}")
    return time.clock_gettime(clock.value)


async def settled(pid: int) -> float:
    """Waits (at most ``SETTLE_MOST`` seconds) until process ``pid`` uses under ``IDLE_CPU``
    of a core over ``SETTLE_SECONDS``; its CPU seconds per second over the last of them."""
    deadline = time.monotonic() + SETTLE_MOST
    while True:
        before, start = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(SETTLE_SECONDS)
        busy = (cpu_seconds(pid) - before) / (time.monotonic() - start)
        if busy < IDLE_CPU or time.monotonic() > deadline:
            return busy


# Put and get against memcpy, and the daemon's CPU per GiB put ------------------------------


@dataclass(frozen=True, slots=True)
class PutCpu:
    """CPU seconds per GiB stored by ``puts`` puts of one chain (deletes outside)."""

    block_bytes: int
    blocks: int
    puts: int
    gbps: float  # the chain's bytes over the puts' median seconds
    daemon_cpu_s_per_gib: float
    client_cpu_s_per_gib: float


async def put_cpu(client: AsyncKVStoreClient, chain: Chain, pid: int, puts: int) -> PutCpu:
    """``puts`` puts of the chain, each after an untimed delete and a pause, each in its own
    window of the daemon's and this process's CPU time."""
    namespace, keys, blocks = chain.namespace, chain.keys, list(chain.blocks)
    daemon_cpu = client_cpu = 0.0
    seconds: list[float] = []
    await settled(pid)
    for _ in range(puts):
        await client.delete(namespace, keys)
        await asyncio.sleep(QUIET_SECONDS)
        daemon, ours = cpu_seconds(pid), time.process_time()
        statuses, spent = await clocked(client.put(namespace, keys, blocks))
        daemon_cpu += cpu_seconds(pid) - daemon
        client_cpu += time.process_time() - ours
        expect(statuses == [WriteStatus.STORED] * len(keys), f"put: {statuses}")
        seconds.append(spent)
    gib = puts * chain.total_bytes / GIB
    return PutCpu(chain.size, len(keys), puts, rate(chain, seconds), daemon_cpu / gib,
                  client_cpu / gib)  # fmt: skip


async def got_back(client: AsyncKVStoreClient, chain: Chain) -> int:
    """Gets the chain into ``chain.out`` (zeroed first), compares every byte with
    ``chain.blocks``; the blocks compared."""
    chain.out.numpy().fill(0)
    found = await client.get(chain.namespace, chain.keys, out=list(chain.out))
    expect(len(found) == len(chain.keys), f"get found {len(found)} of {len(chain.keys)} blocks")
    expect(torch.equal(chain.out, chain.blocks), "get returned other bytes")
    return len(chain.keys)


@dataclass(frozen=True, slots=True)
class Checked:
    """A throughput row, and how many blocks read back were compared with what was put."""

    row: Row
    verified_blocks: int


async def bench_size(
    client: AsyncKVStoreClient, pid: int, size: int, count: int, rounds: int
) -> tuple[list[Checked], PutCpu]:
    chain = Chain.random(model_for(size), count, tenant=TENANT)
    put, get = client_ops(client, chain)  # each get compares every byte, or raises
    gets = 0

    async def counted_get() -> float:
        nonlocal gets
        spent = await get()
        gets += 1
        return spent

    copy_in, copy_out = memcpy_ops(chain)
    steps = [
        paired("put", put, "put limit", copy_in),
        paired("get", counted_get, "get limit", copy_out),
    ]
    timed = (await run_rounds(rounds, steps)).rounds
    cpu = await put_cpu(client, chain, pid, rounds)
    verified = gets * count + await got_back(client, chain)  # the CPU loop's last put too
    await client.delete(chain.namespace, chain.keys)
    rows = [
        Row("shm", op, size, count, rate(chain, timed[op]), rate(chain, timed[f"{op} limit"]),
            MEMCPY, TARGETS["shm"])
        for op in ("put", "get")
    ]  # fmt: skip
    return [Checked(row, verified) for row in rows], cpu


# Many writers --------------------------------------------------------------------------------


async def received(conn: Connection) -> Any:
    """The next message on ``conn`` (a tuple, or ``None``: no more jobs), awaited without
    blocking the event loop.

    Raises:
        BenchmarkError: The other side sent an error (its traceback), or is gone.
    """
    if not conn.poll():
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:  # called again each loop turn until the reader is removed
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(conn.fileno(), wake)
        try:
            await ready
        finally:
            loop.remove_reader(conn.fileno())
    try:
        message = conn.recv()
    except EOFError as error:
        raise BenchmarkError("the other process exited") from error
    if message is not None and message[0] == "error":
        raise BenchmarkError(f"a writer failed:\n{message[1]}")
    return message


def writer_process(conn: Connection, index: int) -> None:
    """A writer's process: serves the parent's jobs until it sends ``None``. Its torch runs
    one thread: the client copies with threads of its own, and ``W`` processes' ``copy_``
    on torch's default threads each spin at every copy's barrier while others hold the cores
    (2 writers on 2 cores: 0.23 GB/s together against 8.6 for one)."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED + index)
    try:
        uvloop.run(writer_jobs(conn))
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))


async def writer_jobs(conn: Connection) -> None:
    """Each job: ``("open", address, block bytes, blocks)`` -> a session and a chain, then
    ``delete``, ``put``, ``copy`` and ``check`` until ``close``."""
    while (job := await received(conn)) is not None:
        _, address, size, count = job
        chain = Chain.random(model_for(size), count, tenant=TENANT)
        namespace, keys, blocks = chain.namespace, chain.keys, list(chain.blocks)
        pairs = list(zip(chain.regions, chain.blocks, strict=True))
        async with AsyncKVStoreClient(address, timeout=60, staging_bytes=WINDOW_BYTES) as client:
            expect(client.data_plane == "shm", f"writer on {client.data_plane}, not shm")
            await client.delete(namespace, keys)
            conn.send(("ready",))
            while (command := (await received(conn))[0]) != "close":
                if command == "delete":
                    await client.delete(namespace, keys)
                    conn.send(("ready",))
                elif command == "check":
                    conn.send(("checked", await got_back(client, chain)))
                else:
                    ours, start = time.process_time(), time.monotonic()
                    if command == "put":
                        statuses = await client.put(namespace, keys, blocks)
                    else:
                        for dst, src in pairs:
                            dst.copy_(src)
                    end, cpu = time.monotonic(), time.process_time() - ours
                    if command == "put":
                        expect(statuses == [WriteStatus.STORED] * count, f"put: {statuses}")
                    conn.send(("done", start, end, cpu))
            await client.delete(namespace, keys)
        conn.send(("closed",))


@dataclass(frozen=True, slots=True)
class Writer:
    index: int
    proc: BaseProcess
    conn: Connection


@contextlib.contextmanager
def writer_pool(count: int) -> Iterator[list[Writer]]:
    """``count`` writer processes (spawned: no fork of this process's threads); told to exit,
    and killed if they do not within 30 s, on exit."""
    spawn = multiprocessing.get_context("spawn")
    writers: list[Writer] = []
    try:
        for index in range(count):
            ours, theirs = spawn.Pipe()
            proc = spawn.Process(target=writer_process, args=(theirs, index), daemon=True)
            proc.start()
            theirs.close()
            writers.append(Writer(index, proc, ours))
        yield writers
    finally:
        for writer in writers:
            with contextlib.suppress(OSError):
                writer.conn.send(None)
        for writer in writers:
            writer.proc.join(30)
            if writer.proc.is_alive():
                writer.proc.kill()
                writer.proc.join()
            writer.conn.close()


async def replies(writers: Sequence[Writer], kind: str) -> list[tuple[Any, ...]]:
    got = await asyncio.gather(*(received(writer.conn) for writer in writers))
    expect(all(reply[0] == kind for reply in got), f"writers replied {got}, not {kind}")
    return got


def tell(writers: Sequence[Writer], *message: object) -> None:
    for writer in writers:
        writer.conn.send(message)


@dataclass(frozen=True, slots=True)
class Window:
    """One round of all writers at once."""

    span: float  # the first writer's start to the last one's end
    released: float  # the parent's release to the last writer's end
    each: tuple[float, ...]  # every writer's own seconds
    daemon_cpu: float  # the daemon's CPU seconds, release to the last reply
    client_cpu: float  # the writers' CPU seconds, summed


@dataclass(frozen=True, slots=True)
class WritersRow:
    """``writers`` processes putting at once, against as many copying at once."""

    writers: int
    block_bytes: int
    blocks: int  # per writer
    rounds: int
    gbps: float  # writers * bytes per writer * rounds / summed round spans
    limit_gbps: float
    limit_name: str
    writer_gbps: float  # bytes per writer * rounds / the writers' mean summed put seconds
    put_seconds: list[float]  # each writer's summed put seconds
    release_to_done_s: float
    daemon_cpu_s_per_gib: float
    client_cpu_s_per_gib: float
    verified_blocks: int

    @property
    def ratio(self) -> float:
        return self.gbps / self.limit_gbps


def all_at_once(writers: Sequence[Writer], command: str, pid: int, log: list[Window]) -> Timed:
    """One round of ``command`` (``put``: after a delete and a pause) by every writer at
    once, logged; its span in seconds."""

    async def run() -> float:
        if command == "put":
            tell(writers, "delete")
            await replies(writers, "ready")
            await asyncio.sleep(QUIET_SECONDS)
        daemon, release = cpu_seconds(pid), time.monotonic()
        tell(writers, command)
        done = await replies(writers, "done")
        daemon_cpu = cpu_seconds(pid) - daemon
        starts, ends, cpus = ([float(reply[i]) for reply in done] for i in (1, 2, 3))
        span = max(ends) - min(starts)
        each = tuple(end - start for start, end in zip(starts, ends, strict=True))
        log.append(Window(span, max(ends) - release, each, daemon_cpu, sum(cpus)))
        return span

    return run


async def bench_writers(
    writers: Sequence[Writer], address: str, pid: int, size: int, count: int, rounds: int
) -> WritersRow:
    tell(writers, "open", address, size, count)
    await replies(writers, "ready")
    await settled(pid)  # a first session's arena is pre-faulted in the background
    puts: list[Window] = []
    copies: list[Window] = []
    step = paired("put", all_at_once(writers, "put", pid, puts),
                  "copy", all_at_once(writers, "copy", pid, copies))  # fmt: skip
    await run_rounds(rounds, [step])
    tell(writers, "check")
    verified = sum(reply[1] for reply in await replies(writers, "checked"))
    tell(writers, "close")
    await replies(writers, "closed")
    puts, copies = puts[1:], copies[1:]  # the first of each: the warm-up round
    expect(len(puts) == len(copies) == rounds, "a round was lost")
    stored = len(writers) * size * count * rounds  # bytes, every writer, every round
    put_seconds = [sum(window.each[i] for window in puts) for i in range(len(writers))]
    gib = stored / GIB
    return WritersRow(
        len(writers), size, count, rounds, stored / sum(w.span for w in puts) / GB,
        stored / sum(w.span for w in copies) / GB, f"{len(writers)} x {MEMCPY} (1 thread)",
        size * count * rounds / statistics.mean(put_seconds) / GB, put_seconds,
        sum(w.released for w in puts), sum(w.daemon_cpu for w in puts) / gib,
        sum(w.client_cpu for w in puts) / gib, verified,
    )  # fmt: skip


# Running and reporting ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Report:
    rows: list[Checked]
    cpu: list[PutCpu]
    writers: list[WritersRow]
    daemon_idle_cpu: float  # CPU seconds per second, settled, before the first size


def arena_for(args: argparse.Namespace) -> int:
    """Twice the most stored at once, plus 64 MiB (as ``benchmarks.daemon``)."""
    chains = [size * (args.total // size) for size in args.sizes]
    writers = max(args.writers) * args.writer_block * (args.writer_bytes // args.writer_block)
    return int(2 * max(*chains, writers) + 64 * MIB)


async def bench_all(args: argparse.Namespace, scratch: Path) -> Report:
    most = max(args.writers)
    async with started_daemon(scratch, arena_for(args)) as up:
        sessions = up.config.server.max_sessions
        expect(most <= sessions, f"{most} writers, the daemon allows {sessions} sessions")
        with writer_pool(most) as pool:
            await up.serving()
            idle = await settled(up.pid)
            rows: list[Checked] = []
            cpu: list[PutCpu] = []
            async with AsyncKVStoreClient(
                up.address, timeout=60, staging_bytes=WINDOW_BYTES
            ) as client:
                expect(client.data_plane == "shm", "the client has no shm session")
                for size in args.sizes:
                    count = args.total // size
                    with progress(f"{format_size(size)} x {count}"):
                        checked, used = await bench_size(client, up.pid, size, count, args.rounds)
                    rows += checked
                    cpu.append(used)
            size, count = args.writer_block, args.writer_bytes // args.writer_block
            many: list[WritersRow] = []
            for writers in args.writers:
                with progress(f"{writers} writers x {format_size(size)} x {count}"):
                    many.append(
                        await bench_writers(pool[:writers], up.address, up.pid, size, count,
                                            args.rounds)
                    )  # fmt: skip
    return Report(rows, cpu, many, idle)


CHECKED = (*THROUGHPUT, "verified blocks")
CPU = ("block size", "blocks", "puts", "put GB/s", "daemon CPU s/GiB", "client CPU s/GiB")
WRITERS = ("writers", "block size", "blocks/writer", "rounds", "put GB/s (all)",
           "limit GB/s (all)", "limit name", "ratio", "GB/s per writer", "release to done s",
           "daemon CPU s/GiB", "client CPU s/GiB", "verified blocks")  # fmt: skip
RIGHT = {"verified blocks", "puts", "put GB/s", "daemon CPU s/GiB", "client CPU s/GiB",
         "writers", "blocks/writer", "rounds", "put GB/s (all)", "limit GB/s (all)",
         "GB/s per writer", "release to done s"}  # fmt: skip


def render(report: Report, about: dict[str, str], rounds: int) -> str:
    checked = [(*throughput_cells(c.row), str(c.verified_blocks)) for c in report.rows]
    cpu = [
        (format_size(c.block_bytes), str(c.blocks), str(c.puts), f"{c.gbps:.2f}",
         f"{c.daemon_cpu_s_per_gib:.3f}", f"{c.client_cpu_s_per_gib:.3f}")
        for c in report.cpu
    ]  # fmt: skip
    many = [
        (str(w.writers), format_size(w.block_bytes), str(w.blocks), str(w.rounds),
         f"{w.gbps:.2f}", f"{w.limit_gbps:.2f}", w.limit_name, f"{w.ratio:.2f}",
         f"{w.writer_gbps:.2f}", f"{w.release_to_done_s:.3f}", f"{w.daemon_cpu_s_per_gib:.3f}",
         f"{w.client_cpu_s_per_gib:.3f}", str(w.verified_blocks))
        for w in report.writers
    ]  # fmt: skip
    return "\n".join(
        [
            "machine: " + ", ".join(f"{key} {value}" for key, value in about.items()),
            f"method: put/get: median of {rounds} timed rounds after 1 warm-up round, one call"
            " per chain of N blocks; GB/s = 1e9 bytes/s; CPU: the daemon's and this process's"
            f" CPU time in {rounds} put windows (deletes outside) per GiB (2^30 bytes) stored;"
            f" writers: W * bytes * {rounds} rounds / summed round spans (first put start to"
            " last put end), after 1 warm-up round",
            "",
            *table(CHECKED, checked, RIGHT),
            "",
            *table(CPU, cpu, RIGHT),
            "",
            *table(WRITERS, many, RIGHT),
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Puts beside memcpy, the daemon's CPU per GiB put, many writers at once."
    )
    add = parser.add_argument
    add("--sizes", default="512KiB,8MiB", type=sizes, help="block sizes (default %(default)s)")
    add("--total", default="256MiB", type=parse_size, help="bytes per size (default %(default)s)")
    add("--rounds", type=positive, default=5, help="timed rounds (default 5)")
    add("--writers", default="1,2,4", type=counts, help="writer processes (default %(default)s)")
    add("--writer-bytes", default="128MiB", type=parse_size, help="per writer (%(default)s)")
    add("--writer-block", default="512KiB", type=parse_size, help="its blocks (%(default)s)")
    add("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if odd := [size for size in [*args.sizes, args.writer_block] if size % 4]:
        parser.error(f"block sizes must be multiples of 4 bytes, got {odd}")
    if big := [size for size in args.sizes if size > args.total]:
        parser.error(f"--total ({args.total}) holds no block of {big}")
    if args.writer_block > args.writer_bytes:
        parser.error(f"--writer-bytes ({args.writer_bytes}) holds no --writer-block")
    return args


def counts(text: str) -> list[int]:
    return [positive(count) for count in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    about = {key: value for key, value in machine().items() if key != "redis"}
    about |= {"grpc": grpc.__version__, "load avg": f"{os.getloadavg()[0]:.2f}"}
    scratch = Path(tempfile.mkdtemp(prefix="kvs-bench-"))  # short: a unix socket path
    try:
        report = uvloop.run(bench_all(args, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    about["daemon idle CPU"] = f"{report.daemon_idle_cpu * 1e3:.1f} ms/s"
    print(render(report, about, args.rounds))
    if args.json:
        out = {
            "machine": about,
            "rounds": args.rounds,
            "daemon_idle_cpu_s_per_s": report.daemon_idle_cpu,
            "rows": [{**as_json(c.row), "verified_blocks": c.verified_blocks} for c in report.rows],
            "put_cpu": [asdict(c) for c in report.cpu],
            "writers": [{**asdict(w), "ratio": w.ratio} for w in report.writers],
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
