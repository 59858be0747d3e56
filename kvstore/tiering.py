r"""Placement: writing, reading, promoting, demoting and evicting blocks across the tiers.

The engine room of :class:`kvstore.store.BlockStore`. ``Placement`` holds the ordered tiers,
the block index and the eviction policy, and moves bytes between tiers. Every block is stored
under its block id (``key || namespace``, :func:`kvstore.index.block_id`).

- ``store_in(tier, node, payload)`` writes a copy, evicting in that tier until it fits; one
  write per (block, tier) is in flight at a time and concurrent callers share it;
- ``promote(node)`` copies a block up into the top tier; one promotion per block is in flight
  at a time, and every concurrent reader waits for that one;
- ``read_payload`` / ``read_layer`` read a copy back, verified: the top tier's raw copy against
  the block's checksum, a lower tier's encoded block against its per-layer and payload
  checksums (and the block's own). A corrupt copy is deleted, counted, and reads as a miss;
- ``evict_one(tier)`` picks the first evictable block in policy order and ``evict``\ s it:
  copy down when the lower tier's write policy admits it, then free the upper copy. The
  policy orders only the tier's *leaves* (the index tells ``Placement``, its
  :class:`~kvstore.index.LeafEvents`, as blocks become or stop being leaves), so a scan
  never passes a chain's ancestors; what it skips is in use (leased, busy, protected). A
  parent that becomes a leaf when its child leaves goes first when it was used no later
  than that child (a chain leaves leaf up, in LRU order), else last, as if just used;
- ``settle(node)`` frees deleted blocks once unleased and forgets blocks with no copy left.

Eviction takes unleased, idle blocks without children in that tier; a block leaves the
store entirely only if it has no children at all (a parent outlives its children).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvstore.budget import LoopBudget
from kvstore.config import Config
from kvstore.errors import InvalidBlockError
from kvstore.index import ID_BYTES, BlockIndex, BlockMeta, Node
from kvstore.policies import EvictionPolicy, WritePolicy, write_policy
from kvstore.tiers.base import Buffer, HashedReads, Tier
from kvstore.tiers.host import HostTier
from kvstore.wire.blocks import (
    HEADER_PREFIX_BYTES,
    BlockFormatError,
    BlockHeader,
    ChecksumMismatchError,
    Codec,
    decode_block,
    decode_header,
    decode_layer,
    encode_block,
    header_length,
    payload_checksum,
)
from kvstore.wire.threads import offload

log = logging.getLogger(__name__)

CODECS = {"none": Codec.RAW, "lz4": Codec.LZ4, "lz4_shuffle": Codec.LZ4_SHUFFLE}
PROMOTE = "^promote"  # the in-flight key of a node's promotion (tier names are plain words)
T = TypeVar("T")


@dataclass(slots=True)
class StoreTier:
    """A level of the hierarchy: a tier with the policies that concern it. Code names one
    ``level``; a ``Slot`` is only ever a byte range in the host arena."""

    tier: Tier
    codec: Codec | None  # None: raw payload (top tier); else encoded blocks with checksums
    write: WritePolicy
    ttl: float = 0.0
    shared: bool = False  # other nodes write it too: ask it live for keys we do not know

    @property
    def name(self) -> str:
        return self.tier.name


def add_run(runs: list[tuple[str, int]], tier: str, count: int) -> None:
    """Appends ``count`` blocks of ``tier`` to ``runs``, merged into the last run if it has
    the same tier."""
    if not count:
        return
    if runs and runs[-1][0] == tier:
        runs[-1] = (tier, runs[-1][1] + count)
    else:
        runs.append((tier, count))


async def checksum_of(payload: Buffer) -> int:
    """The payload's xxh3-64, computed in a worker thread when it is large."""
    return await offload(memoryview(payload).nbytes, payload_checksum, payload)


class Placement:
    """Tiers, index and eviction policy, and the moves between tiers."""

    def __init__(
        self,
        tiers: list[StoreTier],
        index: BlockIndex,
        policy: EvictionPolicy,
        counts: Counter[str],
    ) -> None:
        self.tiers = tiers
        self.index = index
        self.policy = policy
        self.counts = counts
        self._by_name = {level.name: level for level in tiers}
        self.top = tiers[0]
        # The top tier when it is the host tier, whose arenas the data planes lease and fill.
        self.host = self.top.tier if isinstance(self.top.tier, HostTier) else None
        self._tops: dict[frozenset[str], str] = {}  # a node's tier set -> its highest tier
        self.pending: set[asyncio.Task[Any]] = set()  # flights and work finishing anyway
        index.leaf_events = self

    def tier_named(self, name: str) -> StoreTier:
        return self._by_name[name]

    async def drain(self) -> None:
        """Waits for the writes, promotions and other work in flight (for shutdown)."""
        while self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)

    # -- single flight ----------------------------------------------------------------------

    async def once(self, node: Node, what: str, work: Callable[[], Awaitable[bool]]) -> bool:
        """Runs ``work`` unless the same ``what`` of ``node`` is in flight, then shares it.

        The work runs as a task of its own: a cancelled caller stops waiting, the others (and
        the bookkeeping of the work itself) are not cancelled with it.
        """
        task = node.flight(what)
        if task is None:

            async def run() -> bool:
                try:
                    return await work()
                finally:
                    node.end_flight(what, task)
                    await self.settle(node)

            task = asyncio.ensure_future(run())
            node.start_flight(what, task)
            self.pending.add(task)
            task.add_done_callback(self._landed)
        return await asyncio.shield(task)

    def _landed(self, task: asyncio.Task[bool]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.debug("a tier write or promotion failed: %r", error)

    # -- writes -----------------------------------------------------------------------------

    async def store_in(self, level: StoreTier, node: Node, payload: Buffer) -> bool:
        """Writes ``node`` into ``level``, evicting there as needed. False when it cannot."""
        if level.name in node.tiers:
            return True
        return await self.once(node, level.name, lambda: self._store(level, node, payload))

    async def _store(self, level: StoreTier, node: Node, payload: Buffer) -> bool:
        if level.name in node.tiers:
            return True
        with node.working():
            blob = await self.encode(level, node, payload)
            tier, capacity = level.tier, level.tier.capacity()
            while True:
                if tier.usage() + len(blob) <= capacity and await tier.put(node.id, blob):
                    break
                if not tier.healthy() or not await self.evict_one(level):
                    self.counts[f"failed_writes.{level.name}"] += 1
                    return False
        self.index.add_copy(node, level.name)
        self.counts[f"written_bytes.{level.name}"] += len(blob)
        return True

    async def encode(self, level: StoreTier, node: Node, payload: Buffer) -> Buffer:
        if level.codec is None:
            return payload
        return await offload(
            len(payload),
            encode_block,
            key=node.key,
            parent=node.parent,
            namespace=node.meta.namespace,
            num_tokens=node.meta.num_tokens,
            layout=node.meta.layout,
            payload=payload,
            codec=level.codec,
            checksum=node.checksum,
        )

    async def write_through(self, node: Node, payload: Buffer) -> bool:
        """Copies a new block into every lower tier whose policy writes at put time."""
        stored = False
        for level in self.tiers[1:]:
            if level.write.on_put:
                stored = await self.store_in(level, node, payload) or stored
        return stored

    async def write_selective(self, node: Node, payload: Buffer) -> None:
        for level in self.tiers[1:]:
            if level.name not in node.tiers and level.write.admits_on_hit(node.hits):
                await self.store_in(level, node, payload)

    # -- reads ------------------------------------------------------------------------------

    async def read_payload(self, level: StoreTier, node: Node) -> bytes | memoryview | None:
        """The raw payload from ``level``, verified; drops a missing or corrupt copy."""
        got: tuple[bytes | memoryview, int | None] | None
        if level.codec is None and isinstance(level.tier, HashedReads):
            got = await level.tier.get_hashed(node.id)  # copied and hashed in one pass
        else:
            whole = await level.tier.get(node.id)
            got = None if whole is None else (whole, None)
        if got is None:
            self.lost_copy(level, node)
            return None
        blob, found = got
        try:
            if level.codec is None:
                found = await checksum_of(blob) if found is None else found
                if found != node.checksum:
                    raise ChecksumMismatchError(-1, node.checksum, found)
                return blob
            header, payload = await offload(len(blob), decode_block, blob)
            self.check_header(level, header, node)
        except BlockFormatError as error:
            await self.drop_corrupt(level, node, error)
            return None
        return payload

    async def read_any(self, node: Node) -> tuple[StoreTier, bytes | memoryview] | None:
        for level in self.tiers:
            if level.name in node.tiers:
                payload = await self.read_payload(level, node)
                if payload is not None:
                    return level, payload
        return None

    async def read_layer(
        self, level: StoreTier, node: Node, layer: int, offset: int, length: int
    ) -> bytes | None:
        if level.codec is None:
            return await level.tier.get_range(node.id, offset, length)
        try:
            header = await self.read_header(level, node.id)
            if header is None:
                return None
            self.check_header(level, header, node)
            start, size = header.stored_range(layer)
            stored = await level.tier.get_range(node.id, start, size)
            if stored is None:
                return None
            return await offload(size, decode_layer, header, stored, layer)
        except BlockFormatError as error:
            await self.drop_corrupt(level, node, error)
            return None

    async def read_header(self, level: StoreTier, block: bytes) -> BlockHeader | None:
        prefix = await level.tier.get_range(block, 0, HEADER_PREFIX_BYTES)
        if prefix is None:
            return None
        raw = await level.tier.get_range(block, 0, header_length(prefix))
        return None if raw is None else decode_header(raw)

    def check_header(self, level: StoreTier, header: BlockHeader, node: Node) -> None:
        """Raises ``BlockFormatError`` unless ``header`` is this block's (key, namespace,
        layout and checksum). A shared tier may hold another node's equally valid KV for the
        same tokens (a different checksum): adopted when no local copy says otherwise."""
        if (header.key, header.namespace, header.layout) != (
            node.key,
            node.namespace,
            node.meta.layout,
        ):
            raise BlockFormatError(
                f"stored header is for key {header.key.hex()[:16]} namespace "
                f"{header.namespace.hex()[:16]} layout {header.layout}, expected key "
                f"{node.key.hex()[:16]} namespace {node.namespace.hex()[:16]} "
                f"layout {node.meta.layout}"
            )
        if header.checksum == node.checksum:
            return
        local = [s for s in self.tiers if s.name in node.tiers and not s.shared]
        if level.shared and not local:
            node.checksum = header.checksum
            return
        raise ChecksumMismatchError(-1, node.checksum, header.checksum)

    async def drop_corrupt(self, level: StoreTier, node: Node, error: Exception) -> None:
        log.warning("dropping corrupt copy of %s in %s: %s", node.id.hex()[:16], level.name, error)
        self.counts["corrupt_blocks"] += 1
        self.lost_copy(level, node)
        await level.tier.delete(node.id)

    def lost_copy(self, level: StoreTier, node: Node) -> None:
        self.index.drop_copy(node, level.name)

    # -- leaf events: the policy orders a tier's leaves only ---------------------------------

    def leaf_added(self, tier: str, node: Node, freed_by: Node | None) -> None:
        first = freed_by is not None and node.last_access <= freed_by.last_access
        self.policy.inserted(tier, node.id, first=first)

    def leaf_removed(self, tier: str, node: Node) -> None:
        self.policy.removed(tier, node.id)

    # -- promotion --------------------------------------------------------------------------

    async def promote(self, node: Node, payload: Buffer | None = None) -> bool:
        """Copies ``node`` up into the top tier (``payload``, already read and verified, or
        from the highest tier with a good copy); one promotion per block at a time, shared by
        every concurrent caller."""
        top = self.tiers[0]
        if top.name in node.tiers:
            return True
        return await self.once(node, PROMOTE, lambda: self._promote(node, payload))

    async def _promote(self, node: Node, payload: Buffer | None) -> bool:
        top = self.tiers[0]
        if top.name in node.tiers:
            return True
        with node.working():
            if payload is None:
                found = await self.read_any(node)
                if found is None:
                    return False
                source, payload = found
                if source is top:
                    return True
            if not await self.store_in(top, node, payload):
                return False
            self.counts["promotions"] += 1
            return True

    async def held(self, key: bytes, namespace: bytes) -> Node | None:
        """The committed block of ``key`` in ``namespace``, found locally or in a shared tier;
        ``None`` on a miss."""
        node = self.index.find(key, namespace)
        if node is not None:
            return node if node.live and node.tiers else None
        return await self.discover(key, namespace)

    async def discover(self, key: bytes, namespace: bytes) -> Node | None:
        """Adopts a block that another node wrote to a shared tier into the local index."""
        block = key + namespace
        for level in self.tiers:
            if not level.shared:
                continue
            try:
                header = await self.read_header(level, block)
            except BlockFormatError as error:
                log.warning("corrupt header for %s in %s: %s", block.hex()[:16], level.name, error)
                self.counts["corrupt_blocks"] += 1
                await level.tier.delete(block)
                continue
            if header is None or (header.key, header.namespace) != (key, namespace):
                continue
            if self.index.find(key, namespace) is not None:
                return None  # adopted (or written) while we read: ask again
            try:
                return self.adopt(level, header)
            except InvalidBlockError as error:  # its parent chain leads back to it
                log.warning("not adopting %s from %s: %s", block.hex()[:16], level.name, error)
        return None

    def adopt(self, level: StoreTier, header: BlockHeader) -> Node:
        """A committed node for a block that ``level`` holds (its header read and checked)."""
        meta = BlockMeta(header.namespace, header.num_tokens, header.layout)
        node = self.index.begin(header.key, header.parent, meta, header.layout.payload_bytes)
        node.checksum = header.checksum
        self.index.add_copy(node, level.name)
        return self.index.commit(node.id)

    # -- eviction ----------------------------------------------------------------------------

    async def evict_one(self, level: StoreTier, *, spare_protected: bool = False) -> bool:
        """Evicts one block from ``level`` (demoting it first per policy). False if none may go.
        ``spare_protected``: not a block a hint protects (room made for another hint)."""
        for block in self.policy.victims(level.name):
            node = self.index.get(block)
            if node is None or level.name not in node.tiers:
                self.policy.removed(level.name, block)
                continue
            if spare_protected and self.policy.protected(block):
                continue
            if self.evictable(node, level) and await self.evict(node, level):
                return True
        return False

    def evictable(self, node: Node, level: StoreTier) -> bool:
        if not node.committed or not node.idle:
            return False
        if self.index.children_in(node.id, level.name):
            return False
        if node.tiers - {level.name} or self.demotion_target(node, level) is not None:
            return True
        if self.policy.protected(node.id):
            return False  # a queued session needs it: it may move down, never out
        return not self.index.children_of(node.id)  # its last copy: a parent outlives children

    def demotion_target(self, node: Node, level: StoreTier) -> StoreTier | None:
        position = self.tiers.index(level)
        if position + 1 >= len(self.tiers):
            return None
        lower = self.tiers[position + 1]
        if lower.name in node.tiers or not lower.write.admits_demotion(node.hits):
            return None
        return lower if lower.tier.healthy() else None

    async def evict(self, node: Node, level: StoreTier) -> bool:
        """Demotes ``node`` per policy, then frees its copy in ``level``; False when the copy
        stays: the demotion failed and it is the last copy of a parent (or of a block a
        queued session needs)."""
        with node.working():
            lower = self.demotion_target(node, level)
            if lower is not None:
                payload = await self.read_payload(level, node)
                if payload is not None and await self.store_in(lower, node, payload):
                    self.counts["demotions"] += 1
            evicted = level.name in node.tiers and self._may_drop(node, level)
            if evicted:
                self.lost_copy(level, node)
                await level.tier.delete(node.id)
                self.counts[f"evictions.{level.name}"] += 1
        await self.settle(node)
        return evicted

    def _may_drop(self, node: Node, level: StoreTier) -> bool:
        if node.tiers - {level.name}:
            return True  # another tier holds it
        return not self.index.children_of(node.id) and not self.policy.protected(node.id)

    async def expire(self, level: StoreTier, cutoff: float) -> int:
        """Evicts ``level``'s blocks idle since before ``cutoff``; returns how many.

        Walks the policy's order from the front, anew after each eviction (which may put a
        parent first), and stops at the first block used since ``cutoff``: the cost is the
        blocks expired and those in use it passes, not the blocks held. The order is by
        last use except where a block entered the tier after its last use (a demotion) or a
        parent went last: such a block expires once the younger ones ahead of it have (or
        have been used and moved back), within two TTLs. It yields to the loop at least
        every ``SLICE_S`` of work (:class:`~kvstore.budget.LoopBudget`).
        """
        expired, budget = 0, LoopBudget()
        while await self._expire_one(level, cutoff):
            expired += 1
            await budget.tick()
        return expired

    async def _expire_one(self, level: StoreTier, cutoff: float) -> bool:
        for block in self.policy.victims(level.name):
            node = self.index.get(block)
            if node is None or level.name not in node.tiers:
                continue
            if node.last_access >= cutoff:
                return False
            if self.evictable(node, level) and await self.evict(node, level):
                return True
        return False

    async def settle(self, node: Node) -> None:
        """Frees a deleted block once nothing uses it; forgets a block with no copy left.

        Each tier's delete may wait, and meanwhile the block may be put again (revived) or
        read into a tier by a promotion: so every copy is taken only while the block is
        still deleted and unused, and it is forgotten only if nothing uses it then (a node
        forgotten under a promotion would leave the copy it lands as no one's to free).
        """
        while node.doomed and node.idle:
            level = next((s for s in self.tiers if s.name in node.tiers), None)
            if level is None:
                break
            self.lost_copy(level, node)
            await level.tier.delete(node.id)
        if not node.idle:
            return  # whoever uses it settles it when done
        if not node.tiers and node.committed and self.index.get(node.id) is node:
            self.index.discard(node.id)

    # -- misc --------------------------------------------------------------------------------

    def dedup(self, key: bytes, namespace: bytes) -> bool:
        """Whether ``key`` is held or being written already: then a put of it stores nothing
        (the same key has the same content), revives the block if it was deleted, counts as
        an access and as a dedup put. Every write path asks this first."""
        existing = self.index.find(key, namespace)
        if existing is None:
            return False
        existing.revive(time.monotonic())
        self.counts["dedup_puts"] += 1
        return True

    def check_fits(self, size: int) -> None:
        """Raises ``InvalidBlockError`` for a block that can never fit in the top tier, even
        with the tier empty; every write path checks this before it evicts anything."""
        top = self.tiers[0].tier
        fits = top.fits(size) if isinstance(top, HostTier) else size < top.capacity()
        if not fits:
            raise InvalidBlockError(
                f"a block of {size} bytes can never fit in the {top.name} tier "
                f"({top.capacity()} bytes)"
            )

    def count_gets(self, tried: int, missed: int) -> None:
        """Reads of ``tried`` keys, ``missed`` of them not served: every read path counts
        its keys here, a hit's tier and bytes in :meth:`record_hit`."""
        self.counts["gets"] += tried
        self.counts["misses"] += missed

    def record_hit(self, node: Node, level: StoreTier) -> None:
        node.hits += 1
        node.last_access = time.monotonic()
        self.policy.accessed(node.id)
        self.counts[f"hits.{level.name}"] += 1
        self.counts[f"read_bytes.{level.name}"] += node.size

    def top_tier(self, node: Node) -> str:
        """The name of the highest tier holding ``node`` (it must be in one)."""
        return self._top(node.tiers)

    def top_runs(self, runs: Sequence[tuple[frozenset[str], int]]) -> list[tuple[str, int]]:
        """Runs of tier sets (``BlockIndex.match_runs``) as runs of the highest tier in each,
        neighbours with the same highest tier merged."""
        named: list[tuple[str, int]] = []
        for tiers, count in runs:
            add_run(named, self._top(tiers), count)
        return named

    def _top(self, tiers: frozenset[str]) -> str:
        top = self._tops.get(tiers)
        if top is None:
            top = self._tops[tiers] = self._highest(tiers)
        return top

    def _highest(self, tiers: frozenset[str]) -> str:
        for level in self.tiers:
            if level.name in tiers:
                return level.name
        raise LookupError(f"no tier of {sorted(tiers)} is a tier of this store")

    async def rebuild_from(self, level: StoreTier) -> None:
        """Re-adds the blocks a persistent tier holds (their headers carry key, parent,
        namespace and checksum)."""
        adopted = dropped = 0
        for block in list(level.tier.keys()):
            try:
                header = await self.read_header(level, block) if len(block) == ID_BYTES else None
            except BlockFormatError as error:
                log.warning("dropping %s from %s at start: %s", block.hex()[:16], level.name, error)
                header = None
            if header is None or header.key + header.namespace != block:
                await level.tier.delete(block)
                dropped += 1
                continue
            node = self.index.get(block)
            if node is None:
                try:
                    self.adopt(level, header)
                except InvalidBlockError as error:
                    log.warning("dropping %s from %s: %s", block.hex()[:16], level.name, error)
                    await level.tier.delete(block)
                    dropped += 1
                    continue
            else:
                self.index.add_copy(node, level.name)
            adopted += 1
        self.counts["corrupt_blocks"] += dropped
        log.info("%s: rebuilt %d blocks from storage, dropped %d", level.name, adopted, dropped)


def tiers_from_config(
    config: Config, partition_of: Callable[[bytes], str] | None = None
) -> list[StoreTier]:
    """The enabled tiers of ``config``, top to bottom, with their policies (not started).

    Args:
        config: The daemon's configuration.
        partition_of: The host arena a block id belongs to (the daemon: its tenant's).
    """
    from kvstore.tiers.redis import RedisTier
    from kvstore.tiers.ssd import SsdTier

    tiers: list[StoreTier] = []
    if config.host.enabled:
        host = HostTier(
            config.host.capacity, partition_of=partition_of, prefault=config.host.prefault
        )
        tiers.append(StoreTier(host, None, write_policy("write_through", 1), config.host.ttl))
    if config.ssd.enabled:
        ssd_cfg = config.ssd
        ssd = SsdTier(Path(ssd_cfg.directory).expanduser(), ssd_cfg.capacity, fsync=ssd_cfg.fsync)
        policy = write_policy(ssd_cfg.write_policy, ssd_cfg.selective_hits)
        tiers.append(StoreTier(ssd, CODECS[ssd_cfg.compression], policy, ssd_cfg.ttl))
    if config.redis.enabled:
        rc = config.redis
        redis = RedisTier(
            rc.url,
            rc.capacity,
            key_prefix=rc.key_prefix,
            ttl_s=rc.ttl or None,
            pool_size=rc.pool_size,
            timeout_s=rc.timeout,
            tls_ca=rc.tls_ca,
            tls_cert=rc.tls_cert,
            tls_key=rc.tls_key,
        )
        policy = write_policy(rc.write_policy, rc.selective_hits)
        tiers.append(StoreTier(redis, CODECS[rc.compression], policy, 0.0, shared=True))
    return tiers
