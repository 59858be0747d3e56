"""The shared-memory data plane in-process: reserve/commit/abort, acquire, expiry, namespaces."""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path

import pytest

from kvstore.blocks import ROOT_KEY, BlockLayout, Codec
from kvstore.errors import InvalidBlockError, NoArenaError
from kvstore.index import BlockMeta
from kvstore.policies import LruPolicy, write_policy
from kvstore.store import BlockStore, PutStatus, StoreTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.ssd import SsdTier

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


def make_store(tmp_path: Path, host_blocks: int = 4, ssd: bool = True) -> BlockStore:
    tiers = [
        StoreTier(
            HostTier(host_blocks * BLOCK, directory=tmp_path),
            None,
            write_policy("write_through", 1),
        )
    ]
    if ssd:
        disk = SsdTier(tmp_path / "ssd", 64 * (BLOCK + 1024), fsync=False)
        tiers.append(StoreTier(disk, Codec.LZ4, write_policy("write_back", 2)))
    return BlockStore(tiers, eviction=LruPolicy(), high_watermark=1.0, low_watermark=0.5)


class Arena:
    """The arena as a client process sees it: the file mapped by path."""

    def __init__(self, path: str, size: int) -> None:
        self._file = open(path, "r+b")  # noqa: SIM115
        self.map = mmap.mmap(self._file.fileno(), size)

    def write(self, offset: int, data: bytes) -> None:
        self.map[offset : offset + len(data)] = data

    def read(self, offset: int, length: int) -> bytes:
        return self.map[offset : offset + length]

    def close(self) -> None:
        self.map.close()
        self._file.close()


async def test_reserve_write_commit_then_acquire_reads_in_place(tmp_path: Path) -> None:
    async with make_store(tmp_path) as store:
        info = store.arena()
        assert info is not None and info.size == 4 * BLOCK
        arena = Arena(info.path, info.size)
        chain = blocks("a", 2)
        # Step 1: reserve; the block is invisible while the client writes it.
        reserved = [await store.reserve(k, p, BlockMeta(NS_A, 16, LAYOUT)) for k, p, _ in chain]
        assert [r.status for r in reserved] == [PutStatus.RESERVED] * 2
        assert (await store.lookup([k for k, _, _ in chain])).num_blocks == 0
        for (_, _, payload), r in zip(chain, reserved, strict=True):
            assert r.slot is not None and r.slot.length == BLOCK
            arena.write(r.slot.offset, payload)
        # Step 2: commit makes them visible; a second commit finds no reservation.
        assert [await store.commit(k) for k, _, _ in chain] == [PutStatus.STORED] * 2
        assert await store.commit(chain[0][0]) is PutStatus.EXPIRED
        assert (await store.lookup([k for k, _, _ in chain], NS_A)).num_blocks == 2
        # Step 3: acquire returns slots under a lease; bytes read in place are exact.
        acquired = await store.acquire([k for k, _, _ in chain], NS_A)
        assert acquired.lease.num_blocks == 2
        assert [arena.read(s.offset, s.length) for s in acquired.slots] == [p for _, _, p in chain]
        assert store.stats().active_leases == 1
        await store.release(acquired.lease.lease_id)
        # Reserving a held key is a dedup, no space used.
        again = await store.reserve(chain[0][0], ROOT_KEY, BlockMeta(NS_A, 16, LAYOUT))
        assert again.status is PutStatus.DEDUP and again.slot is None
        arena.close()


async def test_abandoned_reservations_expire_and_free_space(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=2, ssd=False) as store:
        ((key, parent, _),) = blocks("crash", 1)
        reserved = await store.reserve(key, parent, BlockMeta(NS_A, 16, LAYOUT), ttl=1.0)
        assert reserved.status is PutStatus.RESERVED
        host = store.tier("host").tier
        assert host.usage() == BLOCK and store.stats().active_reservations == 1
        # The writer died: at expiry the space comes back and the block never appears.
        await store.maintain(now=10**9)
        assert host.usage() == 0 and store.stats().active_reservations == 0
        assert await store.commit(key) is PutStatus.EXPIRED
        assert (await store.lookup([key])).num_blocks == 0
        # An explicit abort works the same way.
        await store.reserve(key, parent, BlockMeta(NS_A, 16, LAYOUT))
        assert await store.abort(key) is True and await store.abort(key) is False
        assert host.usage() == 0


async def test_acquire_promotes_from_ssd_and_stops_at_other_namespaces(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=2) as store:
        chain = blocks("deep", 4)
        for key, parent, payload in chain:
            await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
        keys = [k for k, _, _ in chain]
        assert (await store.lookup(keys)).tiers == ("ssd", "ssd", "host", "host")
        # Tenant B's namespace sees nothing of tenant A's chain.
        assert (await store.lookup(keys, NS_B)).num_blocks == 0
        denied = await store.acquire(keys, NS_B)
        assert denied.lease.num_blocks == 0 and denied.slots == ()
        await store.release(denied.lease.lease_id)
        assert await store.get(keys[0], NS_B) is None
        assert await store.delete(keys[0], NS_B) == 0
        # The host holds 2 blocks: acquire promotes the first two and stops, leased.
        acquired = await store.acquire(keys, NS_A)
        assert acquired.lease.num_blocks == 2
        info = store.arena()
        arena = Arena(info.path, info.size)
        assert [arena.read(s.offset, s.length) for s in acquired.slots] == [
            chain[0][2],
            chain[1][2],
        ]
        assert store.stats().tiers[1].hits == 2
        await store.release(acquired.lease.lease_id)
        assert await store.prefetch(keys[2:], NS_A) == 2
        assert (await store.lookup(keys)).tiers[2:] == ("host", "host")
        arena.close()


async def test_bad_reservations_and_no_arena(tmp_path: Path) -> None:
    async with make_store(tmp_path) as store:
        with pytest.raises(InvalidBlockError, match="parent must be 32 bytes, got 3 bytes"):
            await store.reserve(b"k" * 32, b"abc", BlockMeta(NS_A, 16, LAYOUT))
    disk_only = BlockStore(
        [
            StoreTier(
                SsdTier(tmp_path / "only", 1 << 20, fsync=False),
                Codec.RAW,
                write_policy("write_back", 2),
            )
        ],
        eviction=LruPolicy(),
    )
    async with disk_only:
        assert disk_only.arena() is None
        with pytest.raises(NoArenaError, match="needs the host tier"):
            await disk_only.acquire([b"k" * 32])
