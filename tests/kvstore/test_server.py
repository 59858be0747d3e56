"""The daemon over real sockets: the generated stub against ``create_server`` (unix and TCP)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import grp
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import server as server_module
from kvstore.client.keys import block_keys
from kvstore.client.shm import ShmSession
from kvstore.config import (
    AuthConfig,
    Config,
    ConfigError,
    HostConfig,
    RedisConfig,
    ServerConfig,
    SsdConfig,
    load_config,
    socket_gid,
)
from kvstore.index import BlockMeta
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.server import RunningServer, create_server
from kvstore.store import BlockStore
from kvstore.tiers import collector
from kvstore.wire.blocks import ROOT_KEY, payload_checksum
from kvstore.wire.namespace import ModelFingerprint, Namespace
from kvstore.wire.session import Hello
from tests.support.net import self_signed
from tests.support.workers import start_every_worker

MODEL = ModelFingerprint("test-model", num_layers=2, num_kv_heads=2, head_dim=64,
                         dtype="float16", block_tokens=16)  # fmt: skip
BLOCK = MODEL.layout().payload_bytes  # 16 KiB
CHUNK = 4096  # 4 chunks per block on the streamed data plane
MAX_MESSAGE = 64 * 1024
MODEL_PB = pb.ModelFingerprint(
    model_name="test-model",
    layout=pb.Layout(num_layers=2, num_kv_heads=2, block_tokens=16, head_dim=64, dtype="float16"),
    rope_theta=10000.0,
)
Block = tuple[pb.BlockSpec, bytes]


@pytest.fixture
def short_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, or a shorter temp dir when a socket path there would pass the 107-byte limit."""
    if len(str(tmp_path / "kvstore.sock")) < 100:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="kv-") as name:
        yield Path(name)


def make_config(
    tmp_path: Path, sock_dir: Path, *, tokens: tuple[str, ...] = (), mode: str = "0600"
) -> Config:
    return Config(
        host=HostConfig(capacity=4 << 20),
        ssd=SsdConfig(directory=str(tmp_path / "ssd"), capacity=64 << 20, fsync=False),
        server=ServerConfig(
            listen=(f"unix:{sock_dir}/run/kvstore.sock", "127.0.0.1:0"),
            socket_mode=mode,
            max_message_bytes=MAX_MESSAGE,
            chunk_bytes=CHUNK,
            lease_ttl=5.0,
            shutdown_grace=1.0,
        ),
        auth=AuthConfig(tokens=tokens),
    )


@dataclass
class Daemon:
    store: BlockStore
    running: RunningServer
    channels: list[grpc.aio.Channel]

    def stub(self, address: str) -> kvstore_pb2_grpc.KVStoreStub:
        channel = grpc.aio.insecure_channel(address)
        self.channels.append(channel)
        return kvstore_pb2_grpc.KVStoreStub(channel)


@asynccontextmanager
async def daemon(config: Config) -> AsyncIterator[Daemon]:
    store = BlockStore.from_config(config)
    await store.start()
    running = await create_server(config, store)
    started = Daemon(store, running, [])
    try:
        yield started
    finally:
        for channel in started.channels:
            await channel.close()
        await running.stop()
        await store.aclose()


@pytest.fixture
async def kv(tmp_path: Path, short_dir: Path) -> AsyncIterator[Daemon]:
    async with daemon(make_config(tmp_path, short_dir)) as started:
        yield started


@pytest.fixture(params=["unix", "tcp"])
def address(request: pytest.FixtureRequest, kv: Daemon) -> str:
    unix, tcp = kv.running.addresses
    return unix if request.param == "unix" else tcp


def blocks_of(tenant: str, num_blocks: int, salt: int = 0) -> list[Block]:
    tokens = [salt * 1_000_000 + i for i in range(num_blocks * 16)]
    keys = block_keys(tokens, Namespace(MODEL, tenant))
    parents = [ROOT_KEY, *keys[:-1]]
    return [
        (pb.BlockSpec(key=key, parent=parent, num_tokens=16), os.urandom(BLOCK))
        for key, parent in zip(keys, parents, strict=True)
    ]


def keys(blocks: list[Block]) -> list[bytes]:
    return [spec.key for spec, _ in blocks]


def put_chunks(ns: bytes, blocks: list[Block]) -> Iterator[pb.PutChunk]:
    first = True
    for spec, payload in blocks:
        for start in range(0, len(payload), CHUNK):
            yield pb.PutChunk(
                namespace=ns if first else b"",
                block=spec if start == 0 else None,
                data=payload[start : start + CHUNK],
            )
            first = False


async def register(stub: kvstore_pb2_grpc.KVStoreStub, tenant: str = "", **kw: object) -> bytes:
    request = pb.RegisterNamespaceRequest(model=MODEL_PB, tenant=tenant)
    response = await stub.RegisterNamespace(request, **kw)
    return bytes(response.namespace)


async def get_payloads(stub: kvstore_pb2_grpc.KVStoreStub, ns: bytes, ks: list[bytes]) -> dict:
    payloads: dict[int, bytearray] = {}
    tiers = {}
    async for chunk in stub.Get(pb.GetRequest(namespace=ns, keys=ks)):
        if chunk.index not in payloads:
            payloads[chunk.index], tiers[chunk.index] = bytearray(), chunk.tier
        payloads[chunk.index] += chunk.data
        assert chunk.last == (len(payloads[chunk.index]) == BLOCK)
    return {i: (bytes(data), tiers[i]) for i, data in payloads.items()}


def socket_mode(path: Path) -> int | None:
    """The permission bits of a unix socket file; None when there is no socket there."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    return stat.S_IMODE(mode) if stat.S_ISSOCK(mode) else None


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


# -- round trips ----------------------------------------------------------------------------


async def test_handshake_and_health(kv: Daemon, address: str) -> None:
    stub = kv.stub(address)
    info = await stub.Handshake(pb.HandshakeRequest())
    assert info.shm_socket == kv.running.addresses[0].removeprefix("unix:") + ".shm"
    assert stat.S_ISSOCK(os.stat(info.shm_socket).st_mode)
    assert info.instance_id == kv.running.service.instance_id and len(info.instance_id) == 16
    assert info.max_block_bytes == 4 << 20  # the host tier's size is the tighter limit
    assert (info.max_message_bytes, info.chunk_bytes, info.lease_seconds) == (MAX_MESSAGE, CHUNK, 5)
    health = health_pb2_grpc.HealthStub(kv.channels[-1])
    for service in ("", "kvstore.v1.KVStore"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_streamed_put_and_get_are_bit_exact(kv: Daemon, address: str) -> None:
    stub = kv.stub(address)
    ns = await register(stub, "alice")
    assert ns == Namespace(MODEL, "alice").digest()
    blocks = blocks_of("alice", 3)
    reply = await stub.Put(put_chunks(ns, blocks))
    assert list(reply.statuses) == [pb.STORED] * 3
    reply = await stub.Put(put_chunks(ns, blocks[:1]))
    assert list(reply.statuses) == [pb.DEDUP]
    found = await stub.Lookup(pb.LookupRequest(namespace=ns, keys=[*keys(blocks), b"\0" * 32]))
    assert (found.num_blocks, [(r.tier, r.blocks) for r in found.runs]) == (3, [("host", 3)])
    assert not found.tiers  # one run, not a tier per block
    got = await get_payloads(stub, ns, [*keys(blocks[:2]), b"\1" * 32, blocks[2][0].key])
    assert got == {0: (blocks[0][1], "host"), 1: (blocks[1][1], "host")}  # stops at a miss


async def test_shared_memory_write_and_read(kv: Daemon, address: str) -> None:
    stub = kv.stub(address)
    ns = await register(stub)
    blocks = blocks_of("", 2)
    info = await stub.Handshake(pb.HandshakeRequest())
    session = await ShmSession.open(info.shm_socket, Hello("", "", 1 << 20))
    try:
        assert session.info.instance_id == info.instance_id
        # Reserve -> write the arena slots in place -> Commit (the daemon sums them in place).
        reserved = await stub.Reserve(
            pb.ReserveRequest(
                namespace=ns, blocks=[b for b, _ in blocks], session=session.session_id
            )
        )
        assert [r.status for r in reserved.reservations] == [pb.RESERVED] * 2
        assert reserved.expires_in == 5.0
        slots = [(r.slot.offset, r.slot.length) for r in reserved.reservations]
        assert all(length == BLOCK for _, length in slots)
        await session.writer.write(slots, [payload for _, payload in blocks])
        commit = pb.CommitRequest(namespace=ns, keys=keys(blocks), session=session.session_id)
        assert list((await stub.Commit(commit)).statuses) == [pb.STORED] * 2
        assert list((await stub.Commit(commit)).statuses) == [pb.EXPIRED] * 2
        # Acquire -> read the slots in the arena -> Release.
        acquired = await stub.Acquire(
            pb.AcquireRequest(namespace=ns, keys=keys(blocks), lease_id=77)
        )
        assert acquired.lease_id == 77 and acquired.arena_id == session.arena.arena_id
        assert 0 < acquired.expires_in <= 5.0 and len(acquired.slots) == 2
        got = await session.arena.read([(s.offset, s.length) for s in acquired.slots])
        assert got == [payload for _, payload in blocks]
        assert list(acquired.checksums) == [payload_checksum(p) for _, p in blocks]
    finally:
        await session.aclose()
    stats = await stub.Stats(pb.StatsRequest())
    assert stats.active_leases == 1 and stats.blocks == 2
    await stub.Release(pb.ReleaseRequest(lease_id=acquired.lease_id))
    error = await rpc_error(stub.Release(pb.ReleaseRequest(lease_id=acquired.lease_id)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert f"lease {acquired.lease_id}" in error.details()
    # The same bytes come back through the streamed plane too.
    assert await get_payloads(stub, ns, keys(blocks)) == {
        i: (payload, "host") for i, (_, payload) in enumerate(blocks)
    }


async def test_abort_prefetch_delete_and_stats(kv: Daemon) -> None:
    stub = kv.stub(kv.running.addresses[0])
    ns = await register(stub)
    blocks = blocks_of("", 3)
    info = await stub.Handshake(pb.HandshakeRequest())
    session = await ShmSession.open(info.shm_socket, Hello("", "", 1 << 20))
    sid = session.session_id
    reserved = await stub.Reserve(
        pb.ReserveRequest(namespace=ns, blocks=[blocks[0][0]], session=sid)
    )
    assert (await stub.Stats(pb.StatsRequest())).active_reservations == 1
    await stub.Abort(pb.AbortRequest(namespace=ns, keys=keys(blocks[:1]), session=sid))
    assert reserved.reservations[0].status == pb.RESERVED
    await session.aclose()
    await stub.Put(put_chunks(ns, blocks))
    chains = [pb.KeyChain(keys=keys(blocks))]
    prefetched = await stub.Prefetch(
        pb.PrefetchRequest(session_id="s", namespace=ns, chains=chains)
    )
    assert prefetched.num_blocks == 0  # all in the host tier already
    deleted = await stub.Delete(pb.DeleteRequest(namespace=ns, keys=keys(blocks[1:2])))
    assert deleted.num_blocks == 2
    await stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys(blocks)))
    stats = await stub.Stats(pb.StatsRequest())
    assert (stats.puts, stats.lookups, stats.lookup_hit_blocks) == (3, 1, 1)
    assert (stats.active_reservations, stats.active_leases) == (0, 0)
    assert [t.name for t in stats.tiers] == ["host", "ssd"]
    assert stats.tiers[0].capacity_bytes == 4 << 20


async def test_blocks_put_and_read_over_grpc_add_nothing_to_full_collections(kv: Daemon) -> None:
    """The daemon's whole path (streamed puts evicting from host to SSD, lookups, gets that
    promote back) leaves nothing per block for the cyclic collector to walk: 2,000 blocks
    add under a quarter of a reference each (a tracked node would add five; what does grow,
    a few hundred, is gRPC's and asyncio's own state, whatever the number of blocks)."""
    stub = kv.stub(kv.running.addresses[0])
    ns = await register(stub)
    chains = [blocks_of("", 20, salt) for salt in range(100)]
    await stub.Put(put_chunks(ns, chains[0]))
    await start_every_worker()
    before = collector.tracked_entries()
    for blocks in chains[1:]:
        reply = await stub.Put(put_chunks(ns, blocks))
        assert list(reply.statuses) == [pb.STORED] * 20
    for blocks in chains[::10]:
        found = await stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys(blocks)))
        assert found.num_blocks == 20
        got = await get_payloads(stub, ns, keys(blocks))
        assert [got[i][0] for i in range(20)] == [payload for _, payload in blocks]
    held = len(kv.store.index)
    after = collector.tracked_entries()
    assert held == 2000
    assert after - before < held / 4, f"{after - before} more references to walk, {held} blocks"


# -- errors ---------------------------------------------------------------------------------


async def test_bad_requests_get_status_codes_naming_the_value(kv: Daemon, address: str) -> None:
    stub = kv.stub(address)
    ns = await register(stub)
    (spec, payload), *_ = blocks_of("", 1)
    error = await rpc_error(stub.Lookup(pb.LookupRequest(namespace=ns, keys=[b"short"])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "keys[0] must be 32 bytes, got 5" in error.details()
    # A block that ends short, and one that runs long.
    chunks = list(put_chunks(ns, [(spec, payload[:1000])]))
    error = await rpc_error(stub.Put(iter(chunks)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block 0 ended after 1000 payload bytes; its layout needs 16384" in error.details()
    chunks = [*put_chunks(ns, [(spec, payload)]), pb.PutChunk(data=b"x")]
    error = await rpc_error(stub.Put(iter(chunks)))
    assert "chunk 4 carries data outside a block" in error.details()
    bad_tokens = pb.BlockSpec(key=spec.key, parent=spec.parent, num_tokens=3)
    error = await rpc_error(stub.Put(iter([pb.PutChunk(namespace=ns, block=bad_tokens)])))
    assert "num_tokens must be 16" in error.details() and "got 3" in error.details()
    # A message over max_message_bytes is refused by gRPC itself.
    huge = pb.PutChunk(namespace=ns, block=spec, data=b"x" * (MAX_MESSAGE + 1))
    error = await rpc_error(stub.Put(iter([huge])))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # An unknown namespace, and a malformed fingerprint.
    other = Namespace(MODEL, "never").digest()
    error = await rpc_error(stub.Lookup(pb.LookupRequest(namespace=other, keys=[spec.key])))
    assert error.code() == grpc.StatusCode.NOT_FOUND and other.hex() in error.details()
    bad_model = pb.ModelFingerprint(model_name="m", layout=pb.Layout(num_layers=0))
    error = await rpc_error(stub.RegisterNamespace(pb.RegisterNamespaceRequest(model=bad_model)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_layers must be a positive int, got 0" in error.details()


async def test_oversized_layouts_and_buffers_are_refused_before_any_work(kv: Daemon) -> None:
    stub = kv.stub(kv.running.addresses[0])
    # 4096 layers x 1 GiB per layer: refused when registered, nothing allocated.
    layout = pb.Layout(num_layers=4096, num_kv_heads=4096, block_tokens=256, head_dim=256,
                       dtype="float16")  # fmt: skip
    huge = pb.ModelFingerprint(model_name="huge", layout=layout)
    error = await rpc_error(stub.RegisterNamespace(pb.RegisterNamespaceRequest(model=huge)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4398046511104 bytes; this daemon takes at most 4194304" in error.details()
    # 513 layers x 8 KiB, just over the host tier (4 MiB): refused too.
    over = pb.Layout(num_layers=513, num_kv_heads=2, block_tokens=16, head_dim=64, dtype="float16")
    error = await rpc_error(
        stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model=pb.ModelFingerprint(model_name="o", layout=over))
        )
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ns = await register(stub)
    host = kv.store.tier("host").tier
    usage = host.usage()
    assert usage == 0 and kv.store.stats().tiers[0].evictions == 0
    # Bytes of streamed blocks buffered in memory are bounded: past max_buffered_bytes,
    # RESOURCE_EXHAUSTED (here: no room in a full, leased arena forces the buffer path).
    service = kv.running.service
    meta = BlockMeta(ns, 16, MODEL.layout())
    # The reservations outlive the test: with the daemon's 5 s TTL, a loaded machine let them
    # expire before the Put, which then found room in the arena and never buffered.
    held = [
        await kv.store.writes.reserve(i.to_bytes(32, "big"), ROOT_KEY, meta, 600, "test")
        for i in range(1, 300)
    ]
    assert held[-1].status.name == "NO_SPACE"  # the arena is full of reservations
    with service.buffered(service._server.max_buffered_bytes - BLOCK // 2):
        error = await rpc_error(stub.Put(iter(put_chunks(ns, blocks_of("", 1, salt=3)))))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "server.max_buffered_bytes" in error.details()
    assert host.usage() <= host.capacity()


async def test_tokens_and_tenants(tmp_path: Path, short_dir: Path) -> None:
    config = make_config(tmp_path, short_dir, tokens=("secret-a:alice", "secret-b:bob"))
    async with daemon(config) as kv:
        stub = kv.stub(kv.running.addresses[0])
        alice = {"metadata": (("authorization", "Bearer secret-a"),)}
        bob = {"metadata": (("authorization", "Bearer secret-b"),)}
        wrong = {"metadata": (("authorization", "Bearer nope"),)}
        # Health stays open to probes; everything else needs a known token.
        health = health_pb2_grpc.HealthStub(kv.channels[-1])
        reply = await health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        error = await rpc_error(stub.Handshake(pb.HandshakeRequest()))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing 'authorization: Bearer <token>'" in error.details()
        error = await rpc_error(stub.Stats(pb.StatsRequest(), **wrong))
        assert (error.code(), error.details()) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "unknown bearer token",
        )
        ns = await register(stub, "alice", **alice)
        blocks = blocks_of("alice", 1)
        # Streaming calls are refused too.
        error = await rpc_error(stub.Put(put_chunks(ns, blocks)))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        error = await rpc_error(get_payloads(stub, ns, keys(blocks)))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert list((await stub.Put(put_chunks(ns, blocks), **alice)).statuses) == [pb.STORED]
        # Bob may not use, nor register, alice's namespace.
        error = await rpc_error(
            stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys(blocks)), **bob)
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert ns.hex() in error.details()
        error = await rpc_error(register(stub, "alice", **bob))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "tenant 'bob' cannot register a namespace for tenant 'alice'" in error.details()
        found = await stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys(blocks)), **alice)
        assert found.num_blocks == 1


async def test_a_client_deadline_cancels_a_slow_acquire_cleanly(kv: Daemon, monkeypatch) -> None:
    stub = kv.stub(kv.running.addresses[0])
    ns = await register(stub)
    blocks = blocks_of("", 2)
    await stub.Put(put_chunks(ns, blocks))
    real_acquire = kv.store.acquire

    async def slow_acquire(*args: object, **kwargs: object) -> object:
        await asyncio.sleep(0.3)  # as if promoting from SSD
        return await real_acquire(*args, **kwargs)

    monkeypatch.setattr(kv.store, "acquire", slow_acquire)
    request = pb.AcquireRequest(namespace=ns, keys=keys(blocks))
    error = await rpc_error(stub.Acquire(request, timeout=0.1))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.5)
    assert kv.store.stats().active_leases == 0


# -- sockets and lifecycle ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["0600", "0660"])
async def test_socket_mode_and_bound_addresses(tmp_path: Path, short_dir: Path, mode: str) -> None:
    async with daemon(make_config(tmp_path, short_dir, mode=mode)) as kv:
        unix, tcp = kv.running.addresses
        path = Path(unix.removeprefix("unix:"))
        assert socket_mode(path) == int(mode, 8)
        host, port = tcp.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        # A second daemon on the same socket is refused while the first one lives.
        store = BlockStore.from_config(make_config(tmp_path / "2", short_dir))
        with pytest.raises(OSError) as caught:
            await create_server(make_config(tmp_path, short_dir), store)
        assert caught.value.errno == errno.EADDRINUSE
    assert socket_mode(path) is None  # removed on stop


CONNECT_AS = """
import json, os, socket, sys
from kvstore.client import KVStoreClient, ModelFingerprint, Namespace, block_keys
path, group = sys.argv[1], int(sys.argv[2])
os.setgroups([group] if group >= 0 else [])  # a supplementary group, or none
os.setgid(65533)  # a primary group that is not the socket's
os.setuid(65534)
try:
    socket.socket(socket.AF_UNIX).connect(path)
except OSError as error:
    print(json.dumps({"refused": error.errno}))
    sys.exit(0)
ns = Namespace(ModelFingerprint("group-model", 2, 2, 64, "float16", block_tokens=16), "t")
keys = block_keys(list(range(64)), ns)
blocks = [key * (ns.model.layout().payload_bytes // len(key)) for key in keys]
with KVStoreClient("unix:" + path) as client:
    client.put(ns, keys, blocks)
    same = client.get(ns, keys) == blocks
    print(json.dumps({"data_plane": client.data_plane, "same": same}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
async def test_a_group_socket_is_reachable_by_the_group_only(tmp_path: Path) -> None:
    """``socket_mode = "0660"`` with ``socket_group``: a user of that group connects and maps
    the arena (no fall-back to streaming); a user outside it is refused by the kernel."""
    top = Path(tempfile.mkdtemp(prefix="kv-"))  # under /tmp: every directory above is passable
    os.chmod(top, 0o711)
    config = make_config(tmp_path, top, mode="0660")
    nogroup = grp.getgrnam("nogroup").gr_gid
    config = dataclasses.replace(
        config, server=dataclasses.replace(config.server, socket_group="nogroup")
    )
    async with daemon(config) as kv:
        path = Path(kv.running.addresses[0].removeprefix("unix:"))
        made = os.stat(path.parent)
        assert stat.S_IMODE(made.st_mode) == 0o750  # was 0700: no one passed
        assert made.st_gid == nogroup  # the directory the daemon made is the group's
        for socket_path in (path, Path(f"{path}.shm")):
            assert os.stat(socket_path).st_gid == nogroup
            assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o660

        async def connect(as_group: int) -> dict[str, object]:
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-P", "-c", CONNECT_AS, str(path), str(as_group),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(child.communicate(), 60)
            assert child.returncode == 0, err.decode()
            return dict(json.loads(out))

        member = await connect(nogroup)  # another user, in the socket's group
        assert member == {"data_plane": "shm", "same": True}
        assert await connect(-1) == {"refused": errno.EACCES}  # another user outside it
    shutil.rmtree(top, ignore_errors=True)


def test_an_unknown_socket_group_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.socket_group: no group named 'no-such-grp'"):
        load_config(overrides={"server": {"socket_group": "no-such-grp"}})
    numeric = load_config(overrides={"server": {"socket_group": "65534"}})
    assert socket_gid(numeric.server) == 65534


async def test_a_health_check_right_after_a_tier_failed_says_so(
    tmp_path: Path,
    short_dir: Path,
    redis_url: str,
    redis_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis dies under a serving daemon and the next put's write-through fails: the very
    next ``Check`` says ``kvstore.tiers`` and ``kvstore.tier.redis`` NOT_SERVING (``""``
    stays SERVING), with the poll for ``Watch`` streams pushed out of reach; once Redis is
    back and a put reaches it, ``Check`` says SERVING again."""
    monkeypatch.setattr(server_module, "HEALTH_POLL_S", 3600.0)
    redis = RedisConfig(enabled=True, url=redis_url, write_policy="write_through",
                        capacity=64 << 20)  # fmt: skip
    config = dataclasses.replace(make_config(tmp_path, short_dir), redis=redis)
    async with daemon(config) as kv:
        stub = kv.stub(kv.running.addresses[1])
        health = health_pb2_grpc.HealthStub(kv.channels[-1])

        async def statuses() -> list[str]:
            names = ["", "kvstore.tiers", "kvstore.tier.host", "kvstore.tier.redis"]
            replies = [await health.Check(health_pb2.HealthCheckRequest(service=n)) for n in names]
            return [health_pb2.HealthCheckResponse.ServingStatus.Name(r.status) for r in replies]

        ns = await register(stub)
        await stub.Put(put_chunks(ns, blocks_of("", 2, salt=1)))
        assert await statuses() == ["SERVING"] * 4
        redis_server.stop()
        await stub.Put(put_chunks(ns, blocks_of("", 2, salt=2)))
        assert await statuses() == ["SERVING", "NOT_SERVING", "SERVING", "NOT_SERVING"]
        redis_server.start()
        await asyncio.sleep(1.2)  # the tier's retry interval (1 s): the next call tries Redis
        await stub.Put(put_chunks(ns, blocks_of("", 2, salt=3)))
        assert await statuses() == ["SERVING"] * 4


async def test_stop_turns_health_off_and_flushes_write_back_blocks(
    tmp_path: Path, short_dir: Path
) -> None:
    config = make_config(tmp_path, short_dir)
    blocks = blocks_of("", 3)
    async with daemon(config) as kv:
        stub = kv.stub(kv.running.addresses[1])
        ns = await register(stub)
        await stub.Put(put_chunks(ns, blocks))
        assert kv.store.tier("ssd").tier.usage() == 0  # write-back: nothing there yet
        await kv.running.health.enter_graceful_shutdown()
        health = health_pb2_grpc.HealthStub(kv.channels[-1])
        reply = await health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    # A new store on the same SSD directory finds the blocks that the host held.
    async with BlockStore.from_config(config) as store:
        found = await store.lookup(keys(blocks), namespace=ns)
        assert (found.num_blocks, found.tiers) == (3, ("ssd",) * 3)
        for spec, payload in blocks:
            block = await store.get(spec.key, namespace=ns)
            assert block is not None and block.payload == payload


async def test_stop_lets_calls_in_flight_finish(kv: Daemon, monkeypatch) -> None:
    stub = kv.stub(kv.running.addresses[0])
    ns = await register(stub)
    blocks = blocks_of("", 1)
    await stub.Put(put_chunks(ns, blocks))
    real_lookup = kv.store.lookup
    entered = asyncio.Event()

    async def slow_lookup(*args: object, **kwargs: object) -> object:
        entered.set()
        await asyncio.sleep(0.3)
        return await real_lookup(*args, **kwargs)

    monkeypatch.setattr(kv.store, "lookup", slow_lookup)
    call = asyncio.ensure_future(stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys(blocks))))
    await entered.wait()
    await kv.running.stop(grace=5.0)
    assert (await call).num_blocks == 1
    error = await rpc_error(stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys(blocks))))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_on_tcp(tmp_path: Path, short_dir: Path) -> None:
    cert, key = self_signed(tmp_path)
    base = make_config(tmp_path, short_dir)
    server = dataclasses.replace(
        base.server, listen=("127.0.0.1:0",), tls_cert=str(cert), tls_key=str(key)
    )
    async with daemon(dataclasses.replace(base, server=server)) as kv:
        (address,) = kv.running.addresses
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(address, credentials) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            assert (await stub.Handshake(pb.HandshakeRequest())).chunk_bytes == CHUNK
        plain = kv.stub(address)
        error = await rpc_error(plain.Handshake(pb.HandshakeRequest(), timeout=2))
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_a_stale_socket_file_is_replaced(tmp_path: Path, short_dir: Path) -> None:
    path = short_dir / "run" / "kvstore.sock"
    path.parent.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # a daemon that died without removing its socket
    async with daemon(make_config(tmp_path, short_dir)) as kv:
        stub = kv.stub(kv.running.addresses[0])
        assert (await stub.Handshake(pb.HandshakeRequest())).chunk_bytes == CHUNK
