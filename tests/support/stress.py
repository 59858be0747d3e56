"""A concurrency stress harness: a real daemon on tiny tiers, many client processes and tasks.

Two runs, each of which checks every byte it reads against content derived from the block's
key and the tenant whose namespace holds it (``payload(tenant, key)``: SHAKE-256 of both), so
that another block's bytes, another tenant's bytes, a torn or reused slot all read as *wrong*:

- :func:`run_daemon_stress`: one ``kvstore serve`` (host + SSD + the real Redis, write-back
  all the way down, tiers a few dozen blocks each so eviction, demotion and promotion run all
  the time), three tenants with tokens, and ``workers`` client processes
  (``python stress.py --worker CONFIG``), each with ``tasks`` asyncio tasks doing a random mix
  of puts (shm and stream planes), gets (bytes and ``out=`` buffers), views, lookups, deletes
  of a chain's suffix, prefetch hints, cancelled gets/views/puts, slow readers whose lease
  expires, probes of another tenant's keys under the tenant's own namespace (must miss or
  read the tenant's own content) and calls on another tenant's namespace digest (must be
  refused). At the end: no lease or reservation left once the clients are gone (checked at
  once, well inside the lease lifetime), no lease expired on the daemon that no client saw
  expire and no reservation expired before its commit (both counted in the daemon's log), the
  daemon alive, SERVING and without a traceback in its log, every chain ever written reads
  back exactly (both planes, with ``verify``, and a view), and a whole put of each chain at
  idle leaves all of it held (a DEDUP for a block nobody can read is a lost write).
- :func:`run_store_stress`: the same kind of load on an in-process
  :class:`kvstore.store.BlockStore` (host + SSD + Redis tiers), including ``acquire`` read
  through the tenant's arena mapping (released by owner; a release by another tenant must be
  refused), ``reserve``/``commit`` writes, ``get_layer``, and puts, reserves and gets that are
  cancelled midway (as the daemon's streams are when their client goes away).

Both return a JSON-able report whose ``problems`` list is empty on a healthy run. Chains come
from a small fixed universe (families of prompts sharing prefix blocks, branches sharing the
family prefix) so different tasks and processes write the same keys: DEDUP, shared parents
and concurrent promotions of one block happen constantly.

As a script (prints the report as JSON; exit status 1 when there are problems)::

    python tests/support/stress.py --seconds 600 [--workers 4] [--tasks 12] [--store-seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import mmap
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from kvstore.client import (  # noqa: E402
    ROOT_KEY,
    AsyncKVStoreClient,
    CorruptBlockError,
    DeadlineExceededError,
    KVStoreClient,
    ModelFingerprint,
    Namespace,
    PermissionDeniedError,
    UnknownLeaseError,
    WriteStatus,
    block_keys,
)
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb  # noqa: E402
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc  # noqa: E402

__all__ = [
    "BLOCK",
    "MODEL",
    "TENANTS",
    "payload",
    "run_daemon_stress",
    "run_store_stress",
]

# 2 layers x (k, v) x 2 kv heads x 16 tokens x 32 head dim x fp16 = 8 KiB per block.
MODEL = ModelFingerprint("stress", 2, 2, 32, "float16", block_tokens=16)
LAYOUT = MODEL.layout()
BLOCK = LAYOUT.payload_bytes
TENANTS = ("alpha", "beta", "gamma")
TIERS = {"host", "ssd", "redis"}

# The chain universe: FAMILIES prompts of PREFIX_BLOCKS shared blocks, each with BRANCHES
# continuations of BRANCH_BLOCKS blocks: 5 * 2 + 5 * 5 * 4 = 110 distinct blocks per tenant,
# 330 for the three: more than the tiers hold together, so blocks also leave the bottom tier.
FAMILIES, BRANCHES, PREFIX_BLOCKS, BRANCH_BLOCKS = 5, 5, 2, 4
CHAIN_BLOCKS = PREFIX_BLOCKS + BRANCH_BLOCKS

# Per-op weights of a client task (daemon run) and of a store task (in-process run). Reads
# dominate, as in serving; puts of held chains are cheap DEDUPs, new blocks push others down.
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
STORE_OPS = {
    "put": 10,
    "reserve": 5,
    "get": 20,
    "acquire": 20,
    "get_layer": 3,
    "lookup": 4,
    "delete": 2,
    "prefetch": 4,
    "cancel_get": 4,
    "probe": 4,
    "foreign_put": 1,
    "wrong_owner": 1,
    "cancel_reserve": 2,
    "cancel_put": 2,
}
# Under load these are outcomes, not failures: a lease that expired under a slow reader, a
# call that ran past the client's timeout.
EXPECTED_ERRORS = (UnknownLeaseError, DeadlineExceededError)
MAX_DETAILS = 10


def token_of(tenant: str) -> str:
    return f"stress-token-{tenant}"


def namespace_of(tenant: str) -> Namespace:
    return Namespace(MODEL, tenant)


# -- content ---------------------------------------------------------------------------------

_payloads: dict[tuple[str, bytes], bytes] = {}
_keys: dict[tuple[str, int, int], list[bytes]] = {}


def payload(tenant: str, key: bytes) -> bytes:
    """What a block of ``key`` must hold in ``tenant``'s namespace."""
    found = _payloads.get((tenant, key))
    if found is None:
        data = b"kvstore-stress\0" + tenant.encode() + b"\0" + key
        found = _payloads[(tenant, key)] = hashlib.shake_256(data).digest(BLOCK)
    return found


def chain_tokens(family: int, branch: int) -> list[int]:
    prefix = [100_000 * family + i for i in range(PREFIX_BLOCKS * MODEL.block_tokens)]
    rest = [
        100_000 * family + 1_000 * (branch + 1) + i
        for i in range(BRANCH_BLOCKS * MODEL.block_tokens)
    ]
    return prefix + rest


def chain_keys(key_tenant: str, family: int, branch: int) -> list[bytes]:
    """The full chain's keys, computed in ``key_tenant``'s namespace."""
    found = _keys.get((key_tenant, family, branch))
    if found is None:
        found = block_keys(chain_tokens(family, branch), namespace_of(key_tenant))
        assert len(found) == CHAIN_BLOCKS
        _keys[(key_tenant, family, branch)] = found
    return found


def identify(data: bytes) -> str:
    """What some wrong bytes are, if they are any block of the universe (a diagnosis)."""
    if data == bytes(len(data)):
        return "all zeros"
    for key_tenant in TENANTS:
        for family in range(FAMILIES):
            for branch in range(BRANCHES):
                for index, key in enumerate(chain_keys(key_tenant, family, branch)):
                    for tenant in TENANTS:
                        if payload(tenant, key)[:64] == data[:64]:
                            same = "whole block" if payload(tenant, key) == data else "prefix"
                            return (
                                f"{same} of tenant {tenant!r}'s block {key.hex()[:16]} "
                                f"(keys of {key_tenant!r}, family {family} branch {branch} "
                                f"index {index})"
                            )
    return "unknown bytes"


ChainId = tuple[str, str, int, int]  # (namespace tenant, key tenant, family, branch)


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


class Chooser:
    """Random chains of the universe, biased towards recently written ones (reads hit)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.recent: deque[tuple[str, int, int]] = deque(maxlen=64)

    def chain(self, tenant: str, *, read: bool) -> tuple[int, int, int]:
        """(family, branch, length) for ``tenant``."""
        rng = self.rng
        mine = [c for c in self.recent if c[0] == tenant] if read else []
        if mine and rng.random() < 0.7:
            _, family, branch = rng.choice(mine)
        else:
            family, branch = rng.randrange(FAMILIES), rng.randrange(BRANCHES)
        length = CHAIN_BLOCKS if rng.random() < 0.5 else rng.randint(1, CHAIN_BLOCKS)
        return family, branch, length

    def wrote(self, tenant: str, family: int, branch: int) -> None:
        self.recent.append((tenant, family, branch))


def pick(rng: random.Random, weights: dict[str, float]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def as_payload(rng: random.Random, data: bytes, *, tensors: bool = True) -> Any:
    """The same bytes as one of the payload types ``put`` takes (the store takes buffers;
    the client also tensors)."""
    kind = rng.randrange(4 if tensors else 3)
    if kind == 0:
        return data
    if kind == 1:
        return bytearray(data)
    if kind == 2:
        return memoryview(data)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.float16)
    return tensor.view(
        LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.block_tokens, LAYOUT.head_dim
    )


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


# -- worker process (daemon run) -------------------------------------------------------------


class Worker:
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

    # Each op: (rng, chooser, task, tenant, plane); tenant is the namespace's tenant.

    async def op_put(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        await self._put(rng, chooser, tenant, tenant, plane)

    async def op_foreign_put(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        """Another tenant's keys, stored in this tenant's namespace with this tenant's content."""
        other = rng.choice([t for t in TENANTS if t != tenant])
        await self._put(rng, chooser, tenant, other, plane)

    async def _put(
        self,
        rng: random.Random,
        chooser: Chooser,
        tenant: str,
        key_tenant: str,
        plane: str,
        cancel: bool = False,
    ) -> None:
        family, branch, length = chooser.chain(tenant, read=False)
        keys = chain_keys(key_tenant, family, branch)[:length]
        start = 0 if rng.random() < 0.6 else rng.randrange(length)
        parent = ROOT_KEY if start == 0 else keys[start - 1]
        part = keys[start:]
        blocks = [as_payload(rng, payload(tenant, key)) for key in part]
        client = self.clients[(tenant, plane)]
        self.tally.written.add((tenant, key_tenant, family, branch))
        call = asyncio.ensure_future(client.put(namespace_of(tenant), part, blocks, parent=parent))
        if cancel:
            await asyncio.sleep(rng.uniform(0, 0.005))
            call.cancel()
        try:
            statuses = await call
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            self.tally.events["put_cancelled"] += 1
            return
        if len(statuses) != len(part):
            self.tally.fail("put", f"{len(statuses)} statuses for {len(part)} blocks")
        for status in statuses:
            self.tally.statuses[status.name] += 1
            if status is WriteStatus.CHECKSUM_MISMATCH:
                self.tally.fail("put", f"CHECKSUM_MISMATCH on {plane} for correct bytes")
        if key_tenant == tenant:
            chooser.wrote(tenant, family, branch)

    async def op_cancel_put(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        await self._put(rng, chooser, tenant, tenant, plane, cancel=True)

    async def op_get(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        keys = self._read_keys(chooser, tenant)
        blocks = await self.clients[(tenant, plane)].get(namespace_of(tenant), keys)
        self.tally.check("get", plane, tenant, keys, [bytes(b) for b in blocks])

    async def op_get_out(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        keys = self._read_keys(chooser, tenant)
        client = self.clients[(tenant, plane)]
        if rng.random() < 0.5:
            out: list[Any] = [bytearray(BLOCK) for _ in keys]
            got = await client.get(namespace_of(tenant), keys, out=out)
            blocks = [bytes(b) for b in got]
        else:
            out = [torch.empty(BLOCK, dtype=torch.uint8) for _ in keys]
            got = await client.get(namespace_of(tenant), keys, out=out)
            blocks = [tensor_bytes(t) for t in got]
        if any(a is not b for a, b in zip(got, out, strict=False)):
            self.tally.fail("get_out", "get(out=...) did not return the out buffers")
        self.tally.check("get_out", plane, tenant, keys, blocks)

    async def op_view(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        keys = self._read_keys(chooser, tenant)
        hold = rng.uniform(0, 0.005) if rng.random() < 0.5 else 0.0
        async with self.clients[(tenant, plane)].view(namespace_of(tenant), keys) as views:
            if hold:
                await asyncio.sleep(hold)  # the slots must stay the blocks' while leased
            blocks = [bytes(v) for v in views]
        self.tally.check("view", plane, tenant, keys, blocks)  # only once the lease was valid

    async def op_view_tensors(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        keys = self._read_keys(chooser, tenant)
        client = self.clients[(tenant, plane)]
        async with client.view_tensors(namespace_of(tenant), keys) as tensors:
            await asyncio.sleep(0)
            blocks = [tensor_bytes(t) for t in tensors]
        self.tally.check("view_tensors", plane, tenant, keys, blocks)

    async def op_slow_view(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        """Holds a view past the lease's lifetime: the exit must say the lease expired, or
        else the bytes must still be right."""
        keys = self._read_keys(chooser, tenant)
        self.slow_view_running = True
        try:
            manager = self.clients[(tenant, plane)].view(namespace_of(tenant), keys)
            try:
                async with manager as views:
                    held = len(views)
                    await asyncio.sleep(self.lease_ttl + 2.0)
                    blocks = [bytes(v) for v in views]
            except UnknownLeaseError:
                self.tally.events["slow_view_expired"] += 1
                return
            if held:
                self.tally.events["slow_view_not_expired"] += 1
            self.tally.check("slow_view", plane, tenant, keys, blocks)
        finally:
            self.slow_view_running = False

    async def op_cancel_get(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        keys = self._read_keys(chooser, tenant)
        call = asyncio.ensure_future(self.clients[(tenant, plane)].get(namespace_of(tenant), keys))
        await asyncio.sleep(rng.uniform(0, 0.005))
        call.cancel()
        try:
            blocks = await call
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            self.tally.events["get_cancelled"] += 1
            return
        self.tally.check("cancel_get", plane, tenant, keys, [bytes(b) for b in blocks])

    async def op_cancel_view(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        keys = self._read_keys(chooser, tenant)
        client = self.clients[(tenant, plane)]

        async def read() -> list[bytes]:
            async with client.view(namespace_of(tenant), keys) as views:
                await asyncio.sleep(0.002)
                return [bytes(v) for v in views]

        call = asyncio.ensure_future(read())
        await asyncio.sleep(rng.uniform(0, 0.005))
        call.cancel()
        try:
            blocks = await call
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            self.tally.events["view_cancelled"] += 1
            return
        self.tally.check("cancel_view", plane, tenant, keys, blocks)

    async def op_lookup(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        keys = self._read_keys(chooser, tenant)
        client = self.clients[(tenant, plane)]
        if rng.random() < 0.5:
            held = await client.lookup(namespace_of(tenant), keys)
            if not 0 <= held <= len(keys):
                self.tally.fail("lookup", f"lookup answered {held} for {len(keys)} keys")
        else:
            found = await client.lookup_tiers(namespace_of(tenant), keys)
            if found.num_blocks != len(found.tiers) or found.num_blocks > len(keys):
                self.tally.fail("lookup", f"lookup_tiers answered {found} for {len(keys)} keys")
            if not set(found.tiers) <= TIERS:
                self.tally.fail("lookup", f"lookup_tiers named unknown tiers: {found.tiers}")

    async def op_delete(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        family, branch, _ = chooser.chain(tenant, read=True)
        keys = chain_keys(tenant, family, branch)
        # Mostly a branch's suffix; rarely block 0, which takes the whole family with it.
        first = 0 if rng.random() < 0.03 else rng.randrange(1, CHAIN_BLOCKS)
        deleted = await self.clients[(tenant, plane)].delete(namespace_of(tenant), [keys[first]])
        if deleted < 0:
            self.tally.fail("delete", f"delete answered {deleted}")
        self.tally.events["deleted_blocks"] += deleted

    async def op_prefetch(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        chains = [self._read_keys(chooser, tenant) for _ in range(rng.randint(1, 3))]
        session = f"w{self.index}-t{task}"
        queued = await self.clients[(tenant, plane)].prefetch(session, namespace_of(tenant), chains)
        if not 0 <= queued <= sum(len(c) for c in chains):
            self.tally.fail("prefetch", f"prefetch queued {queued} blocks")

    async def op_probe(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        """Another tenant's keys asked in this tenant's namespace: a miss, or this tenant's
        own content (when it stored those keys itself, see ``foreign_put``)."""
        other = rng.choice([t for t in TENANTS if t != tenant])
        family, branch, length = chooser.chain(other, read=True)
        keys = chain_keys(other, family, branch)[:length]
        blocks = await self.clients[(tenant, plane)].get(namespace_of(tenant), keys)
        self.tally.events["probe_hits" if blocks else "probe_misses"] += 1
        self.tally.check("probe", plane, tenant, keys, [bytes(b) for b in blocks])

    async def op_foreign_ns(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        """Calls on another tenant's namespace digest with this tenant's token: refused."""
        other = rng.choice([t for t in TENANTS if t != tenant])
        family, branch, length = chooser.chain(other, read=True)
        keys = chain_keys(other, family, branch)[:length]
        digest = namespace_of(other).digest()
        method = rng.choice(["client", "Lookup", "Get", "Acquire", "Delete", "Prefetch"])
        if method == "client":
            try:
                blocks = await self.clients[(tenant, plane)].get(namespace_of(other), keys)
            except PermissionDeniedError:
                self.tally.events["foreign_ns_refused"] += 1
                return
            for index, block in enumerate(blocks):
                self.tally.mark_wrong("foreign_ns", plane, tenant, keys[index], index, bytes(block))
            self.tally.fail("foreign_ns", f"{tenant} registered/read {other}'s namespace")
            return
        assert self.channel is not None
        stub = kvstore_pb2_grpc.KVStoreStub(self.channel)  # type: ignore[no-untyped-call]
        metadata = (("authorization", f"Bearer {token_of(tenant)}"),)
        try:
            if method == "Lookup":
                reply = await stub.Lookup(
                    pb.LookupRequest(namespace=digest, keys=keys), metadata=metadata, timeout=10
                )
                answered = f"{reply.num_blocks} blocks held"
            elif method == "Get":
                call = stub.Get(
                    pb.GetRequest(namespace=digest, keys=keys), metadata=metadata, timeout=10
                )
                chunks = [chunk async for chunk in call]
                answered = f"{len(chunks)} chunks"
                if chunks:
                    self.tally.mark_wrong("foreign_ns", "stream", tenant, keys[0], 0, "Get data")
            elif method == "Acquire":
                lease_id = random.getrandbits(62) | 1
                acquired = await stub.Acquire(
                    pb.AcquireRequest(namespace=digest, keys=keys, lease_id=lease_id),
                    metadata=metadata,
                    timeout=10,
                )
                answered = f"{len(acquired.slots)} slots"
                with contextlib.suppress(grpc.RpcError):
                    await stub.Release(
                        pb.ReleaseRequest(lease_id=lease_id), metadata=metadata, timeout=10
                    )
                if acquired.slots:
                    self.tally.mark_wrong("foreign_ns", "shm", tenant, keys[0], 0, "Acquire slots")
            elif method == "Delete":
                deleted = await stub.Delete(
                    pb.DeleteRequest(namespace=digest, keys=keys[-1:]),
                    metadata=metadata,
                    timeout=10,
                )
                answered = f"{deleted.num_blocks} deleted"
            else:
                queued = await stub.Prefetch(
                    pb.PrefetchRequest(
                        session_id="intruder", namespace=digest, chains=[pb.KeyChain(keys=keys)]
                    ),
                    metadata=metadata,
                    timeout=10,
                )
                answered = f"{queued.num_blocks} queued"
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.PERMISSION_DENIED:
                self.tally.events["foreign_ns_refused"] += 1
                return
            if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceededError(str(error)) from error
            self.tally.fail("foreign_ns", f"{method} on another tenant's namespace: {error.code()}")
            return
        self.tally.fail("foreign_ns", f"{method} on {other}'s namespace by {tenant}: {answered}")

    def _read_keys(self, chooser: Chooser, tenant: str) -> list[bytes]:
        family, branch, length = chooser.chain(tenant, read=True)
        return chain_keys(tenant, family, branch)[:length]


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


# -- Redis for script runs -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A private redis-server on a free port; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
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


# -- the daemon run --------------------------------------------------------------------------


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
    """Runs the multi-process load against one daemon; see the module docstring.

    Returns:
        The report: ``verified`` / ``wrong`` reads, ``failures`` (unexpected errors),
        ``problems`` (every check that failed, as text; empty on a healthy run), ops and
        errors by kind, the daemon's counters and per-second rates.
    """
    from tests.support.daemon import Daemon

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        if redis_url is None:
            redis_url = stack.enter_context(redis_server(workdir / "redis"))
        prefix = f"stress-{os.getpid()}-{random.getrandbits(32):08x}"
        daemon = Daemon(
            workdir / "daemon",
            host_capacity=_kib(host_blocks),
            ssd_capacity=_kib(ssd_blocks, BLOCK + 1024),
            tokens=[f"{token_of(t)}:{t}" for t in TENANTS],
            settings={
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
            },
        )
        stack.callback(daemon.close)
        daemon.start()
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
                config = {
                    "address": daemon.address,
                    "index": index,
                    "seed": seed,
                    "seconds": seconds,
                    "tasks": tasks,
                    "lease_ttl": lease_ttl,
                    "report": str(workdir / f"worker-{index}.json"),
                }
                Path(config["report"]).unlink(missing_ok=True)
                log = open(workdir / f"worker-{index}.log", "wb")  # noqa: SIM115
                clients.callback(log.close)
                path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
                command = [sys.executable, __file__, "--worker", json.dumps(config)]
                procs.append(
                    subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
                )
            started = time.monotonic()
            samples = _sample_until_done(stats_client, procs, started + seconds + 180)
            load_seconds = time.monotonic() - started
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
                    problems.append(
                        f"worker {index} wrote no report (exit {proc.returncode}):\n{tail}"
                    )
                    continue
                if "crashed" in report:
                    problems.append(f"worker {index} crashed:\n{report['crashed']}")
                    continue
                reports.append(report)
            # Idle: every lease and reservation must be back at once (the clients released
            # theirs before they exited; only the daemon's own clean-ups may still run), well
            # before the lease lifetime would end a leaked one by itself.
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
            written = {tuple(c) for r in reports for c in r["written"]}
            scan = _scan(daemon.address, written)
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
        log_text = daemon.log_path.read_text(errors="replace")
        if "Traceback" in log_text:
            at = log_text.index("Traceback")
            problems.append(f"a traceback in the daemon log:\n{log_text[at - 200 : at + 3000]}")
    total = merge(reports)
    expired_in_log = len(re.findall(r"kvstore\.leases: lease \d+ expired", log_text))
    total["scan"] = {k: v for k, v in scan.items() if k not in ("wrong_details", "unheld_details")}
    total["wrong"] += scan["wrong"]
    total["wrong_details"] += scan["wrong_details"]
    daemon_counters = _counters(before, after)
    total["daemon"] = daemon_counters
    total["daemon"]["max_active_leases"] = max((s[0] for s in samples), default=0)
    total["daemon"]["max_active_reservations"] = max((s[1] for s in samples), default=0)
    total["daemon"]["leases_expired_in_log"] = expired_in_log
    total["idle_check_lag_seconds"] = round(idle_lag, 2)
    total["seconds"] = round(load_seconds, 1)
    total["workers"], total["tasks_per_worker"] = workers, tasks
    _rates(total, sum(r["seconds"] for r in reports) / max(1, len(reports)))
    problems += _problems(total, seconds, check_tiers=("host", "ssd", "redis"))
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
    if daemon_counters["corrupt_blocks"]:
        problems.append(f"{daemon_counters['corrupt_blocks']} corrupt block copies found")
    if daemon_counters["corrupt_writes"]:
        problems.append(f"{daemon_counters['corrupt_writes']} puts did not match their checksum")
    total["problems"] = problems
    return total


def _sample_until_done(
    client: KVStoreClient, procs: Sequence[subprocess.Popen[bytes]], deadline: float
) -> list[tuple[int, int]]:
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


def _scan(address: str, written: set[tuple[Any, ...]]) -> dict[str, Any]:
    """Reads back every chain ever written, on both planes with verify, and a view."""
    tally = Tally()
    scan = {"chains": len(written), "held": 0, "read": 0, "short": 0}

    async def run() -> int:
        clients = {}
        for tenant in TENANTS:
            for plane in ("shm", "stream"):
                clients[(tenant, plane)] = AsyncKVStoreClient(
                    address, token=token_of(tenant), use_shm=plane == "shm", verify=True
                )
                await clients[(tenant, plane)].connect()
        try:
            for number, (tenant, key_tenant, family, branch) in enumerate(sorted(written)):
                keys = chain_keys(key_tenant, family, branch)
                namespace = namespace_of(tenant)
                shm, stream = clients[(tenant, "shm")], clients[(tenant, "stream")]
                try:
                    held = await shm.lookup(namespace, keys)
                    blocks = [bytes(b) for b in await shm.get(namespace, keys)]
                    tally.check("scan", "shm", tenant, keys, blocks)
                    scan["held"] += held
                    scan["read"] += len(blocks)
                    scan["short"] += len(blocks) < held
                    client = stream if number % 2 else shm
                    async with client.view(namespace, keys) as views:
                        tally.check("scan_view", "view", tenant, keys, [bytes(v) for v in views])
                    blocks = [bytes(b) for b in await stream.get(namespace, keys)]
                    tally.check("scan", "stream", tenant, keys, blocks)
                except CorruptBlockError as error:
                    tally.mark_wrong(
                        "scan", "verify", tenant, b"", -1, f"CorruptBlockError {error}"
                    )
            # Idle, a put of a whole chain must leave all of it held: a block answered DEDUP
            # that no read can find (twice in a row) is a write that never became visible.
            for number, (tenant, key_tenant, family, branch) in enumerate(sorted(written)):
                keys = chain_keys(key_tenant, family, branch)
                client = clients[(tenant, "shm" if number % 2 else "stream")]
                blocks = [payload(tenant, key) for key in keys]
                for _ in range(2):
                    statuses = await client.put(namespace_of(tenant), keys, blocks)
                    held = await client.lookup(namespace_of(tenant), keys)
                    if held == len(keys):
                        break
                else:
                    scan["unheld_after_put"] += 1
                    if len(unheld) < MAX_DETAILS:
                        unheld.append(
                            f"{tenant}'s chain (keys of {key_tenant}, family {family}, branch "
                            f"{branch}) put whole at idle: statuses {[s.name for s in statuses]}, "
                            f"but only {held} leading blocks held (block {keys[held].hex()[:16]})"
                        )
            stats = await clients[(TENANTS[0], "shm")].stats()
            return stats.active_leases
        finally:
            for client in clients.values():
                await client.aclose()

    unheld: list[str] = []
    scan["unheld_after_put"] = 0
    leases = asyncio.run(run())
    return {
        **scan,
        "verified": tally.verified,
        "wrong": tally.wrong,
        "wrong_details": tally.wrong_details,
        "leases_after": leases,
        "unheld_details": unheld,
    }


def _counters(before: Any, after: Any) -> dict[str, Any]:
    names = ("puts", "dedup_puts", "gets", "misses", "promotions", "demotions")
    names += ("dropped_saves", "corrupt_blocks", "corrupt_writes")
    counters: dict[str, Any] = {n: getattr(after, n) - getattr(before, n) for n in names}
    counters["blocks"] = after.blocks
    counters["tiers"] = {
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
    return counters


def _rates(total: dict[str, Any], seconds: float) -> None:
    seconds = max(seconds, 1e-9)
    total["load_seconds"] = round(seconds, 1)
    total["verified_per_second"] = round(total["verified"] / seconds)
    total["ops_per_second"] = round(sum(total["ops"].values()) / seconds)


def _problems(total: dict[str, Any], seconds: float, check_tiers: Sequence[str]) -> list[str]:
    problems = []
    if total["wrong"]:
        details = json.dumps(total["wrong_details"], indent=1)
        problems.append(f"{total['wrong']} wrong reads; first ones:\n{details}")
    if total["failures"]:
        details = "\n".join(
            f"[{d['op']}] {d['message']}\n{d.get('traceback', '')}"
            for d in total["failure_details"]
        )
        problems.append(f"{total['failures']} unexpected errors; first ones:\n{details}")
    if seconds >= 10:  # long enough that every mechanism must have run
        daemon = total["daemon"]
        for name in ("promotions", "demotions", "dedup_puts"):
            if not daemon[name]:
                problems.append(f"no {name} happened: the load did not exercise them")
        for tier in check_tiers:
            # The bottom tier fills last: it must have evicted in a run of half a minute.
            if not daemon["tiers"][tier]["evictions"] and (tier != "redis" or seconds >= 30):
                problems.append(f"no evictions from the {tier} tier")
    return problems


# -- the in-process store run ----------------------------------------------------------------


async def run_store_stress(
    workdir: Path,
    *,
    seconds: float,
    redis_url: str,
    tasks: int = 32,
    seed: int = 0,
    host_blocks: int = 32,
    ssd_blocks: int = 96,
    redis_blocks: int = 192,
    lease_ttl: float = 3.0,
    policy: str = "scheduler_aware",
) -> dict[str, Any]:
    """Runs ``tasks`` asyncio tasks against an in-process :class:`BlockStore`."""
    from kvstore.blocks import Codec, payload_checksum
    from kvstore.errors import UnknownLeaseError as UnknownLeaseErrorStore
    from kvstore.index import BlockMeta
    from kvstore.policies import eviction_policy, write_policy
    from kvstore.store import BlockStore, PutStatus, StoreTier
    from kvstore.tiers.host import HostTier
    from kvstore.tiers.redis import RedisTier
    from kvstore.tiers.ssd import SsdTier

    workdir = Path(workdir)
    prefix = f"stress-store-{os.getpid()}-{random.getrandbits(32):08x}"
    tiers = [
        StoreTier(HostTier(host_blocks * BLOCK), None, write_policy("write_through", 1)),
        StoreTier(
            SsdTier(workdir / "store-ssd", ssd_blocks * (BLOCK + 1024), fsync=False),
            Codec.LZ4_SHUFFLE,
            write_policy("write_back", 2),
        ),
        StoreTier(
            RedisTier(redis_url, redis_blocks * (BLOCK + 1024), key_prefix=prefix, timeout_s=2.0),
            Codec.LZ4,
            write_policy("write_back", 2),
            shared=True,
        ),
    ]
    store = BlockStore(
        tiers,
        eviction=eviction_policy(policy),
        high_watermark=0.9,
        low_watermark=0.75,
        lease_ttl=lease_ttl,
        maintenance_interval=0.5,
        hint_ttl=2.0,
    )
    tally = Tally()
    problems: list[str] = []
    digests = {t: namespace_of(t).digest() for t in TENANTS}
    metas = {t: BlockMeta(digests[t], MODEL.block_tokens, LAYOUT) for t in TENANTS}
    maps: dict[str, mmap.mmap] = {}
    arena_ids: dict[str, bytes] = {}

    def arena(tenant: str) -> mmap.mmap:
        if tenant not in maps:
            handle = store.arena(tenant)
            assert handle is not None
            maps[tenant] = mmap.mmap(handle.fd, handle.size, mmap.MAP_SHARED, mmap.PROT_READ)
            arena_ids[tenant] = handle.arena_id
        return maps[tenant]

    async def put(rng: random.Random, chooser: Chooser, tenant: str, key_tenant: str) -> None:
        family, branch, length = chooser.chain(tenant, read=False)
        keys = chain_keys(key_tenant, family, branch)[:length]
        start = 0 if rng.random() < 0.6 else rng.randrange(length)
        tally.written.add((tenant, key_tenant, family, branch))
        for index in range(start, length):
            parent = ROOT_KEY if index == 0 else keys[index - 1]
            data = payload(tenant, keys[index])
            checksum = payload_checksum(data) if rng.random() < 0.5 else 0
            status = await store.put(
                keys[index],
                parent,
                metas[tenant],
                as_payload(rng, data, tensors=False),
                checksum=checksum,
            )
            tally.statuses[status.name] += 1
            if status is PutStatus.CHECKSUM_MISMATCH:
                tally.fail("put", "CHECKSUM_MISMATCH for correct bytes")
        if key_tenant == tenant:
            chooser.wrote(tenant, family, branch)

    async def reserve(rng: random.Random, chooser: Chooser, tenant: str, owner: str) -> None:
        family, branch, length = chooser.chain(tenant, read=False)
        keys = chain_keys(tenant, family, branch)[:length]
        tally.written.add((tenant, tenant, family, branch))
        for index in range(length):
            parent = ROOT_KEY if index == 0 else keys[index - 1]
            reserved = await store.reserve(keys[index], parent, metas[tenant], owner=owner)
            tally.statuses[f"reserve_{reserved.status.name}"] += 1
            if reserved.status is not PutStatus.RESERVED:
                continue
            assert reserved.slot is not None
            data = payload(tenant, keys[index])
            with store.reserved_view(reserved.slot) as view:
                view[:] = data
            if rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0, 0.002))
            if rng.random() < 0.05:
                await store.abort(keys[index], digests[tenant], owner=owner)
                tally.events["reservations_aborted"] += 1
                return
            checksum = payload_checksum(data) if rng.random() < 0.5 else 0
            status = await store.commit(
                keys[index], digests[tenant], owner=owner, checksum=checksum
            )
            tally.statuses[f"commit_{status.name}"] += 1
            if status is PutStatus.CHECKSUM_MISMATCH:
                tally.fail("reserve", "CHECKSUM_MISMATCH for correct bytes")
        chooser.wrote(tenant, family, branch)

    async def get(tenant: str, keys: Sequence[bytes], op: str = "get") -> None:
        blocks = []
        for key in keys:
            block = await store.get(key, digests[tenant])
            if block is None:
                break
            if block.key != key:
                tally.fail(op, f"get({key.hex()[:16]}) answered block {block.key.hex()[:16]}")
            blocks.append(bytes(block.payload))
        tally.check(op, "store", tenant, keys, blocks)

    async def acquire(rng: random.Random, tenant: str, keys: Sequence[bytes], op: str) -> None:
        acquired = await store.acquire(keys, digests[tenant], owner=tenant)
        try:
            view = arena(tenant)
            if rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0, 0.003))  # the slots stay the blocks' meanwhile
            blocks = [view[s.offset : s.offset + s.length] for s in acquired.slots]
        except BaseException:
            with contextlib.suppress(UnknownLeaseErrorStore):
                await store.release(acquired.lease.lease_id, owner=tenant)
            raise
        try:
            await store.release(acquired.lease.lease_id, owner=tenant)
        except UnknownLeaseErrorStore:  # it expired under a slow reader: the bytes are unusable
            tally.errors["UnknownLeaseError"] += 1
            return
        if acquired.slots and acquired.arena_id != arena_ids[tenant]:
            tally.fail(op, f"acquire named arena {acquired.arena_id.hex()}, not {tenant}'s")
        tally.check(op, "arena", tenant, keys, blocks)
        for key, data, checksum in zip(keys, blocks, acquired.checksums, strict=False):
            if data == payload(tenant, key) and payload_checksum(data) != checksum:
                tally.fail(op, f"acquire answered checksum {checksum:#x} for a correct block")

    async def cancel_reserve(
        rng: random.Random, tenant: str, keys: Sequence[bytes], owner: str
    ) -> None:
        index = len(keys) - 1
        parent = ROOT_KEY if index == 0 else keys[index - 1]
        call = asyncio.ensure_future(store.reserve(keys[index], parent, metas[tenant], owner=owner))
        await asyncio.sleep(rng.uniform(0, 0.002))
        call.cancel()
        try:
            reserved = await call
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            tally.events["reserve_cancelled"] += 1
            return
        tally.statuses[f"reserve_{reserved.status.name}"] += 1
        if reserved.status is PutStatus.RESERVED:  # what the stream does when it stops
            await store.abort(keys[index], digests[tenant], owner=owner)

    async def loop(task: int, deadline: float) -> None:
        rng = random.Random(f"{seed}/store/{task}")
        chooser = Chooser(rng)
        owner = f"writer-{task}"
        while time.monotonic() < deadline:
            op = pick(rng, STORE_OPS)
            tenant = rng.choice(TENANTS)
            other = rng.choice([t for t in TENANTS if t != tenant])
            family, branch, length = chooser.chain(tenant, read=True)
            keys = chain_keys(tenant, family, branch)[:length]
            tally.ops[op] += 1
            try:
                if op == "put":
                    await put(rng, chooser, tenant, tenant)
                elif op == "foreign_put":
                    await put(rng, chooser, tenant, other)
                elif op == "reserve":
                    await reserve(rng, chooser, tenant, owner)
                elif op == "get":
                    await get(tenant, keys)
                elif op == "acquire":
                    await acquire(rng, tenant, keys, "acquire")
                elif op == "get_layer":
                    layer = rng.randrange(LAYOUT.num_layers)
                    data = await store.get_layer(keys[0], digests[tenant], layer)
                    if data is not None:
                        offset, size = LAYOUT.layer_range(layer)
                        want = payload(tenant, keys[0])[offset : offset + size]
                        if data == want:
                            tally.verified += 1
                        else:
                            tally.mark_wrong("get_layer", "store", tenant, keys[0], layer, data)
                elif op == "lookup":
                    found = await store.lookup(keys, digests[tenant])
                    if found.num_blocks != len(found.tiers) or found.num_blocks > len(keys):
                        tally.fail("lookup", f"lookup answered {found} for {len(keys)} keys")
                elif op == "delete":
                    first = 0 if rng.random() < 0.03 else rng.randrange(1, CHAIN_BLOCKS)
                    full = chain_keys(tenant, family, branch)
                    tally.events["deleted_blocks"] += await store.delete(
                        full[first], digests[tenant]
                    )
                elif op == "prefetch":
                    promoted = await store.prefetch(keys, digests[tenant])
                    if not 0 <= promoted <= len(keys):
                        tally.fail("prefetch", f"prefetch answered {promoted}")
                elif op == "cancel_get":
                    call = asyncio.ensure_future(get(tenant, keys, "cancel_get"))
                    await asyncio.sleep(rng.uniform(0, 0.002))
                    call.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await call
                elif op == "probe":
                    o_family, o_branch, o_length = chooser.chain(other, read=True)
                    foreign = chain_keys(other, o_family, o_branch)[:o_length]
                    if rng.random() < 0.5:
                        await get(tenant, foreign, "probe")
                    else:
                        await acquire(rng, tenant, foreign, "probe_acquire")
                elif op == "cancel_put":  # a Put stream cancelled while it stores a block whole
                    call = asyncio.ensure_future(put(rng, chooser, tenant, tenant))
                    await asyncio.sleep(rng.uniform(0, 0.002))
                    call.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await call
                elif op == "cancel_reserve":  # a Put stream cancelled while it lands a block
                    await cancel_reserve(rng, tenant, keys, owner)
                elif op == "wrong_owner":
                    acquired = await store.acquire(keys, digests[tenant], owner=tenant)
                    try:
                        await store.release(acquired.lease.lease_id, owner=other)
                        tally.fail("wrong_owner", f"{other} released {tenant}'s lease")
                    except UnknownLeaseErrorStore:
                        tally.events["wrong_owner_refused"] += 1
                    finally:
                        with contextlib.suppress(UnknownLeaseErrorStore):
                            await store.release(acquired.lease.lease_id, owner=tenant)
            except Exception as error:
                tally.errors[type(error).__name__] += 1
                tally.fail(op, f"{type(error).__name__}: {error}", error)

    async with store:
        for tenant in TENANTS:
            store.register_namespace(digests[tenant], tenant)
        before = store.stats()
        started = time.monotonic()
        await asyncio.gather(*(loop(task, started + seconds) for task in range(tasks)))
        load_seconds = time.monotonic() - started
        idle = store.stats()
        if idle.active_leases or idle.active_reservations:
            problems.append(
                f"not idle after the tasks ended: {idle.active_leases} leases, "
                f"{idle.active_reservations} reservations active"
            )
        # The final scan: every chain ever written reads back exactly, by get and by acquire.
        scan = Tally()
        held = read = 0
        rng = random.Random(seed)
        for tenant, key_tenant, family, branch in sorted(tally.written):
            keys = chain_keys(key_tenant, family, branch)
            held += (await store.lookup(keys, digests[tenant])).num_blocks
            blocks = []
            for key in keys:
                block = await store.get(key, digests[tenant])
                if block is None:
                    break
                blocks.append(bytes(block.payload))
            read += len(blocks)
            scan.check("scan", "store", tenant, keys, blocks)
            acquired = await store.acquire(keys, digests[tenant], owner=tenant)
            view = arena(tenant)
            scan.check(
                "scan_acquire",
                "arena",
                tenant,
                keys,
                [view[s.offset : s.offset + s.length] for s in acquired.slots],
            )
            await store.release(acquired.lease.lease_id, owner=tenant)
        del rng
        # Idle, a put of a whole chain must leave all of it held (see the daemon run's scan).
        unheld = []
        for tenant, key_tenant, family, branch in sorted(tally.written):
            keys = chain_keys(key_tenant, family, branch)
            for _ in range(2):
                statuses = [
                    await store.put(
                        key,
                        ROOT_KEY if i == 0 else keys[i - 1],
                        metas[tenant],
                        payload(tenant, key),
                    )
                    for i, key in enumerate(keys)
                ]
                found = (await store.lookup(keys, digests[tenant])).num_blocks
                if found == len(keys):
                    break
            else:
                unheld.append(
                    f"{tenant}'s chain (keys of {key_tenant}, family {family}, branch {branch}) "
                    f"put whole at idle: {[s.name for s in statuses]}, but only {found} held"
                )
        if unheld:
            problems.append(
                f"{len(unheld)} chains not held after a whole put at idle:\n"
                + "\n".join(unheld[:MAX_DETAILS])
            )
        after = store.stats()
        if after.active_leases:
            problems.append(f"{after.active_leases} leases active after the final scan")
        for view in maps.values():
            view.close()
    total = tally.report()
    del total["written"]
    total["scan"] = {
        "chains": len(tally.written),
        "held": held,
        "read": read,
        "verified": scan.verified,
        "wrong": scan.wrong,
    }
    total["wrong"] += scan.wrong
    total["wrong_details"] += scan.wrong_details
    total["daemon"] = _counters(before, after)
    total["seconds"] = round(load_seconds, 1)
    total["tasks"] = tasks
    _rates(total, load_seconds)
    problems += _problems(total, seconds, check_tiers=("host", "ssd"))
    if total["daemon"]["corrupt_blocks"] or total["daemon"]["corrupt_writes"]:
        problems.append(f"corrupt copies or writes: {total['daemon']}")
    total["problems"] = problems
    return total


def summary(report: dict[str, Any]) -> str:
    """One line of figures for logs."""
    return (
        f"{report['verified']} verified reads, {report['wrong']} wrong, "
        f"{sum(report['ops'].values())} ops in {report['load_seconds']} s "
        f"({report['verified_per_second']} verified/s, {report['ops_per_second']} ops/s), "
        f"{report['failures']} unexpected errors, errors {report['errors']}, "
        f"final scan {report['scan']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=60.0, help="daemon run's load time")
    parser.add_argument("--store-seconds", type=float, default=0.0, help="in-process run too")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=12, help="tasks per worker process")
    parser.add_argument("--store-tasks", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="lru", choices=["lru", "scheduler_aware"])
    parser.add_argument("--host-blocks", type=int, default=48, help="the daemon's host tier")
    parser.add_argument("--ssd-blocks", type=int, default=144)
    parser.add_argument("--redis-blocks", type=int, default=288)
    parser.add_argument("--redis-url", help="an empty Redis to use (default: start one)")
    parser.add_argument("--workdir", type=Path, help="where the daemon's files go (kept)")
    args = parser.parse_args(argv)
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
