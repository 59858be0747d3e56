"""The tier manager: puts, gets and moves KV blocks across the tiers, top to bottom.

``BlockStore`` owns an ordered list of tiers (host shared memory, then SSD, then Redis; any
may be disabled), the block index and the policies. The top tier stores the raw layer-major
payload (so co-located clients can view it in place); lower tiers store the encoded block
(header with per-layer checksums + payload, compressed per the tier's config), checked on
every read: a mismatch is a miss, the bad copy is deleted and ``corrupt_blocks`` goes up.

Primitives, in the order a request uses them (the service's calls):

0. ``register_namespace(namespace, tenant)``: the host arena a namespace's blocks live in
   (one arena per tenant; unregistered namespaces share the arena of tenant ``""``);
1. ``lookup(keys, namespace)`` -> :class:`LookupResult`: how many leading blocks are held, and
   where (shared tiers such as Redis are asked live for keys the local index lacks);
2. reads, :mod:`kvstore.reads`: ``acquire(keys, namespace)`` -> :class:`Acquired` (the leading
   held blocks promoted into the host arena and leased), then ``release(lease_id)``; ``held``
   serves the Get stream from the same leases; ``get(key, namespace)`` -> :class:`Block` or
   ``None`` copies what the arena cannot take (no host tier, or no room);
3. writes, :mod:`kvstore.writes`: the service reserves through ``writes`` itself
   (``writes.reserve`` -> :class:`Reserved`, ``writes.land`` for the Put stream), then
   ``commit([Commit, ...])`` here (run to its end, then the watermarks) or ``abort``;
   ``put`` is reserve + commit of a whole block;
4. ``prefetch(keys, namespace)``: a hinted session's blocks moved up into the arena;
5. ``delete(key, namespace)``, ``flush()`` (write-back blocks to the tier below, for shutdown),
   ``stats()``, and ``maintain()`` (lease expiry, TTLs, watermarks; also run periodically);
6. operations: ``namespaces()``, ``usage_of(namespace)`` -> :class:`NamespaceUsage`,
   ``evict_namespace(namespace)`` (every block of it, from every tier).

``pin(keys, namespace)`` (a lease without the arena) and ``get_layer(key, namespace, layer)``
(one layer's raw bytes, read from whichever tier holds the block) serve no request today; the
tests and the stress harness use them to hold blocks and to read lower tiers layer by layer.

The store trusts its caller with the fields (32-byte keys, a payload of its layout's size):
the service checks each once, at the edge (:mod:`kvstore.checks`). What only the store knows
(a block too large for the top tier, a parent that would make a cycle) it checks itself.

Every operation is scoped by a namespace: a block is indexed and stored under
``key || namespace``, so the same key in another namespace is another block (see
:mod:`kvstore.index`). Each block's xxh3-64 checksum is computed once, when it is committed,
and checked whenever the block moves between tiers or is read back by copy.

Eviction takes unleased blocks without children in that tier, in eviction-policy order; a
block leaves the store entirely only if it has no children at all (a parent outlives its
children). Demotion copies a block down (per the lower tier's write policy) before freeing
it above. The index and policies are synchronous; only tier I/O awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Coroutine, Sequence
from typing import Any, Self

from kvstore.budget import LoopBudget
from kvstore.config import Config
from kvstore.errors import InvalidBlockError, NoArenaError, StoreClosedError
from kvstore.index import BlockIndex, BlockMeta
from kvstore.leases import LeaseTable
from kvstore.policies import EvictionPolicy, HintBudget, eviction_policy
from kvstore.reads import HeldBlock, ReadPath
from kvstore.results import Acquired, Block, Lease, Reserved
from kvstore.tasks import finish_anyway
from kvstore.tiering import Placement, StoreTier, tiers_from_config
from kvstore.tiers.base import Buffer
from kvstore.tiers.host import ArenaHandle
from kvstore.wire.blocks import KEY_BYTES
from kvstore.wire.results import (
    COUNTERS,
    LookupResult,
    NamespaceUsage,
    PutStatus,
    StoreStats,
    TierStats,
)
from kvstore.writes import Commit, Landing, WritePath

__all__ = [
    "Acquired",
    "Block",
    "BlockStore",
    "Commit",
    "HeldBlock",
    "Landing",
    "Lease",
    "LookupResult",
    "PutStatus",
    "Reserved",
    "StoreStats",
    "StoreTier",
]

log = logging.getLogger(__name__)
FLUSH_PROGRESS_S = 2.0  # a long flush (shutdown) says how far it is this often


class BlockStore:
    """Blocks across tiers; see the module docstring."""

    def __init__(
        self,
        tiers: Sequence[StoreTier],
        *,
        eviction: EvictionPolicy,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        lease_ttl: float = 10.0,
        maintenance_interval: float = 1.0,
        hint_ttl: float = 60.0,
        hint_share: float = 0.25,
        hint_rate: float = 1.0,
    ) -> None:
        if not tiers:
            raise ValueError("a BlockStore needs at least one tier")
        self._tiers = list(tiers)
        self.index = BlockIndex()
        self.policy = eviction
        self._high, self._low = high_watermark, low_watermark
        self._interval = maintenance_interval
        self._hint_ttl = hint_ttl
        self._counts: Counter[str] = Counter()
        self._tenants: dict[bytes, str] = {}  # namespace -> tenant: the arena of its blocks
        self._placement = Placement(self._tiers, self.index, self.policy, self._counts)
        self._host = self._placement.host
        capacity = self._tiers[0].tier.capacity()
        self._hints = HintBudget(int(hint_share * capacity), int(hint_rate * capacity))
        self._leases = LeaseTable(
            self.index,
            self._placement,
            lease_ttl,
            unpin=None if self._host is None else self._host.unpin,
        )
        if self._host is not None:
            self._host.partition_of = lambda block: self.partition_of(block[KEY_BYTES:])
        self.reads = ReadPath(self._placement, self._leases, self.partition_of)
        self.writes = WritePath(self._placement, self._leases, self._counts)
        self._maintenance: asyncio.Task[None] | None = None
        self._open = False

    @classmethod
    def from_config(cls, config: Config) -> BlockStore:
        """Builds the tiers and policies that ``config`` describes (tiers not started)."""
        tiers = tiers_from_config(config)
        return cls(
            tiers,
            eviction=eviction_policy(config.eviction.policy),
            high_watermark=config.eviction.high_watermark,
            low_watermark=config.eviction.low_watermark,
            lease_ttl=config.server.lease_ttl,
            hint_ttl=config.eviction.hint_ttl,
            hint_share=config.eviction.hint_share,
            hint_rate=config.eviction.hint_rate,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the tiers, rebuilds the index from persistent tiers, starts maintenance.

        A start that fails closes the tiers it started (their arenas, files and locks), then
        raises.
        """
        try:
            for level in self._tiers:
                await level.tier.start()
            for level in self._tiers:
                if level.codec is not None and not level.shared:
                    await self._placement.rebuild_from(level)
        except BaseException:
            for level in self._tiers:
                with contextlib.suppress(Exception):
                    await level.tier.aclose()
            raise
        self._open = True
        self._maintenance = asyncio.create_task(self._maintain_forever(), name="store-maintenance")

    async def aclose(self, *, flush: bool = True) -> None:
        """Stops maintenance, writes back what would be lost (``flush``), closes the tiers."""
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
            self._maintenance = None
        await self._placement.drain()
        if self._open and flush:
            await self.flush()
        self._open = False
        for level in self._tiers:
            await level.tier.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def tiers(self) -> tuple[StoreTier, ...]:
        return tuple(self._tiers)

    def tier(self, name: str) -> StoreTier:
        for level in self._tiers:
            if level.name == name:
                return level
        raise KeyError(f"no tier named {name!r}; tiers: {[s.name for s in self._tiers]}")

    # -- namespaces -------------------------------------------------------------------------

    def set_watermarks(self, high: float, low: float) -> None:
        """The eviction watermarks from now on (a config reload); ``0 < low < high <= 1``.

        Raises:
            ValueError: naming both values.
        """
        if not 0.0 < low < high <= 1.0:
            raise ValueError(f"watermarks need 0 < low < high <= 1, got low={low} high={high}")
        self._high, self._low = high, low

    def register_namespace(self, namespace: bytes, tenant: str) -> None:
        """Puts ``namespace``'s blocks in ``tenant``'s host arena (call before using it)."""
        _check_key("namespace", namespace)
        self._tenants.setdefault(namespace, tenant)

    def partition_of(self, namespace: bytes) -> str:
        """The tenant whose host arena holds ``namespace``'s blocks."""
        return self._tenants.get(namespace, "")

    # -- lookups and reads ------------------------------------------------------------------

    def lookup_local(self, keys: Sequence[bytes], namespace: bytes) -> LookupResult:
        """Leading blocks of ``keys`` that the local index holds (no I/O)."""
        self._check_open()
        return self.reads.lookup_local(keys, namespace)

    async def lookup(self, keys: Sequence[bytes], namespace: bytes) -> LookupResult:
        """Leading blocks of ``keys`` held here or, past the local prefix, in shared tiers."""
        self._check_open()
        return await self.reads.lookup(keys, namespace)

    async def get(self, key: bytes, namespace: bytes) -> Block | None:
        """A verified copy of a block, or ``None`` on a miss: see :meth:`ReadPath.get`."""
        self._check_open()
        return await self.reads.get(key, namespace)

    async def get_layer(self, key: bytes, namespace: bytes, layer: int) -> bytes | None:
        """Raw bytes of one layer of a block (no promotion), or ``None`` on a miss."""
        self._check_open()
        return await self.reads.get_layer(key, namespace, layer)

    # -- writes -----------------------------------------------------------------------------

    async def put(
        self, key: bytes, parent: bytes, meta: BlockMeta, payload: Buffer, *, checksum: int = 0
    ) -> PutStatus:
        """Stores a block; it becomes visible only once a tier holds all of its bytes.

        ``payload`` must not change until this returns (its checksum is taken first). With a
        nonzero ``checksum`` (the writer's xxh3-64 of it), a payload that does not match is
        not stored: CHECKSUM_MISMATCH.

        The fields are the caller's to check (the service does, at the edge); ``payload``
        must be ``meta.layout.payload_bytes`` long.

        Raises:
            InvalidBlockError: a block larger than the top tier.
        """
        self._check_open()
        work = self.writes.put(key, parent, meta, payload, checksum)
        (status,) = await self._finished(_listed(work))
        return status

    async def delete(self, key: bytes, namespace: bytes) -> int:
        """Deletes a block and its descendants (unreachable without it); returns how many.

        Blocks under a lease are hidden at once and freed when the lease ends.
        """
        self._check_open()
        root = self.index.find(key, namespace)
        if root is None:
            return 0
        nodes = self.index.subtree(root.id)
        for node in nodes:
            node.doom()
        for node in nodes:
            await self._placement.settle(node)
        return len(nodes)

    # -- operations ---------------------------------------------------------------------------

    def namespaces(self) -> list[bytes]:
        """The namespaces that hold blocks (registered since the start or found in a tier)."""
        return self.index.namespaces()

    async def usage_of(self, namespace: bytes) -> NamespaceUsage:
        """How many committed blocks ``namespace`` has, their payload bytes, and how many of
        them each tier holds a copy of (it yields to the loop by ``LoopBudget``)."""
        blocks = size = 0
        per_tier: Counter[str] = Counter()
        budget = LoopBudget()
        for node in self.index.in_namespace(namespace):
            if node.live:
                blocks += 1
                size += node.size
                per_tier.update(node.tiers)
            await budget.tick()
        tiers = tuple((level.name, per_tier[level.name]) for level in self._tiers)
        return NamespaceUsage(namespace, blocks, size, tiers)

    async def evict_namespace(self, namespace: bytes) -> int:
        """Deletes every block of ``namespace`` from every tier; returns how many. Blocks
        under a lease are hidden at once and freed when the lease ends."""
        self._check_open()
        nodes = [node for node in self.index.in_namespace(namespace) if node.committed]
        for node in nodes:
            node.doom()
        budget = LoopBudget()
        for node in nodes:
            await self._placement.settle(node)
            await budget.tick()
        if nodes:
            log.info("evicted namespace %s: %d blocks", namespace.hex()[:16], len(nodes))
        return len(nodes)

    async def flush(self) -> int:
        """Copies blocks that live only in the top tier down where policy allows; a count.

        Called on shutdown so write-back blocks survive a restart (the host tier does not).
        """
        if len(self._tiers) < 2 or self._tiers[0].codec is not None:
            return 0
        top, lower = self._tiers[0], self._tiers[1]
        due = [
            node
            for node in self.index.nodes()
            if node.tiers == {top.name} and node.live
            and lower.write.admits_demotion(node.hits)
        ]  # fmt: skip
        if due:
            size = sum(node.size for node in due)
            log.info("flushing %d blocks (%.1f MiB) from %s to %s", len(due), size / 2**20,
                     top.name, lower.name)  # fmt: skip
        flushed, said = 0, time.monotonic()
        for done, node in enumerate(due, 1):
            if node.tiers != {top.name} or node.doomed:  # deleted or copied meanwhile
                continue
            payload = await self._placement.read_payload(top, node)
            if payload is not None and await self._placement.store_in(lower, node, payload):
                flushed += 1
            if time.monotonic() - said >= FLUSH_PROGRESS_S and done < len(due):
                said = time.monotonic()
                log.info("flushing: %d of %d blocks done", done, len(due))
        log.info("flushed %d blocks from %s to %s", flushed, top.name, lower.name)
        return flushed

    # -- leases -----------------------------------------------------------------------------

    def pin(self, keys: Sequence[bytes], namespace: bytes, ttl: float | None = None) -> Lease:
        """Leases the leading held blocks of ``keys``: they are not evicted or freed until
        :meth:`release` or the lease expires (``ttl`` seconds, default the store's)."""
        self._check_open()
        return self._leases.grant(self.index.match(keys, namespace), ttl)

    async def release(self, lease_id: int, *, owner: object = None) -> None:
        """Ends a lease of ``owner``.

        Raises:
            UnknownLeaseError: the lease was never issued to ``owner``, or already ended.
        """
        await self.reads.release(lease_id, owner=owner)

    def leases_of(self, owner: object) -> int:
        """How many leases ``owner`` holds."""
        return self._leases.count(owner)

    # -- the host arena: leases and reservations (kvstore.reads, kvstore.writes) ------------

    @property
    def has_arena(self) -> bool:
        """Whether there is a host tier, hence a shared-memory data plane."""
        return self._host is not None

    def arena(self, partition: str) -> ArenaHandle | None:
        """The host arena of ``partition`` that its clients map (read-only), or ``None``
        without a host tier."""
        return None if self._host is None else self._host.arena(partition)

    def keep_arena_pages(self, partition: str, keep: bool) -> None:
        """A client mapping of ``partition``'s arena was registered with CUDA (``keep``) or
        that registration ended: see ``HostTier.keep_pages``."""
        if self._host is None:
            return
        if keep:
            self._host.keep_pages(partition)
        else:
            self._host.release_pages(partition)

    async def acquire(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        ttl: float | None = None,
        *,
        owner: object = None,
        lease_id: int = 0,
    ) -> Acquired:
        """Promotes the leading held blocks of ``keys`` into the arena and leases them.

        Args:
            keys: A key chain.
            namespace: Its namespace.
            ttl: Seconds the lease lives (default the store's).
            owner: Who may release the lease.
            lease_id: An id the owner chose (0: a new one); see :mod:`kvstore.leases`.

        Raises:
            NoArenaError: the store has no host tier.
            InvalidRequestError: ``lease_id`` names a live lease of ``owner``.
        """
        self.check_arena()
        return await self.reads.acquire(keys, namespace, ttl, owner=owner, lease_id=lease_id)

    async def lookup_and_lease(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        ttl: float | None = None,
        *,
        owner: object = None,
        lease_id: int = 0,
    ) -> tuple[LookupResult, Acquired | None]:
        """A lookup that also leases the leading blocks in the arena: see
        :meth:`ReadPath.lookup_and_lease`.

        Raises:
            NoArenaError: the store has no host tier.
            InvalidRequestError: ``lease_id`` names a live lease of ``owner``.
        """
        self.check_arena()
        return await self.reads.lookup_and_lease(
            keys, namespace, ttl, owner=owner, lease_id=lease_id
        )

    def held(
        self, keys: Sequence[bytes], namespace: bytes, block_bytes: int
    ) -> AsyncGenerator[HeldBlock, None]:
        """The leading held blocks as views of leased arena slots: :meth:`ReadPath.held`.

        Raises:
            NoArenaError: the store has no host tier.
        """
        self.check_arena()
        return self.reads.held(keys, namespace, block_bytes)

    async def commit(self, writes: Sequence[Commit]) -> list[PutStatus]:
        """Commits reservations made through :attr:`writes` (``WritePath.reserve`` or
        ``land``): :meth:`kvstore.writes.WritePath.commit`, finished even when the caller is
        cancelled, then the watermarks applied.

        Raises:
            NoArenaError: the store has no host tier.
        """
        self.check_arena()
        return await self._finished(self.writes.commit(writes))

    async def _finished(self, work: Coroutine[Any, Any, list[PutStatus]]) -> list[PutStatus]:
        """Runs a put or a commit to its end even when the caller is cancelled meanwhile (as a
        task of its own: the copies into the arena end before a slot can be freed, and a
        block ends stored and indexed or discarded); then, when it stored a block, applies
        the watermarks."""
        statuses = await finish_anyway(work, self._placement.pending)
        if PutStatus.STORED in statuses:
            await self.relieve_pressure()
        return statuses

    async def abort(
        self, key: bytes, namespace: bytes, *, owner: object = None, abandoned: bool = False
    ) -> bool:
        """Frees ``owner``'s reservation; False when it holds none. ``abandoned``: its writer
        went away (counted with the reservations whose TTL ran out)."""
        self.check_arena()
        freed = await self.writes.abort(key, namespace, owner)
        self._counts["expired_reservations"] += freed and abandoned
        return freed

    async def prefetch(self, keys: Sequence[bytes], namespace: bytes) -> int:
        """Moves the leading held blocks of ``keys`` up into the arena; returns how many are
        there.

        The eviction policy is told these blocks are wanted soon (a queued session): the
        scheduler-aware policy evicts them last and never drops them, for ``hint_ttl``. The
        promotion stays within the hint budget (``hint_share`` of the host tier per hint,
        ``hint_rate`` of it per second) and makes room only by evicting blocks no hint
        protects: hints naming more than the tier holds stop short, never thrash it.
        """
        self.check_arena()
        held = [node.id for node in self.index.match(keys, namespace)]
        self.policy.protect(held, time.monotonic() + self._hint_ttl)
        budget = self._hints.grant()
        count, promoted = await self.reads.prefetch(keys, namespace, budget)
        self._hints.spent(budget, promoted)
        return count

    def check_arena(self) -> None:
        """Raises ``NoArenaError`` without a host tier (``StoreClosedError`` when closed)."""
        self._check_open()
        if self._host is None:
            raise NoArenaError("the shared-memory data plane needs the host tier (host.enabled)")

    # -- maintenance ------------------------------------------------------------------------

    async def maintain(self, now: float | None = None) -> None:
        """Expires leases, applies tier TTLs and watermarks. Runs every second by itself."""
        now = time.monotonic() if now is None else now
        self._counts["expired_leases"] += await self._leases.expire(now)
        self._counts["expired_reservations"] += await self.writes.expire(now)
        for level in self._tiers:
            if level.ttl > 0:
                await self._placement.expire(level, now - level.ttl)
        await self.relieve_pressure()

    async def relieve_pressure(self) -> None:
        """Evicts from each tier above its high watermark until it is under the low one,
        yielding to the loop at least every ``SLICE_S`` of work."""
        for level in self._tiers:
            capacity = level.tier.capacity()
            if level.tier.usage() <= self._high * capacity:
                continue
            budget = LoopBudget()  # a long drain must not stall the loop
            while level.tier.usage() > self._low * capacity:
                if not await self._placement.evict_one(level):
                    break
                await budget.tick()

    def stats(self) -> StoreStats:
        tiers = tuple(
            TierStats(
                name=s.name,
                usage_bytes=s.tier.usage(),
                capacity_bytes=s.tier.capacity(),
                blocks=self.index.blocks_in(s.name),
                hits=self._counts[f"hits.{s.name}"],
                evictions=self._counts[f"evictions.{s.name}"],
                healthy=s.tier.healthy(),
                read_bytes=self._counts[f"read_bytes.{s.name}"],
                written_bytes=self._counts[f"written_bytes.{s.name}"],
                failed_writes=self._counts[f"failed_writes.{s.name}"],
            )
            for s in self._tiers
        )
        return StoreStats(
            tiers=tiers,
            blocks=len(self.index),
            active_leases=len(self._leases),
            active_reservations=len(self.writes),
            **{name: self._counts[name] for name in COUNTERS},
        )

    async def _maintain_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.maintain()
            except Exception:
                log.exception("store maintenance failed; retrying in %.1fs", self._interval)

    def _check_open(self) -> None:
        if not self._open:
            raise StoreClosedError("the block store is not started, or already closed")


def _check_key(name: str, value: object) -> None:
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        shown = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise InvalidBlockError(f"{name} must be {KEY_BYTES} bytes, got {shown}")


async def _listed(work: Coroutine[Any, Any, PutStatus]) -> list[PutStatus]:
    return [await work]
