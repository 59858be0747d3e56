"""A client worker process of the daemon run: ``python -m tests.support.stress --worker CONFIG``.

:class:`Worker` opens clients of every tenant on both data planes and runs ``tasks`` asyncio
tasks, each a random loop over the ops of :mod:`.worker_ops` and :mod:`.foreign_ops` weighted
by ``CLIENT_OPS``, until the run's deadline; :func:`worker_main` writes its tally as a JSON
report to the file the orchestrator named (or the traceback, if it crashed).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import grpc

from kvstore.client import (
    AsyncKVStoreClient,
    CorruptBlockError,
    DeadlineExceededError,
    UnknownLeaseError,
)
from tests.support.stress.content import TENANTS, Chooser, pick, token_of
from tests.support.stress.foreign_ops import ForeignOps
from tests.support.stress.tally import Tally
from tests.support.stress.worker_ops import ReadOps, WriteOps

# Per-op weights of a client task. Reads dominate, as in serving; puts of held chains are
# cheap DEDUPs, new blocks push others down.
CLIENT_OPS = {
    "put": 12,
    "get": 20,
    "get_out": 10,
    "view": 10,
    "view_tensors": 6,
    "lookup": 4,
    "delete": 2,
    "prefetch": 4,
    "cancel_get": 5,
    "cancel_view": 2,
    "cancel_put": 2,
    "probe": 3,
    "foreign_put": 1,
    "foreign_ns": 1,
    "slow_view": 0.3,
}
# Under load these are outcomes, not failures: a lease that expired under a slow reader, a
# call that ran past the client's timeout.
EXPECTED_ERRORS = (UnknownLeaseError, DeadlineExceededError)


class Worker(WriteOps, ReadOps, ForeignOps):
    """One client process: clients of every tenant on both planes, ``tasks`` random loops."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.address: str = config["address"]
        self.index: int = config["index"]
        self.lease_ttl: float = config["lease_ttl"]
        self.tally = Tally()
        self.clients: dict[tuple[str, str], AsyncKVStoreClient] = {}
        self.slow_view_running = False
        self.channel: grpc.aio.Channel | None = None

    async def run(self) -> dict[str, Any]:
        await self._connect()
        self.channel = grpc.aio.insecure_channel(self.address)
        started = time.monotonic()
        deadline = started + self.config["seconds"]
        try:
            await asyncio.gather(
                *(self.loop(task, deadline) for task in range(self.config["tasks"]))
            )
        finally:
            elapsed = time.monotonic() - started
            for client in self.clients.values():
                await client.aclose()
            await self.channel.close()
        report = self.tally.report()
        report["seconds"] = elapsed
        report["finished_at"] = time.time()
        return report

    async def _connect(self) -> None:
        for tenant in TENANTS:
            for plane in ("shm", "stream"):
                verify = (self.index + (plane == "stream")) % 2 == 0
                client = AsyncKVStoreClient(
                    self.address,
                    token=token_of(tenant),
                    use_shm=plane == "shm",
                    verify=verify,
                    staging_bytes=512 << 10,
                )
                await client.connect()
                if client.data_plane != plane:
                    self.tally.fail("connect", f"{tenant} {plane} client has {client.data_plane}")
                self.clients[(tenant, plane)] = client

    async def loop(self, task: int, deadline: float) -> None:
        rng = random.Random(f"{self.config['seed']}/{self.index}/{task}")
        chooser = Chooser(rng)
        while time.monotonic() < deadline:
            op = pick(rng, self.config.get("ops") or CLIENT_OPS)
            tenant = rng.choice(TENANTS)
            plane = rng.choice(("shm", "stream"))
            if op == "slow_view":
                # One at a time, and none that would outlast the run: the workers end together,
                # so that a leaked lease is still live when the orchestrator checks.
                if self.slow_view_running or time.monotonic() + self.lease_ttl + 3 > deadline:
                    continue
                plane = "shm"
            self.tally.ops[op] += 1
            try:
                await getattr(self, f"op_{op}")(rng, chooser, task, tenant, plane)
            except EXPECTED_ERRORS as error:
                self.tally.errors[type(error).__name__] += 1
            except CorruptBlockError as error:  # verify=True found bytes that are not the block's
                self.tally.errors[type(error).__name__] += 1
                self.tally.mark_wrong(op, plane, tenant, b"", -1, f"CorruptBlockError: {error}")
            except Exception as error:
                self.tally.errors[type(error).__name__] += 1
                self.tally.fail(op, f"{type(error).__name__}: {error}", error)


def worker_main(config_json: str) -> int:
    config = json.loads(config_json)
    try:
        report = asyncio.run(Worker(config).run())
    except BaseException as error:  # the orchestrator reports it
        report = {"crashed": "".join(traceback.format_exception(error))}
    Path(config["report"]).write_text(json.dumps(report))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if "crashed" not in report else 1)  # no interpreter teardown: exit at once
