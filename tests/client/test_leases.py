"""Leases never stranded: a get cancelled or timed out at any point leaves no lease behind.

The daemon runs in this process (``create_server`` on a unix socket) with a lease lifetime of
a minute, so a lease that comes back to zero within a second was released, not expired. The
points a get can be interrupted at: before the Acquire reply arrives (the daemon still
promoting), after the daemon granted it but before the reply reached the client, during the
copy, and during the final Release.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.client import (
    AsyncKVStoreClient,
    DeadlineExceededError,
    ModelFingerprint,
    Namespace,
    UnknownLeaseError,
    block_keys,
    transfer,
)
from kvstore.config import Config, HostConfig, ServerConfig, SsdConfig
from kvstore.server import RunningServer, create_server
from kvstore.store import BlockStore

MODEL = ModelFingerprint("lease-test", 4, 4, 128, "float16", block_tokens=64)  # 512 KiB blocks
BLOCK = MODEL.layout().payload_bytes


@dataclass
class Daemon:
    store: BlockStore
    running: RunningServer

    @property
    def address(self) -> str:
        return self.running.addresses[0]

    async def leases_drain(self, within: float = 2.0) -> int:
        """Active leases after waiting up to ``within`` seconds for them to reach zero."""
        for _ in range(int(within / 0.02)):
            if self.store.stats().active_leases == 0:
                break
            await asyncio.sleep(0.02)
        return self.store.stats().active_leases


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    sockets = Path(tempfile.mkdtemp(prefix="kvs-"))
    config = Config(
        host=HostConfig(capacity=32 << 20),
        ssd=SsdConfig(directory=str(tmp_path / "ssd"), capacity=256 << 20, fsync=False),
        server=ServerConfig(listen=(f"unix:{sockets}/kv.sock",), lease_ttl=60.0),
    )
    store = BlockStore.from_config(config)
    await store.start()
    running = await create_server(config, store)
    try:
        yield Daemon(store, running)
    finally:
        await running.stop(0.5)
        await store.aclose()


def slow_releases(
    client: AsyncKVStoreClient, monkeypatch: pytest.MonkeyPatch, delay: float
) -> asyncio.Event:
    """Makes each Release of ``client`` start ``delay`` seconds late; the event is set when
    one is about to wait."""
    conn = client._conn
    real = conn.call  # the read path's calls, over the session socket or gRPC
    releasing = asyncio.Event()

    async def slow_release(session: object, method: str, *args: object) -> object:
        if method == "Release":
            releasing.set()
            await asyncio.sleep(delay)
        return await real(session, method, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(conn, "call", slow_release)
    return releasing


def leases_alive_for(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Makes the client believe each lease it is granted holds for ``seconds`` only."""
    acquire = transfer.acquire

    async def short_lease(*args: object, **kwargs: object) -> transfer.Leased:
        leased = await acquire(*args, **kwargs)  # type: ignore[arg-type]
        return dataclasses.replace(leased, alive_until=time.monotonic() + seconds)

    monkeypatch.setattr(transfer, "acquire", short_lease)


def chain(namespace: Namespace, count: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(seed)
    tokens = [rng.randrange(32000) for _ in range(count * MODEL.block_tokens)]
    keys = block_keys(tokens, namespace)
    return keys, [os.urandom(BLOCK) for _ in keys]


async def test_gets_cancelled_at_random_moments_leave_no_lease(daemon: Daemon) -> None:
    namespace = Namespace(MODEL, "random")
    keys, blocks = chain(namespace, 8)
    async with AsyncKVStoreClient(daemon.address) as client:
        await client.put(namespace, keys, blocks)
        rng = random.Random(7)
        cancelled = 0
        for _ in range(40):
            task = asyncio.create_task(client.get(namespace, keys))
            await asyncio.sleep(rng.uniform(0, 0.004))
            if not task.cancel():
                assert await task == blocks  # it finished first
                continue
            cancelled += 1
            with pytest.raises(asyncio.CancelledError):
                await task
        assert cancelled >= 10
        assert await daemon.leases_drain() == 0
        assert await client.get(namespace, keys) == blocks


async def test_a_get_within_its_lease_returns_before_the_release_and_still_releases(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One round trip a read: the Release goes out in the background."""
    namespace = Namespace(MODEL, "background")
    keys, blocks = chain(namespace, 2)
    async with AsyncKVStoreClient(daemon.address) as client:
        await client.put(namespace, keys, blocks)
        slow_releases(client, monkeypatch, 0.3)
        assert await client.get(namespace, keys) == blocks
        assert daemon.store.stats().active_leases == 1  # its Release is still on the way
        assert await daemon.leases_drain() == 0


async def test_a_read_past_its_lease_waits_for_the_release_and_says_it_expired(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace = Namespace(MODEL, "expired")
    keys, blocks = chain(namespace, 2)
    async with AsyncKVStoreClient(daemon.address) as client:
        await client.put(namespace, keys, blocks)
        leases_alive_for(monkeypatch, 0.05)
        with pytest.raises(UnknownLeaseError):
            async with client.view(namespace, keys) as views:
                assert [bytes(view) for view in views] == blocks
                await asyncio.sleep(0.1)  # past what the client knows of the lease ...
                await daemon.store.maintain(time.monotonic() + 120)  # ... the daemon ends it
        assert daemon.store.stats().active_leases == 0


async def test_a_get_cancelled_during_its_release_still_releases(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read past its lease's sure lifetime awaits the Release: cancelled then, it still
    releases."""
    namespace = Namespace(MODEL, "release")
    keys, blocks = chain(namespace, 2)
    async with AsyncKVStoreClient(daemon.address) as client:
        await client.put(namespace, keys, blocks)
        leases_alive_for(monkeypatch, 0.0)
        releasing = slow_releases(client, monkeypatch, 0.2)  # the caller is cancelled meanwhile
        task = asyncio.create_task(client.get(namespace, keys))
        await releasing.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await daemon.leases_drain() == 0


async def test_an_acquire_whose_reply_never_arrives_is_released_by_its_id(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace = Namespace(MODEL, "lost")
    keys, blocks = chain(namespace, 2)
    async with AsyncKVStoreClient(daemon.address) as client:
        await client.put(namespace, keys, blocks)
        conn = client._conn
        real = conn.call
        granted: list[int] = []

        async def lost_reply(session: object, method: str, *args: object) -> object:
            reply = await real(session, method, *args)  # type: ignore[arg-type]
            if method == "Acquire":
                granted.append(reply.lease_id)  # type: ignore[attr-defined]
                raise asyncio.CancelledError  # as if the caller gave up just before the reply
            return reply

        monkeypatch.setattr(conn, "call", lost_reply)
        with pytest.raises(asyncio.CancelledError):
            await client.get(namespace, keys)
        assert len(granted) == 1 and daemon.store.stats().active_leases <= 1
        monkeypatch.setattr(conn, "call", real)
        assert await daemon.leases_drain() == 0


async def test_a_timed_out_acquire_is_released_when_the_daemon_finishes_it(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace = Namespace(MODEL, "slow")
    keys, blocks = chain(namespace, 2)
    async with AsyncKVStoreClient(daemon.address, timeout=0.2, retries=0) as client:
        await client.put(namespace, keys, blocks)
        real = daemon.store.acquire

        async def slow_acquire(*args: object, **kwargs: object) -> object:
            await asyncio.sleep(0.5)  # promoting from SSD, longer than the client waits
            return await real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(daemon.store, "acquire", slow_acquire)
        with pytest.raises(DeadlineExceededError):
            await client.get(namespace, keys)
        await asyncio.sleep(0.7)  # the daemon's acquire ends after the client gave up
        assert await daemon.leases_drain() == 0


async def test_a_release_that_overtakes_its_acquire_leaves_nothing(daemon: Daemon) -> None:
    namespace = Namespace(MODEL, "overtake")
    keys, blocks = chain(namespace, 2)
    async with AsyncKVStoreClient(daemon.address) as client:
        await client.put(namespace, keys, blocks)
        session = await client._conn.session(namespace.tenant)
        assert session is not None
        digest = await client.register(namespace)
        lease_id = transfer.new_lease_id()
        await client._conn.release_quietly(lease_id)  # arrives before the Acquire
        from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb

        request = pb.AcquireRequest(namespace=digest, keys=keys, lease_id=lease_id)
        reply = await client._conn.unary("Acquire", request, pb.AcquireResponse)
        assert list(reply.slots) == []  # granted nothing: its caller already gave up
        assert daemon.store.stats().active_leases == 0
