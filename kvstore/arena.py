"""The shared-memory data plane: clients read blocks in place in their tenant's host arena.

The host tier keeps one arena per partition (the daemon's partitions are tenants), which
co-located clients of that tenant map read-only. Instead of copying KV through gRPC, the
daemon hands out ``(offset, length)`` slots:

- reads: ``acquire(keys, namespace)`` promotes the leading held blocks into the arena, pins
  their slots, leases them and returns the slots (with the arena's id and each block's
  checksum); the client copies or views them, then releases the lease. A slot stays pinned,
  so its bytes stay the block's, until the lease ends;
- writes: ``reserve(key, parent, meta, owner=...)`` holds arena space for a block (invisible
  to everyone), the owner's bytes are copied into it, ``commit([Commit(key, namespace,
  owner, source, checksum), ...])`` records each block's checksum and makes it visible (and
  writes it through to lower tiers per policy) or ``abort`` frees it. Only the owner of a
  reservation can commit or abort it. A reservation not committed within its lifetime is
  aborted by ``expire`` (a crashed writer), so a half-written block is never readable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.budget import LoopBudget
from kvstore.index import BlockIndex, BlockMeta, Node, block_id
from kvstore.leases import LeaseTable
from kvstore.results import Acquired, Lease, Reserved
from kvstore.tiering import Placement, StoreTier
from kvstore.tiers.allocator import Slot
from kvstore.tiers.base import Buffer
from kvstore.tiers.host import ArenaHandle, HostTier
from kvstore.wire.blocks import payload_checksum
from kvstore.wire.results import PutStatus
from kvstore.wire.threads import THREAD_BYTES, offload

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Commit:
    """One block to commit: whose reservation, the bytes to copy in, the writer's checksum."""

    key: bytes
    namespace: bytes
    owner: object = None
    source: Buffer | None = None  # copied into the reserved slot first (a staging slot)
    checksum: int = 0  # the payload's xxh3-64 as the writer computed it; 0: not checked


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
        index: BlockIndex,
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
        # Commits copy into the arena one call at a time, in the order they came: several
        # copying threads finished together, later than one after another, and the writer's
        # pipeline waits for the first commit's reply (measured: 4 commits of 8 MiB at once
        # took 11 ms, the last of them done first).
        self._copying = asyncio.Lock()
        # Whether a lower tier takes a copy at put (else a commit awaits nothing per block).
        self._writes_on_put = any(slot.write.on_put for slot in placement.tiers[1:])

    def __len__(self) -> int:
        return len(self._reservations)

    def arena(self, partition: str) -> ArenaHandle:
        """The arena of ``partition`` for clients to map (read-only)."""
        return self._host.arena(partition)

    def keep_pages(self, partition: str, keep: bool) -> None:
        """A client registered ``partition``'s arena with CUDA (``keep``), or that ended."""
        if keep:
            self._host.keep_pages(partition)
        else:
            self._host.release_pages(partition)

    async def acquire(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        ttl: float | None,
        *,
        owner: object = None,
        lease_id: int = 0,
    ) -> Acquired:
        """Leases the leading held blocks of ``keys``, promoted into the arena and pinned.

        A block already in the arena costs no await (the common case: a hit on the host
        tier) but the loop's yield once a ``LoopBudget`` slice has run; its hit is counted
        as :meth:`Placement.record_hit` counts one, the counters once per call.
        """
        nodes: list[Node] = []
        slots: list[Slot] = []
        placement, host = self._placement, self._host
        top = self._top.name
        find, accessed, pin = self._index.find, placement.policy.accessed, host.pin_block
        now = time.monotonic()
        tried = misses = hits = hit_bytes = 0
        budget = LoopBudget()
        try:
            for key in keys:
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
                await budget.tick()  # the blocks so far are leased: nothing evicts them
        except BaseException:
            self._unpin(slots)
            raise
        finally:
            for node in nodes:
                node.let_go()
            placement.count_gets(tried, misses)
            if hits:  # as Placement.record_hit counts each, for the whole call at once
                counts = placement.counts
                counts[f"hits.{top}"] += hits
                counts[f"read_bytes.{top}"] += hit_bytes
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

    # -- writes -----------------------------------------------------------------------------

    async def reserve(
        self, key: bytes, parent: bytes, meta: BlockMeta, ttl: float | None, owner: object
    ) -> Reserved:
        """Holds arena space for a block that ``owner`` will fill, then commit."""
        done = self.reserve_now(key, parent, meta, ttl, owner)
        if done is not None:
            return done
        size = meta.layout.payload_bytes
        node = self._index.begin(key, parent, meta, size)
        try:
            slot = await self._reserve_slot(node.id, size)
        except BaseException:  # cancelled while evicting: the key must stay writable
            self._index.discard(node.id)
            raise
        if slot is None:
            self._index.discard(node.id)
            self._counts["dropped_saves"] += 1
            return Reserved(PutStatus.NO_SPACE)
        self._hold(node, slot, ttl, owner)
        return Reserved(PutStatus.RESERVED, slot)

    def reserve_now(
        self, key: bytes, parent: bytes, meta: BlockMeta, ttl: float | None, owner: object
    ) -> Reserved | None:
        """:meth:`reserve` without an await: DEDUP, or RESERVED when the arena has room now;
        ``None`` (nothing changed) when blocks must be evicted first."""
        size = meta.layout.payload_bytes
        host = self._host
        self._placement.check_fits(size)
        if self._placement.dedup(key, meta.namespace):
            return Reserved(PutStatus.DEDUP)
        if host.usage() + host.slot_bytes(size) > host.capacity():
            return None
        node = self._index.begin(key, parent, meta, size)
        slot = host.reserve(node.id, size)
        if slot is None:
            self._index.discard(node.id)
            return None
        self._hold(node, slot, ttl, owner)
        return Reserved(PutStatus.RESERVED, slot)

    def _hold(self, node: Node, slot: Slot, ttl: float | None, owner: object) -> None:
        lifetime = self._leases.default_ttl if ttl is None or ttl <= 0 else ttl
        self._reservations[node.id] = _Reservation(node, slot, owner, time.monotonic() + lifetime)

    async def _reserve_slot(self, block: bytes, size: int) -> Slot | None:
        while True:
            if self._host.usage() + self._host.slot_bytes(size) <= self._host.capacity():
                slot = self._host.reserve(block, size)
                if slot is not None:
                    return slot
                if await self._host.wait_unheld():  # room held a moment for pre-faulting
                    continue
            if not await self._placement.evict_one(self._top):
                return None

    def reserved(self, key: bytes, namespace: bytes, owner: object) -> Slot | None:
        """The slot of ``owner``'s live reservation of ``key``, or None."""
        entry = self._reservations.get(block_id(key, namespace))
        return entry.slot if entry is not None and entry.owner == owner else None

    def view(self, slot: Slot) -> memoryview:
        """A writable view of a reserved slot (the daemon fills it)."""
        return self._host.view(slot)

    async def commit(self, writes: Sequence[Commit]) -> list[PutStatus]:
        """Makes each write's reservation visible, if its owner holds it.

        Every block's bytes are copied in (from ``source``, a client's staging slot, when
        given) and summed in one pass over them, all the writes' blocks in one worker thread.

        Returns:
            Per write: STORED; EXPIRED when its owner holds no live reservation of its key;
            CHECKSUM_MISMATCH when the bytes do not match the writer's ``checksum``.
        """
        entries: list[_Reservation | None] = []
        budget = LoopBudget()
        for write in writes:
            block = block_id(write.key, write.namespace)
            entry = self._reservations.get(block)
            if entry is not None and entry.owner == write.owner:
                del self._reservations[block]  # from here this commit owns it
                entries.append(entry)
            else:
                entries.append(None)
            await budget.tick()
        live = [(e, w) for e, w in zip(entries, writes, strict=True) if e is not None]
        try:
            sums = await self._sum([(entry.slot, write.source) for entry, write in live])
        except BaseException:
            for entry, _ in live:
                self._drop(entry.node.id)
            raise
        # Each block lands in the arena in turn, the loop yielded to once a slice of them ran
        # (a 512-block commit is ~10 ms of per-block work); their write-throughs to lower
        # tiers then run side by side, so a commit waits for one tier call (a silent Redis:
        # its timeout), not one a block.
        landed: list[PutStatus] = []
        throughs: list[_Reservation] = []  # landed; visible once written through
        try:
            for (entry, write), total in zip(live, sums, strict=True):
                status = self._land(entry, write, total)
                landed.append(status)
                if status is PutStatus.STORED:
                    if self._writes_on_put:
                        throughs.append(entry)
                    else:
                        self._visible(entry.node)
                await budget.tick()
        except BaseException:  # cancelled at a yield: what had not landed is dropped,
            for entry, _ in live[len(landed) :]:  # what had is served without lower copies
                self._drop(entry.node.id)
            for entry in throughs:
                self._visible(entry.node)
            raise
        await asyncio.gather(*(self._write_through(entry) for entry in throughs))
        statuses = iter(landed)
        return [PutStatus.EXPIRED if entry is None else next(statuses) for entry in entries]

    async def _sum(self, items: Sequence[tuple[Slot, Buffer | None]]) -> list[int]:
        """The checksum of each slot, after copying its source into it: in one worker thread
        when the blocks are large, on the loop a slice at a time when they are small."""
        size = sum(slot.length for slot, _ in items)
        if size < THREAD_BYTES or size < len(items) * THREAD_BLOCK_BYTES:
            sums: list[int] = []
            budget = LoopBudget()
            for slot, source in items:
                with self._host.view(slot) as view:
                    sums.extend(_sum_all(((view, source),)))
                await budget.tick()
            return sums
        views = self._host.views([slot for slot, _ in items])
        try:
            jobs = [(view, source) for view, (_, source) in zip(views, items, strict=True)]
            async with self._copying:
                return await offload(size, _sum_all, jobs)
        finally:
            for view in views:
                view.release()

    def _land(self, entry: _Reservation, write: Commit, found: int) -> PutStatus:
        """Makes the arena hold a filled reservation (not yet visible): STORED, or
        CHECKSUM_MISMATCH (dropped)."""
        node = entry.node
        if write.checksum and found != write.checksum:
            log.warning("block %s: bytes do not match the writer's checksum", node.id.hex()[:16])
            self._drop(node.id)
            self._counts["corrupt_writes"] += 1
            return PutStatus.CHECKSUM_MISMATCH
        self._host.commit(node.id)
        node.checksum = found
        self._placement.index.add_copy(node, self._top.name)
        self._counts[f"written_bytes.{self._top.name}"] += node.size
        return PutStatus.STORED

    async def _write_through(self, entry: _Reservation) -> None:
        """Copies a landed block to the tiers that write at put time, then makes it visible."""
        node = entry.node
        with node.working(), self._host.view(entry.slot) as payload:
            await self._placement.write_through(node, payload)
        self._visible(node)

    def _visible(self, node: Node) -> None:
        self._index.commit(node.id)
        self._counts["puts"] += 1

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


# Blocks smaller than this are copied and summed on the loop, between its other callbacks. A
# worker thread holds the GIL for the per-block Python of each (~5 us), so with small blocks
# it holds it nearly all the time and the loop waits up to the switch interval for it at
# every turn: 512 blocks of 4 KiB in a thread stalled the loop 1-3 ms at a time.
THREAD_BLOCK_BYTES = 64 << 10
SUM_CHUNK_BYTES = 256 << 10  # copied, then summed while still in cache


def _sum_all(jobs: Sequence[tuple[memoryview, Buffer | None]]) -> list[int]:
    return [
        payload_checksum(target) if source is None else copy_and_sum(target, source)
        for target, source in jobs
    ]


def copy_and_sum(target: memoryview, source: Buffer) -> int:
    """Copies ``source`` into ``target`` and returns the xxh3-64 of what landed there, one
    cache-sized piece at a time (1.5x faster than a copy, then a sum), without the GIL."""
    dst = np.frombuffer(target, dtype=np.uint8)
    src = np.frombuffer(source, dtype=np.uint8)
    digest = xxhash.xxh3_64()
    for start in range(0, dst.size, SUM_CHUNK_BYTES):
        piece = dst[start : start + SUM_CHUNK_BYTES]
        np.copyto(piece, src[start : start + SUM_CHUNK_BYTES])
        digest.update(piece.data)
    return digest.intdigest()
