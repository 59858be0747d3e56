"""The stress harness as a script: ``python -m tests.support.stress [options]``.

Runs the daemon run for ``--seconds`` and, with ``--store-seconds``, the in-process run too
(on a private redis-server unless ``--redis-url`` names one), prints both reports as JSON and
exits 1 when either has problems. With ``--worker CONFIG`` it is one of the daemon run's
client processes instead (:func:`~tests.support.stress.workers.worker_main`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tests.support.stress as package
from tests.support.stress.daemon_run import run_daemon_stress
from tests.support.stress.processes import redis_server
from tests.support.stress.store_run import run_store_stress
from tests.support.stress.workers import worker_main


def parser() -> argparse.ArgumentParser:
    description = (package.__doc__ or "").split("\n\n")[0]
    found = argparse.ArgumentParser(prog="python -m tests.support.stress", description=description)
    found.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    found.add_argument("--seconds", type=float, default=60.0, help="daemon run's load time")
    found.add_argument("--store-seconds", type=float, default=0.0, help="in-process run too")
    found.add_argument("--workers", type=int, default=4)
    found.add_argument("--tasks", type=int, default=12, help="tasks per worker process")
    found.add_argument("--store-tasks", type=int, default=32)
    found.add_argument("--seed", type=int, default=0)
    found.add_argument("--policy", default="lru", choices=["lru", "scheduler_aware"])
    found.add_argument("--host-blocks", type=int, default=48, help="the daemon's host tier")
    found.add_argument("--ssd-blocks", type=int, default=144)
    found.add_argument("--redis-blocks", type=int, default=288)
    found.add_argument("--redis-url", help="an empty Redis to use (default: start one)")
    found.add_argument("--workdir", type=Path, help="where the daemon's files go (kept)")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        report: dict[str, Any] = {}
        if args.seconds > 0:
            report["daemon_run"] = run_daemon_stress(
                workdir / "daemon-run",
                seconds=args.seconds,
                redis_url=args.redis_url,
                workers=args.workers,
                tasks=args.tasks,
                seed=args.seed,
                policy=args.policy,
                host_blocks=args.host_blocks,
                ssd_blocks=args.ssd_blocks,
                redis_blocks=args.redis_blocks,
            )
        if args.store_seconds > 0:
            url = args.redis_url or stack.enter_context(redis_server(workdir / "store-redis"))
            report["store_run"] = asyncio.run(
                run_store_stress(
                    workdir / "store-run",
                    seconds=args.store_seconds,
                    redis_url=url,
                    tasks=args.store_tasks,
                    seed=args.seed,
                )
            )
    print(json.dumps(report, indent=1, default=str))
    return 1 if any(run["problems"] for run in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
