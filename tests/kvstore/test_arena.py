"""The shared-memory data plane in-process: reserve/commit/abort, acquire, expiry, namespaces,
and the races of promotion into a full arena."""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import time
from pathlib import Path

import pytest

from kvstore.budget import LoopBudget
from kvstore.errors import InvalidBlockError, NoArenaError, UnknownLeaseError
from kvstore.index import BlockMeta
from kvstore.policies import (
    EvictionPolicy,
    HintBudget,
    LruPolicy,
    SchedulerAwarePolicy,
    write_policy,
)
from kvstore.store import BlockStore, PutStatus, StoreTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.ssd import SsdTier
from kvstore.wire.blocks import ROOT_KEY, BlockLayout, Codec, payload_checksum
from tests.support.prefault import StalledPrefault

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


async def test_reserve_write_commit_then_acquire_reads_in_place(tmp_path: Path) -> None:
    async with make_store(tmp_path) as store:
        arena = Arena(store)
        assert len(arena.map) == 4 * BLOCK
        chain = blocks("a", 2)
        # Step 1: reserve; the block is invisible while its bytes are written.
        reserved = [await store.reserve(k, p, BlockMeta(NS_A, 16, LAYOUT)) for k, p, _ in chain]
        assert [r.status for r in reserved] == [PutStatus.RESERVED] * 2
        assert (await store.lookup([k for k, _, _ in chain], NS_A)).num_blocks == 0
        for (_, _, payload), r in zip(chain, reserved, strict=True):
            assert r.slot is not None and r.slot.length == BLOCK
            with store.reserved_view(r.slot) as slot:
                slot[:] = payload
        # Step 2: commit makes them visible; a second commit finds no reservation.
        assert [await store.commit(k, NS_A) for k, _, _ in chain] == [PutStatus.STORED] * 2
        assert await store.commit(chain[0][0], NS_A) is PutStatus.EXPIRED
        assert (await store.lookup([k for k, _, _ in chain], NS_A)).num_blocks == 2
        # Step 3: acquire returns slots under a lease; bytes read in place are exact.
        acquired = await store.acquire([k for k, _, _ in chain], NS_A)
        assert acquired.lease.num_blocks == 2
        assert acquired.arena_id == store.arena("").arena_id
        assert [arena.read(s.offset, s.length) for s in acquired.slots] == [p for _, _, p in chain]
        assert acquired.checksums == tuple(payload_checksum(p) for _, _, p in chain)
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
        assert await store.commit(key, NS_A) is PutStatus.EXPIRED
        assert (await store.lookup([key], NS_A)).num_blocks == 0
        # An explicit abort works the same way.
        await store.reserve(key, parent, BlockMeta(NS_A, 16, LAYOUT))
        assert await store.abort(key, NS_A) is True and await store.abort(key, NS_A) is False
        assert host.usage() == 0


async def put_chain(store: BlockStore, chain: list[tuple[bytes, bytes, bytes]]) -> list[bytes]:
    for key, parent, payload in chain:
        await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
    return [key for key, _, _ in chain]


async def test_a_hint_never_evicts_what_another_hint_protects(tmp_path: Path) -> None:
    """Two queued sessions whose KV is each the size of the host tier: the first hint moves
    its chain up (evicting unhinted blocks), the second finds only protected blocks to
    evict and stops, instead of trading the first session's blocks for its own."""
    async with make_store(tmp_path, host_blocks=4, eviction=SchedulerAwarePolicy()) as store:
        a = await put_chain(store, blocks("a", 4))
        b = await put_chain(store, blocks("b", 4))  # the host holds b; a went down to SSD
        c = await put_chain(store, blocks("c", 4))  # and now c; b went down too
        assert (await store.lookup(a + b, NS_A)).tiers == ("ssd",) * 8
        assert await store.prefetch(a, NS_A) == 4  # evicts c (no hint protects it)
        assert await store.prefetch(b, NS_A) == 0  # only a's protected blocks could go
        assert (await store.lookup(a, NS_A)).tiers == ("host",) * 4
        assert (await store.lookup(b, NS_A)).tiers == ("ssd",) * 4
        assert (await store.lookup(c, NS_A)).tiers == ("ssd",) * 4


async def test_a_hint_promotes_at_most_its_share_of_the_host_tier(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=8, hint_share=0.25) as store:
        a = await put_chain(store, blocks("a", 8))
        await put_chain(store, blocks("b", 8))  # a is in SSD now
        assert await store.prefetch(a, NS_A) == 2  # a quarter of 8 blocks
        assert (await store.lookup(a, NS_A)).tiers == ("host",) * 2 + ("ssd",) * 6


def test_the_hint_budget_refills_at_its_rate_up_to_one_second() -> None:
    budget = HintBudget(per_hint=100, per_second=300)
    start = budget.grant(now=0.0)
    assert start == 100  # per hint, though a second's worth is there
    budget.spent(start, 100)
    assert [budget.grant(now=0.0) for _ in range(2)] == [100, 100]  # 200 left: unspent
    budget.spent(100, 150)  # spends at most what it was granted
    assert budget.grant(now=0.0) == 100
    budget.spent(100, 100)
    assert budget.grant(now=0.0) == 0  # 300 spent in the same instant
    assert budget.grant(now=0.1) == 30  # refills at 300 per second
    assert budget.grant(now=60.0) == 100  # holds a second's worth, capped per hint


async def test_acquire_promotes_from_ssd_and_stops_at_other_namespaces(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=2) as store:
        chain = blocks("deep", 4)
        for key, parent, payload in chain:
            await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
        keys = [k for k, _, _ in chain]
        assert (await store.lookup(keys, NS_A)).tiers == ("ssd", "ssd", "host", "host")
        # Tenant B's namespace sees nothing of tenant A's chain.
        assert (await store.lookup(keys, NS_B)).num_blocks == 0
        denied = await store.acquire(keys, NS_B)
        assert denied.lease.num_blocks == 0 and denied.slots == ()
        assert (store.stats().gets, store.stats().misses) == (1, 1)  # counted as get() counts
        await store.release(denied.lease.lease_id)
        assert await store.get(keys[0], NS_B) is None
        assert await store.delete(keys[0], NS_B) == 0
        # The host holds 2 blocks: acquire promotes the first two and stops, leased.
        acquired = await store.acquire(keys, NS_A)
        assert acquired.lease.num_blocks == 2
        arena = Arena(store)
        assert [arena.read(s.offset, s.length) for s in acquired.slots] == [
            chain[0][2],
            chain[1][2],
        ]
        assert store.stats().tiers[1].hits == 2
        # Two blocks served, the third held but with no room left in the arena: a miss.
        stats = store.stats()
        assert (stats.gets, stats.misses) == (2 + 3, 2 + 1)
        assert stats.gets == sum(t.hits for t in stats.tiers) + stats.misses
        await store.release(acquired.lease.lease_id)
        assert await store.prefetch(keys[2:], NS_A) == 2
        assert (await store.lookup(keys, NS_A)).tiers[2:] == ("host", "host")
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
        assert disk_only.arena("") is None
        with pytest.raises(NoArenaError, match="needs the host tier"):
            await disk_only.acquire([b"k" * 32], NS_A)


async def fill_host_with_evictable(store: BlockStore, count: int) -> None:
    for key, parent, payload in blocks("filler", count):
        assert await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload) in (
            PutStatus.STORED,
            PutStatus.DEDUP,
        )


async def test_a_reserve_that_finds_only_a_faulting_chunk_free_waits_instead_of_evicting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arena fills while pre-faulting holds a chunk (one block of 16): the next reserve
    waits for the chunk's faulting to end; it does not send a block down to SSD for room
    that is only held a moment."""
    stall = StalledPrefault(monkeypatch)
    async with make_store(tmp_path, host_blocks=16, prefault=True) as store:
        store.arena("")
        await stall.started()
        await fill_host_with_evictable(store, 15)
        ((key, parent, _),) = blocks("last", 1)
        task = asyncio.create_task(store.reserve(key, parent, BlockMeta(NS_A, 16, LAYOUT)))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not task.done()
        stall.release()
        assert (await task).status is PutStatus.RESERVED
        assert store.stats().tiers[0].evictions == 0
        filler = [k for k, _, _ in blocks("filler", 15)]
        assert (await store.lookup(filler, NS_A)).runs == (("host", 15),)


async def test_a_lease_released_while_the_expiry_sweep_yields_ends_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The expiry sweep yields between leases (LoopBudget, its slice 0 s here): a lease its
    holder releases meanwhile is not ended a second time, and every block is unleased."""
    monkeypatch.setattr(LoopBudget.__init__, "__defaults__", (0.0,))
    async with make_store(tmp_path, host_blocks=8, ssd=False) as store:
        chain = blocks("leased", 4)
        for key, parent, payload in chain:
            await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
        leases = [(await store.acquire([k], NS_A, ttl=1.0)).lease for k, _, _ in chain]
        sweep = asyncio.create_task(store.maintain(now=time.monotonic() + 60))
        await asyncio.sleep(0)  # the sweep ended the first lease and yielded
        assert not sweep.done()
        await store.release(leases[-1].lease_id)
        await sweep
        assert store.stats().expired_leases == 3
        assert store.stats().active_leases == 0
        assert all(store.index.find(k, NS_A).leases == 0 for k, _, _ in chain)


async def test_concurrent_acquires_of_an_ssd_only_block_promote_it_once(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=4) as store:
        # Step 1: the block lives only on SSD, and the arena is full of evictable blocks.
        ((key, parent, payload),) = blocks("cold", 1)
        await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
        await fill_host_with_evictable(store, 5)  # evicts "cold" down to SSD
        assert (await store.lookup([key], NS_A)).tiers == ("ssd",)
        host = store.tier("host").tier
        assert host.usage() == 4 * BLOCK
        # Step 2: six readers at once. One promotion; every lease points at the same slot.
        acquired = await asyncio.gather(*(store.acquire([key], NS_A) for _ in range(6)))
        assert store.stats().promotions == 1
        assert {a.slots for a in acquired} == {acquired[0].slots}
        (slot,) = acquired[0].slots
        assert host.pinned(slot) == 6
        arena = Arena(store)
        assert arena.read(slot.offset, slot.length) == payload
        # Step 3: churn the arena while the leases hold: the slot keeps the block's bytes.
        await fill_host_with_evictable(store, 12)
        assert arena.read(slot.offset, slot.length) == payload
        for one in acquired:
            await store.release(one.lease.lease_id)
        assert host.pinned(slot) == 0
        assert host.usage() <= host.capacity()
        arena.close()


async def test_a_leased_slot_outlives_delete_and_reuse(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=2, ssd=False) as store:
        ((key, parent, payload),) = blocks("leased", 1)
        await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
        acquired = await store.acquire([key], NS_A)
        (slot,) = acquired.slots
        # Deleted while leased: hidden at once, its slot neither freed nor reused.
        assert await store.delete(key, NS_A) == 1
        assert (await store.lookup([key], NS_A)).num_blocks == 0
        others = [blocks(f"other{i}", 1)[0] for i in range(3)]
        host = store.tier("host").tier
        for k, p, b in others:  # each evicts the one before: only one slot is free
            assert await store.put(k, p, BlockMeta(NS_A, 16, LAYOUT), b) is PutStatus.STORED
            assert host.locate(k + NS_A) != slot
        arena = Arena(store)
        assert arena.read(slot.offset, slot.length) == payload
        assert host.usage() == 2 * BLOCK
        await store.release(acquired.lease.lease_id)
        assert host.usage() == BLOCK  # the deleted block's slot is free at last
        arena.close()


async def test_a_tenant_cannot_reach_another_tenants_reservations_or_blocks(
    tmp_path: Path,
) -> None:
    async with make_store(tmp_path, host_blocks=8, ssd=False) as store:
        ((key, parent, payload),) = blocks("shared-key", 1)
        # Step 1: A reserves K. B's commit and abort of K (in B's namespace) find nothing.
        mine = await store.reserve(key, parent, BlockMeta(NS_A, 16, LAYOUT), owner="a")
        assert mine.status is PutStatus.RESERVED
        assert await store.commit(key, NS_B, owner="b") is PutStatus.EXPIRED
        assert await store.abort(key, NS_B, owner="b") is False
        # ... nor may another writer of A's own namespace finish A's reservation.
        assert await store.commit(key, NS_A, owner="other") is PutStatus.EXPIRED
        assert await store.abort(key, NS_A, owner="other") is False
        # Step 2: B reserving or putting the same key is not told A holds it (no DEDUP).
        theirs = await store.reserve(key, parent, BlockMeta(NS_B, 16, LAYOUT), owner="b")
        assert theirs.status is PutStatus.RESERVED
        assert await store.abort(key, NS_B, owner="b") is True
        forged = b"\xee" * BLOCK
        assert await store.put(key, parent, BlockMeta(NS_B, 16, LAYOUT), forged) is (
            PutStatus.STORED
        )
        # Step 3: A commits its own bytes; each namespace reads its own block.
        assert await store.commit(key, NS_A, owner="a", source=payload) is PutStatus.STORED
        assert (await store.get(key, NS_A)).payload == payload
        assert (await store.get(key, NS_B)).payload == forged
        # Step 4: B deleting K removes only B's block.
        assert await store.delete(key, NS_B) == 1
        assert (await store.get(key, NS_A)).payload == payload


async def test_a_commit_with_the_wrong_checksum_stores_nothing(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=4, ssd=False) as store:
        ((key, parent, payload),) = blocks("sum", 1)
        await store.reserve(key, parent, BlockMeta(NS_A, 16, LAYOUT))
        bad = payload_checksum(payload) ^ 1
        status = await store.commit(key, NS_A, source=payload, checksum=bad)
        assert status is PutStatus.CHECKSUM_MISMATCH
        assert (await store.lookup([key], NS_A)).num_blocks == 0
        assert store.tier("host").tier.usage() == 0
        assert store.stats().corrupt_writes == 1
        await store.reserve(key, parent, BlockMeta(NS_A, 16, LAYOUT))
        good = payload_checksum(payload)
        assert await store.commit(key, NS_A, source=payload, checksum=good) is PutStatus.STORED


async def test_a_corrupted_host_copy_is_caught_when_it_moves(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=2) as store:
        chain = blocks("flip", 2)
        for key, parent, payload in chain:
            await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
        host = store.tier("host").tier
        # A bit flips in the daemon's memory (what a scribbling client could have done).
        slot = host.locate(chain[1][0] + NS_A)
        with host.view(slot) as view:
            view[100] ^= 0x01
        # Read by copy: the checksum catches it; the bad copy is dropped, not served.
        assert await store.get(chain[1][0], NS_A) is None
        assert store.stats().corrupt_blocks == 1
        # Block 0 demoted to SSD on eviction is checked too: a good copy moves, bit-exact.
        await fill_host_with_evictable(store, 2)
        assert (await store.lookup([chain[0][0]], NS_A)).tiers == ("ssd",)
        assert (await store.get(chain[0][0], NS_A)).payload == chain[0][2]
        with host.view(host.locate(chain[0][0] + NS_A)) as view:
            view[0] ^= 0x80
        # Evicted again: its SSD copy already exists, so the bad host copy is dropped unread.
        await fill_host_with_evictable(store, 4)
        assert (await store.lookup([chain[0][0]], NS_A)).tiers == ("ssd",)
        assert (await store.get(chain[0][0], NS_A)).payload == chain[0][2]
        assert store.stats().corrupt_blocks == 1


async def test_a_lease_released_before_its_grant_is_never_held(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=4) as store:
        ((key, parent, payload),) = blocks("early", 1)
        await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
        # The client gave up on its Acquire and released the id it had chosen for it.
        with pytest.raises(UnknownLeaseError):
            await store.release(0xABCDEF, owner="alice")
        # Another tenant's id of the same value is unaffected.
        theirs = await store.acquire([key], NS_A, owner="bob", lease_id=0xABCDEF)
        assert theirs.lease.num_blocks == 1
        # The late Acquire grants nothing: no lease, no pin, the block evictable again.
        late = await store.acquire([key], NS_A, owner="alice", lease_id=0xABCDEF)
        assert late.lease.num_blocks == 0 and late.slots == ()
        assert store.stats().active_leases == 1
        await store.release(0xABCDEF, owner="bob")
        assert store.stats().active_leases == 0
        assert store.tier("host").tier.pinned(theirs.slots[0]) == 0


async def test_an_oversized_block_is_refused_before_anything_is_evicted(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=4) as store:
        await fill_host_with_evictable(store, 4)
        huge = BlockLayout(num_layers=64, num_kv_heads=2, block_tokens=16, head_dim=64,
                           dtype="float16")  # fmt: skip
        with pytest.raises(InvalidBlockError, match="can never fit in the host tier"):
            await store.reserve(b"h" * 32, ROOT_KEY, BlockMeta(NS_A, 16, huge))
        with pytest.raises(InvalidBlockError, match="can never fit in the host tier"):
            await store.put(
                b"h" * 32, ROOT_KEY, BlockMeta(NS_A, 16, huge), bytes(huge.payload_bytes)
            )
        assert store.tier("host").tier.usage() == 4 * BLOCK
        assert store.stats().tiers[0].evictions == 0


async def test_a_corrupted_host_copy_is_never_demoted(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=2) as store:
        ((key, parent, payload),) = blocks("demote", 1)
        await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload)
        host, ssd = store.tier("host").tier, store.tier("ssd").tier
        with host.view(host.locate(key + NS_A)) as view:
            view[-1] ^= 0x10
        await fill_host_with_evictable(store, 3)  # evicts it: the demotion reads and checks it
        assert await ssd.contains(key + NS_A) is False
        assert (await store.lookup([key], NS_A)).num_blocks == 0
        assert store.stats().corrupt_blocks == 1 and store.stats().demotions >= 1


async def slow_evictions(store: BlockStore, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Makes every eviction take 50 ms; the event is set when the first one starts."""
    placement = store._placement
    real = placement.evict_one
    started = asyncio.Event()

    async def slow(slot: StoreTier) -> bool:
        started.set()
        await asyncio.sleep(0.05)
        return await real(slot)

    monkeypatch.setattr(placement, "evict_one", slow)
    return started


async def test_a_reserve_cancelled_while_evicting_leaves_the_key_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_store(tmp_path, host_blocks=2) as store:
        await fill_host_with_evictable(store, 2)
        started = await slow_evictions(store, monkeypatch)
        ((key, parent, payload),) = blocks("cancelled-reserve", 1)
        task = asyncio.create_task(store.reserve(key, parent, BlockMeta(NS_A, 16, LAYOUT)))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Not a pending ghost: the key can be stored, and then it reads back.
        assert await store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload) is (
            PutStatus.STORED
        )
        assert (await store.get(key, NS_A)).payload == payload


async def test_a_put_cancelled_while_evicting_ends_consistently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_store(tmp_path, host_blocks=2) as store:
        await fill_host_with_evictable(store, 2)
        started = await slow_evictions(store, monkeypatch)
        ((key, parent, payload),) = blocks("cancelled-put", 1)
        task = asyncio.create_task(store.put(key, parent, BlockMeta(NS_A, 16, LAYOUT), payload))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store._placement.drain()  # the put went on to its end meanwhile
        host = store.tier("host").tier
        indexed = {n.id for n in store.index.nodes() if "host" in n.tiers}
        assert set(host.keys()) == indexed  # no copy the index does not know
        assert (await store.get(key, NS_A)).payload == payload  # it was stored, and reads back
        await store.delete(key, NS_A)
        reserved = await store.reserve(key, parent, BlockMeta(NS_A, 16, LAYOUT))
        assert reserved.status is PutStatus.RESERVED
        assert await store.commit(key, NS_A, source=payload) is PutStatus.STORED


async def test_a_parent_whose_demotion_fails_is_kept(tmp_path: Path) -> None:
    tiers = [
        StoreTier(HostTier(2 * BLOCK), None, write_policy("write_through", 1)),
        StoreTier(
            SsdTier(tmp_path / "ssd", 2 * (BLOCK + 1024), fsync=False),
            Codec.RAW,
            write_policy("write_back", 2),
        ),
    ]
    store = BlockStore(tiers, eviction=LruPolicy(), high_watermark=1.0, low_watermark=0.5)
    async with store:
        meta = BlockMeta(NS_A, 16, LAYOUT)
        (a0, root, p0), (a1, _, p1) = blocks("family", 2)
        (lone, lone_parent, lone_payload) = blocks("lone", 1)[0]
        host = store.tiers[0]
        # Step 1: a1 (a0's child) and a lone block in the SSD, both leased; a0 in the host.
        for key, parent, payload in [(a0, root, p0), (a1, a0, p1)]:
            await store.put(key, parent, meta, payload)
        await store._placement.evict(store.index.find(a1, NS_A), host)
        await store.put(lone, lone_parent, meta, lone_payload)
        await store._placement.evict(store.index.find(lone, NS_A), host)
        assert (await store.lookup([a0, a1], NS_A)).tiers == ("host", "ssd")
        leases = [store.pin([a0, a1], NS_A), store.pin([lone], NS_A)]
        await store.release(leases[0].lease_id)  # a0 evictable again; a1 stays leased below
        leases[0] = store.pin([a1], NS_A)  # (a1 alone: a0 is not in the chain [a1])
        # Step 2: two more puts need a0's slot; the SSD cannot take a0 (full, all leased).
        for name in ("x", "y"):
            (key, parent, payload) = blocks(name, 1)[0]
            await store.put(key, parent, meta, payload)
        # a0 is a1's parent: its last copy was not dropped while a1 lives.
        assert (await store.lookup([a0, a1], NS_A)).num_blocks == 2
        for lease in leases:
            await store.release(lease.lease_id)


@pytest.mark.parametrize(("block_tokens", "count", "threads"), [(16, 128, 0), (256, 8, 1)])
async def test_small_blocks_are_summed_on_the_loop_and_large_ones_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_tokens: int, count: int, threads: int
) -> None:
    """A 2 MiB commit of 16 KiB blocks is copied and summed on the loop, between other
    callbacks (in a thread, its per-block Python held the GIL nearly throughout); one of
    256 KiB blocks goes to one worker thread. Either way every byte lands and is summed."""
    import kvstore.arena as arena_module
    from kvstore.arena import Commit

    layout = BlockLayout(num_layers=2, num_kv_heads=2, block_tokens=block_tokens, head_dim=64,
                         dtype="float16")  # fmt: skip
    size = layout.payload_bytes
    offloaded: list[int] = []
    real_offload = arena_module.offload

    async def counting_offload(nbytes: int, fn: object, *args: object) -> object:
        offloaded.append(nbytes)
        return await real_offload(nbytes, fn, *args)

    monkeypatch.setattr(arena_module, "offload", counting_offload)
    monkeypatch.setattr(LoopBudget.__init__, "__defaults__", (0.0,))
    host = HostTier(count * size)
    store = BlockStore([StoreTier(host, None, write_policy("write_through", 1))],
                       eviction=LruPolicy(), high_watermark=1.0, low_watermark=0.5)  # fmt: skip
    async with store:
        meta = BlockMeta(NS_A, block_tokens, layout)
        chain = [(k, p, hashlib.shake_256(k).digest(size)) for k, p, _ in blocks("s", count)]
        for key, parent, _ in chain:
            assert (await store.reserve(key, parent, meta)).status is PutStatus.RESERVED
        writes = [Commit(k, NS_A, None, payload, payload_checksum(payload)) for k, _, payload
                  in chain]  # fmt: skip
        turns = 0
        task = asyncio.ensure_future(store.commit_many(writes))
        while not task.done():
            turns += 1
            await asyncio.sleep(0)
        assert await task == [PutStatus.STORED] * count
        assert len(offloaded) == threads
        if not threads:
            assert turns > count  # other callbacks ran between the blocks' sums
        acquired = await store.acquire([k for k, _, _ in chain], NS_A)
        arena = Arena(store)
        assert [arena.read(s.offset, s.length) for s in acquired.slots] == [
            payload for _, _, payload in chain
        ]
        await store.release(acquired.lease.lease_id)
        arena.close()
