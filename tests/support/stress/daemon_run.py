"""The daemon run: one ``kvstore serve`` on tiny tiers, client worker processes, then checks.

:func:`run_daemon_stress` starts the daemon (host + SSD + Redis, write-back all the way
down), registers the three tenants' namespaces, runs the workers (:mod:`.workers`) for the
load time, checks that no lease or reservation is left at once, runs the final scan
(:mod:`.daemon_scan`), and reads the daemon's log for tracebacks, leases that expired
unseen and reservations that expired before their commit.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.client import KVStoreClient
from tests.support.daemon import Daemon
from tests.support.stress import checks
from tests.support.stress.content import BLOCK, TENANTS, namespace_of, token_of
from tests.support.stress.daemon_scan import scan as final_scan
from tests.support.stress.processes import (
    collect_reports,
    redis_server,
    sample_until_done,
    spawn_worker,
)
from tests.support.stress.tally import merge


@dataclass
class Load:
    """What the load left for the report: the daemon's stats around it, the workers'
    reports, the samples of active leases and reservations, and the final scan."""

    before: Any
    after: Any
    samples: list[tuple[int, int]]
    load_seconds: float
    reports: list[dict[str, Any]]
    idle_lag: float
    scan: dict[str, Any]


def _kib(blocks: int, per_block: int = BLOCK) -> str:
    return f"{blocks * per_block // 1024}KiB"


def run_daemon_stress(
    workdir: Path,
    *,
    seconds: float,
    redis_url: str | None = None,
    workers: int = 4,
    tasks: int = 12,
    seed: int = 0,
    host_blocks: int = 48,
    ssd_blocks: int = 144,
    redis_blocks: int = 288,
    lease_ttl: float = 5.0,
    policy: str = "lru",
) -> dict[str, Any]:
    """Runs the multi-process load against one daemon; see the package docstring.

    Returns:
        The report: ``verified`` / ``wrong`` reads, ``failures`` (unexpected errors),
        ``problems`` (every check that failed, as text; empty on a healthy run), ops and
        errors by kind, the daemon's counters and per-second rates.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        if redis_url is None:
            redis_url = stack.enter_context(redis_server(workdir / "redis"))
        daemon = Daemon(
            workdir / "daemon",
            host_capacity=_kib(host_blocks),
            ssd_capacity=_kib(ssd_blocks, BLOCK + 1024),
            tokens=[f"{token_of(t)}:{t}" for t in TENANTS],
            settings=_settings(redis_url, redis_blocks, lease_ttl, policy),
        )
        stack.callback(daemon.close)
        daemon.start()
        config = {"seed": seed, "seconds": seconds, "tasks": tasks, "lease_ttl": lease_ttl}
        load = _load(daemon, workdir, workers, config, problems)
        log_text = daemon.log_path.read_text(errors="replace")
        if "Traceback" in log_text:
            at = log_text.index("Traceback")
            problems.append(f"a traceback in the daemon log:\n{log_text[at - 200 : at + 3000]}")
    total = _report(load, log_text, seconds, workers, tasks, problems)
    total["problems"] = problems
    return total


def _settings(
    redis_url: str, redis_blocks: int, lease_ttl: float, policy: str
) -> dict[str, dict[str, Any]]:
    prefix = f"stress-{os.getpid()}-{random.getrandbits(32):08x}"
    return {
        "ssd": {"write_policy": "write_back"},
        "redis": {
            "enabled": True,
            "url": redis_url,
            "capacity": _kib(redis_blocks, BLOCK + 1024),
            "write_policy": "write_back",
            "key_prefix": prefix,
            "ttl": "0s",
        },
        "eviction": {"policy": policy, "high_watermark": 0.9, "low_watermark": 0.75},
        "server": {"lease_ttl": f"{lease_ttl}s"},
    }


def _load(
    daemon: Daemon, workdir: Path, workers: int, config: dict[str, Any], problems: list[str]
) -> Load:
    """Runs the workers against ``daemon``, then the idle check and the final scan."""
    with contextlib.ExitStack() as clients:
        stats_client = clients.enter_context(
            KVStoreClient(daemon.address, token=token_of(TENANTS[0]))
        )
        for tenant in TENANTS:  # every namespace exists: foreign calls must be refused
            with KVStoreClient(daemon.address, token=token_of(tenant)) as client:
                client.register(namespace_of(tenant))
        before = stats_client.stats()
        procs = []
        for index in range(workers):
            report = str(workdir / f"worker-{index}.json")
            worker = {"address": daemon.address, "index": index, **config, "report": report}
            procs.append(spawn_worker(clients, workdir, worker))
        started = time.monotonic()
        samples = sample_until_done(stats_client, procs, started + config["seconds"] + 180)
        load_seconds = time.monotonic() - started
        reports = collect_reports(procs, workdir, problems)
        idle_lag = _check_idle(stats_client, reports, config["lease_ttl"], problems)
        written = {tuple(c) for r in reports for c in r["written"]}
        scan = final_scan(daemon.address, written)
        if scan["leases_after"]:
            problems.append(f"{scan['leases_after']} leases active after the final scan")
        if scan["unheld_after_put"]:
            problems.append(
                f"{scan['unheld_after_put']} chains not held after a whole put at idle:\n"
                + "\n".join(scan["unheld_details"])
            )
        after = stats_client.stats()
        if not daemon.running:
            problems.append("the daemon exited")
        elif not stats_client.health():
            problems.append("the daemon's health is not SERVING")
    return Load(before, after, samples, load_seconds, reports, idle_lag, scan)


def _check_idle(
    stats_client: KVStoreClient,
    reports: list[dict[str, Any]],
    lease_ttl: float,
    problems: list[str],
) -> float:
    """Idle: every lease and reservation must be back at once (the clients released theirs
    before they exited; only the daemon's own clean-ups may still run), well before the lease
    lifetime would end a leaked one by itself. Returns how long after the last worker's end
    the check began."""
    idle_at = time.monotonic()
    idle_lag = time.time() - max((r["finished_at"] for r in reports), default=time.time())
    while True:
        idle = stats_client.stats()
        if idle.active_leases == 0 and idle.active_reservations == 0:
            break
        if time.monotonic() - idle_at > min(1.0, lease_ttl / 4):
            problems.append(
                f"not idle after the clients left: {idle.active_leases} leases, "
                f"{idle.active_reservations} reservations still active"
            )
            break
        time.sleep(0.05)
    return idle_lag


def _report(
    load: Load, log_text: str, seconds: float, workers: int, tasks: int, problems: list[str]
) -> dict[str, Any]:
    """The merged report of the run; appends the checks that failed to ``problems``."""
    reports, scan = load.reports, load.scan
    total = merge(reports)
    expired_in_log = len(re.findall(r"kvstore\.leases: lease \d+ expired", log_text))
    total["scan"] = {k: v for k, v in scan.items() if k not in ("wrong_details", "unheld_details")}
    total["wrong"] += scan["wrong"]
    total["wrong_details"] += scan["wrong_details"]
    daemon_counters = checks.counters(load.before, load.after)
    total["daemon"] = daemon_counters
    total["daemon"]["max_active_leases"] = max((s[0] for s in load.samples), default=0)
    total["daemon"]["max_active_reservations"] = max((s[1] for s in load.samples), default=0)
    total["daemon"]["leases_expired_in_log"] = expired_in_log
    total["idle_check_lag_seconds"] = round(load.idle_lag, 2)
    total["seconds"] = round(load.load_seconds, 1)
    total["workers"], total["tasks_per_worker"] = workers, tasks
    checks.rates(total, sum(r["seconds"] for r in reports) / max(1, len(reports)))
    problems += checks.problems(total, seconds, check_tiers=("host", "ssd", "redis"))
    _log_checks(total, log_text, expired_in_log, problems)
    if daemon_counters["corrupt_blocks"]:
        problems.append(f"{daemon_counters['corrupt_blocks']} corrupt block copies found")
    if daemon_counters["corrupt_writes"]:
        problems.append(f"{daemon_counters['corrupt_writes']} puts did not match their checksum")
    return total


def _log_checks(
    total: dict[str, Any], log_text: str, expired_in_log: int, problems: list[str]
) -> None:
    """Reservations and leases that the daemon had to expire, against what clients saw."""
    # No writer here stalls for a lease lifetime between Reserve and Commit: a reservation
    # the daemon had to expire was stranded (its writer was told otherwise, or not at all).
    stranded = log_text.count("expired before commit; freed")
    if stranded:
        problems.append(
            f"{stranded} reservations expired before their commit (stranded; statuses seen by "
            f"the writers: {total['statuses']})"
        )
    total["daemon"]["reservations_expired_in_log"] = stranded
    # Every lease the daemon expired should be one a client saw expire (a slow reader); more
    # means leases stayed held after their use ended, until the daemon took them back.
    seen = total["events"].get("slow_view_expired", 0) + total["errors"].get("UnknownLeaseError", 0)
    if expired_in_log > seen + max(3, seen // 5):
        problems.append(
            f"{expired_in_log} leases expired on the daemon, but clients saw only {seen} "
            f"expire: leases outlive their use (leaked until lease_ttl)"
        )
