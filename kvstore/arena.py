"""The shared-memory data plane: clients read and write blocks in the host arena in place.

The host tier is one arena file that co-located clients map. Instead of copying KV through
gRPC, the daemon hands out ``(offset, length)`` slots:

- reads: ``acquire(keys)`` promotes the leading held blocks into the arena, leases them and
  returns their slots; the client copies or views them, then releases the lease;
- writes: ``reserve(key, parent, meta)`` holds arena space for a block (invisible to
  everyone), the client writes the raw payload into it, ``commit(key)`` makes it visible
  (and writes it through to lower tiers per policy) or ``abort(key)`` frees it. A
  reservation not committed within its lifetime is aborted by ``expire`` (a crashed client),
  so a half-written block is never readable.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.index import BlockMeta, Node, RadixIndex
from kvstore.leases import LeaseTable
from kvstore.results import Acquired, ArenaInfo, PutStatus, Reserved
from kvstore.tiering import Placement, StoreTier
from kvstore.tiers.allocator import Slot
from kvstore.tiers.host import HostTier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Reservation:
    node: Node
    expires_at: float


class ArenaPlane:
    """Acquire/release and reserve/commit over the host tier's arena."""

    def __init__(
        self,
        top: StoreTier,
        index: RadixIndex,
        placement: Placement,
        leases: LeaseTable,
        counts: Counter[str],
    ) -> None:
        if not isinstance(top.tier, HostTier):
            raise TypeError(f"the arena needs a HostTier on top, got {type(top.tier).__name__}")
        self._top = top
        self._host: HostTier = top.tier
        self._index = index
        self._placement = placement
        self._leases = leases
        self._counts = counts
        self._reservations: dict[bytes, _Reservation] = {}

    def __len__(self) -> int:
        return len(self._reservations)

    def info(self) -> ArenaInfo:
        stat = os.stat(self._host.arena_path)
        return ArenaInfo(
            str(self._host.arena_path), self._host.arena_bytes, stat.st_dev, stat.st_ino
        )

    async def acquire(
        self, keys: Sequence[bytes], namespace: bytes | None, ttl: float | None
    ) -> Acquired:
        """Leases the leading held blocks of ``keys``, promoted into the arena."""
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
        finally:
            for node in nodes:
                node.leases -= 1
        lease = self._leases.grant(nodes[: len(slots)], ttl)
        for node in nodes[len(slots) :]:
            await self._placement.settle(node)
        return Acquired(lease, tuple(slots))

    async def _into_arena(self, node: Node) -> Slot | None:
        if self._top.name not in node.tiers:
            found = await self._placement.read_any(node)
            if found is None:
                return None
            source, payload = found
            if not await self._placement.store_in(self._top, node, payload):
                return None
            self._counts["promotions"] += 1
            self._placement.record_hit(node, source)
        else:
            self._placement.record_hit(node, self._top)
        return self._host.locate(node.key)

    async def prefetch(self, keys: Sequence[bytes], namespace: bytes | None) -> int:
        """Moves the leading held blocks of ``keys`` into the arena; returns how many are there."""
        count = 0
        for key in keys:
            node = await self._placement.held(key, namespace)
            if node is None:
                break
            node.busy += 1
            try:
                if self._top.name not in node.tiers:
                    found = await self._placement.read_any(node)
                    if found is None or not await self._placement.store_in(
                        self._top, node, found[1]
                    ):
                        break
                    self._counts["promotions"] += 1
            finally:
                node.busy -= 1
                await self._placement.settle(node)
            count += 1
        return count

    async def reserve(
        self, key: bytes, parent: bytes, meta: BlockMeta, ttl: float | None
    ) -> Reserved:
        """Holds arena space for a block that the client will write, then commit."""
        existing = self._index.get(key)
        if existing is not None:
            existing.doomed = False
            self._counts["dedup_puts"] += 1
            return Reserved(PutStatus.DEDUP)
        node = self._index.begin(key, parent, meta, meta.layout.payload_bytes)
        slot = await self._reserve_slot(key, meta.layout.payload_bytes)
        if slot is None:
            self._index.discard(key)
            self._counts["dropped_saves"] += 1
            return Reserved(PutStatus.NO_SPACE)
        lifetime = self._leases.default_ttl if ttl is None or ttl <= 0 else ttl
        self._reservations[key] = _Reservation(node, time.monotonic() + lifetime)
        return Reserved(PutStatus.RESERVED, slot)

    async def _reserve_slot(self, key: bytes, size: int) -> Slot | None:
        while True:
            if self._host.usage() + size <= self._host.capacity():
                slot = self._host.reserve(key, size)
                if slot is not None:
                    return slot
            if not await self._placement.evict_one(self._top):
                return None

    async def commit(self, key: bytes) -> PutStatus:
        """Makes a reserved block visible; EXPIRED when there is no live reservation."""
        entry = self._reservations.pop(key, None)
        if entry is None:
            return PutStatus.EXPIRED
        node = entry.node
        slot = self._host.commit(key)
        node.tiers.add(self._top.name)
        self._placement.policy.inserted(self._top.name, key)
        node.busy += 1
        try:
            await self._placement.write_through(node, self._host.view(slot))
        finally:
            node.busy -= 1
        self._index.commit(key)
        self._counts["puts"] += 1
        return PutStatus.STORED

    async def abort(self, key: bytes) -> bool:
        """Frees a reservation; False when there is none."""
        entry = self._reservations.pop(key, None)
        if entry is None:
            return False
        self._host.abort(key)
        self._index.discard(key)
        return True

    async def expire(self, now: float) -> int:
        """Aborts reservations past their deadline (their writer crashed or stalled)."""
        expired = [key for key, entry in self._reservations.items() if entry.expires_at <= now]
        for key in expired:
            log.warning("reservation for %s expired before commit; freed", key.hex()[:16])
            await self.abort(key)
        return len(expired)
