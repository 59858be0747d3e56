"""A worker's ops in its tenant's own namespace: puts, reads, views, lookups, deletes.

Each ``op_NAME`` method is one step of a worker task (see :class:`~.workers.Worker`), called
as ``(rng, chooser, task, tenant, plane)`` with ``tenant`` the namespace's tenant and
``plane`` the client's data plane; every block read is checked with ``Tally.check``.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc
import torch

from kvstore.client import ROOT_KEY, AsyncKVStoreClient, UnknownLeaseError, WriteStatus
from tests.support.stress.content import (
    BLOCK,
    CHAIN_BLOCKS,
    TENANTS,
    TIERS,
    Chooser,
    as_payload,
    chain_keys,
    namespace_of,
    payload,
    tensor_bytes,
)
from tests.support.stress.tally import Tally


class WorkerState:
    """What a worker's ops share: its clients by (tenant, plane), its tally, its settings."""

    index: int
    lease_ttl: float
    tally: Tally
    clients: dict[tuple[str, str], AsyncKVStoreClient]
    slow_view_running: bool
    channel: grpc.aio.Channel | None

    def _read_keys(self, chooser: Chooser, tenant: str) -> list[bytes]:
        family, branch, length = chooser.chain(tenant, read=True)
        return chain_keys(tenant, family, branch)[:length]


class WriteOps(WorkerState):
    """Puts (whole, partial, cancelled), deletes of a chain's suffix, prefetch hints."""

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
        statuses = await self.tally.unless_cancelled(
            client.put(namespace_of(tenant), part, blocks, parent=parent),
            rng.uniform(0, 0.005) if cancel else None,
            "put_cancelled",
        )
        if statuses is None:
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


class ReadOps(WorkerState):
    """Gets (bytes and ``out=`` buffers), views, lookups, and their cancelled and slow kinds."""

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
        client = self.clients[(tenant, plane)]
        blocks = await self.tally.unless_cancelled(
            client.get(namespace_of(tenant), keys), rng.uniform(0, 0.005), "get_cancelled"
        )
        if blocks is None:
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

        blocks = await self.tally.unless_cancelled(read(), rng.uniform(0, 0.005), "view_cancelled")
        if blocks is None:
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
