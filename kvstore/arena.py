"""The shared-memory data plane: clients read blocks in place in their tenant's host arena.

The host tier keeps one arena per partition (the daemon's partitions are tenants), which
co-located clients of that tenant map read-only. Instead of copying KV through gRPC, the
daemon hands out ``(offset, length)`` slots:

- reads: ``acquire(keys, namespace)`` promotes the leading held blocks into the arena, pins
  their slots, leases them and returns the slots (with the arena's id and each block's
  checksum); the client copies or views them, then releases the lease. A slot stays pinned,
  so its bytes stay the block's, until the lease ends;
- writes: ``reserve(key, parent, meta, owner=...)`` holds arena space for a block (invisible
  to everyone), the owner's bytes are copied into it, ``commit(key, namespace, owner=...)``
  records its checksum and makes it visible (and writes it through to lower tiers per policy)
  or ``abort`` frees it. Only the owner of a reservation can commit or abort it. A
  reservation not committed within its lifetime is aborted by ``expire`` (a crashed writer),
  so a half-written block is never readable.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.blocks import payload_checksum
from kvstore.errors import InvalidBlockError
from kvstore.index import BlockMeta, Node, RadixIndex, block_id
from kvstore.leases import LeaseTable
from kvstore.results import Acquired, Lease, PutStatus, Reserved
from kvstore.tiering import Placement, StoreTier, offload
from kvstore.tiers.allocator import Slot
from kvstore.tiers.base import Buffer
from kvstore.tiers.host import ArenaHandle, HostTier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Reservation:
    node: Node
    slot: Slot
    owner: object
    expires_at: float


class ArenaPlane:
    """Acquire/release and reserve/commit over the host tier's arenas."""

    def __init__(
        self,
        top: StoreTier,
        index: RadixIndex,
        placement: Placement,
        leases: LeaseTable,
        counts: Counter[str],
        partition_of: Callable[[bytes], str],
    ) -> None:
        if not isinstance(top.tier, HostTier):
            raise TypeError(f"the arena needs a HostTier on top, got {type(top.tier).__name__}")
        self._top = top
        self._host: HostTier = top.tier
        self._index = index
        self._placement = placement
        self._leases = leases
        self._counts = counts
        self._partition_of = partition_of  # namespace -> the arena its blocks live in
        self._reservations: dict[bytes, _Reservation] = {}

    def __len__(self) -> int:
        return len(self._reservations)

    def arena(self, partition: str) -> ArenaHandle:
        """The arena of ``partition`` for clients to map (read-only)."""
        return self._host.arena(partition)

    async def acquire(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        ttl: float | None,
        *,
        owner: object = None,
        lease_id: int = 0,
    ) -> Acquired:
        """Leases the leading held blocks of ``keys``, promoted into the arena and pinned."""
        nodes: list[Node] = []
        slots: list[Slot] = []
        try:
            for key in keys:
                node = await self._placement.held(key, namespace)
                if node is None:
                    break
                node.leases += 1  # so that promoting later blocks cannot evict this one
                nodes.append(node)
                slot = await self._into_arena(node)
                if slot is None:
                    break
                slots.append(slot)
        except BaseException:
            self._unpin(slots)
            raise
        finally:
            for node in nodes:
                node.leases -= 1
        arena_id = self._host.arena(self._partition_of(namespace)).arena_id
        if self._leases.released_early(lease_id, owner):  # its caller gave up: grant nothing
            self._unpin(slots)
            for node in nodes:
                await self._placement.settle(node)
            return Acquired(Lease(lease_id, 0, time.monotonic()), (), arena_id, ())
        leased = nodes[: len(slots)]
        lease = self._leases.grant(leased, ttl, owner=owner, lease_id=lease_id, slots=slots)
        for node in nodes[len(slots) :]:
            await self._placement.settle(node)
        return Acquired(lease, tuple(slots), arena_id, tuple(node.checksum for node in leased))

    async def _into_arena(self, node: Node) -> Slot | None:
        """Promotes ``node`` if needed and pins its host slot; None when it cannot."""
        source = self._placement.tier_named(self._placement.top_tier(node))
        if not await self._placement.promote(node):
            return None
        self._placement.record_hit(node, source)
        return self._host.pin(node.id)

    def _unpin(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            self._host.unpin(slot)

    async def prefetch(self, keys: Sequence[bytes], namespace: bytes) -> int:
        """Moves the leading held blocks of ``keys`` into the arena; returns how many are there."""
        count = 0
        for key in keys:
            node = await self._placement.held(key, namespace)
            if node is None or not await self._placement.promote(node):
                break
            count += 1
        return count

    # -- writes -----------------------------------------------------------------------------

    async def reserve(
        self, key: bytes, parent: bytes, meta: BlockMeta, ttl: float | None, owner: object
    ) -> Reserved:
        """Holds arena space for a block that ``owner`` will fill, then commit."""
        size = meta.layout.payload_bytes
        if not self._host.fits(size):
            raise InvalidBlockError(
                f"a block of {size} bytes can never fit in the host tier "
                f"({self._host.capacity()} bytes)"
            )
        existing = self._index.find(key, meta.namespace)
        if existing is not None:
            existing.doomed = False
            self._counts["dedup_puts"] += 1
            return Reserved(PutStatus.DEDUP)
        node = self._index.begin(key, parent, meta, size)
        slot = await self._reserve_slot(node.id, size)
        if slot is None:
            self._index.discard(node.id)
            self._counts["dropped_saves"] += 1
            return Reserved(PutStatus.NO_SPACE)
        lifetime = self._leases.default_ttl if ttl is None or ttl <= 0 else ttl
        self._reservations[node.id] = _Reservation(node, slot, owner, time.monotonic() + lifetime)
        return Reserved(PutStatus.RESERVED, slot)

    async def _reserve_slot(self, block: bytes, size: int) -> Slot | None:
        while True:
            if self._host.usage() + self._host.slot_bytes(size) <= self._host.capacity():
                slot = self._host.reserve(block, size)
                if slot is not None:
                    return slot
            if not await self._placement.evict_one(self._top):
                return None

    def reserved(self, key: bytes, namespace: bytes, owner: object) -> Slot | None:
        """The slot of ``owner``'s live reservation of ``key``, or None."""
        entry = self._reservations.get(block_id(key, namespace))
        return entry.slot if entry is not None and entry.owner == owner else None

    def view(self, slot: Slot) -> memoryview:
        """A writable view of a reserved slot (the daemon fills it)."""
        return self._host.view(slot)

    async def commit(
        self,
        key: bytes,
        namespace: bytes,
        owner: object,
        *,
        source: Buffer | None = None,
        checksum: int = 0,
    ) -> PutStatus:
        """Makes ``owner``'s reservation of ``key`` visible.

        Args:
            key: The block's key.
            namespace: Its namespace.
            owner: Who reserved it.
            source: Bytes to copy into the slot first (a client's staging slot).
            checksum: The payload's xxh3-64 as the writer computed it; 0: not checked.

        Returns:
            STORED; EXPIRED when ``owner`` holds no live reservation of ``key``;
            CHECKSUM_MISMATCH when the slot's bytes do not match ``checksum`` (not stored).
        """
        block = block_id(key, namespace)
        entry = self._reservations.get(block)
        if entry is None or entry.owner != owner:
            return PutStatus.EXPIRED
        del self._reservations[block]
        node, slot = entry.node, entry.slot
        try:
            with self._host.view(slot) as target:
                if source is not None:
                    await offload(slot.length, _copy, target, source)
                found = await offload(slot.length, payload_checksum, target)
        except BaseException:
            self._drop(block)
            raise
        if checksum and found != checksum:
            log.warning("block %s: bytes do not match the writer's checksum", block.hex()[:16])
            self._drop(block)
            self._counts["corrupt_writes"] += 1
            return PutStatus.CHECKSUM_MISMATCH
        self._host.commit(block)
        node.checksum = found
        node.tiers.add(self._top.name)
        self._placement.policy.inserted(self._top.name, block)
        node.busy += 1
        try:
            with self._host.view(slot) as payload:
                await self._placement.write_through(node, payload)
        finally:
            node.busy -= 1
        self._index.commit(block)
        self._counts["puts"] += 1
        return PutStatus.STORED

    async def abort(self, key: bytes, namespace: bytes, owner: object) -> bool:
        """Frees ``owner``'s reservation of ``key``; False when it holds none."""
        block = block_id(key, namespace)
        entry = self._reservations.get(block)
        if entry is None or entry.owner != owner:
            return False
        del self._reservations[block]
        self._drop(block)
        return True

    def _drop(self, block: bytes) -> None:
        self._host.abort(block)
        self._index.discard(block)

    async def expire(self, now: float) -> int:
        """Aborts reservations past their deadline (their writer crashed or stalled)."""
        expired = [b for b, entry in self._reservations.items() if entry.expires_at <= now]
        for block in expired:
            log.warning("reservation for %s expired before commit; freed", block.hex()[:16])
            del self._reservations[block]
            self._drop(block)
        return len(expired)


def _copy(target: memoryview, source: Buffer) -> None:
    """One memcpy that does not hold the GIL (a memoryview slice assignment would)."""
    np.copyto(np.frombuffer(target, dtype=np.uint8), np.frombuffer(source, dtype=np.uint8))
