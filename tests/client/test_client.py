"""The async client against a real daemon, on both data planes (shm and streamed)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from pathlib import Path

import pytest
import torch

from kvstore.client import (
    ROOT_KEY,
    AsyncKVStoreClient,
    KVStoreClient,
    KVStoreError,
    Namespace,
    NotConnectedError,
    WriteStatus,
    block_keys,
    transfer,
)
from kvstore.client.shm import Arena
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from tests.client.conftest import SMALL
from tests.support.daemon import Daemon
from tests.support.waiting import until


def chain(namespace: Namespace, num_blocks: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    tokens = [rng.randrange(32000) for _ in range(num_blocks * namespace.model.block_tokens)]
    return block_keys(tokens, namespace)


async def no_leases(client: AsyncKVStoreClient) -> bool:
    return (await client.stats()).active_leases == 0


def payloads(namespace: Namespace, count: int) -> list[bytes]:
    return [os.urandom(namespace.model.layout().payload_bytes) for _ in range(count)]


async def test_put_lookup_get_round_trip_is_bit_exact(
    any_client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 3), payloads(namespace, 3)
    assert await any_client.lookup(namespace, keys) == 0  # a miss is a value
    assert await any_client.get(namespace, keys) == []

    assert await any_client.put(namespace, keys, blocks) == [WriteStatus.STORED] * 3

    found = await any_client.lookup_tiers(namespace, keys)
    assert found.num_blocks == 3
    assert found.tiers == ("host",) * 3
    assert await any_client.get(namespace, keys) == blocks


async def test_a_partial_hit_returns_the_leading_blocks(
    any_client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 4), payloads(namespace, 4)
    await any_client.put(namespace, keys[:2], blocks[:2])

    assert await any_client.lookup(namespace, keys) == 2
    assert await any_client.get(namespace, keys) == blocks[:2]


async def test_put_continues_a_chain_from_its_parent(
    any_client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 4), payloads(namespace, 4)
    await any_client.put(namespace, keys[:2], blocks[:2], parent=ROOT_KEY)
    await any_client.put(namespace, keys[2:], blocks[2:], parent=keys[1])

    assert await any_client.get(namespace, keys) == blocks


async def test_tensors_in_and_out(any_client: AsyncKVStoreClient, namespace: Namespace) -> None:
    model = namespace.model
    shape = model.layout().shape
    keys = chain(namespace, 2)
    blocks = [torch.randn(shape, dtype=torch.float16) for _ in keys]  # [L, 2, T, H, D]
    await any_client.put(namespace, keys, blocks)

    out = [torch.empty(shape, dtype=torch.float16) for _ in keys]
    got = await any_client.get(namespace, keys, out=out)

    assert len(got) == 2 and got[0] is out[0] and got[1] is out[1]
    for sent, received in zip(blocks, got, strict=True):
        assert torch.equal(sent.view(torch.int16), received.view(torch.int16))  # bit-exact


async def test_get_into_buffers_fills_only_the_held_blocks(
    any_client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 3), payloads(namespace, 3)
    await any_client.put(namespace, keys[:2], blocks[:2])
    size = namespace.model.layout().payload_bytes
    out = [bytearray(size), memoryview(bytearray(size)), bytearray(size)]

    got = await any_client.get(namespace, keys, out=out)

    assert len(got) == 2
    assert bytes(got[0]) == blocks[0] and bytes(got[1]) == blocks[1]
    assert out[2] == bytearray(size)  # untouched


async def test_a_block_put_by_one_client_is_found_by_another_and_deduplicated(
    daemon: Daemon, client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 2), payloads(namespace, 2)
    assert await client.put(namespace, keys, blocks) == [WriteStatus.STORED] * 2

    for use_shm in (True, False):
        async with AsyncKVStoreClient(daemon.address, use_shm=use_shm) as other:
            assert await other.lookup(namespace, keys) == 2
            assert await other.get(namespace, keys) == blocks
            assert await other.put(namespace, keys, blocks) == [WriteStatus.DEDUP] * 2
    stats = await client.stats()
    assert stats.dedup_puts >= 4


async def test_view_lends_the_arena_under_a_lease(
    client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 3), payloads(namespace, 3)
    await client.put(namespace, keys[:2], blocks[:2])

    async with client.view(namespace, keys) as views:
        assert [bytes(view) for view in views] == blocks[:2]
        assert all(view.readonly for view in views)
        assert (await client.stats()).active_leases == 1
    await until(lambda: no_leases(client))  # the Release went out in the background
    with pytest.raises(ValueError, match="released"):
        bytes(views[0])  # the views end with the lease


async def test_view_tensors_share_the_arena(
    any_client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 2), payloads(namespace, 2)
    await any_client.put(namespace, keys, blocks)

    async with any_client.view_tensors(namespace, keys) as tensors:
        assert [tensor.dtype for tensor in tensors] == [torch.uint8] * 2
        assert [bytes(tensor.numpy()) for tensor in tensors] == blocks
    await until(lambda: no_leases(any_client))


async def test_view_on_the_stream_plane_views_downloaded_bytes(
    stream_client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 2), payloads(namespace, 2)
    await stream_client.put(namespace, keys, blocks)

    async with stream_client.view(namespace, keys + chain(namespace, 1, seed=9)) as views:
        assert [bytes(view) for view in views] == blocks


async def test_a_failing_caller_inside_view_still_releases_the_lease(
    client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 1), payloads(namespace, 1)
    await client.put(namespace, keys, blocks)

    with pytest.raises(RuntimeError, match="caller"):
        async with client.view(namespace, keys):
            raise RuntimeError("caller failed")
    assert (await client.stats()).active_leases == 0


async def test_a_cancelled_get_releases_its_lease(
    client: AsyncKVStoreClient, namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get cancelled while it holds its lease (stopped in its copy out of the arena, a
    fault injected there) releases the lease; the next get reads the same bytes."""
    keys, blocks = chain(namespace, 8), payloads(namespace, 8)
    await client.put(namespace, keys, blocks)
    copying, never = asyncio.Event(), asyncio.Event()
    read = Arena.read

    async def stuck(self: Arena, slots: object) -> list[bytes]:
        copying.set()
        await never.wait()
        raise AssertionError("the copy was not cancelled")

    monkeypatch.setattr(Arena, "read", stuck)
    for _ in range(3):
        copying.clear()
        task = asyncio.create_task(client.get(namespace, keys))
        await asyncio.wait_for(copying.wait(), 10.0)  # leased, in the copy
        assert (await client.stats()).active_leases == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if (await client.stats()).active_leases == 0:
                break
            await asyncio.sleep(0.02)
        assert (await client.stats()).active_leases == 0
    monkeypatch.setattr(Arena, "read", read)
    assert await client.get(namespace, keys) == blocks


async def test_delete_and_prefetch(any_client: AsyncKVStoreClient, namespace: Namespace) -> None:
    keys, blocks = chain(namespace, 3), payloads(namespace, 3)
    await any_client.put(namespace, keys, blocks)

    assert await any_client.prefetch("session-1", namespace, [keys, keys[:1]]) >= 0
    assert await any_client.delete(namespace, keys[2:]) == 1
    assert await any_client.lookup(namespace, keys) == 2
    assert await any_client.delete(namespace, keys[2:]) == 0


async def test_stats_health_and_handshake(client: AsyncKVStoreClient) -> None:
    stats = await client.stats()
    assert [tier.name for tier in stats.tiers] == ["host", "ssd"]
    assert stats.tiers[0].capacity_bytes == 32 * 2**20
    assert await client.health() is True
    info = client.server_info
    assert info.chunk_bytes == 64 * 2**10
    assert info.shm_socket.endswith(".sock.shm") and len(info.instance_id) == 16
    assert "shm" in repr(client)


async def test_many_concurrent_puts_and_gets(
    any_client: AsyncKVStoreClient, small_namespace: Namespace
) -> None:
    chains = [chain(small_namespace, 4, seed=seed) for seed in range(16)]
    blocks = [payloads(small_namespace, 4) for _ in chains]

    await asyncio.gather(
        *(any_client.put(small_namespace, k, b) for k, b in zip(chains, blocks, strict=True))
    )
    got = await asyncio.gather(*(any_client.get(small_namespace, k) for k in chains))

    assert got == blocks


async def test_a_long_put_runs_as_a_pipeline_of_batches_copied_in_order(
    daemon: Daemon, namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put cut into batches: each copied into its arena slots after the one before, at most
    four (what the session's window holds) between their Reserve and their Commit's reply at once,
    every status in its place (blocks stored before answer DEDUP from the middle of the
    put)."""
    monkeypatch.setattr(transfer, "MIN_BATCH_BYTES", 1)  # batches of one block
    keys, blocks = chain(namespace, 12), payloads(namespace, 12)
    size = namespace.model.layout().payload_bytes
    async with AsyncKVStoreClient(daemon.address, staging_bytes=4 * size) as client:
        assert (
            await client.put(namespace, keys[5:7], blocks[5:7], parent=keys[4])
            == [WriteStatus.STORED] * 2
        )
        session = await client._conn.session(namespace.tenant)
        assert session is not None
        copied: list[int] = []
        in_flight = most = 0
        write, call = session.writer.write, client._conn.call

        async def spy_copy(slots, sources, stream=None):  # type: ignore[no-untyped-def]
            copied.extend(blocks.index(source) for source in sources)
            return await write(slots, sources, stream)

        async def spy_call(on, method, request, reply):  # type: ignore[no-untyped-def]
            nonlocal in_flight, most
            in_flight += method == "Reserve"
            most = max(most, in_flight)
            answer = None
            try:
                answer = await call(on, method, request, reply)
                return answer
            finally:
                nothing_reserved = method == "Reserve" and not any(
                    r.status == pb.RESERVED for r in getattr(answer, "reservations", ())
                )
                in_flight -= method == "Commit" or nothing_reserved

        monkeypatch.setattr(session.writer, "write", spy_copy)
        monkeypatch.setattr(client._conn, "call", spy_call)
        statuses = await client.put(namespace, keys, blocks)

        assert (
            statuses
            == [WriteStatus.STORED] * 5 + [WriteStatus.DEDUP] * 2 + [WriteStatus.STORED] * 5
        )
        assert copied == [0, 1, 2, 3, 4, 7, 8, 9, 10, 11]
        assert 1 < most <= 4
        assert await client.get(namespace, keys) == blocks


async def test_calls_before_connect_raise(daemon: Daemon, namespace: Namespace) -> None:
    client = AsyncKVStoreClient(daemon.address)
    assert client.data_plane == "stream"
    with pytest.raises(NotConnectedError):
        await client.lookup(namespace, chain(namespace, 1))
    with pytest.raises(NotConnectedError):
        _ = client.server_info
    await client.aclose()  # closing an unconnected client is harmless


async def test_arguments_are_checked_before_any_call(namespace: Namespace) -> None:
    client = AsyncKVStoreClient("unix:/nonexistent.sock")  # never connected: no call is made
    keys = chain(namespace, 2)
    size = namespace.model.layout().payload_bytes

    with pytest.raises(ValueError, match=r"blocks\[1\] must be .* bytes .* got 7"):
        await client.put(namespace, keys, [bytes(size), bytes(7)])
    with pytest.raises(ValueError, match="one block per key: 2 keys, 1 blocks"):
        await client.put(namespace, keys, [bytes(size)])
    with pytest.raises(ValueError, match=r"keys\[0\] must be 32 bytes"):
        await client.put(namespace, [b"short"], [bytes(size)])
    with pytest.raises(ValueError, match=r"parent\[0\] must be 32 bytes"):
        await client.put(namespace, keys, [bytes(size)] * 2, parent=b"x")
    with pytest.raises(ValueError, match="one buffer per key"):
        await client.get(namespace, keys, out=[bytearray(size)])
    with pytest.raises(ValueError, match=r"out\[0\] must be writable"):
        await client.get(namespace, keys, out=[memoryview(bytes(size))] * 2)
    with pytest.raises(ValueError, match=r"keys\[1\] must be 32 bytes"):
        await client.lookup(namespace, [keys[0], b""])
    assert await client.put(namespace, [], []) == []
    assert await client.get(namespace, []) == []
    assert await client.lookup(namespace, []) == 0


@pytest.mark.parametrize(
    ("address", "options"),
    [("localhost", {}), ("unix:/x.sock", {"timeout": 0}), ("unix:/x.sock", {"retries": -1})],
)
def test_bad_client_options_are_refused(address: str, options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AsyncKVStoreClient(address, **options)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_tensors_in_and_out(
    any_client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    model = namespace.model
    shape = model.layout().shape
    keys = chain(namespace, 2)
    blocks = [torch.randn(shape, dtype=torch.float16, device="cuda") for _ in keys]
    await any_client.put(namespace, keys, blocks)

    out = [torch.empty(shape, dtype=torch.float16, device="cuda") for _ in keys]
    await any_client.get(namespace, keys, out=out)

    for sent, received in zip(blocks, out, strict=True):
        assert torch.equal(sent.view(torch.int16), received.view(torch.int16))


async def pinned_client_round_trip(
    daemon: Daemon, namespace: Namespace, device: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Puts two blocks through a client made with ``pin_arena=True``, gets them into tensors
    on ``device`` and views them; the blocks sent and received."""
    model = namespace.model
    shape = model.layout().shape
    keys = chain(namespace, 2)
    blocks = [torch.randn(shape, dtype=torch.float16, device=device) for _ in keys]
    out = [torch.empty(shape, dtype=torch.float16, device=device) for _ in keys]
    async with AsyncKVStoreClient(daemon.address, pin_arena=True) as client:
        assert await client.put(namespace, keys, blocks) == [WriteStatus.STORED] * 2
        assert len(await client.get(namespace, keys, out=out)) == 2
        arena = client._conn.sessions[namespace.tenant].arena
        pinned = arena.pinned
        async with client.view_tensors(namespace, keys) as views:
            views_pinned = [view.is_pinned() for view in views] if pinned else []
    assert not arena.pinned  # unregistered on close
    if device == "cuda":
        assert pinned and views_pinned == [True, True]
    else:
        assert not pinned
    return blocks, out


async def test_pin_arena_without_cuda_maps_unpinned(
    daemon: Daemon, namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is usable here: test_pin_arena_registers_with_cuda covers it")
    blocks, out = await pinned_client_round_trip(daemon, namespace, "cpu")
    for sent, received in zip(blocks, out, strict=True):
        assert torch.equal(sent.view(torch.int16), received.view(torch.int16))
    assert "CUDA" not in caplog.text  # nothing to register: no warning


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_pin_arena_registers_with_cuda(
    daemon: Daemon, namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    blocks, out = await pinned_client_round_trip(daemon, namespace, "cuda")
    for sent, received in zip(blocks, out, strict=True):
        assert torch.equal(sent.view(torch.int16), received.view(torch.int16))
    assert "cannot register" not in caplog.text


def test_a_new_client_connects_at_once_after_the_daemon_came_back(tmp_path: Path) -> None:
    """Clients made during an outage fail; one made right after the restart must not
    inherit their reconnect backoff (gRPC shares subchannels per address by default)."""
    daemon = Daemon(tmp_path)
    try:
        for _ in range(3):  # refused attempts push the shared backoff up
            with pytest.raises(KVStoreError), KVStoreClient(daemon.address, retries=0, timeout=1.0):
                pass
        daemon.start()
        with KVStoreClient(daemon.address, retries=0, timeout=5.0) as client:
            assert client.health()
    finally:
        daemon.close()


@pytest.mark.parametrize("how", ["refused", "missing"])
async def test_a_client_that_cannot_map_says_why_once_and_streams(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """The session socket refuses (as for a user without the rights to it) or is not in
    this process's view: one WARNING naming the socket and the reason, then every call
    streams the right bytes."""
    daemon = Daemon(tmp_path, host_capacity="16MiB")
    daemon.start()
    try:
        session_socket = Path(f"{daemon.socket_path}.shm")
        namespace = Namespace(SMALL, "no-map")
        async with AsyncKVStoreClient(daemon.address) as client:
            await asyncio.to_thread(session_socket.unlink)
            if how == "refused":  # a socket at that path that no one listens on
                socket.socket(socket.AF_UNIX).bind(str(session_socket))
            with caplog.at_level(logging.DEBUG, logger="kvstore.client"):
                for turn in range(3):
                    keys = block_keys(list(range(turn * 100, turn * 100 + 32)), namespace)
                    blocks = [key * (SMALL.layout().payload_bytes // len(key)) for key in keys]
                    await client.put(namespace, keys, blocks)
                    assert await client.get(namespace, keys) == blocks
                assert client.data_plane == ("stream" if how == "missing" else "shm")
        said = [r for r in caplog.records if "cannot map the daemon's shared memory" in r.message]
        warnings = [r for r in said if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.message for r in said]
        assert str(session_socket) in warnings[0].message
        reason = "Connection refused" if how == "refused" else "no such file"
        assert reason in warnings[0].message
        assert len(said) >= 3  # tried again on later calls (a restart heals), quietly
    finally:
        daemon.close()
