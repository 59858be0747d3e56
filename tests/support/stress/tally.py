"""What a stress run saw: :class:`Tally` counts ops, errors and verified or wrong reads.

Each worker process (and the in-process store run) keeps one and reports it as JSON;
:func:`merge` sums the workers' reports. Details are kept for the first few wrong reads and
unexpected errors only (``MAX_DETAILS``).
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tests.support.stress.content import ChainId, identify, payload

MAX_DETAILS = 10
T = TypeVar("T")


@dataclass
class Tally:
    """What one worker (or the in-process run) saw."""

    ops: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    verified: int = 0
    wrong: int = 0
    wrong_details: list[dict[str, Any]] = field(default_factory=list)
    failures: int = 0
    failure_details: list[dict[str, Any]] = field(default_factory=list)
    written: set[ChainId] = field(default_factory=set)

    def check(
        self, op: str, plane: str, tenant: str, keys: Sequence[bytes], blocks: Sequence[bytes]
    ) -> None:
        """Counts each block as verified or wrong: block i must be ``payload(tenant, keys[i])``."""
        if len(blocks) > len(keys):
            self.fail(op, f"{len(blocks)} blocks answered for {len(keys)} keys")
        for index, (key, data) in enumerate(zip(keys, blocks, strict=False)):
            if data == payload(tenant, key):
                self.verified += 1
            else:
                self.mark_wrong(op, plane, tenant, key, index, data)

    def mark_wrong(
        self, op: str, plane: str, tenant: str, key: bytes, index: int, data: bytes | str
    ) -> None:
        self.wrong += 1
        if len(self.wrong_details) < MAX_DETAILS:
            seen = data if isinstance(data, str) else identify(data)
            self.wrong_details.append(
                {
                    "op": op,
                    "plane": plane,
                    "tenant": tenant,
                    "key": key.hex(),
                    "index": index,
                    "length": None if isinstance(data, str) else len(data),
                    "seen": seen,
                    "time": time.time(),
                }
            )

    async def unless_cancelled(
        self, work: Coroutine[Any, Any, T], after: float | None, event: str
    ) -> T | None:
        """Runs ``work``, cancelled ``after`` seconds (``None``: never); its result, or
        ``None`` counted as ``event`` when the cancel reached it before it finished."""
        call = asyncio.ensure_future(work)
        if after is not None:
            await asyncio.sleep(after)
            call.cancel()
        try:
            return await call
        except asyncio.CancelledError:
            if not call.cancelled():
                raise  # this task itself was cancelled
            self.events[event] += 1
            return None

    def fail(self, op: str, message: str, error: BaseException | None = None) -> None:
        self.failures += 1
        if len(self.failure_details) < MAX_DETAILS:
            detail: dict[str, Any] = {"op": op, "message": message, "time": time.time()}
            if error is not None:
                detail["traceback"] = "".join(traceback.format_exception(error))
            self.failure_details.append(detail)

    def report(self) -> dict[str, Any]:
        return {
            "ops": dict(self.ops),
            "errors": dict(self.errors),
            "statuses": dict(self.statuses),
            "events": dict(self.events),
            "verified": self.verified,
            "wrong": self.wrong,
            "wrong_details": self.wrong_details,
            "failures": self.failures,
            "failure_details": self.failure_details,
            "written": sorted(self.written),
        }


def merge(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The sum of worker reports."""
    total: dict[str, Any] = {"verified": 0, "wrong": 0, "failures": 0}
    for name in ("ops", "errors", "statuses", "events"):
        counter: Counter[str] = Counter()
        for report in reports:
            counter.update(report[name])
        total[name] = dict(sorted(counter.items()))
    for report in reports:
        total["verified"] += report["verified"]
        total["wrong"] += report["wrong"]
        total["failures"] += report["failures"]
    total["wrong_details"] = [d for r in reports for d in r["wrong_details"]][:MAX_DETAILS]
    total["failure_details"] = [d for r in reports for d in r["failure_details"]][:MAX_DETAILS]
    return total
