"""The end-of-run figures and checks that both stress runs share.

:func:`counters` is what the daemon (or the store) counted during the run, :func:`rates` the
per-second figures, :func:`problems` the checks of a merged report (no wrong read, no
unexpected error, and, on a run long enough, every mechanism exercised) and :func:`summary`
one line of figures for logs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def counters(before: Any, after: Any) -> dict[str, Any]:
    names = ("puts", "dedup_puts", "gets", "misses", "promotions", "demotions")
    names += ("dropped_saves", "corrupt_blocks", "corrupt_writes")
    found: dict[str, Any] = {n: getattr(after, n) - getattr(before, n) for n in names}
    found["blocks"] = after.blocks
    found["tiers"] = {
        t.name: {
            "blocks": t.blocks,
            "usage_bytes": t.usage_bytes,
            "capacity_bytes": t.capacity_bytes,
            "hits": t.hits,
            "evictions": t.evictions,
            "healthy": t.healthy,
        }
        for t in after.tiers
    }
    return found


def rates(total: dict[str, Any], seconds: float) -> None:
    seconds = max(seconds, 1e-9)
    total["load_seconds"] = round(seconds, 1)
    total["verified_per_second"] = round(total["verified"] / seconds)
    total["ops_per_second"] = round(sum(total["ops"].values()) / seconds)


def problems(total: dict[str, Any], seconds: float, check_tiers: Sequence[str]) -> list[str]:
    found = []
    if total["wrong"]:
        details = json.dumps(total["wrong_details"], indent=1)
        found.append(f"{total['wrong']} wrong reads; first ones:\n{details}")
    if total["failures"]:
        details = "\n".join(
            f"[{d['op']}] {d['message']}\n{d.get('traceback', '')}"
            for d in total["failure_details"]
        )
        found.append(f"{total['failures']} unexpected errors; first ones:\n{details}")
    if seconds >= 10:  # long enough that every mechanism must have run
        daemon = total["daemon"]
        for name in ("promotions", "demotions", "dedup_puts"):
            if not daemon[name]:
                found.append(f"no {name} happened: the load did not exercise them")
        for tier in check_tiers:
            # The bottom tier fills last: it must have evicted in a run of half a minute.
            if not daemon["tiers"][tier]["evictions"] and (tier != "redis" or seconds >= 30):
                found.append(f"no evictions from the {tier} tier")
    return found


def summary(report: dict[str, Any]) -> str:
    """One line of figures for logs."""
    return (
        f"{report['verified']} verified reads, {report['wrong']} wrong, "
        f"{sum(report['ops'].values())} ops in {report['load_seconds']} s "
        f"({report['verified_per_second']} verified/s, {report['ops_per_second']} ops/s), "
        f"{report['failures']} unexpected errors, errors {report['errors']}, "
        f"final scan {report['scan']}"
    )
