r"""Placement: writing, reading, promoting, demoting and evicting blocks across the tiers.

The engine room of :class:`kvstore.store.BlockStore`. ``Placement`` holds the ordered tiers,
the radix index and the eviction policy, and moves bytes between tiers:

- ``store_in(tier, node, payload)`` writes a copy, evicting in that tier until it fits;
- ``read_payload`` / ``read_layer`` read a copy back; the top tier holds the raw payload,
  lower tiers the encoded block whose checksums are verified on every read (a corrupt copy
  is deleted and counted, and reads as a miss);
- ``evict_one(tier)`` picks the first evictable block in policy order and ``evict``\ s it:
  copy down when the lower tier's write policy admits it, then free the upper copy;
- ``settle(node)`` frees deleted blocks once unleased and forgets blocks with no copy left.

Eviction takes unleased, idle blocks without children in that tier; a block leaves the
store entirely only if it has no children at all (a parent outlives its children).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvstore.blocks import (
    HEADER_PREFIX_BYTES,
    BlockFormatError,
    BlockHeader,
    Codec,
    decode_block,
    decode_header,
    decode_layer,
    encode_block,
    header_length,
)
from kvstore.config import Config
from kvstore.index import BlockMeta, Node, RadixIndex
from kvstore.policies import EvictionPolicy, WritePolicy, write_policy
from kvstore.tiers.base import Buffer, Tier

log = logging.getLogger(__name__)

OFFLOAD_BYTES = 1 << 20  # copies and codecs above this size run in a worker thread
CODECS = {"none": Codec.RAW, "lz4": Codec.LZ4, "lz4_shuffle": Codec.LZ4_SHUFFLE}
T = TypeVar("T")


@dataclass(slots=True)
class StoreTier:
    """A tier in the hierarchy, with the policies that concern it."""

    tier: Tier
    codec: Codec | None  # None: raw payload (top tier); else encoded blocks with checksums
    write: WritePolicy
    ttl: float = 0.0
    shared: bool = False  # other nodes write it too: ask it live for keys we do not know

    @property
    def name(self) -> str:
        return self.tier.name


async def offload(size: int, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """Runs ``fn`` inline when ``size`` is small, in a worker thread otherwise."""
    if size < OFFLOAD_BYTES:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


class Placement:
    """Tiers, index and eviction policy, and the moves between tiers."""

    def __init__(
        self,
        tiers: list[StoreTier],
        index: RadixIndex,
        policy: EvictionPolicy,
        counts: Counter[str],
    ) -> None:
        self.tiers = tiers
        self.index = index
        self.policy = policy
        self.counts = counts

    # -- internals: moving blocks -----------------------------------------------------------

    async def store_in(self, slot: StoreTier, node: Node, payload: Buffer) -> bool:
        """Writes ``node`` into ``slot``, evicting there as needed. False when it cannot."""
        if slot.name in node.tiers:
            return True
        blob = await self.encode(slot, node, payload)
        capacity = slot.tier.capacity()
        while True:
            if slot.tier.usage() + len(blob) <= capacity and await slot.tier.put(node.key, blob):
                break
            if not slot.tier.healthy() or not await self.evict_one(slot):
                return False
        node.tiers.add(slot.name)
        self.policy.inserted(slot.name, node.key)
        return True

    async def encode(self, slot: StoreTier, node: Node, payload: Buffer) -> Buffer:
        if slot.codec is None:
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
            codec=slot.codec,
        )

    async def read_payload(self, slot: StoreTier, node: Node) -> bytes | None:
        """The raw payload from ``slot``; drops a missing or corrupt copy from the index."""
        blob = await slot.tier.get(node.key)
        if blob is None:
            self.lost_copy(slot, node)
            return None
        if slot.codec is None:
            return blob
        try:
            header, payload = await offload(len(blob), decode_block, blob)
            check_header(header, node)
        except BlockFormatError as error:
            await self.drop_corrupt(slot, node, error)
            return None
        return payload

    async def read_any(self, node: Node) -> tuple[StoreTier, bytes] | None:
        for slot in self.tiers:
            if slot.name in node.tiers:
                payload = await self.read_payload(slot, node)
                if payload is not None:
                    return slot, payload
        return None

    async def read_layer(
        self, slot: StoreTier, node: Node, layer: int, offset: int, length: int
    ) -> bytes | None:
        if slot.codec is None:
            return await slot.tier.get_range(node.key, offset, length)
        try:
            header = await self.read_header(slot, node.key)
            if header is None:
                return None
            check_header(header, node)
            start, size = header.stored_range(layer)
            stored = await slot.tier.get_range(node.key, start, size)
            if stored is None:
                return None
            return await offload(size, decode_layer, header, stored, layer)
        except BlockFormatError as error:
            await self.drop_corrupt(slot, node, error)
            return None

    async def read_header(self, slot: StoreTier, key: bytes) -> BlockHeader | None:
        prefix = await slot.tier.get_range(key, 0, HEADER_PREFIX_BYTES)
        if prefix is None:
            return None
        raw = await slot.tier.get_range(key, 0, header_length(prefix))
        return None if raw is None else decode_header(raw)

    async def drop_corrupt(self, slot: StoreTier, node: Node, error: Exception) -> None:
        log.warning("dropping corrupt copy of %s in %s: %s", node.key.hex()[:16], slot.name, error)
        self.counts["corrupt_blocks"] += 1
        self.lost_copy(slot, node)
        await slot.tier.delete(node.key)

    def lost_copy(self, slot: StoreTier, node: Node) -> None:
        node.tiers.discard(slot.name)
        self.policy.removed(slot.name, node.key)

    async def promote(self, node: Node, payload: bytes) -> None:
        node.busy += 1
        try:
            if await self.store_in(self.tiers[0], node, payload):
                self.counts["promotions"] += 1
        finally:
            node.busy -= 1

    async def write_selective(self, node: Node, payload: bytes) -> None:
        for slot in self.tiers[1:]:
            if slot.name not in node.tiers and slot.write.admits_on_hit(node.hits):
                node.busy += 1
                try:
                    await self.store_in(slot, node, payload)
                finally:
                    node.busy -= 1

    async def held(self, key: bytes, namespace: bytes | None) -> Node | None:
        """The committed block under ``key`` (of ``namespace`` when given), found locally or
        in a shared tier; ``None`` on a miss."""
        node = self.index.committed(key) or await self.discover(key)
        if node is None or (namespace is not None and node.meta.namespace != namespace):
            return None
        return node

    async def write_through(self, node: Node, payload: Buffer) -> bool:
        """Copies a new block into every lower tier whose policy writes at put time."""
        stored = False
        for slot in self.tiers[1:]:
            if slot.write.on_put:
                stored = await self.store_in(slot, node, payload) or stored
        return stored

    async def discover(self, key: bytes) -> Node | None:
        """Adopts a block that another node wrote to a shared tier into the local index."""
        for slot in self.tiers:
            if not slot.shared:
                continue
            try:
                header = await self.read_header(slot, key)
            except BlockFormatError as error:
                log.warning("corrupt header for %s in %s: %s", key.hex()[:16], slot.name, error)
                self.counts["corrupt_blocks"] += 1
                await slot.tier.delete(key)
                continue
            if header is None or header.key != key or self.index.get(key) is not None:
                continue
            meta = BlockMeta(header.namespace, header.num_tokens, header.layout)
            node = self.index.begin(key, header.parent, meta, header.layout.payload_bytes)
            node.tiers.add(slot.name)
            self.policy.inserted(slot.name, key)
            return self.index.commit(key)
        return None

    # -- eviction ----------------------------------------------------------------------------

    async def evict_one(self, slot: StoreTier) -> bool:
        """Evicts one block from ``slot`` (demoting it first per policy). False if none may go."""
        for key in self.policy.victims(slot.name):
            node = self.index.get(key)
            if node is None or slot.name not in node.tiers:
                self.policy.removed(slot.name, key)
                continue
            if self.evictable(node, slot):
                await self.evict(node, slot)
                return True
        return False

    def evictable(self, node: Node, slot: StoreTier) -> bool:
        if not node.committed or node.pinned or self.index.has_children_in(node.key, slot.name):
            return False
        if node.tiers - {slot.name} or self.demotion_target(node, slot) is not None:
            return True
        if self.policy.protected(node.key):
            return False  # a queued session needs it: it may move down, never out
        return not self.index.children_of(node.key)  # its last copy: a parent outlives children

    def demotion_target(self, node: Node, slot: StoreTier) -> StoreTier | None:
        position = self.tiers.index(slot)
        if position + 1 >= len(self.tiers):
            return None
        lower = self.tiers[position + 1]
        if lower.name in node.tiers or not lower.write.admits_demotion(node.hits):
            return None
        return lower if lower.tier.healthy() else None

    async def evict(self, node: Node, slot: StoreTier) -> None:
        node.busy += 1
        try:
            lower = self.demotion_target(node, slot)
            if lower is not None:
                payload = await self.read_payload(slot, node)
                if payload is not None and await self.store_in(lower, node, payload):
                    self.counts["demotions"] += 1
            if slot.name in node.tiers:
                self.lost_copy(slot, node)
                await slot.tier.delete(node.key)
                self.counts[f"evictions.{slot.name}"] += 1
        finally:
            node.busy -= 1
        await self.settle(node)

    async def expire(self, slot: StoreTier, cutoff: float) -> None:
        for node in self.index.nodes():
            if slot.name in node.tiers and node.last_access < cutoff and self.evictable(node, slot):
                await self.evict(node, slot)

    async def settle(self, node: Node) -> None:
        """Frees a deleted block once nothing uses it; forgets a block with no copy left."""
        if node.pinned:
            return
        if node.doomed:
            for slot in self.tiers:
                if slot.name in node.tiers:
                    self.lost_copy(slot, node)
                    await slot.tier.delete(node.key)
        if not node.tiers and node.committed and self.index.get(node.key) is node:
            self.index.discard(node.key)

    # -- misc --------------------------------------------------------------------------------

    def record_hit(self, node: Node, slot: StoreTier) -> None:
        node.hits += 1
        node.last_access = time.monotonic()
        self.policy.accessed(node.key)
        self.counts[f"hits.{slot.name}"] += 1

    def top_tier(self, node: Node) -> str:
        """The name of the highest tier holding ``node`` (it must be in one)."""
        held = node.tiers
        if len(held) == 1:  # the common case, one copy: no need to walk the tiers
            return next(iter(held))
        for slot in self.tiers:  # a plain loop: this runs per block of every lookup
            name = slot.tier.name
            if name in held:
                return name
        raise LookupError(f"block {node.key.hex()[:16]} is in no tier")

    async def rebuild_from(self, slot: StoreTier) -> None:
        """Re-adds the blocks a persistent tier holds (its files carry key and parent)."""
        adopted = dropped = 0
        for key in list(slot.tier.keys()):
            try:
                header = await self.read_header(slot, key)
            except BlockFormatError as error:
                log.warning("dropping %s from %s at start: %s", key.hex()[:16], slot.name, error)
                header = None
            if header is None or header.key != key:
                await slot.tier.delete(key)
                dropped += 1
                continue
            node = self.index.get(key)
            if node is None:
                meta = BlockMeta(header.namespace, header.num_tokens, header.layout)
                node = self.index.begin(key, header.parent, meta, header.layout.payload_bytes)
                self.index.commit(key)
            node.tiers.add(slot.name)
            self.policy.inserted(slot.name, key)
            adopted += 1
        self.counts["corrupt_blocks"] += dropped
        log.info("%s: rebuilt %d blocks from storage, dropped %d", slot.name, adopted, dropped)


def check_header(header: BlockHeader, node: Node) -> None:
    if header.key != node.key or header.layout != node.meta.layout:
        raise BlockFormatError(
            f"stored header is for key {header.key.hex()[:16]} layout {header.layout}, "
            f"expected key {node.key.hex()[:16]} layout {node.meta.layout}"
        )


def tiers_from_config(config: Config) -> list[StoreTier]:
    """The enabled tiers of ``config``, top to bottom, with their policies (not started)."""
    from kvstore.tiers.host import HostTier
    from kvstore.tiers.redis import RedisTier
    from kvstore.tiers.ssd import SsdTier

    tiers: list[StoreTier] = []
    if config.host.enabled:
        host = HostTier(config.host.capacity, directory=config.host.directory)
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
        )
        policy = write_policy(rc.write_policy, rc.selective_hits)
        tiers.append(StoreTier(redis, CODECS[rc.compression], policy, 0.0, shared=True))
    return tiers
