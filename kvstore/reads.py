"""The read path: every block the daemon hands out is acquired (leased in the arena), read,
then released.

1. ``lookup(keys, namespace)`` -> :class:`LookupResult`: how many leading blocks are held, and
   where (shared tiers such as Redis are asked live for keys the local index lacks);
   ``lookup_and_lease`` also leases the leading ones already in the arena, as ``acquire``
   would: a host hit is then one call;
2. ``acquire(keys, namespace)`` -> :class:`Acquired`: the leading held blocks promoted into the
   host arena, their slots pinned and leased; a block already there costs no await. The
   caller reads the slots in place, then ``release(lease_id)`` ends the lease.

The ways out are this pair for different readers:

- an shm session (the client's get): the client acquires, copies or views the slots in its
  mapping of the arena, releases;
- the Get stream with a host tier: :meth:`ReadPath.held` acquires ``LEASED_BYTES`` at a time
  and hands out read-only views of the slots, whose chunks are cut straight from the arena;
- a block the arena cannot take (no host tier, or no room for it): :meth:`ReadPath.get` holds
  the node, reads a verified copy from the highest tier with one, promotes it, lets go.

``prefetch`` moves a hinted session's blocks up into the arena ahead of its acquire.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from kvstore.budget import LoopBudget
from kvstore.errors import UnknownLeaseError
from kvstore.index import Node, block_id
from kvstore.leases import LeaseTable
from kvstore.results import Acquired, Block, Lease
from kvstore.tiering import Placement, add_run
from kvstore.tiers.allocator import Slot
from kvstore.tiers.host import HostTier
from kvstore.wire.results import LookupResult

__all__ = ["HeldBlock", "ReadPath"]

LEASED_BYTES = 64 << 20  # arena bytes that one Get stream holds leased at a time


@dataclass(frozen=True, slots=True)
class HeldBlock:
    """A leased block for the Get stream: its bytes in the arena, not a copy."""

    tier: str  # where the block was found (it is in the arena now)
    payload: memoryview  # its slot, read-only; valid until the next block is asked for
    checksum: int  # xxh3-64 of the payload


class ReadPath:
    """Lookups, leases on arena slots and copies out of the tiers; see the module doc."""

    def __init__(
        self,
        placement: Placement,
        leases: LeaseTable,
        partition_of: Callable[[bytes], str],
    ) -> None:
        self._placement = placement
        self._index = placement.index
        self._top, self._host = placement.top, placement.host
        self._leases = leases
        self._partition_of = partition_of  # namespace -> the arena its blocks live in

    # -- lookup -----------------------------------------------------------------------------

    def lookup_local(self, keys: Sequence[bytes], namespace: bytes) -> LookupResult:
        """Leading blocks of ``keys`` that the local index holds (no I/O)."""
        matched, runs = self._index.match_runs(keys, namespace)
        return LookupResult(len(matched), tuple(self._placement.top_runs(runs)))

    async def lookup(self, keys: Sequence[bytes], namespace: bytes) -> LookupResult:
        """Leading blocks of ``keys`` held here or, past the local prefix, in shared tiers.

        Shared tiers are asked by block id; a read checks the stored header before handing
        bytes out.
        """
        local = self.lookup_local(keys, namespace)
        shared = [level for level in self._placement.tiers if level.shared]
        if not shared or local.num_blocks == len(keys):
            return local
        rest = [key + namespace for key in keys[local.num_blocks :]]
        runs, held = list(local.runs), local.num_blocks
        for level in shared:
            if not rest:
                break
            found = await level.tier.contains_many(rest)
            count = next((i for i, hit in enumerate(found) if not hit), len(found))
            add_run(runs, level.name, count)
            held, rest = held + count, rest[count:]
        return LookupResult(held, tuple(runs))

    async def lookup_and_lease(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        ttl: float | None,
        *,
        owner: object = None,
        lease_id: int = 0,
    ) -> tuple[LookupResult, Acquired | None]:
        """:meth:`lookup`, with the leading blocks already in the arena leased as
        :meth:`acquire` leases them: a host hit takes one call. Nothing is promoted: blocks
        below the arena are only reported (the caller acquires them, or hints them). No lease
        is granted (None) when the first block is not in the arena.
        """
        local = self.lookup_local(keys, namespace)
        resident = 0
        if self._host is not None and local.runs and local.runs[0][0] == self._top.name:
            resident = local.runs[0][1]
        acquired = None
        if resident:  # no await before the blocks are pinned: nothing evicts them first
            acquired = await self.acquire(keys[:resident], namespace, ttl, owner=owner,
                                          lease_id=lease_id)  # fmt: skip
        found = local if local.num_blocks == len(keys) else await self.lookup(keys, namespace)
        return found, acquired

    # -- acquire and release ----------------------------------------------------------------

    async def acquire(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        ttl: float | None,
        *,
        owner: object = None,
        lease_id: int = 0,
        count_stop: bool = True,
    ) -> Acquired:
        """Leases the leading held blocks of ``keys``, promoted into the arena and pinned.

        A block already in the arena costs no await (the common case: a hit on the host
        tier) but the loop's yield once a ``LoopBudget`` slice has run; its hit is counted
        as :meth:`Placement.record_hit` counts one, the counters once per call.
        ``count_stop``: count the key it stopped at (a miss, or no room) as a get that
        missed; the Get stream leaves that key to the copy read that follows.
        """
        host = self._require_host()
        nodes: list[Node] = []
        slots: list[Slot] = []
        placement = self._placement
        top = self._top.name
        find, accessed, pin = self._index.find, placement.policy.accessed, host.pin_block
        now = time.monotonic()
        tried = misses = hits = hit_bytes = 0
        budget = LoopBudget()
        try:
            for key in keys:
                if tried:  # between blocks, not after the last: a one-block call never yields
                    await budget.tick()  # the blocks so far are leased: nothing evicts them
                tried += 1
                node = find(key, namespace)
                if node is not None and node.live and top in node.tiers:
                    node.hold()  # so that promoting later blocks cannot evict this one
                    nodes.append(node)
                    node.hits += 1
                    node.last_access = now
                    accessed(node.id)
                    hits += 1
                    hit_bytes += node.size
                    slot = pin(node.id)
                else:  # not in the index (a shared tier may hold it), or below the arena
                    node = await placement.held(key, namespace)
                    if node is None:
                        misses += 1
                        break
                    node.hold()
                    nodes.append(node)
                    slot = await self._into_arena(node)
                if slot is None:
                    misses += 1  # held, but no room in the arena for it
                    break
                slots.append(slot)
        except BaseException:
            self._unpin(slots)
            raise
        finally:
            for node in nodes:
                node.let_go()
            stopped = misses if count_stop else 0  # else the copy read counts that key
            placement.count_gets(tried - misses + stopped, stopped)
            if hits:  # as Placement.record_hit counts each, for the whole call at once
                counts = placement.counts
                counts[f"hits.{top}"] += hits
                counts[f"read_bytes.{top}"] += hit_bytes
        arena_id = host.arena(self._partition_of(namespace)).arena_id
        if self._leases.released_early(lease_id, owner):  # its caller gave up: grant nothing
            self._unpin(slots)
            for node in nodes:
                await placement.settle(node)
            return Acquired(Lease(lease_id, 0, time.monotonic()), (), arena_id, ())
        leased = nodes[: len(slots)]
        lease = self._leases.grant(leased, ttl, owner=owner, lease_id=lease_id, slots=slots)
        for node in nodes[len(slots) :]:
            await placement.settle(node)
        return Acquired(lease, tuple(slots), arena_id, tuple(node.checksum for node in leased))

    async def release(self, lease_id: int, *, owner: object = None) -> None:
        """Ends a lease of ``owner``.

        Raises:
            UnknownLeaseError: the lease was never issued to ``owner``, or already ended.
        """
        await self._leases.release(lease_id, owner=owner)

    async def _into_arena(self, node: Node) -> Slot | None:
        """Promotes ``node`` if needed and pins its host slot; None when it cannot."""
        source = self._placement.tier_named(self._placement.top_tier(node))
        if not await self._placement.promote(node):
            return None
        self._placement.record_hit(node, source)
        return self._require_host().pin(node.id)

    def _unpin(self, slots: Sequence[Slot]) -> None:
        host = self._require_host()
        for slot in slots:
            host.unpin(slot)

    def _require_host(self) -> HostTier:
        assert self._host is not None  # the store refuses arena calls without a host tier
        return self._host

    # -- the Get stream ---------------------------------------------------------------------

    async def held(
        self, keys: Sequence[bytes], namespace: bytes, block_bytes: int
    ) -> AsyncGenerator[HeldBlock, None]:
        """The leading held blocks of ``keys`` as read-only views of their arena slots,
        leased (and promoted, as :meth:`acquire` does) ``LEASED_BYTES`` at a time, so that a
        long chain neither fills the arena nor waits for all of it; each slot is also pinned,
        so its bytes outlive a lease that expires under a slow reader. It stops at the first
        block it could not lease (a miss, or no room left): the caller reads the rest with
        :meth:`get`.

        Close the iterator (``contextlib.aclosing``) when stopping early: that ends its lease.
        """
        batch = max(1, LEASED_BYTES // block_bytes)
        for start in range(0, len(keys), batch):
            asked = keys[start : start + batch]
            async with self._leased(asked, namespace) as blocks:
                for block in blocks:
                    yield block
            if len(blocks) < len(asked):
                return

    @contextlib.asynccontextmanager
    async def _leased(
        self, keys: Sequence[bytes], namespace: bytes
    ) -> AsyncIterator[list[HeldBlock]]:
        """The leading held blocks of ``keys``, leased and pinned until the context exits."""
        host = self._require_host()
        found = await self.lookup(keys, namespace)  # before promotion moves them up
        acquired = await self.acquire(keys, namespace, None, owner=_OWNER, count_stop=False)
        pinned: list[Slot] = []
        views: list[memoryview] = []
        try:
            for key in keys[: len(acquired.slots)]:
                slot = host.pin(key + namespace)
                if slot is None:  # cannot happen while leased: stop rather than skip a block
                    break
                pinned.append(slot)
                views.append(host.view(slot).toreadonly())
            tiers = [*found.tiers, *[host.name] * len(views)]  # adopted while promoting
            sums = acquired.checksums
            yield [HeldBlock(*held) for held in zip(tiers, views, sums, strict=False)]
        finally:
            for view in views:
                view.release()
            for slot in pinned:
                host.unpin(slot)
            with contextlib.suppress(UnknownLeaseError):  # it expired: the pins kept the bytes
                await self.release(acquired.lease.lease_id, owner=_OWNER)

    # -- copies -----------------------------------------------------------------------------

    async def get(self, key: bytes, namespace: bytes) -> Block | None:
        """The block of ``key`` in ``namespace`` (a verified copy of its raw payload), or
        ``None`` on a miss.

        A hit below the top tier is promoted; lower tiers with a selective write policy
        receive the block when it reaches their hit threshold.
        """
        placement = self._placement
        node = await placement.held(key, namespace)
        if node is None:
            placement.count_gets(1, 1)
            return None
        node.hold()
        try:
            found = await placement.read_any(node)
            if found is not None:
                level, payload = found
                placement.record_hit(node, level)
                if level is not self._top:
                    await placement.promote(node, payload)
                await placement.write_selective(node, payload)
        finally:
            node.let_go()
        await placement.settle(node)
        placement.count_gets(1, int(found is None))
        if found is None:
            return None
        return Block(node.key, node.parent, node.meta, payload, level.name, node.checksum)

    async def get_layer(self, key: bytes, namespace: bytes, layer: int) -> bytes | None:
        """Raw bytes of one layer of a block (no promotion), or ``None`` on a miss."""
        node = self._index.committed(block_id(key, namespace))
        if node is None:
            return None
        offset, length = node.meta.layout.layer_range(layer)
        node.hold()
        try:
            for level in self._placement.tiers:
                if level.name in node.tiers:
                    data = await self._placement.read_layer(level, node, layer, offset, length)
                    if data is not None:
                        return data
            return None
        finally:
            node.let_go()
            await self._placement.settle(node)

    # -- prefetch ---------------------------------------------------------------------------

    async def prefetch(
        self, keys: Sequence[bytes], namespace: bytes, budget: int
    ) -> tuple[int, int]:
        """Moves the leading held blocks of ``keys`` into the arena, promoting at most
        ``budget`` bytes and making room only by evicting blocks no hint protects.

        Returns:
            How many leading blocks are in the arena now, and the bytes promoted.
        """
        count = promoted = 0
        top = self._top
        for key in keys:
            node = await self._placement.held(key, namespace)
            if node is None:
                break
            if top.name not in node.tiers:
                if promoted + node.size > budget or not await self._room_for(node.size):
                    break
                if not await self._placement.promote(node):
                    break
                promoted += node.size
            count += 1
        return count, promoted

    async def _room_for(self, size: int) -> bool:
        """Evicts unprotected blocks until ``size`` more bytes fit; False when they cannot."""
        host = self._top.tier
        while host.usage() + size > host.capacity():
            if not await self._placement.evict_one(self._top, spare_protected=True):
                return False
        return True


_OWNER = object()  # the owner of the daemon's own leases: no tenant can name it
