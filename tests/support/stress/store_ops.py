"""The in-process run's tasks: random ops on a :class:`kvstore.store.BlockStore`.

:class:`StoreRun` holds the store, the tenants' namespace digests, block metadata and arena
mappings, and the tally; each task (:meth:`StoreRun.loop`) picks ops weighted by
``STORE_OPS``: puts, ``reserve``/``commit`` writes, gets, ``acquire`` read through the
tenant's arena mapping, ``get_layer``, lookups, deletes, prefetches, probes of another
tenant's keys, releases by the wrong owner (refused), puts, reserves and gets cancelled
midway (as the daemon's streams are when their client goes away), and the operations: a
namespace's usage (checked for sense), a flush, and a whole namespace evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.client import ROOT_KEY
from kvstore.errors import UnknownLeaseError as UnknownLeaseErrorStore
from kvstore.index import BlockMeta
from kvstore.store import BlockStore, Commit, PutStatus
from kvstore.wire.blocks import payload_checksum
from tests.support.stress.content import (
    CHAIN_BLOCKS,
    LAYOUT,
    MODEL,
    TENANTS,
    Chooser,
    as_payload,
    chain_keys,
    namespace_of,
    payload,
    pick,
)
from tests.support.stress.tally import Tally

# Per-op weights of a store task. Reads dominate, as in serving; puts of held chains are
# cheap DEDUPs, new blocks push others down.
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
    "usage": 1,
    "flush": 0.5,
    "evict_namespace": 0.2,  # the operator's `kvstore evict`: a whole tenant's cache goes
}


@dataclass
class Step:
    """One step of a store task: what its op works on (``tenant``'s namespace)."""

    rng: random.Random
    chooser: Chooser
    owner: str  # the task's writer name, for reserves
    tenant: str
    other: str  # another tenant
    family: int
    branch: int
    keys: list[bytes]  # a chain of ``tenant``'s, ``family`` and ``branch``


class StoreRun:
    """The store, the tenants' namespaces and arena mappings, and the ops of the tasks."""

    def __init__(self, store: BlockStore, seed: int) -> None:
        self.store = store
        self.seed = seed
        self.tally = Tally()
        self.digests = {t: namespace_of(t).digest() for t in TENANTS}
        self.metas = {t: BlockMeta(self.digests[t], MODEL.block_tokens, LAYOUT) for t in TENANTS}
        self.maps: dict[str, mmap.mmap] = {}
        self.arena_ids: dict[str, bytes] = {}

    def arena(self, tenant: str) -> mmap.mmap:
        if tenant not in self.maps:
            handle = self.store.arena(tenant)
            assert handle is not None
            self.maps[tenant] = mmap.mmap(handle.fd, handle.size, mmap.MAP_SHARED, mmap.PROT_READ)
            self.arena_ids[tenant] = handle.arena_id
        return self.maps[tenant]

    async def loop(self, task: int, deadline: float) -> None:
        rng = random.Random(f"{self.seed}/store/{task}")
        chooser = Chooser(rng)
        owner = f"writer-{task}"
        while time.monotonic() < deadline:
            op = pick(rng, STORE_OPS)
            tenant = rng.choice(TENANTS)
            other = rng.choice([t for t in TENANTS if t != tenant])
            family, branch, length = chooser.chain(tenant, read=True)
            keys = chain_keys(tenant, family, branch)[:length]
            step = Step(rng, chooser, owner, tenant, other, family, branch, keys)
            self.tally.ops[op] += 1
            try:
                await getattr(self, f"op_{op}")(step)
            except Exception as error:
                self.tally.errors[type(error).__name__] += 1
                self.tally.fail(op, f"{type(error).__name__}: {error}", error)

    # -- the ops, each of one Step --------------------------------------------------------

    async def op_put(self, step: Step) -> None:
        await self.put(step.rng, step.chooser, step.tenant, step.tenant)

    async def op_foreign_put(self, step: Step) -> None:
        await self.put(step.rng, step.chooser, step.tenant, step.other)

    async def op_reserve(self, step: Step) -> None:
        await self.reserve(step.rng, step.chooser, step.tenant, step.owner)

    async def op_get(self, step: Step) -> None:
        await self.get(step.tenant, step.keys)

    async def op_acquire(self, step: Step) -> None:
        await self.acquire(step.rng, step.tenant, step.keys, "acquire")

    async def op_get_layer(self, step: Step) -> None:
        tenant, keys = step.tenant, step.keys
        layer = step.rng.randrange(LAYOUT.num_layers)
        data = await self.store.get_layer(keys[0], self.digests[tenant], layer)
        if data is not None:
            offset, size = LAYOUT.layer_range(layer)
            want = payload(tenant, keys[0])[offset : offset + size]
            if data == want:
                self.tally.verified += 1
            else:
                self.tally.mark_wrong("get_layer", "store", tenant, keys[0], layer, data)

    async def op_lookup(self, step: Step) -> None:
        found = await self.store.lookup(step.keys, self.digests[step.tenant])
        if found.num_blocks != len(found.tiers) or found.num_blocks > len(step.keys):
            self.tally.fail("lookup", f"lookup answered {found} for {len(step.keys)} keys")

    async def op_delete(self, step: Step) -> None:
        first = 0 if step.rng.random() < 0.03 else step.rng.randrange(1, CHAIN_BLOCKS)
        full = chain_keys(step.tenant, step.family, step.branch)
        self.tally.events["deleted_blocks"] += await self.store.delete(
            full[first], self.digests[step.tenant]
        )

    async def op_usage(self, step: Step) -> None:
        usage = await self.store.usage_of(self.digests[step.tenant])
        copies = dict(usage.tiers)
        if usage.size != usage.blocks * LAYOUT.payload_bytes or any(
            not 0 <= count <= usage.blocks for count in copies.values()
        ):
            self.tally.fail("usage", f"usage_of answered {usage}")

    async def op_flush(self, step: Step) -> None:
        self.tally.events["flushed_blocks"] += await self.store.flush()

    async def op_evict_namespace(self, step: Step) -> None:
        self.tally.events["evicted_blocks"] += await self.store.evict_namespace(
            self.digests[step.tenant]
        )

    async def op_prefetch(self, step: Step) -> None:
        promoted = await self.store.prefetch(step.keys, self.digests[step.tenant])
        if not 0 <= promoted <= len(step.keys):
            self.tally.fail("prefetch", f"prefetch answered {promoted}")

    async def op_cancel_get(self, step: Step) -> None:
        call = asyncio.ensure_future(self.get(step.tenant, step.keys, "cancel_get"))
        await asyncio.sleep(step.rng.uniform(0, 0.002))
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call

    async def op_probe(self, step: Step) -> None:
        o_family, o_branch, o_length = step.chooser.chain(step.other, read=True)
        foreign = chain_keys(step.other, o_family, o_branch)[:o_length]
        if step.rng.random() < 0.5:
            await self.get(step.tenant, foreign, "probe")
        else:
            await self.acquire(step.rng, step.tenant, foreign, "probe_acquire")

    async def op_cancel_put(self, step: Step) -> None:
        """A Put stream cancelled while it stores a block whole."""
        call = asyncio.ensure_future(self.put(step.rng, step.chooser, step.tenant, step.tenant))
        await asyncio.sleep(step.rng.uniform(0, 0.002))
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call

    async def op_cancel_reserve(self, step: Step) -> None:
        """A Put stream cancelled while it lands a block."""
        await self.cancel_reserve(step.rng, step.tenant, step.keys, step.owner)

    async def op_wrong_owner(self, step: Step) -> None:
        tenant, other = step.tenant, step.other
        acquired = await self.store.acquire(step.keys, self.digests[tenant], owner=tenant)
        try:
            await self.store.release(acquired.lease.lease_id, owner=other)
            self.tally.fail("wrong_owner", f"{other} released {tenant}'s lease")
        except UnknownLeaseErrorStore:
            self.tally.events["wrong_owner_refused"] += 1
        finally:
            with contextlib.suppress(UnknownLeaseErrorStore):
                await self.store.release(acquired.lease.lease_id, owner=tenant)

    # -- what the ops share ----------------------------------------------------------------

    async def put(self, rng: random.Random, chooser: Chooser, tenant: str, key_tenant: str) -> None:
        family, branch, length = chooser.chain(tenant, read=False)
        keys = chain_keys(key_tenant, family, branch)[:length]
        start = 0 if rng.random() < 0.6 else rng.randrange(length)
        self.tally.written.add((tenant, key_tenant, family, branch))
        for index in range(start, length):
            parent = ROOT_KEY if index == 0 else keys[index - 1]
            data = payload(tenant, keys[index])
            checksum = payload_checksum(data) if rng.random() < 0.5 else 0
            status = await self.store.put(
                keys[index],
                parent,
                self.metas[tenant],
                as_payload(rng, data, tensors=False),
                checksum=checksum,
            )
            self.tally.statuses[status.name] += 1
            if status is PutStatus.CHECKSUM_MISMATCH:
                self.tally.fail("put", "CHECKSUM_MISMATCH for correct bytes")
        if key_tenant == tenant:
            chooser.wrote(tenant, family, branch)

    async def reserve(self, rng: random.Random, chooser: Chooser, tenant: str, owner: str) -> None:
        store, digest = self.store, self.digests[tenant]
        family, branch, length = chooser.chain(tenant, read=False)
        keys = chain_keys(tenant, family, branch)[:length]
        self.tally.written.add((tenant, tenant, family, branch))
        for index in range(length):
            parent = ROOT_KEY if index == 0 else keys[index - 1]
            meta = self.metas[tenant]
            reserved = await store.writes.reserve(keys[index], parent, meta, None, owner)
            self.tally.statuses[f"reserve_{reserved.status.name}"] += 1
            if reserved.status is not PutStatus.RESERVED:
                continue
            assert reserved.slot is not None
            data = payload(tenant, keys[index])
            with store.writes.view(reserved.slot) as view:
                view[:] = data
            if rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0, 0.002))
            if rng.random() < 0.05:
                await store.abort(keys[index], digest, owner=owner)
                self.tally.events["reservations_aborted"] += 1
                return
            checksum = payload_checksum(data) if rng.random() < 0.5 else 0
            (status,) = await store.commit([Commit(keys[index], digest, owner, checksum=checksum)])
            self.tally.statuses[f"commit_{status.name}"] += 1
            if status is PutStatus.CHECKSUM_MISMATCH:
                self.tally.fail("reserve", "CHECKSUM_MISMATCH for correct bytes")
        chooser.wrote(tenant, family, branch)

    async def get(self, tenant: str, keys: Sequence[bytes], op: str = "get") -> None:
        blocks = []
        for key in keys:
            block = await self.store.get(key, self.digests[tenant])
            if block is None:
                break
            if block.key != key:
                self.tally.fail(op, f"get({key.hex()[:16]}) answered block {block.key.hex()[:16]}")
            blocks.append(bytes(block.payload))
        self.tally.check(op, "store", tenant, keys, blocks)

    async def acquire(
        self, rng: random.Random, tenant: str, keys: Sequence[bytes], op: str
    ) -> None:
        store = self.store
        acquired = await store.acquire(keys, self.digests[tenant], owner=tenant)
        try:
            view = self.arena(tenant)
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
            self.tally.errors["UnknownLeaseError"] += 1
            return
        if acquired.slots and acquired.arena_id != self.arena_ids[tenant]:
            self.tally.fail(op, f"acquire named arena {acquired.arena_id.hex()}, not {tenant}'s")
        self.tally.check(op, "arena", tenant, keys, blocks)
        for key, data, checksum in zip(keys, blocks, acquired.checksums, strict=False):
            if data == payload(tenant, key) and payload_checksum(data) != checksum:
                self.tally.fail(op, f"acquire answered checksum {checksum:#x} for a correct block")

    async def cancel_reserve(
        self, rng: random.Random, tenant: str, keys: Sequence[bytes], owner: str
    ) -> None:
        store = self.store
        index = len(keys) - 1
        parent = ROOT_KEY if index == 0 else keys[index - 1]
        reserved = await self.tally.unless_cancelled(
            store.writes.reserve(keys[index], parent, self.metas[tenant], None, owner),
            rng.uniform(0, 0.002),
            "reserve_cancelled",
        )
        if reserved is None:
            return
        self.tally.statuses[f"reserve_{reserved.status.name}"] += 1
        if reserved.status is PutStatus.RESERVED:  # what the stream does when it stops
            await store.abort(keys[index], self.digests[tenant], owner=owner)
