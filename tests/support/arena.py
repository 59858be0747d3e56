"""A block store with a small host arena (and an SSD tier below) for the arena tests of
:mod:`kvstore.reads` and :mod:`kvstore.writes`, with the chains and helpers they share."""

from __future__ import annotations

import asyncio
import hashlib
import mmap
from pathlib import Path

import pytest

from kvstore.index import BlockMeta
from kvstore.policies import (
    EvictionPolicy,
    LruPolicy,
    write_policy,
)
from kvstore.results import Reserved
from kvstore.store import BlockStore, Commit, PutStatus, StoreTier
from kvstore.tiers.base import Buffer
from kvstore.tiers.host import HostTier
from kvstore.tiers.ssd import SsdTier
from kvstore.wire.blocks import ROOT_KEY, BlockLayout, Codec

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, block_tokens=16, head_dim=64, dtype="float16")
BLOCK = LAYOUT.payload_bytes
NS_A = hashlib.sha256(b"tenant-a").digest()
NS_B = hashlib.sha256(b"tenant-b").digest()


def blocks(name: str, count: int) -> list[tuple[bytes, bytes, bytes]]:
    out, parent = [], ROOT_KEY
    for i in range(count):
        key = hashlib.sha256(parent + f"{name}{i}".encode()).digest()
        out.append((key, parent, hashlib.shake_256(key).digest(BLOCK)))
        parent = key
    return out


def make_store(
    tmp_path: Path,
    host_blocks: int = 4,
    ssd: bool = True,
    eviction: EvictionPolicy | None = None,
    hint_share: float = 1.0,
    prefault: bool = False,
) -> BlockStore:
    tiers = [
        StoreTier(
            HostTier(host_blocks * BLOCK, prefault=prefault),
            None,
            write_policy("write_through", 1),
        )
    ]
    if ssd:
        disk = SsdTier(tmp_path / "ssd", 64 * (BLOCK + 1024), fsync=False)
        tiers.append(StoreTier(disk, Codec.LZ4, write_policy("write_back", 2)))
    return BlockStore(
        tiers,
        eviction=eviction or LruPolicy(),
        high_watermark=1.0,
        low_watermark=0.5,
        hint_share=hint_share,
    )


class Arena:
    """A tenant's arena as a client process sees it: the read-only descriptor, mapped."""

    def __init__(self, store: BlockStore, partition: str = "") -> None:
        handle = store.arena(partition)
        assert handle is not None
        self.map = mmap.mmap(handle.fd, handle.size, mmap.MAP_SHARED, mmap.PROT_READ)

    def read(self, offset: int, length: int) -> bytes:
        return self.map[offset : offset + length]

    def close(self) -> None:
        self.map.close()


async def reserve(
    store: BlockStore,
    key: bytes,
    parent: bytes,
    meta: BlockMeta,
    *,
    ttl: float | None = None,
    owner: object = None,
) -> Reserved:
    """One block reserved through the store's write path, as the service reserves."""
    return await store.writes.reserve(key, parent, meta, ttl, owner)


async def commit(
    store: BlockStore,
    key: bytes,
    namespace: bytes,
    *,
    owner: object = None,
    source: Buffer | None = None,
    checksum: int = 0,
) -> PutStatus:
    """One reservation committed through the store, as the service commits."""
    (status,) = await store.commit([Commit(key, namespace, owner, source, checksum)])
    return status


async def put_chain(store: BlockStore, chain: list[tuple[bytes, bytes, bytes]]) -> list[bytes]:
    for key, parent, payload in chain:
        await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
    return [key for key, _, _ in chain]


async def fill_host_with_evictable(store: BlockStore, count: int) -> None:
    for key, parent, payload in blocks("filler", count):
        assert await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload) in (
            PutStatus.STORED,
            PutStatus.DEDUP,
        )


async def slow_evictions(store: BlockStore, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Makes every eviction take 50 ms; the event is set when the first one starts."""
    placement = store._placement
    real = placement.evict_one
    started = asyncio.Event()

    async def slow(level: StoreTier) -> bool:
        started.set()
        await asyncio.sleep(0.05)
        return await real(level)

    monkeypatch.setattr(placement, "evict_one", slow)
    return started
