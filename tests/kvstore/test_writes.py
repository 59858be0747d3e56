"""The write path in-process (:mod:`kvstore.writes`): reserve/commit/abort, expiry, checksums,
puts as a reservation and a commit, cancellation while evicting, namespaces."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from kvstore.budget import LoopBudget
from kvstore.errors import InvalidBlockError, NoArenaError
from kvstore.index import BlockMeta
from kvstore.policies import (
    LruPolicy,
    write_policy,
)
from kvstore.store import BlockStore, Commit, PutStatus, StoreTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.ssd import SsdTier
from kvstore.wire.blocks import ROOT_KEY, BlockLayout, Codec, payload_checksum
from tests.support.arena import (
    BLOCK,
    LAYOUT,
    NS_A,
    NS_B,
    Arena,
    blocks,
    commit,
    fill_host_with_evictable,
    make_store,
    reserve,
    slow_evictions,
)
from tests.support.prefault import StalledPrefault


async def test_reserve_write_commit_then_acquire_reads_in_place(tmp_path: Path) -> None:
    async with make_store(tmp_path) as store:
        arena = Arena(store)
        assert len(arena.map) == 4 * BLOCK
        chain = blocks("a", 2)
        # Step 1: reserve; the block is invisible while its bytes are written.
        reserved = [await reserve(store, k, p, BlockMeta(NS_A, 16, LAYOUT)) for k, p, _ in chain]
        assert [r.status for r in reserved] == [PutStatus.RESERVED] * 2
        assert (await store.lookup([k for k, _, _ in chain], NS_A)).num_blocks == 0
        for (_, _, payload), r in zip(chain, reserved, strict=True):
            assert r.slot is not None and r.slot.length == BLOCK
            with store.writes.view(r.slot) as slot:
                slot[:] = payload
        # Step 2: commit makes them visible; a second commit finds no reservation.
        assert [await commit(store, k, NS_A) for k, _, _ in chain] == [PutStatus.STORED] * 2
        assert await commit(store, chain[0][0], NS_A) is PutStatus.EXPIRED
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
        again = await reserve(store, chain[0][0], ROOT_KEY, BlockMeta(NS_A, 16, LAYOUT))
        assert again.status is PutStatus.DEDUP and again.slot is None
        arena.close()


async def test_abandoned_reservations_expire_and_free_space(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=2, ssd=False) as store:
        ((key, parent, _),) = blocks("crash", 1)
        reserved = await reserve(store, key, parent, BlockMeta(NS_A, 16, LAYOUT), ttl=1.0)
        assert reserved.status is PutStatus.RESERVED
        host = store.tier("host").tier
        assert host.usage() == BLOCK and store.stats().active_reservations == 1
        # The writer died: at expiry the space comes back and the block never appears.
        await store.maintain(now=10**9)
        assert host.usage() == 0 and store.stats().active_reservations == 0
        assert await commit(store, key, NS_A) is PutStatus.EXPIRED
        assert (await store.lookup([key], NS_A)).num_blocks == 0
        # An explicit abort works the same way.
        await reserve(store, key, parent, BlockMeta(NS_A, 16, LAYOUT))
        assert await store.abort(key, NS_A) is True and await store.abort(key, NS_A) is False
        assert host.usage() == 0


async def test_a_store_without_an_arena_refuses_arena_calls(tmp_path: Path) -> None:
    """(A malformed key or parent never reaches the store: the service checks each field at
    the edge, test_service's test_validation_errors_name_the_bad_value.)"""
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
        with pytest.raises(NoArenaError, match="needs the host tier"):
            await disk_only.commit([Commit(b"k" * 32, NS_A)])


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
        task = asyncio.create_task(reserve(store, key, parent, BlockMeta(NS_A, 16, LAYOUT)))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not task.done()
        stall.release()
        assert (await task).status is PutStatus.RESERVED
        assert store.stats().tiers[0].evictions == 0
        filler = [k for k, _, _ in blocks("filler", 15)]
        assert (await store.lookup(filler, NS_A)).runs == (("host", 15),)


async def test_a_tenant_cannot_reach_another_tenants_reservations_or_blocks(
    tmp_path: Path,
) -> None:
    async with make_store(tmp_path, host_blocks=8, ssd=False) as store:
        ((key, parent, payload),) = blocks("shared-key", 1)
        # Step 1: A reserves K. B's commit and abort of K (in B's namespace) find nothing.
        mine = await reserve(store, key, parent, BlockMeta(NS_A, 16, LAYOUT), owner="a")
        assert mine.status is PutStatus.RESERVED
        assert await commit(store, key, NS_B, owner="b") is PutStatus.EXPIRED
        assert await store.abort(key, NS_B, owner="b") is False
        # ... nor may another writer of A's own namespace finish A's reservation.
        assert await commit(store, key, NS_A, owner="other") is PutStatus.EXPIRED
        assert await store.abort(key, NS_A, owner="other") is False
        # Step 2: B reserving or putting the same key is not told A holds it (no DEDUP).
        theirs = await reserve(store, key, parent, BlockMeta(NS_B, 16, LAYOUT), owner="b")
        assert theirs.status is PutStatus.RESERVED
        assert await store.abort(key, NS_B, owner="b") is True
        forged = b"\xee" * BLOCK
        assert await store.put(key, parent, BlockMeta(NS_B, 16, LAYOUT), forged) is (
            PutStatus.STORED
        )
        # Step 3: A commits its own bytes; each namespace reads its own block.
        assert await commit(store, key, NS_A, owner="a", source=payload) is PutStatus.STORED
        assert (await store.get(key, NS_A)).payload == payload
        assert (await store.get(key, NS_B)).payload == forged
        # Step 4: B deleting K removes only B's block.
        assert await store.delete(key, NS_B) == 1
        assert (await store.get(key, NS_A)).payload == payload


async def test_a_commit_with_the_wrong_checksum_stores_nothing(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=4, ssd=False) as store:
        ((key, parent, payload),) = blocks("sum", 1)
        await reserve(store, key, parent, BlockMeta(NS_A, 16, LAYOUT))
        bad = payload_checksum(payload) ^ 1
        status = await commit(store, key, NS_A, source=payload, checksum=bad)
        assert status is PutStatus.CHECKSUM_MISMATCH
        assert (await store.lookup([key], NS_A)).num_blocks == 0
        assert store.tier("host").tier.usage() == 0
        assert store.stats().corrupt_writes == 1
        await reserve(store, key, parent, BlockMeta(NS_A, 16, LAYOUT))
        good = payload_checksum(payload)
        assert await commit(store, key, NS_A, source=payload, checksum=good) is PutStatus.STORED


async def test_an_oversized_block_is_refused_before_anything_is_evicted(tmp_path: Path) -> None:
    async with make_store(tmp_path, host_blocks=4) as store:
        await fill_host_with_evictable(store, 4)
        huge = BlockLayout(num_layers=64, num_kv_heads=2, block_tokens=16, head_dim=64,
                           dtype="float16")  # fmt: skip
        with pytest.raises(InvalidBlockError, match="can never fit in the host tier"):
            await reserve(store, b"h" * 32, ROOT_KEY, BlockMeta(NS_A, 16, huge))
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


async def test_a_reserve_cancelled_while_evicting_leaves_the_key_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_store(tmp_path, host_blocks=2) as store:
        await fill_host_with_evictable(store, 2)
        started = await slow_evictions(store, monkeypatch)
        ((key, parent, payload),) = blocks("cancelled-reserve", 1)
        task = asyncio.create_task(reserve(store, key, parent, BlockMeta(NS_A, 16, LAYOUT)))
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
        reserved = await reserve(store, key, parent, BlockMeta(NS_A, 16, LAYOUT))
        assert reserved.status is PutStatus.RESERVED
        assert await commit(store, key, NS_A, source=payload) is PutStatus.STORED


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
    import kvstore.writes as arena_module

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
            assert (await reserve(store, key, parent, meta)).status is PutStatus.RESERVED
        writes = [Commit(k, NS_A, None, payload, payload_checksum(payload)) for k, _, payload
                  in chain]  # fmt: skip
        turns = 0
        task = asyncio.ensure_future(store.commit(writes))
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


async def test_a_put_the_arena_has_no_room_for_is_reserved_without_a_slot_and_stored_below(
    tmp_path: Path,
) -> None:
    """A put is a reservation and a commit: with every arena slot leased, the reservation
    has no slot and its commit stores the payload in the tier below (write-through), which
    then serves it; no reservation is left behind."""
    host = HostTier(2 * BLOCK)
    disk = SsdTier(tmp_path / "ssd", 16 * (BLOCK + 1024), fsync=False)
    store = BlockStore(
        [
            StoreTier(host, None, write_policy("write_through", 1)),
            StoreTier(disk, Codec.LZ4, write_policy("write_through", 1)),
        ],
        eviction=LruPolicy(),
    )
    async with store:
        chain = blocks("spill", 3)
        meta = BlockMeta(NS_A, 16, LAYOUT)
        for key, parent, payload in chain[:2]:
            assert await store.put(key, parent, meta, payload) is PutStatus.STORED
        lease = await store.acquire([key for key, _, _ in chain[:2]], NS_A)
        assert len(lease.slots) == 2  # the arena is full of leased blocks
        key, parent, payload = chain[2]
        assert await store.put(key, parent, meta, payload) is PutStatus.STORED
        assert host.usage() == 2 * BLOCK
        stats = store.stats()
        assert stats.active_reservations == 0 and stats.tiers[0].failed_writes == 1
        block = await store.get(key, NS_A)
        assert block is not None and block.tier == "ssd" and bytes(block.payload) == payload
        await store.release(lease.lease.lease_id)


async def test_a_put_without_a_host_tier_checks_the_writers_checksum(tmp_path: Path) -> None:
    """Without an arena, the put's commit sums the payload itself: a checksum that does not
    match stores nothing and leaves the key writable; the right one stores it."""
    disk = SsdTier(tmp_path / "ssd", 16 * (BLOCK + 1024), fsync=False)
    store = BlockStore([StoreTier(disk, Codec.LZ4, write_policy("write_through", 1))],
                       eviction=LruPolicy())  # fmt: skip
    async with store:
        (key, parent, payload), *_ = blocks("sum", 1)
        meta = BlockMeta(NS_A, 16, LAYOUT)
        good = payload_checksum(payload)
        assert await store.put(key, parent, meta, payload, checksum=good ^ 1) is (
            PutStatus.CHECKSUM_MISMATCH
        )
        assert store.stats().corrupt_writes == 1 and await store.get(key, NS_A) is None
        assert await store.put(key, parent, meta, payload, checksum=good) is PutStatus.STORED
        block = await store.get(key, NS_A)
        assert block is not None and bytes(block.payload) == payload and block.checksum == good
        assert store.stats().active_reservations == 0 and disk.usage() > 0
