"""The daemon's request logic in-process: namespaces, tenants, validation, leases, prefetch."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

import pytest

from kvstore.budget import LoopBudget
from kvstore.client.keys import block_keys
from kvstore.client.shm import ShmSession
from kvstore.config import Config, EvictionConfig, HostConfig, ServerConfig, SsdConfig
from kvstore.errors import (
    InvalidBlockError,
    InvalidRequestError,
    PermissionDeniedError,
    UnknownLeaseError,
    UnknownNamespaceError,
    UnknownSessionError,
)
from kvstore.service import MAX_KEYS, BlockSpec, KVStoreService
from kvstore.sessions import SessionServer
from kvstore.store import BlockStore
from kvstore.tiers.host import HostTier
from kvstore.wire.blocks import ROOT_KEY, payload_checksum
from kvstore.wire.namespace import ModelFingerprint, Namespace
from kvstore.wire.results import PutStatus
from kvstore.wire.session import (
    VERSION,
    Hello,
    SessionError,
    decode_hello,
    encode_hello,
    session_path,
)

MODEL = ModelFingerprint("test-model", num_layers=2, num_kv_heads=2, head_dim=64,
                         dtype="float16", block_tokens=16)  # fmt: skip
LAYOUT = MODEL.layout()
BLOCK = LAYOUT.payload_bytes  # 16 KiB
T = TypeVar("T")


def make_config(tmp_path: Path, host_blocks: int = 64) -> Config:
    return Config(
        host=HostConfig(capacity=host_blocks * BLOCK),
        ssd=SsdConfig(directory=str(tmp_path / "ssd"), capacity=1 << 26, fsync=False),
        server=ServerConfig(listen=(f"unix:{tmp_path}/kv.sock",), lease_ttl=5.0),
        eviction=EvictionConfig(hint_share=1.0),  # a few blocks of host: hints may fill it
    )


def blocks_of(tenant: str, num_blocks: int, salt: int = 0) -> list[tuple[BlockSpec, bytes]]:
    """``num_blocks`` chained blocks of ``tenant``'s namespace with distinct payloads."""
    tokens = [salt * 1_000_000 + i for i in range(num_blocks * LAYOUT.block_tokens)]
    keys = block_keys(tokens, Namespace(MODEL, tenant))
    parents = [ROOT_KEY, *keys[:-1]]
    return [
        (BlockSpec(key, parent, LAYOUT.block_tokens), bytes([i + 1 + salt]) * BLOCK)
        for i, (key, parent) in enumerate(zip(keys, parents, strict=True))
    ]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[BlockStore]:
    store = BlockStore.from_config(make_config(tmp_path))
    async with store:
        yield store


@pytest.fixture
async def service(store: BlockStore, tmp_path: Path) -> AsyncIterator[KVStoreService]:
    config = make_config(tmp_path)
    async with KVStoreService(store, config) as service:
        sessions = SessionServer(
            Path(session_path(str(short_socket_dir() / "kv.sock"))),
            socket_mode=0o600,
            store=store,
            tenant_of=lambda token: None,
            on_close=service.close_session,
            instance_id=service.instance_id,
            max_staging_bytes=1 << 20,
            max_sessions=8,
        )
        await sessions.start()
        service.sessions = sessions
        try:
            yield service
        finally:
            await sessions.aclose()


@pytest.fixture
async def session(service: KVStoreService) -> AsyncIterator[ShmSession]:
    """Alice's shm session, opened over the real session socket."""
    assert service.sessions is not None
    opened = await ShmSession.open(str(service.sessions.path), Hello("", "alice", 1 << 20))
    yield opened
    await opened.aclose()


async def test_a_session_that_pins_keeps_its_arenas_pages_while_it_lasts(
    service: KVStoreService, store: BlockStore
) -> None:
    """A client that registers its arena with CUDA says so in its hello: the host tier keeps
    that arena's pages from then until the session ends (tiers/host.py, keep_pages)."""
    assert service.sessions is not None
    host = store.tiers[0].tier
    assert isinstance(host, HostTier)
    path = str(service.sessions.path)
    plain = await ShmSession.open(path, Hello("", "alice", 1 << 20))
    pinned = [await ShmSession.open(path, Hello("", "alice", 1 << 20, pin=True)) for _ in "ab"]
    assert (host.kept("alice"), host.kept("bob")) == (2, 0)
    for session, left in [(pinned[0], 1), (plain, 1), (pinned[1], 0)]:
        await session.aclose()
        deadline = asyncio.get_running_loop().time() + 15
        while host.kept("alice") != left:  # the daemon sees the socket close
            assert asyncio.get_running_loop().time() < deadline, (host.kept("alice"), left)
            await asyncio.sleep(0.05)


def test_a_hellos_pin_is_true_or_false_and_absent_means_false() -> None:
    assert decode_hello(encode_hello(Hello("t", "alice", 1, pin=True))).pin
    line = json.dumps({"version": VERSION, "token": "", "tenant": "", "staging_bytes": 0})
    assert not decode_hello(line.encode() + b"\n").pin  # a client from before the field
    bad = json.dumps({"version": VERSION, "token": "", "tenant": "", "staging_bytes": 0, "pin": 1})
    with pytest.raises(SessionError, match="pin must be true or false, got 1"):
        decode_hello(bad.encode() + b"\n")


def short_socket_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvs-"))  # unix socket paths must stay short


async def put_all(
    service: KVStoreService, ns: bytes, blocks: list[tuple[BlockSpec, bytes]], tenant: str | None
) -> list[PutStatus]:
    return [await service.put(ns, spec, payload, tenant=tenant) for spec, payload in blocks]


def keys(blocks: list[tuple[BlockSpec, bytes]]) -> list[bytes]:
    return [spec.key for spec, _ in blocks]


async def test_register_returns_the_clients_digest_and_is_idempotent(service) -> None:
    digest = service.register_namespace(MODEL, "alice")
    assert digest == Namespace(MODEL, "alice").digest()
    assert service.register_namespace(MODEL, "alice", caller="alice") == digest
    assert service.layout_of(digest) == LAYOUT
    assert service.register_namespace(MODEL, "bob") != digest


async def test_unknown_namespace_is_named(service) -> None:
    digest = Namespace(MODEL, "nobody").digest()
    with pytest.raises(UnknownNamespaceError, match=f"namespace {digest.hex()} is not registered"):
        await service.lookup(digest, [])
    with pytest.raises(InvalidRequestError, match="32-byte digest, got 3 bytes"):
        await service.lookup(b"abc", [])


async def test_put_lookup_get_round_trip_and_counts(service) -> None:
    ns = service.register_namespace(MODEL, "alice")
    blocks = blocks_of("alice", 3)
    assert await put_all(service, ns, blocks, None) == [PutStatus.STORED] * 3
    assert await put_all(service, ns, blocks[:1], None) == [PutStatus.DEDUP]
    found = await service.lookup(ns, [*keys(blocks), b"\0" * 32])
    assert (found.num_blocks, found.tiers) == (3, ("host",) * 3)
    probe = [*keys(blocks[:2]), b"\1" * 32, *keys(blocks)]
    got = [block async for block in service.get(ns, probe)]
    assert [block.payload for block in got] == [payload for _, payload in blocks[:2]]
    stats = service.stats()
    assert (stats.lookups, stats.lookup_hit_blocks, stats.store.puts) == (1, 3, 3)
    assert await service.delete(ns, keys(blocks[1:2])) == 2  # the block and its child
    assert (await service.lookup(ns, keys(blocks))).num_blocks == 1


async def test_a_tenant_cannot_use_or_register_anothers_namespace(service) -> None:
    ns = service.register_namespace(MODEL, "alice", caller="alice")
    blocks = blocks_of("alice", 2)
    await put_all(service, ns, blocks, "alice")
    with pytest.raises(PermissionDeniedError, match=r"tenant 'bob' cannot register .* 'alice'"):
        service.register_namespace(MODEL, "alice", caller="bob")
    with pytest.raises(PermissionDeniedError, match=f"namespace {ns.hex()} belongs to another"):
        await service.lookup(ns, keys(blocks), tenant="bob")
    with pytest.raises(PermissionDeniedError):
        service.get(ns, keys(blocks), tenant="bob")
    with pytest.raises(PermissionDeniedError):
        await put_all(service, ns, blocks_of("alice", 1, salt=9), "bob")
    with pytest.raises(PermissionDeniedError):
        await service.delete(ns, keys(blocks), tenant="bob")
    # A lease granted to alice cannot be ended by bob: to bob it does not exist.
    acquired = await service.acquire(ns, keys(blocks), tenant="alice")
    with pytest.raises(UnknownLeaseError, match=f"lease {acquired.lease.lease_id} is unknown"):
        await service.release(acquired.lease.lease_id, tenant="bob")
    assert service.stats().store.active_leases == 1
    await service.release(acquired.lease.lease_id, tenant="alice")
    # Bob's own namespace for the same model is a different one, empty.
    bob_ns = service.register_namespace(MODEL, "bob", caller="bob")
    assert (await service.lookup(bob_ns, keys(blocks), tenant="bob")).num_blocks == 0


async def test_validation_errors_name_the_bad_value(service) -> None:
    ns = service.register_namespace(MODEL, "")
    (spec, payload), *_ = blocks_of("", 1)
    with pytest.raises(InvalidBlockError, match=r"keys\[1\] must be 32 bytes, got 31"):
        await service.lookup(ns, [spec.key, b"k" * 31])
    with pytest.raises(InvalidRequestError, match=f"{MAX_KEYS + 1} keys in one call; at most"):
        await service.lookup(ns, [spec.key] * (MAX_KEYS + 1))
    with pytest.raises(InvalidBlockError, match="has 100 payload bytes; its layout needs 16384"):
        await service.put(ns, spec, b"x" * 100)
    with pytest.raises(InvalidBlockError, match=r"block\.key must be 32 bytes, got 5"):
        await service.put(ns, BlockSpec(b"short", spec.parent, 16), payload)
    with pytest.raises(InvalidBlockError, match=r"block\.parent is the block's own key"):
        await service.put(ns, BlockSpec(spec.key, spec.key, 16), payload)
    with pytest.raises(InvalidBlockError, match=r"keys\[0\] must be 32 bytes, got 31"):
        service.get(ns, [b"k" * 31])
    short = BlockSpec(spec.key, spec.parent, 15)
    with pytest.raises(InvalidBlockError, match=r"num_tokens must be 16 .*got 15"):
        await service.put(ns, short, payload)
    with pytest.raises(InvalidBlockError, match=r"blocks\[1\].parent must be 32 bytes, got 0"):
        await service.reserve(ns, [spec, BlockSpec(spec.key, b"", 16)], session=b"s" * 16)
    assert service.stats().store.active_reservations == 0  # checked before any was reserved
    with pytest.raises(InvalidRequestError, match=r"lease_seconds must be in 0\.\.3600.*got -1"):
        await service.acquire(ns, [spec.key], -1.0)
    with pytest.raises(InvalidBlockError, match=r"chains\[0\].keys\[0\] must be 32 bytes"):
        await service.prefetch(ns, [[b"short"]])
    with pytest.raises(UnknownLeaseError, match="lease 12345"):
        await service.release(12345)


async def test_a_reserve_into_a_full_arena_evicts_before_it_reserves(
    service, store, session
) -> None:
    """The arena holds 64 blocks and is full (no watermark drains it): a Reserve reserves
    nothing while every block is leased, and makes room (the least recently used leaf goes
    down to SSD) once none is."""
    store.set_watermarks(1.0, 0.99)
    ns = service.register_namespace(MODEL, "alice")
    held = blocks_of("alice", 64)
    for spec, payload in held:
        assert await service.put(ns, spec, payload) == PutStatus.STORED
    assert (await service.lookup(ns, keys(held))).runs == (("host", 64),)
    new = blocks_of("alice", 2, salt=1)
    specs = [spec for spec, _ in new]

    acquired = await service.acquire(ns, keys(held), lease_seconds=5.0)
    assert acquired.lease.num_blocks == 64
    reserved = await service.reserve(ns, specs, session=session.session_id)
    assert [r.status for r in reserved.items] == [PutStatus.NO_SPACE] * 2
    await service.release(acquired.lease.lease_id)
    reserved = await service.reserve(ns, specs, session=session.session_id)

    assert [r.status for r in reserved.items] == [PutStatus.RESERVED] * 2
    assert (await service.lookup(ns, keys(held))).runs == (("host", 62), ("ssd", 2))
    await service.abort(ns, keys(new), session=session.session_id)


async def test_a_many_block_reserve_commit_and_acquire_let_other_calls_run_between_blocks(
    service: KVStoreService, store: BlockStore, session: ShmSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reserve, Commit and Acquire of many blocks yield to the loop as they go (LoopBudget;
    here its slice is 0 s, so after every block): another task, running meanwhile, sees the
    48 reservations, the commits and the leased blocks part done (a 512-block call is ~10 ms
    of per-block work that every other call used to wait for)."""
    monkeypatch.setattr(LoopBudget.__init__, "__defaults__", (0.0,))
    ns = service.register_namespace(MODEL, "alice")
    chain = blocks_of("alice", 48)
    seen: dict[str, set[int]] = {"reserved": set(), "visible": set(), "leased": set()}

    async def watch(call: Awaitable[T]) -> T:
        task = asyncio.ensure_future(call)
        while not task.done():
            stats = store.stats()
            seen["reserved"].add(stats.active_reservations)
            seen["visible"].add(store.lookup_local(keys(chain), ns).num_blocks)
            seen["leased"].add(sum(node.leases for node in store.index.in_namespace(ns)))
            await asyncio.sleep(0)
        return await task

    reserved = await watch(
        service.reserve(ns, [spec for spec, _ in chain], session=session.session_id)
    )
    slots = [(item.slot.offset, item.slot.length) for item in reserved.items]
    await session.writer.write(slots, [payload for _, payload in chain])
    statuses = await watch(service.commit(ns, keys(chain), session=session.session_id))
    acquired = await watch(service.acquire(ns, keys(chain), lease_seconds=5.0))
    assert statuses == [PutStatus.STORED] * 48 and acquired.lease.num_blocks == 48
    for name, counts in seen.items():
        assert any(0 < count < 48 for count in counts), (name, sorted(counts))
    await service.release(acquired.lease.lease_id)


async def test_reserve_write_commit_acquire_read_release(service, session) -> None:
    ns = service.register_namespace(MODEL, "alice")
    blocks = blocks_of("alice", 2)
    assert service.handshake().shm_socket.endswith(".shm")
    reserved = await service.reserve(ns, [spec for spec, _ in blocks], session=session.session_id)
    assert [r.status for r in reserved.items] == [PutStatus.RESERVED] * 2
    assert reserved.expires_in == 5.0
    # Invisible until committed; the slots are in alice's arena, written in place.
    assert (await service.lookup(ns, keys(blocks))).num_blocks == 0
    slots = [(item.slot.offset, item.slot.length) for item in reserved.items]
    await session.writer.write(slots, [payload for _, payload in blocks])
    statuses = await service.commit(ns, keys(blocks), session=session.session_id)
    assert statuses == [PutStatus.STORED] * 2
    assert await service.commit(ns, keys(blocks), session=session.session_id) == (
        [PutStatus.EXPIRED] * 2
    )
    again = await service.reserve(ns, [blocks[0][0]], session=session.session_id)
    assert [r.status for r in again.items] == [PutStatus.DEDUP]
    # Read back in place, in alice's arena, which the session maps read-only.
    acquired = await service.acquire(ns, keys(blocks), lease_seconds=2.0)
    assert acquired.lease.num_blocks == 2
    assert acquired.arena_id == session.arena.arena_id
    got = await session.arena.read([(s.offset, s.length) for s in acquired.slots])
    assert got == [payload for _, payload in blocks]
    assert service.stats().store.active_leases == 1
    await service.release(acquired.lease.lease_id)
    assert service.stats().store.active_leases == 0
    with pytest.raises(UnknownLeaseError):
        await service.release(acquired.lease.lease_id)


async def test_a_block_unlike_the_checksum_its_writer_committed_is_never_served(
    service, store, session
) -> None:
    """The daemon records the writer's checksum without reading the bytes: a writer that
    lies (or writes the slot again after its commit) gets STORED, and the block is a miss,
    counted, wherever the daemon reads it."""
    ns = service.register_namespace(MODEL, "alice")
    ((spec, payload),) = blocks_of("alice", 1)
    reserved = await service.reserve(ns, [spec], session=session.session_id)
    slot = reserved.items[0].slot
    await session.writer.write([(slot.offset, slot.length)], [payload])
    wrong = [payload_checksum(payload) ^ 1]
    statuses = await service.commit(ns, [spec.key], session=session.session_id, checksums=wrong)
    assert statuses == [PutStatus.STORED]
    assert await store.get(spec.key, ns) is None  # copied out and checked: a miss
    assert store.stats().corrupt_blocks == 1
    assert (await service.lookup(ns, [spec.key])).num_blocks == 0  # and dropped
    with pytest.raises(InvalidRequestError, match="one per key: 1 keys, 2 checksums"):
        await service.commit(ns, [spec.key], session=session.session_id, checksums=[1, 2])


async def test_without_checksums_the_daemon_sums_what_was_written(service, store, session) -> None:
    ns = service.register_namespace(MODEL, "alice")
    ((spec, payload),) = blocks_of("alice", 1)
    reserved = await service.reserve(ns, [spec], session=session.session_id)
    slot = reserved.items[0].slot
    await session.writer.write([(slot.offset, slot.length)], [payload])
    assert await service.commit(ns, [spec.key], session=session.session_id) == [PutStatus.STORED]
    block = await store.get(spec.key, ns)
    assert block is not None and block.checksum == payload_checksum(payload)


async def test_abort_frees_a_reservation(service, session) -> None:
    ns = service.register_namespace(MODEL, "alice")
    blocks = blocks_of("alice", 1)
    await service.reserve(ns, [blocks[0][0]], session=session.session_id)
    assert service.stats().store.active_reservations == 1
    await service.abort(ns, keys(blocks), session=session.session_id)
    assert service.stats().store.active_reservations == 0
    assert await service.commit(ns, keys(blocks), session=session.session_id) == [PutStatus.EXPIRED]


async def test_a_closed_session_leaves_no_reservation_and_cannot_be_used(service, session) -> None:
    ns = service.register_namespace(MODEL, "alice")
    blocks = blocks_of("alice", 3)
    await service.reserve(ns, [spec for spec, _ in blocks], session=session.session_id)
    assert service.stats().store.active_reservations == 3
    await session.aclose()  # the client went away without committing
    for _ in range(100):
        if service.stats().store.active_reservations == 0:
            break
        await asyncio.sleep(0.01)
    assert service.stats().store.active_reservations == 0
    with pytest.raises(UnknownSessionError, match="is not open"):
        await service.reserve(ns, [blocks[0][0]], session=session.session_id)


async def test_prefetch_promotes_in_the_background(tmp_path: Path) -> None:
    config = make_config(tmp_path, host_blocks=4)
    async with BlockStore.from_config(config) as store, KVStoreService(store, config) as service:
        ns = service.register_namespace(MODEL, "alice")
        old, new = blocks_of("alice", 3), blocks_of("alice", 3, salt=1)
        await put_all(service, ns, old, None)
        await put_all(service, ns, new, None)  # the host holds 4 blocks: old goes to SSD
        before = await service.lookup(ns, keys(old))
        assert before.num_blocks == 3 and "ssd" in before.tiers
        queued = await service.prefetch(ns, [keys(old)], session_id="chat-1")
        assert queued == before.tiers.count("ssd")
        await service.wait_prefetches()
        assert (await service.lookup(ns, keys(old))).tiers == ("host",) * 3
        assert await service.prefetch(ns, [keys(old)]) == 0  # nothing left to move


async def test_close_cancels_prefetches_in_flight(service, store, monkeypatch) -> None:
    ns = service.register_namespace(MODEL, "alice")
    blocks = blocks_of("alice", 1)
    await put_all(service, ns, blocks, None)
    started = asyncio.Event()

    async def stuck(keys: object, namespace: bytes | None = None) -> int:
        started.set()
        await asyncio.sleep(3600)
        return 0

    async def on_ssd(keys: object, namespace: bytes | None = None) -> object:
        from kvstore.wire.results import LookupResult

        return LookupResult.of_tiers(("ssd",))

    monkeypatch.setattr(store, "prefetch", stuck)
    monkeypatch.setattr(store, "lookup", on_ssd)
    assert await service.prefetch(ns, [keys(blocks)], session_id="s") == 1
    await started.wait()
    assert service.stats().prefetches_in_flight == 1
    names = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("prefetch-")]
    assert names == ["prefetch-1-s"]
    await asyncio.wait_for(service.aclose(), timeout=5)
    assert service.stats().prefetches_in_flight == 0


async def test_a_cancelled_acquire_leaves_no_lease(service, store, monkeypatch) -> None:
    ns = service.register_namespace(MODEL, "alice")
    blocks = blocks_of("alice", 2)
    await put_all(service, ns, blocks, None)
    real_acquire = store.acquire

    async def slow_acquire(*args: object, **kwargs: object) -> object:
        await asyncio.sleep(0.2)  # a promotion from SSD in progress
        return await real_acquire(*args, **kwargs)

    monkeypatch.setattr(store, "acquire", slow_acquire)
    call = asyncio.create_task(service.acquire(ns, keys(blocks)))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.sleep(0.3)  # the promotion finishes; its lease is released at once
    assert store.stats().active_leases == 0


async def test_tenants_and_their_namespaces_are_bounded(service) -> None:
    from kvstore.errors import ResourceExhaustedError
    from kvstore.service import MAX_NAMESPACES, MAX_TENANTS

    for i in range(MAX_TENANTS):
        service.register_namespace(MODEL, f"tenant-{i}")
    with pytest.raises(ResourceExhaustedError, match=f"{MAX_TENANTS} tenants"):
        service.register_namespace(MODEL, "one-too-many")
    service.register_namespace(MODEL, "tenant-0")  # again: the same digest, no new tenant
    for i in range(MAX_NAMESPACES - 1):
        other = ModelFingerprint(f"m{i}", 2, 2, 64, "float16", block_tokens=16)
        service.register_namespace(other, "tenant-1")
    with pytest.raises(ResourceExhaustedError, match=f"{MAX_NAMESPACES} namespaces"):
        service.register_namespace(ModelFingerprint("last", 2, 2, 64, "float16"), "tenant-1")


async def test_a_slot_whose_reservation_expired_passes_to_no_block_while_its_writer_holds_it(
    service: KVStoreService, store: BlockStore, session: ShmSession
) -> None:
    """A slow writer (its reservation's TTL ran out while it wrote) still writes its slot in
    place: the range stays held until it commits or aborts, so its late bytes land in no
    other block, however hard the arena turns over; its Commit is EXPIRED, and only then is
    the range free."""
    ns = service.register_namespace(MODEL, "alice")
    host = store.tiers[0].tier
    assert isinstance(host, HostTier)
    ((slow_spec, slow_payload),) = blocks_of("alice", 1, salt=9)
    slow = (await service.reserve(ns, [slow_spec], session=session.session_id)).items[0].slot
    assert slow is not None
    assert await store.writes.expire(time.monotonic() + 3600) == 1  # its TTL ran out
    assert host.usage() == host.slot_bytes(BLOCK)  # yet its range is still held
    assert service.sessions is not None
    filler = await ShmSession.open(str(service.sessions.path), Hello("", "alice", 1 << 20))
    try:
        stored: list[tuple[BlockSpec, bytes]] = []
        for round_ in range(12):  # 96 blocks through a 64-block arena: evictions all along
            batch = blocks_of("alice", 8, salt=round_)
            reserved = await service.reserve(ns, [b for b, _ in batch], session=filler.session_id)
            slots = [(r.slot.offset, r.slot.length) for r in reserved.items]
            assert all(o + n <= slow.offset or o >= slow.end for o, n in slots), round_
            await filler.writer.write(slots, [payload for _, payload in batch])
            statuses = await service.commit(ns, keys(batch), session=filler.session_id)
            assert statuses == [PutStatus.STORED] * 8
            stored += batch
        await session.writer.write([(slow.offset, slow.length)], [slow_payload])  # late
        held = 0
        for spec, payload in stored:
            block = await store.get(spec.key, ns)
            if block is not None:
                held += 1
                assert block.payload == payload
        assert held > 0 and store.stats().corrupt_blocks == 0
        used = host.usage()
        assert await service.commit(ns, [slow_spec.key], session=session.session_id) == [
            PutStatus.EXPIRED
        ]
        assert host.usage() == used - host.slot_bytes(BLOCK)  # let go of: free now
    finally:
        await filler.aclose()


async def test_reserves_under_way_hold_the_window_and_never_share_a_slot(
    service, store, monkeypatch
) -> None:
    ns = service.register_namespace(MODEL, "alice")
    assert service.sessions is not None
    opened = await ShmSession.open(str(service.sessions.path), Hello("", "alice", 2 * BLOCK))
    try:
        real = store.writes.reserve

        async def slow_reserve(*args: object, **kwargs: object) -> object:
            await asyncio.sleep(0.05)  # evicting to make room
            return await real(*args, **kwargs)

        monkeypatch.setattr(store.writes, "reserve", slow_reserve)
        monkeypatch.setattr(store.writes, "reserve_now", lambda *args, **kwargs: None)
        blocks = blocks_of("alice", 3)
        sid = opened.session_id
        first = [
            asyncio.create_task(service.reserve(ns, [spec], session=sid)) for spec, _ in blocks[:2]
        ]
        await asyncio.sleep(0.01)  # both hold their share of the window, reservations under way
        third = await service.reserve(ns, [blocks[2][0]], session=sid)
        assert [r.status for r in third.items] == [PutStatus.NO_SPACE]  # the window is full
        done = [(await task).items[0] for task in first]
        assert [r.status for r in done] == [PutStatus.RESERVED] * 2
        assert done[0].slot != done[1].slot
        slots = [(r.slot.offset, r.slot.length) for r in done]
        await opened.writer.write(slots, [payload for _, payload in blocks[:2]])
        statuses = await service.commit(ns, keys(blocks[:2]), session=sid)
        assert statuses == [PutStatus.STORED] * 2
        for spec, payload in blocks[:2]:
            assert (await store.get(spec.key, ns)).payload == payload
    finally:
        await opened.aclose()
