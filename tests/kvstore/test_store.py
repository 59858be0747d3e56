"""Tier manager scenarios, narrated step by step, on real tiers (shm arena, files, Redis)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.budget import SLICE_S
from kvstore.errors import InvalidBlockError, StoreClosedError, UnknownLeaseError
from kvstore.index import BlockMeta, block_id
from kvstore.policies import LruPolicy, eviction_policy, write_policy
from kvstore.store import BlockStore, PutStatus, StoreTier
from kvstore.tiers import collector
from kvstore.tiers.host import HostTier
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.ssd import SsdTier
from kvstore.wire.blocks import ROOT_KEY, BlockLayout, Codec
from kvstore.wire.results import LookupResult
from tests.support.leaves import tier_leaves
from tests.support.workers import start_every_worker

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, block_tokens=16, head_dim=64, dtype="float16")
BLOCK = LAYOUT.payload_bytes  # 16 KiB
NAMESPACE = hashlib.sha256(b"test-namespace").digest()
META = BlockMeta(NAMESPACE, LAYOUT.block_tokens, LAYOUT)


def chain(name: str, length: int, parent: bytes = ROOT_KEY) -> list[tuple[bytes, bytes, bytes]]:
    """``length`` chained (key, parent, payload) blocks; payload bytes derive from the key."""
    blocks = []
    for i in range(length):
        key = hashlib.sha256(parent + f"{name}/{i}".encode()).digest()
        payload = hashlib.shake_256(key).digest(BLOCK)
        blocks.append((key, parent, payload))
        parent = key
    return blocks


async def put_all(store: BlockStore, blocks: list[tuple[bytes, bytes, bytes]]) -> list[PutStatus]:
    return [await store.put(key, parent, META, payload) for key, parent, payload in blocks]


def keys_of(blocks: list[tuple[bytes, bytes, bytes]]) -> list[bytes]:
    return [key for key, _, _ in blocks]


def ids_of(blocks: list[tuple[bytes, bytes, bytes]]) -> list[bytes]:
    """Where the tiers store the blocks: key || namespace."""
    return [key + NAMESPACE for key, _, _ in blocks]


Factory = Callable[..., AsyncIterator[BlockStore]]


@pytest.fixture
def make_store(tmp_path: Path) -> Callable[..., object]:
    """Builds a started store: ``host_blocks`` of shm, optional SSD/Redis with a policy."""

    @asynccontextmanager
    async def factory(
        host_blocks: int = 4,
        ssd_policy: str | None = None,
        ssd_blocks: int = 64,
        ssd_dir: Path | None = None,
        redis_url: str | None = None,
        redis_policy: str = "write_through",
        high: float = 1.0,
        low: float = 0.75,
        selective_hits: int = 2,
        ssd_codec: Codec = Codec.LZ4_SHUFFLE,
    ) -> AsyncIterator[BlockStore]:
        tiers = []
        if host_blocks:
            host = HostTier(host_blocks * BLOCK)
            tiers.append(StoreTier(host, None, write_policy("write_through", 1)))
        if ssd_policy is not None:
            ssd = SsdTier(ssd_dir or tmp_path / "ssd", ssd_blocks * (BLOCK + 1024), fsync=False)
            tiers.append(StoreTier(ssd, ssd_codec, write_policy(ssd_policy, selective_hits)))
        if redis_url is not None:
            redis = RedisTier(
                redis_url, 1 << 30, key_prefix="store-test", timeout_s=0.3, retry_interval_s=0.1
            )
            policy = write_policy(redis_policy, selective_hits)
            tiers.append(StoreTier(redis, Codec.LZ4, policy, shared=True))
        store = BlockStore(
            tiers, eviction=LruPolicy(), high_watermark=high, low_watermark=low, lease_ttl=5.0
        )
        async with store:
            yield store

    return factory


async def test_shared_prefixes_are_stored_once(make_store) -> None:
    async with make_store(host_blocks=16) as store:
        # Two conversations share a 3-block system prompt, then diverge.
        system = chain("system", 3)
        alice = system + chain("alice", 2, parent=system[-1][0])
        bob = system + chain("bob", 2, parent=system[-1][0])
        assert await put_all(store, alice) == [PutStatus.STORED] * 5
        # Bob's first three blocks are the same keys: no new space.
        assert await put_all(store, bob) == [PutStatus.DEDUP] * 3 + [PutStatus.STORED] * 2
        stats = store.stats()
        assert stats.blocks == 7
        assert stats.dedup_puts == 3
        assert store.tier("host").tier.usage() == 7 * BLOCK
        assert (await store.lookup(keys_of(bob), NAMESPACE)).num_blocks == 5
        # A prefix of Alice's plus an unknown block matches only the known part.
        probe = keys_of(alice[:4]) + keys_of(chain("nobody", 1))
        assert (await store.lookup(probe, NAMESPACE)).num_blocks == 4
        for key, _, payload in bob:
            block = await store.get(key, NAMESPACE)
            assert block is not None and block.payload == payload and block.tier == "host"


async def test_eviction_takes_leaves_only_and_never_leased_blocks(make_store) -> None:
    async with make_store(host_blocks=4) as store:
        a = chain("a", 3)  # a0 <- a1 <- a2
        b = chain("b", 1)
        await put_all(store, a + b)  # host full: a0 a1 a2 b0
        # Step 1: lease a2. LRU order is a0 a1 a2 b0; a0 and a1 have children, a2 is leased.
        lease = store.pin(keys_of(a), NAMESPACE)
        assert lease.num_blocks == 3
        c = chain("c", 1)
        assert await put_all(store, c) == [PutStatus.STORED]
        # b0 was the only evictable block: no lower tier, so it is gone.
        assert (await store.lookup(keys_of(b), NAMESPACE)).num_blocks == 0
        assert (await store.lookup(keys_of(a), NAMESPACE)).num_blocks == 3
        # Step 2: while everything left is leased or has children, a new put finds no room.
        lease_c = store.pin(keys_of(c), NAMESPACE)
        assert await put_all(store, chain("d", 1)) == [PutStatus.NO_SPACE]
        assert store.stats().dropped_saves == 1
        # Step 3: released, the leaf a2 goes before its parents.
        await store.release(lease.lease_id)
        await store.release(lease_c.lease_id)
        assert await put_all(store, chain("e", 1)) == [PutStatus.STORED]
        assert (await store.lookup(keys_of(a), NAMESPACE)).num_blocks == 2
        assert store.stats().tiers[0].evictions == 2
        with pytest.raises(UnknownLeaseError, match=f"lease {lease.lease_id} is unknown"):
            await store.release(lease.lease_id)


async def test_a_chain_is_evicted_leaf_up_as_lru_orders_it(make_store) -> None:
    """After a leaf goes, its parent is tried first (next in LRU order once the leaf is
    gone): evicting a chain does not rescan its ancestors per block. A parent used since
    the leaf was is not tried first: the order stays LRU's."""
    async with make_store(host_blocks=8) as store:
        a, b = chain("a", 4), chain("b", 4)
        await put_all(store, a + b)  # host full; LRU: a0 a1 a2 a3 b0 b1 b2 b3
        await put_all(store, chain("c", 3))  # a3, then its parents a2 and a1, leaf up
        assert (await store.lookup(keys_of(a), NAMESPACE)).num_blocks == 1
        assert (await store.lookup(keys_of(b), NAMESPACE)).num_blocks == 4
        assert store.stats().tiers[0].evictions == 3

    async with make_store(host_blocks=8) as store:
        await put_all(store, a + b)
        for key in keys_of(a)[:3]:  # a0-a2 used: LRU last
            assert await store.get(key, NAMESPACE) is not None
        await put_all(store, chain("c", 1))  # a3, the oldest leaf; a2 is newer than it now
        await put_all(store, chain("d", 1))  # so b3 goes next, as LRU says, not a2
        held = [(await store.lookup(keys_of(x), NAMESPACE)).num_blocks for x in (a, b)]
        assert held == [3, 3]
        await put_all(store, chain("e", 1))  # b2, b3's parent, older than b3: tried first
        held = [(await store.lookup(keys_of(x), NAMESPACE)).num_blocks for x in (a, b)]
        assert held == [3, 2]


async def test_write_back_copies_down_on_demotion_and_promotes_on_hit(make_store) -> None:
    async with make_store(host_blocks=4, ssd_policy="write_back") as store:
        blocks = chain("doc", 4)
        await put_all(store, blocks)
        ssd = store.tier("ssd").tier
        # Step 1: write-back: nothing reaches the SSD while the host has room.
        assert ssd.usage() == 0
        # Step 2: a fifth block evicts the LRU leaf (doc3, the chain's tail) down to SSD.
        extra = chain("extra", 1)
        await put_all(store, extra)
        assert list(ssd.keys()) == [blocks[3][0] + NAMESPACE]
        assert store.stats().demotions == 1
        assert (await store.lookup(keys_of(blocks), NAMESPACE)).tiers == ("host",) * 3 + ("ssd",)
        # Step 3: reading it back is bit-exact, comes from SSD, and promotes it to host.
        block = await store.get(blocks[3][0], NAMESPACE)
        assert block is not None and block.payload == blocks[3][2] and block.tier == "ssd"
        assert store.stats().promotions == 1
        block = await store.get(blocks[3][0], NAMESPACE)
        assert block is not None and block.tier == "host"
        assert store.stats().tiers[0].hits == 1 and store.stats().tiers[1].hits == 1


async def test_write_through_writes_every_put_down(make_store) -> None:
    async with make_store(host_blocks=4, ssd_policy="write_through", ssd_codec=Codec.RAW) as store:
        blocks = chain("wt", 3)
        await put_all(store, blocks)
        ssd = store.tier("ssd").tier
        assert sorted(ssd.keys()) == sorted(ids_of(blocks))
        for key, _, payload in blocks:
            assert (await ssd.get(key + NAMESPACE)).endswith(payload)  # raw codec: header + payload


async def test_selective_write_through_on_the_nth_hit(make_store) -> None:
    async with make_store(host_blocks=2, ssd_policy="write_through_selective") as store:
        hot, cold = chain("hot", 1), chain("cold", 1)
        await put_all(store, hot + cold)
        ssd = store.tier("ssd").tier
        # Step 1: one hit is not enough.
        await store.get(hot[0][0], NAMESPACE)
        assert list(ssd.keys()) == []
        # Step 2: the second hit writes it to SSD.
        await store.get(hot[0][0], NAMESPACE)
        assert list(ssd.keys()) == ids_of(hot)
        # Step 3: evicted before reaching two hits, the cold block is dropped, not copied.
        await store.get(hot[0][0], NAMESPACE)  # make cold the LRU block
        await put_all(store, chain("new", 1))
        assert (await store.lookup(keys_of(cold), NAMESPACE)).num_blocks == 0
        assert list(ssd.keys()) == ids_of(hot)


async def test_watermarks_start_high_and_stop_low(make_store) -> None:
    async with make_store(host_blocks=10, ssd_policy="write_back", high=0.8, low=0.5) as store:
        host = store.tier("host").tier
        await put_all(store, chain("w1", 1) + chain("w2", 1) + chain("w3", 1) + chain("w4", 1))
        await put_all(store, chain("w5", 1) + chain("w6", 1) + chain("w7", 1) + chain("w8", 1))
        # At 80% nothing moves: the high watermark is not exceeded.
        assert host.usage() == 8 * BLOCK and store.stats().demotions == 0
        # The ninth block crosses it: evict down to 50%.
        await put_all(store, chain("w9", 1))
        assert host.usage() == 5 * BLOCK
        assert store.stats().demotions == 4
        assert len(list(store.tier("ssd").tier.keys())) == 4


async def test_a_watermark_drain_yields_by_time_not_by_count(make_store, monkeypatch) -> None:
    """Each eviction here takes longer than a slice (``SLICE_S``), so the drain lets the
    loop run after every one: a task beside it sees every step of the drain."""
    async with make_store(host_blocks=10, high=0.8, low=0.3) as store:
        host = store.tier("host").tier
        await put_all(store, [block for i in range(8) for block in chain(f"y{i}", 1)])
        evict_one = store._placement.evict_one

        async def slow_evict_one(*args, **kwargs) -> bool:
            started = time.perf_counter()
            while time.perf_counter() - started < 2 * SLICE_S:
                pass  # holds the loop, as a costly eviction does
            return await evict_one(*args, **kwargs)

        monkeypatch.setattr(store._placement, "evict_one", slow_evict_one)
        seen: list[int] = []

        async def watch() -> None:
            while True:
                seen.append(host.usage() // BLOCK)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        await put_all(store, chain("y9", 1))  # 9 of 10: past 0.8, drained to 3
        watcher.cancel()
        assert host.usage() == 3 * BLOCK
        assert {3, 4, 5, 6, 7, 8} <= set(seen)  # the loop ran between every two evictions


class CountingLru(LruPolicy):
    """LRU that counts the keys its scans hand out."""

    def __init__(self) -> None:
        super().__init__()
        self.offered = 0

    def victims(self, tier: str) -> Iterator[bytes]:
        for key in super().victims(tier):
            self.offered += 1
            yield key


async def test_a_tier_ttl_expires_idle_chains_leaf_up_and_reads_only_what_it_expires() -> None:
    """Two old chains and a hundred young ones in a host tier with a 60 s TTL: a sweep at
    the cutoff takes both old chains whole (each leaf, then its parent, first in the order
    once the leaf is gone), keeps every young block, and is offered only the old blocks and
    the first young one, not the 400 blocks held."""
    policy = CountingLru()
    host = StoreTier(HostTier(512 * BLOCK), None, write_policy("write_through", 1), ttl=60.0)
    async with BlockStore([host], eviction=policy, high_watermark=1.0, low_watermark=1.0) as store:
        old, kept = chain("old1", 4) + chain("old2", 4), chain("kept", 2)
        await put_all(store, old + kept)
        cutoff = time.monotonic()
        young = [block for i in range(100) for block in chain(f"young{i}", 3)]
        await put_all(store, young)
        for key in keys_of(kept):  # put before the cutoff, used after it: kept
            assert await store.get(key, NAMESPACE) is not None
        policy.offered = 0
        await store.maintain(now=cutoff + 60.0)
        assert (await store.lookup(keys_of(old[:4]), NAMESPACE)).num_blocks == 0
        assert (await store.lookup(keys_of(old[4:]), NAMESPACE)).num_blocks == 0
        assert (await store.lookup(keys_of(kept), NAMESPACE)).num_blocks == 2
        assert store.stats().tiers[0].blocks == 302 and store.stats().tiers[0].evictions == 8
        assert policy.offered <= 8 + 8  # each sweep step: its victim, then the young head


async def test_restart_rebuilds_from_ssd_and_drops_damaged_files(make_store, tmp_path) -> None:
    ssd_dir = tmp_path / "blocks"
    blocks = chain("persist", 6)
    async with make_store(host_blocks=8, ssd_policy="write_through", ssd_dir=ssd_dir) as store:
        await put_all(store, blocks)
        ssd = store.tier("ssd").tier
        flipped, truncated = (ssd.path_of(block) for block in ids_of(blocks[2:5:2]))
    # Damage two files while the daemon is down: flip one payload byte, truncate another.
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-10])

    async with make_store(host_blocks=8, ssd_policy="write_through", ssd_dir=ssd_dir) as store:
        # The truncated file is gone at start; the chain is held up to it.
        result = await store.lookup(keys_of(blocks), NAMESPACE)
        assert result.num_blocks == 4 and result.tiers == ("ssd",) * 4
        for key, _, payload in blocks[:2]:
            block = await store.get(key, NAMESPACE)
            assert block is not None and block.payload == payload
        # The flipped byte is caught by the checksum: a miss, the copy deleted, counted.
        assert await store.get(blocks[2][0], NAMESPACE) is None
        assert store.stats().corrupt_blocks == 1
        assert not flipped.exists()
        assert (await store.lookup(keys_of(blocks), NAMESPACE)).num_blocks == 2
        assert (await store.get(blocks[3][0], NAMESPACE)).payload == blocks[3][2]


async def test_flush_on_close_keeps_write_back_blocks(
    make_store, tmp_path, caplog, monkeypatch
) -> None:
    ssd_dir = tmp_path / "wb"
    blocks = chain("wb", 3)
    monkeypatch.setattr("kvstore.store.FLUSH_PROGRESS_S", 0.0)  # a line after every block
    async with make_store(host_blocks=8, ssd_policy="write_back", ssd_dir=ssd_dir) as store:
        await put_all(store, blocks)
        assert store.tier("ssd").tier.usage() == 0
        caplog.set_level("INFO", logger="kvstore.store")
    said = [r.getMessage() for r in caplog.records if r.name == "kvstore.store"]
    assert said == [
        "flushing 3 blocks (0.0 MiB) from host to ssd",
        "flushing: 1 of 3 blocks done",
        "flushing: 2 of 3 blocks done",
        "flushed 3 blocks from host to ssd",
    ]
    async with make_store(host_blocks=8, ssd_policy="write_back", ssd_dir=ssd_dir) as store:
        assert (await store.lookup(keys_of(blocks), NAMESPACE)).num_blocks == 3
        for key, _, payload in blocks:
            assert (await store.get(key, NAMESPACE)).payload == payload


async def test_delete_hides_at_once_and_frees_after_the_lease(make_store) -> None:
    async with make_store(host_blocks=8) as store:
        blocks = chain("del", 3)
        await put_all(store, blocks)
        lease = store.pin(keys_of(blocks) + keys_of(chain("missing", 1)), NAMESPACE)
        assert lease.num_blocks == 3  # a lease covers the leading held blocks only
        # Deleting block 1 removes its descendant too; both are leased, so space waits.
        assert await store.delete(blocks[1][0], NAMESPACE) == 2
        assert (await store.lookup(keys_of(blocks), NAMESPACE)).num_blocks == 1
        assert await store.get(blocks[2][0], NAMESPACE) is None
        assert store.tier("host").tier.usage() == 3 * BLOCK
        await store.release(lease.lease_id)
        assert store.tier("host").tier.usage() == BLOCK
        # Putting a deleted key again stores it again.
        assert await put_all(store, blocks[1:2]) == [PutStatus.STORED]


async def test_leases_expire(make_store) -> None:
    async with make_store(host_blocks=2) as store:
        blocks = chain("exp", 2)
        await put_all(store, blocks)
        lease = store.pin(keys_of(blocks), NAMESPACE, ttl=1.0)
        assert store.stats().active_leases == 1
        await store.maintain(now=lease.expires_at + 0.1)
        assert store.stats().active_leases == 0
        assert await put_all(store, chain("after", 1)) == [PutStatus.STORED]


async def test_shared_tier_serves_another_node(make_store, redis_url) -> None:
    blocks = chain("shared", 3)
    async with make_store(host_blocks=4, redis_url=redis_url) as node_a:
        await put_all(node_a, blocks)
        async with make_store(host_blocks=4, redis_url=redis_url) as node_b:
            # Node B never saw these puts: it finds them live in Redis by key.
            result = await node_b.lookup(keys_of(blocks), NAMESPACE)
            assert result.num_blocks == 3 and result.tiers == ("redis",) * 3
            block = await node_b.get(blocks[1][0], NAMESPACE)
            assert block is not None and block.payload == blocks[1][2] and block.tier == "redis"
            assert (await node_b.get(blocks[1][0], NAMESPACE)).tier == "host"  # promoted


async def test_redis_down_means_misses_and_back_means_writes(make_store, redis_server) -> None:
    if redis_server.proc is None:
        redis_server.start()
    async with make_store(host_blocks=8, redis_url=redis_server.url) as store:
        before = chain("before", 2)
        await put_all(store, before)
        redis_server.stop()
        # Redis is gone: puts still land in host, lookups do not raise, health says so.
        during = chain("during", 2)
        assert await put_all(store, during) == [PutStatus.STORED] * 2
        assert (await store.lookup(keys_of(chain("unknown", 2)), NAMESPACE)).num_blocks == 0
        assert (await store.get(before[0][0], NAMESPACE)).payload == before[0][2]
        assert store.stats().tiers[1].healthy is False
        redis_server.start()
        await asyncio.sleep(0.2)
        after = chain("after", 1)
        await put_all(store, after)
        assert await store.tier("redis").tier.contains(after[0][0] + NAMESPACE)
        assert store.stats().tiers[1].healthy is True


async def test_a_closed_store_refuses_puts(make_store) -> None:
    """(Malformed fields never reach the store: the service checks each at the edge,
    test_service's test_validation_errors_name_the_bad_value.)"""
    async with make_store(host_blocks=2) as store:
        key, parent, payload = chain("closed", 1)[0]
    with pytest.raises(StoreClosedError):
        await store.put(key, parent, META, payload)


async def test_many_tasks_racing_eviction_never_see_wrong_bytes(make_store) -> None:
    async with make_store(host_blocks=6, ssd_policy="write_back", ssd_blocks=40) as store:
        chains = {f"user{i}": chain(f"user{i}", 4) for i in range(12)}
        wrong: list[str] = []

        async def user(name: str) -> None:
            blocks = chains[name]
            for _ in range(3):
                await put_all(store, blocks)
                for key, _, payload in blocks:
                    block = await store.get(key, NAMESPACE)
                    if block is not None and block.payload != payload:
                        wrong.append(name)

        await asyncio.gather(*(user(name) for name in chains))
        assert wrong == []
        # The books balance: every tier's usage is exactly what the index says it holds.
        host, ssd = store.tier("host").tier, store.tier("ssd").tier
        in_host = [n for n in store.index.nodes() if "host" in n.tiers]
        in_ssd = [n for n in store.index.nodes() if "ssd" in n.tiers]
        assert host.usage() == len(in_host) * BLOCK
        assert sorted(ssd.keys()) == sorted(n.id for n in in_ssd)
        assert all(n.leases == 0 and n.busy == 0 for n in store.index.nodes())
        assert host.usage() <= host.capacity() and ssd.usage() <= ssd.capacity()
        # Everything indexed reads back bit-exact. These gets promote into a 6-block host
        # tier and so evict: a block may be dropped by an earlier get of this loop (then it
        # is gone from the index too), never read back wrong or lost while still indexed.
        payloads = {key: payload for blocks in chains.values() for key, _, payload in blocks}
        read = 0
        for node in list(store.index.nodes()):
            block = await store.get(node.key, NAMESPACE)
            if block is None:
                assert store.index.get(node.id) is None, f"{node.key.hex()} indexed, not read"
                continue
            assert block.payload == payloads[node.key]
            read += 1
        assert read > 0


async def test_scheduler_aware_eviction_keeps_hinted_sessions(tmp_path: Path) -> None:
    from kvstore.policies import SchedulerAwarePolicy

    host = HostTier(3 * BLOCK)
    store = BlockStore(
        [StoreTier(host, None, write_policy("write_through", 1))],
        eviction=SchedulerAwarePolicy(),
        high_watermark=1.0,
        low_watermark=0.5,
    )
    async with store:
        queued, idle = chain("queued", 1), chain("idle", 1)
        await put_all(store, queued + idle)  # LRU order: queued, idle
        # Step 1: the engine says the "queued" session runs next.
        assert await store.prefetch(keys_of(queued), NAMESPACE) == 1
        assert store.policy.protected(queued[0][0] + NAMESPACE)
        # Step 2: pressure. Plain LRU would drop "queued" (the oldest); this drops "idle".
        await put_all(store, chain("new1", 1) + chain("new2", 1))
        assert (await store.lookup(keys_of(queued), NAMESPACE)).num_blocks == 1
        assert (await store.lookup(keys_of(idle), NAMESPACE)).num_blocks == 0
        # Step 3: with only hinted blocks left to go, a put finds no room rather than drop one.
        held = store.pin(keys_of(chain("new1", 1)) + keys_of(chain("new2", 1)), NAMESPACE)
        assert await put_all(store, chain("new3", 1)) == [PutStatus.NO_SPACE]
        await store.release(held.lease_id)
        # Step 4: its turn came (a read): plain LRU again.
        await store.get(queued[0][0], NAMESPACE)
        assert not store.policy.protected(queued[0][0] + NAMESPACE)


async def test_a_parent_cycle_is_refused_and_delete_ends(make_store) -> None:
    async with make_store(host_blocks=8) as store:
        a, b = b"\xaa" * 32, b"\xbb" * 32
        payload = bytes(BLOCK)
        with pytest.raises(InvalidBlockError, match="its descendants"):
            await store.put(a, a, META, payload)  # its own parent
        assert await store.put(b, a, META, payload) is PutStatus.STORED  # b's parent a: absent
        with pytest.raises(InvalidBlockError, match="its descendants"):
            await store.put(a, b, META, payload)  # a <- b <- a would close a cycle
        assert await store.put(a, ROOT_KEY, META, payload) is PutStatus.STORED
        assert await store.delete(a, NAMESPACE) == 2  # a and its child b, once each
        assert store.stats().blocks == 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "delete", "pin", "release", "prefetch", "maintain"]),
        st.integers(0, 5),  # which chain
        st.integers(1, 5),  # how many of its blocks
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, policy=st.sampled_from(["lru", "scheduler_aware"]))
def test_the_eviction_order_holds_each_tiers_leaves_under_random_operations(
    ops: list[tuple[str, int, int]], policy: str
) -> None:
    """Puts (chains sharing prefixes), gets that promote, deletes under leases, leases,
    hints and maintenance on a 4-block host over an 8-block write-back SSD, so that every
    few operations evict and demote: after each one, each tier's eviction order lists
    exactly its leaves found by a walk of the index, and every byte read is the key's."""
    chains = [
        chain(f"c{i % 3}", 5) + chain(f"d{i}", 3, chain(f"c{i % 3}", 5)[-1][0]) for i in range(6)
    ]

    async def run(directory: Path) -> None:
        tiers = [
            StoreTier(HostTier(4 * BLOCK), None, write_policy("write_through", 1)),
            StoreTier(
                SsdTier(directory, 8 * (BLOCK + 1024), fsync=False),
                Codec.LZ4,
                write_policy("write_back", 1),
            ),
        ]
        store = BlockStore(
            tiers, eviction=eviction_policy(policy), high_watermark=0.9, low_watermark=0.6
        )
        leases: list[int] = []
        async with store:
            for op, which, count in ops:
                blocks = chains[which][: count + (3 if which % 2 else 0)]
                if op == "put":
                    await put_all(store, blocks)
                elif op == "get":
                    for key, _, payload in blocks:
                        block = await store.get(key, NAMESPACE)
                        assert block is None or bytes(block.payload) == payload
                elif op == "delete":
                    await store.delete(blocks[-1][0], NAMESPACE)
                elif op == "pin":
                    leases.append(store.pin(keys_of(blocks), NAMESPACE).lease_id)
                elif op == "release" and leases:
                    await store.release(leases.pop(count % len(leases)))
                elif op == "prefetch":
                    store.policy.protect([key + NAMESPACE for key in keys_of(blocks)], 1e18)
                elif op == "maintain":
                    await store.maintain()
                for level in store.tiers:
                    assert set(store.policy.victims(level.name)) == tier_leaves(
                        store.index, level.name
                    )
                for keys in map(keys_of, chains):  # lookups' runs, against a walk per block
                    found = await store.lookup(keys, NAMESPACE)
                    assert found.tiers == top_tiers(store, keys)
                    assert all(count for _, count in found.runs)
                    assert all(a[0] != b[0] for a, b in itertools.pairwise(found.runs))

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(run(Path(directory)))


async def test_a_large_host_block_changed_in_memory_is_dropped_not_served() -> None:
    """Host reads of large blocks copy and hash in one pass (``get_hashed``): a byte changed
    in the arena behind the index's back (the wrong-slot bug class) is caught there."""
    layout = BlockLayout(num_layers=16, num_kv_heads=8, block_tokens=64, head_dim=128,
                         dtype="float16")  # fmt: skip
    meta = BlockMeta(NAMESPACE, layout.block_tokens, layout)
    blocks = [(bytes([i]) * 32, os.urandom(layout.payload_bytes)) for i in (1, 2)]
    host = HostTier(4 * layout.payload_bytes)
    tiers = [StoreTier(host, None, write_policy("write_through", 1))]
    async with BlockStore(tiers, eviction=LruPolicy()) as store:
        for key, payload in blocks:
            assert await store.put(key, ROOT_KEY, meta, payload) == PutStatus.STORED
        good = await store.get(blocks[0][0], NAMESPACE)
        assert good is not None and bytes(good.payload) == blocks[0][1]
        slot = host.locate(blocks[1][0] + NAMESPACE)
        assert slot is not None and slot.length >= 4 << 20
        with memoryview(host._owner[slot.offset].map) as arena:
            arena[slot.offset + 12345] ^= 0x01
        assert await store.get(blocks[1][0], NAMESPACE) is None
        assert store.stats().corrupt_blocks == 1
        assert (await store.lookup([blocks[1][0]], NAMESPACE)).num_blocks == 0


def top_tiers(store: BlockStore, keys: list[bytes]) -> tuple[str, ...]:
    """The highest tier of each leading held block, found one node at a time."""
    found = []
    for key in keys:
        node = store.index.find(key, NAMESPACE)
        if node is None or not node.committed or node.doomed or not node.tiers:
            break
        found.append(next(level.name for level in store.tiers if level.name in node.tiers))
    return tuple(found)


def test_lookup_results_hold_runs() -> None:
    result = LookupResult.of_tiers(["host", "host", "ssd", "host"])
    assert result == LookupResult(4, (("host", 2), ("ssd", 1), ("host", 1)))
    assert result.tiers == ("host", "host", "ssd", "host")
    assert (result.below("host"), result.below("ssd")) == (1, 3)
    assert LookupResult.of_tiers([]) == LookupResult(0, ())


async def test_held_blocks_add_nothing_to_full_garbage_collections(make_store: Factory) -> None:
    """A full collection walks every object the collector tracks and every entry of each:
    with 1,200 blocks held on host and SSD (after promotions, evictions, leases, deletes)
    it walks no more than with none, so a million blocks cannot stall the loop."""
    async with make_store(host_blocks=32, ssd_policy="write_back", ssd_blocks=1400) as store:
        chains = [chain(f"gc{i}", 30) for i in range(40)]
        await put_all(store, chains[0])
        await start_every_worker()
        before = collector.tracked_entries()  # the namespace and each tier's first use made
        for blocks in chains[1:]:
            await put_all(store, blocks)
        lease = store.pin(keys_of(chains[5]), NAMESPACE)
        for blocks in chains[::3]:  # gets promote from SSD, evicting on host
            for key, _, payload in blocks[::4]:
                block = await store.get(key, NAMESPACE)
                assert block is not None and bytes(block.payload) == payload
        gone = [
            store.index.find(key, NAMESPACE)
            for blocks in chains[1::9]
            for key in keys_of(blocks[10:])
        ]
        for blocks in chains[1::9]:
            await store.delete(blocks[10][0], NAMESPACE)
        await store.release(lease.lease_id)
        await store.maintain()
        held = len(store.index)
        after = collector.tracked_entries()
    # Untracked nodes are freed by reference counting alone: nothing else holds a deleted one.
    assert len(gone) == 100 and all(sys.getrefcount(node) == 3 for node in gone)  # list, call
    assert held > 1000
    grown = after - before - (1 + len(gone))  # the list of deleted nodes is the test's own
    assert grown < held / 5, f"{grown} more references to walk, {held} blocks"


async def test_a_block_put_again_and_promoted_while_its_delete_waits_is_kept(
    make_store, redis_url, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete's SSD delete stalls; the block is put again (revived) and a get promotes it
    from Redis, whose read stalls too. The delete must not forget the node under the
    promotion: the host copy it lands would be no one's (then a write of the key failed
    with SlotExistsError, as the stress run found)."""
    async with make_store(host_blocks=4, ssd_policy="write_through", redis_url=redis_url) as store:
        ((key, parent, payload),) = chain("revived", 1)
        assert await store.put(key, parent, META, payload) is PutStatus.STORED
        ssd, redis = store.tier("ssd").tier, store.tier("redis").tier
        deleting, reading = asyncio.Event(), asyncio.Event()
        real_delete, real_get = ssd.delete, redis.get

        async def slow_delete(block: bytes) -> bool:
            await deleting.wait()
            return await real_delete(block)

        async def slow_get(block: bytes) -> bytes | None:
            data = await real_get(block)  # read before the delete reaches Redis
            await reading.wait()
            return data

        monkeypatch.setattr(ssd, "delete", slow_delete)
        monkeypatch.setattr(redis, "get", slow_get)
        delete = asyncio.create_task(store.delete(key, NAMESPACE))
        await asyncio.sleep(0.05)  # the host copy is gone; the SSD delete waits
        assert await store.put(key, parent, META, payload) is PutStatus.DEDUP  # revived
        get = asyncio.create_task(store.get(key, NAMESPACE))  # promotes from Redis
        await asyncio.sleep(0.05)
        deleting.set()
        assert await delete == 1
        reading.set()
        block = await get
        assert block is not None and block.payload == payload
        host = store.tier("host").tier
        listed = {node.id for node in store.index.nodes() if "host" in node.tiers}
        assert set(host.keys()) == listed == {block_id(key, NAMESPACE)}  # no orphan copy
        assert await store.put(key, parent, META, payload) is PutStatus.DEDUP
        reserved = await store.writes.reserve(key, parent, META, None, None)
        assert reserved.status is PutStatus.DEDUP
