"""The read path in-process (:mod:`kvstore.reads`): acquire and release, prefetch under hint
budgets, leases against expiry and deletes, promotion into a full arena, corrupt copies."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from kvstore.budget import LoopBudget
from kvstore.errors import UnknownLeaseError
from kvstore.index import BlockMeta
from kvstore.policies import (
    HintBudget,
    SchedulerAwarePolicy,
)
from kvstore.store import PutStatus
from tests.support.arena import (
    BLOCK,
    LAYOUT,
    NS_A,
    NS_B,
    Arena,
    blocks,
    fill_host_with_evictable,
    make_store,
    put_chain,
)


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


async def test_the_get_streams_leased_blocks_and_copies_count_each_key_once(
    tmp_path: Path,
) -> None:
    """The Get stream leases what the arena takes and copies the rest: a key the lease
    stopped at (no room) is counted once, as the copy read's hit, not also as a miss."""
    async with make_store(tmp_path, host_blocks=2) as store:
        keys = await put_chain(store, blocks("counted", 3))  # the first is on SSD only
        lease = await store.acquire(keys[1:], NS_A)  # the arena is full of leased blocks
        assert len(lease.slots) == 2
        before = store.stats()
        async with contextlib.aclosing(store.held(keys, NS_A, BLOCK)) as stream:
            leased = [block async for block in stream]
        copied = [await store.get(key, NS_A) for key in keys[len(leased) :]]
        after = store.stats()
        assert len(leased) + len(copied) == 3 and all(copied)
        assert (after.gets - before.gets, after.misses - before.misses) == (3, 0)
        await store.release(lease.lease.lease_id)
