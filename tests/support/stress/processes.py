"""The daemon run's child processes: a private redis-server, and the client workers.

Workers run the module ``tests.support.stress --worker CONFIG`` (with ``-P`` and the
repository root last on ``sys.path``), log to ``worker-N.log`` and write ``worker-N.json`` in
the run's directory; :func:`collect_reports` reads those back, and says which worker hung,
crashed or wrote none.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvstore.client import KVStoreClient
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A private redis-server on a free port; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    args += ["no", "--dir", str(workdir), "--protected-mode", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on {port}") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(10)


def spawn_worker(
    stack: contextlib.ExitStack, workdir: Path, config: dict[str, Any]
) -> subprocess.Popen[bytes]:
    """Starts worker ``config["index"]``; its log file is closed when ``stack`` ends."""
    Path(config["report"]).unlink(missing_ok=True)
    log = open(workdir / f"worker-{config['index']}.log", "wb")  # noqa: SIM115
    stack.callback(log.close)
    # -P, and the repository root last on sys.path: it serves `tests` alone, and its folders
    # never stand in for installed packages (or the link tree on PYTHONPATH) of their names.
    boot = f"import runpy, sys; sys.path.append({str(ROOT)!r}); "
    boot += "runpy.run_module('tests.support.stress', run_name='__main__', alter_sys=True)"
    command = [sys.executable, "-P", "-c", boot, "--worker", json.dumps(config)]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def sample_until_done(
    client: KVStoreClient, procs: Sequence[subprocess.Popen[bytes]], deadline: float
) -> list[tuple[int, int]]:
    """(active leases, active reservations) about once a second until the workers exit."""
    samples: list[tuple[int, int]] = []
    sampled = 0.0
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if time.monotonic() - sampled >= 1.0:
            sampled = time.monotonic()
            with contextlib.suppress(Exception):
                stats = client.stats()
                samples.append((stats.active_leases, stats.active_reservations))
        time.sleep(0.05)
    return samples


def collect_reports(
    procs: Sequence[subprocess.Popen[bytes]], workdir: Path, problems: list[str]
) -> list[dict[str, Any]]:
    """The reports of the workers that finished; a problem for each other one (killed)."""
    reports = []
    for index, proc in enumerate(procs):
        if proc.returncode is None:
            proc.kill()
            proc.wait(10)
            problems.append(f"worker {index} did not finish in time; killed")
        path = workdir / f"worker-{index}.json"
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            tail = (workdir / f"worker-{index}.log").read_text(errors="replace")[-3000:]
            problems.append(f"worker {index} wrote no report (exit {proc.returncode}):\n{tail}")
            continue
        if "crashed" in report:
            problems.append(f"worker {index} crashed:\n{report['crashed']}")
            continue
        reports.append(report)
    return reports
