"""The write path: every block the daemon stores is reserved, filled, then committed.

One primitive pair, whoever writes:

1. ``reserve(key, parent, meta, ttl, owner)`` -> :class:`Reserved`: DEDUP when the namespace
   holds the key already (identical prefixes are stored once); else an invisible, pending node
   and an arena slot for its bytes (RESERVED), or NO_SPACE when the arena cannot make room;
2. ``commit([Commit(key, namespace, owner, source, checksum, written), ...])``: each block's
   ``source`` copied into its slot and summed in one pass (or, with no source, the slot summed
   in place), checked against the writer's checksum; or, ``written`` by its owner in place,
   the writer's checksum recorded as the block's without a pass over the bytes (checked
   wherever the bytes leave the arena). Then written through to the lower tiers that take a
   copy at put, then visible: STORED; or CHECKSUM_MISMATCH (dropped); or EXPIRED (the owner
   holds no live reservation of the key).
   ``abort`` frees a reservation; ``expire`` frees those whose writer never committed.

Only a reservation's owner can commit or abort it, and a half-written block is never readable.
The three ways in are this pair with different owners and sources:

- an shm session (the client's put): the client reserves, writes the arena slots reserved
  for it in place (summing each block as it copies it), commits with those sums, ``written``
  (:meth:`kvstore.service.KVStoreService.commit`);
- the Put stream with a host tier: :meth:`WritePath.land` reserves under the stream's own
  owner, the chunks are copied into the slot as they arrive, the commit has no ``source``;
- a whole block in hand (the Put stream without a host tier, or without room in the arena):
  :meth:`WritePath.put` is ``reserve`` + ``commit`` with the payload as ``source``; reserved
  without an arena slot, the commit sums the payload and stores it in each tier that takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.budget import LoopBudget
from kvstore.index import BlockMeta, Node, block_id
from kvstore.leases import LeaseTable
from kvstore.results import Reserved
from kvstore.tiering import Placement
from kvstore.tiers.allocator import Slot
from kvstore.tiers.base import Buffer, TierClosedError
from kvstore.wire.blocks import payload_checksum
from kvstore.wire.results import PutStatus
from kvstore.wire.threads import THREAD_BYTES, copy_and_sum_at, offload

__all__ = ["Commit", "Landing", "WritePath", "copy_and_sum"]

log = logging.getLogger(__name__)

LANDING_SECONDS = 3600.0  # a reservation the daemon commits or aborts itself (a stream, a put)


@dataclass(frozen=True, slots=True)
class Commit:
    """One block to commit: whose reservation, the bytes to copy in, the writer's checksum."""

    key: bytes
    namespace: bytes
    owner: object = None
    source: Buffer | None = None  # copied into the reserved slot first (a whole block)
    checksum: int = 0  # the payload's xxh3-64 as the writer computed it; 0: not checked
    # The owner wrote the slot in place and ``checksum`` is the sum of what it wrote: taken as
    # the block's, the bytes not read (a zero checksum: summed in place all the same).
    written: bool = False


@dataclass(frozen=True, slots=True)
class Landing:
    """An arena slot reserved for a block of the Put stream: write it, then commit or abort."""

    key: bytes
    namespace: bytes
    slot: memoryview  # writable; release it once the block is committed or aborted
    deadline: float  # time.monotonic() from which the reservation may be reclaimed
    owner: tuple[str, int] = field(default=("stream", 0))  # who may commit or abort it


@dataclass(slots=True)
class _Reservation:
    node: Node
    slot: Slot | None  # None: no arena slot; the commit stores its source in the tiers
    owner: object
    expires_at: float


class WritePath:
    """Reservations and commits over the tiers (the host arena first); see the module doc."""

    def __init__(self, placement: Placement, leases: LeaseTable, counts: Counter[str]) -> None:
        self._placement = placement
        self._index = placement.index
        self._top, self._host = placement.top, placement.host
        self._leases = leases
        self._counts = counts
        self._reservations: dict[bytes, _Reservation] = {}
        self._owners = itertools.count(1)  # the daemon's own reservations (streams, puts)
        # Commits copy into the arena one call at a time, in the order they came: several
        # copying threads finished together, later than one after another, and the writer's
        # pipeline waits for the first commit's reply (measured: 4 commits of 8 MiB at once
        # took 11 ms, the last of them done first).
        self._copying = asyncio.Lock()
        # Whether a lower tier takes a copy at put (else a commit awaits nothing per block).
        self._writes_on_put = any(level.write.on_put for level in placement.tiers[1:])

    def __len__(self) -> int:
        return len(self._reservations)

    # -- the three ways in ------------------------------------------------------------------

    async def put(
        self, key: bytes, parent: bytes, meta: BlockMeta, payload: Buffer, checksum: int = 0
    ) -> PutStatus:
        """Stores a whole block: reserved (without an arena slot when the arena has none to
        give), then committed with ``payload`` as its source. NO_SPACE when no tier took it."""
        owner = ("put", next(self._owners))
        reserved = await self.reserve(key, parent, meta, LANDING_SECONDS, owner, spill=True)
        if reserved.status is not PutStatus.RESERVED:
            return reserved.status
        (status,) = await self.commit([Commit(key, meta.namespace, owner, payload, checksum)])
        return status

    async def land(self, key: bytes, parent: bytes, meta: BlockMeta) -> Landing | PutStatus:
        """Reserves an arena slot for a block of the Put stream, to be written in place.

        The stream owns the reservation and ends it in every case, so it lives up to an hour,
        not the lease lifetime given to a client that writes a slot itself.

        Returns:
            The slot to write, then commit or abort by key; ``DEDUP`` when the block is held
            already; ``NO_SPACE`` when the arena has no room (store it whole instead).
        """
        deadline = time.monotonic() + LANDING_SECONDS  # the reservation's clock starts later
        owner = ("stream", next(self._owners))
        reserved = await self.reserve(key, parent, meta, LANDING_SECONDS, owner)
        if reserved.slot is None:
            return reserved.status
        return Landing(key, meta.namespace, self.view(reserved.slot), deadline, owner)

    # -- reserve ----------------------------------------------------------------------------

    async def reserve(
        self,
        key: bytes,
        parent: bytes,
        meta: BlockMeta,
        ttl: float | None,
        owner: object,
        *,
        spill: bool = False,
    ) -> Reserved:
        """Holds arena space for a block that ``owner`` will fill, then commit.

        ``spill``: reserve the block without a slot when the arena cannot take it (there is
        none, or it has no room); its commit then needs a ``source``.
        """
        done = self.reserve_now(key, parent, meta, ttl, owner, spill=spill)
        if done is not None:
            return done
        size = meta.layout.payload_bytes
        node = self._index.begin(key, parent, meta, size)
        try:
            slot = await self._reserve_slot(node.id, size)
        except BaseException:  # cancelled while evicting: the key must stay writable
            self._index.discard(node.id)
            raise
        if slot is None and not spill:
            self._index.discard(node.id)
            self._counts["dropped_saves"] += 1
            return Reserved(PutStatus.NO_SPACE)
        if slot is None:  # spilled: the arena could not take it, the tiers below may
            self._counts[f"failed_writes.{self._top.name}"] += 1
        self._hold(node, slot, ttl, owner)
        return Reserved(PutStatus.RESERVED, slot)

    def reserve_now(
        self,
        key: bytes,
        parent: bytes,
        meta: BlockMeta,
        ttl: float | None,
        owner: object,
        *,
        spill: bool = False,
    ) -> Reserved | None:
        """:meth:`reserve` without an await: DEDUP, or RESERVED when the arena has room now
        (or, with ``spill``, there is no arena); ``None`` (nothing changed) when blocks must
        be evicted first."""
        size = meta.layout.payload_bytes
        host = self._host
        self._placement.check_fits(size)
        if self._placement.dedup(key, meta.namespace):
            return Reserved(PutStatus.DEDUP)
        if host is None:
            if not spill:
                raise TypeError("only a spilling reservation can be made without a host tier")
            self._hold(self._index.begin(key, parent, meta, size), None, ttl, owner)
            return Reserved(PutStatus.RESERVED)
        if host.usage() + host.slot_bytes(size) > host.capacity():
            return None
        node = self._index.begin(key, parent, meta, size)
        slot = host.reserve(node.id, size)
        if slot is None:
            self._index.discard(node.id)
            return None
        self._hold(node, slot, ttl, owner)
        return Reserved(PutStatus.RESERVED, slot)

    def _hold(self, node: Node, slot: Slot | None, ttl: float | None, owner: object) -> None:
        lifetime = self._leases.default_ttl if ttl is None or ttl <= 0 else ttl
        self._reservations[node.id] = _Reservation(node, slot, owner, time.monotonic() + lifetime)

    async def _reserve_slot(self, block: bytes, size: int) -> Slot | None:
        host = self._host
        assert host is not None  # reserve_now spilled, or raised, without one
        while True:
            if host.usage() + host.slot_bytes(size) <= host.capacity():
                slot = host.reserve(block, size)
                if slot is not None:
                    return slot
                if await host.wait_unheld():  # room held a moment for pre-faulting
                    continue
            if not await self._placement.evict_one(self._top):
                return None

    def hold(self, slot: Slot) -> None:
        """Keeps a reserved slot's range for a client that writes it in place, until
        :meth:`let_go`: its reservation may end first (committed, aborted or expired), and its
        range then passes to no other block while the client may still be writing it."""
        assert self._host is not None  # a slot is only ever given out by the host tier
        self._host.hold(slot)

    def let_go(self, slot: Slot) -> None:
        """Ends a :meth:`hold` (a closed tier has nothing left to free)."""
        if self._host is not None:
            with contextlib.suppress(TierClosedError):
                self._host.unpin(slot)

    def view(self, slot: Slot) -> memoryview:
        """A writable view of a reserved slot (the daemon fills it)."""
        assert self._host is not None  # a slot is only ever given out by the host tier
        return self._host.view(slot)

    # -- commit -----------------------------------------------------------------------------

    async def commit(self, writes: Sequence[Commit]) -> list[PutStatus]:
        """Makes each write's reservation visible, if its owner holds it.

        Every block's bytes are copied in (from ``source``, when given) and summed in one
        pass over them, all the writes' blocks in one worker thread when they are large.

        Returns:
            Per write: STORED; EXPIRED when its owner holds no live reservation of its key;
            CHECKSUM_MISMATCH when the bytes do not match the writer's ``checksum``;
            NO_SPACE when a block reserved without a slot found no tier to take it.
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
            sums = await self._sum(
                [(entry.slot, write.source) for entry, write in live if not _taken(write)]
            )
            sums = _with_taken([write for _, write in live], sums)
        except BaseException:
            for entry, _ in live:
                self._drop(entry)
            raise
        # Each block lands in the arena in turn, the loop yielded to once a slice of them ran
        # (a 512-block commit is ~10 ms of per-block work); their write-throughs to lower
        # tiers then run side by side, so a commit waits for one tier call (a silent Redis:
        # its timeout), not one a block.
        landed: list[PutStatus] = []
        finishing: list[tuple[int, _Reservation, Buffer | None]] = []  # still to be stored
        try:
            for (entry, write), total in zip(live, sums, strict=True):
                status = self._land(entry, write, total)
                if status is PutStatus.STORED:
                    if entry.slot is None or self._writes_on_put:
                        finishing.append((len(landed), entry, write.source))
                    else:
                        self._visible(entry.node)
                landed.append(status)
                await budget.tick()
        except BaseException:  # cancelled at a yield: what had not landed is dropped,
            for entry, _ in live[len(landed) :]:  # what had is served without lower copies
                self._drop(entry)
            for _, entry, _ in finishing:
                if entry.slot is None:
                    self._drop(entry)
                else:
                    self._visible(entry.node)
            raise
        stored = await asyncio.gather(*(self._finish(e, source) for _, e, source in finishing))
        for (at, _, _), status in zip(finishing, stored, strict=True):
            landed[at] = status
        statuses = iter(landed)
        return [PutStatus.EXPIRED if entry is None else next(statuses) for entry in entries]

    async def _sum(self, items: Sequence[tuple[Slot | None, Buffer | None]]) -> list[int]:
        """The checksum of each block, its source copied into its slot first: in one worker
        thread when the blocks are large, on the loop a slice at a time when they are small."""
        size = sum(_size(slot, source) for slot, source in items)
        if size < THREAD_BYTES or size < len(items) * THREAD_BLOCK_BYTES:
            sums: list[int] = []
            budget = LoopBudget()
            for slot, source in items:
                if slot is None:
                    sums.append(_sum_one(None, source))
                else:
                    with self.view(slot) as view:
                        sums.append(_sum_one(view, source))
                await budget.tick()
            return sums
        slots = [slot for slot, _ in items if slot is not None]
        views = [] if not slots else self._views(slots)
        try:
            targets = iter(views)
            jobs = [(None if slot is None else next(targets), source) for slot, source in items]
            async with self._copying:
                return await offload(size, _sum_all, jobs)
        finally:
            for view in views:
                view.release()

    def _views(self, slots: Sequence[Slot]) -> list[memoryview]:
        assert self._host is not None
        return self._host.views(slots)

    def _land(self, entry: _Reservation, write: Commit, found: int) -> PutStatus:
        """Records a filled reservation's checksum and, in the arena, its copy (not yet
        visible): STORED, or CHECKSUM_MISMATCH (dropped)."""
        node = entry.node
        if write.checksum and found != write.checksum:
            log.warning("block %s: bytes do not match the writer's checksum", node.id.hex()[:16])
            self._drop(entry)
            self._counts["corrupt_writes"] += 1
            return PutStatus.CHECKSUM_MISMATCH
        node.checksum = found
        if entry.slot is not None and self._host is not None:
            self._host.commit(node.id)
            self._index.add_copy(node, self._top.name)
            self._counts[f"written_bytes.{self._top.name}"] += node.size
        return PutStatus.STORED

    async def _finish(self, entry: _Reservation, source: Buffer | None) -> PutStatus:
        """Copies a landed block to the tiers that write at put time, then makes it visible;
        a block without a slot is stored in every tier that takes it first (NO_SPACE: none)."""
        node = entry.node
        if entry.slot is None:
            assert source is not None  # its sum raised otherwise
            return await self._store_whole(node, source)
        with node.working(), self.view(entry.slot) as payload:
            await self._placement.write_through(node, payload)
        self._visible(node)
        return PutStatus.STORED

    async def _store_whole(self, node: Node, payload: Buffer) -> PutStatus:
        """Stores a block reserved without a slot: in the top tier unless it is the arena
        (which had no room for it: the reservation tried), and in the tiers that take a copy
        at put."""
        placement = self._placement
        try:
            with node.working():
                stored = self._host is None and await placement.store_in(self._top, node, payload)
                stored = await placement.write_through(node, payload) or stored
        except BaseException:
            await self._forget(node)
            raise
        if not stored:
            await self._forget(node)
            self._counts["dropped_saves"] += 1
            return PutStatus.NO_SPACE
        self._visible(node)
        return PutStatus.STORED

    async def _forget(self, node: Node) -> None:
        """Drops a block that never became visible, with any copy a tier took of it."""
        for level in self._placement.tiers:
            if level.name in node.tiers:
                self._placement.lost_copy(level, node)
                await level.tier.delete(node.id)
        self._index.discard(node.id)

    def _visible(self, node: Node) -> None:
        self._index.commit(node.id)
        self._counts["puts"] += 1

    # -- abort and expiry -------------------------------------------------------------------

    async def abort(self, key: bytes, namespace: bytes, owner: object) -> bool:
        """Frees ``owner``'s reservation of ``key``; False when it holds none."""
        block = block_id(key, namespace)
        entry = self._reservations.get(block)
        if entry is None or entry.owner != owner:
            return False
        del self._reservations[block]
        self._drop(entry)
        return True

    def _drop(self, entry: _Reservation) -> None:
        if entry.slot is not None and self._host is not None:
            self._host.abort(entry.node.id)
        self._index.discard(entry.node.id)

    async def expire(self, now: float) -> int:
        """Aborts reservations past their deadline (their writer crashed or stalled)."""
        expired = [b for b, entry in self._reservations.items() if entry.expires_at <= now]
        for block in expired:
            log.warning("reservation for %s expired before commit; freed", block.hex()[:16])
            self._drop(self._reservations.pop(block))
        return len(expired)


# Blocks smaller than this are copied and summed on the loop, between its other callbacks. A
# worker thread holds the GIL for the per-block Python of each (~5 us), so with small blocks
# it holds it nearly all the time and the loop waits up to the switch interval for it at
# every turn: 512 blocks of 4 KiB in a thread stalled the loop 1-3 ms at a time.
THREAD_BLOCK_BYTES = 64 << 10


def _taken(write: Commit) -> bool:
    """Whether a write's checksum is the block's as it stands (written in place, summed by its
    writer): no pass over its bytes."""
    return write.written and write.checksum != 0 and write.source is None


def _with_taken(writes: Sequence[Commit], sums: Sequence[int]) -> list[int]:
    """Every write's checksum: the writer's where it is taken, else the next of ``sums``."""
    found = iter(sums)
    return [write.checksum if _taken(write) else next(found) for write in writes]


def _size(slot: Slot | None, source: Buffer | None) -> int:
    if slot is not None:
        return slot.length
    return 0 if source is None else memoryview(source).nbytes


def _sum_all(jobs: Sequence[tuple[memoryview | None, Buffer | None]]) -> list[int]:
    return [_sum_one(target, source) for target, source in jobs]


def _sum_one(target: memoryview | None, source: Buffer | None) -> int:
    """The checksum of a block: of ``target`` (a slot) after ``source`` was copied into it,
    or of ``source`` alone when there is no slot."""
    if target is None:
        if source is None:
            raise ValueError("a block reserved without a slot is committed with its bytes")
        return payload_checksum(source)
    return payload_checksum(target) if source is None else copy_and_sum(target, source)


def copy_and_sum(target: memoryview, source: Buffer) -> int:
    """Copies ``source`` into ``target`` and returns the xxh3-64 of what landed there, one
    cache-sized piece at a time (1.5x faster than a copy, then a sum), without the GIL."""
    dst = np.frombuffer(target, dtype=np.uint8)
    src = np.frombuffer(source, dtype=np.uint8)
    if dst.size != src.size or not dst.flags.writeable:
        raise ValueError(f"cannot copy {src.size} bytes into a {dst.size}-byte target")
    return copy_and_sum_at(src.ctypes.data, dst.ctypes.data, dst.size)
