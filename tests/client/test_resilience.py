"""Failures: retries of idempotent calls only, daemon restarts, tokens, TLS.

Channel failures are injected by a stub wrapper, and on shm session sockets by a wrapper of
their calls (the only mocks here); restarts are real.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.client import (
    AsyncKVStoreClient,
    DeadlineExceededError,
    InvalidArgumentError,
    ModelFingerprint,
    Namespace,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    WriteStatus,
    block_keys,
)
from kvstore.client import connection as connection_module
from kvstore.client.calls import SessionCalls
from tests.support.daemon import Daemon, running_daemon
from tests.support.net import free_port, self_signed

SMALL = ModelFingerprint("test-tiny", 2, 2, 16, "float16", block_tokens=16)  # 8 KiB blocks


class FlakyStub:
    """Delegates to the real stub; the first ``failures[method]`` calls fail with ``code``."""

    def __init__(self, stub: object, failures: dict[str, int], code: grpc.StatusCode) -> None:
        self._stub, self._failures, self._code = stub, dict(failures), code
        self.calls: Counter[str] = Counter()

    def __getattr__(self, method: str) -> Callable[..., object]:
        real = getattr(self._stub, method)

        def call(*args: object, **kwargs: object) -> object:
            self.calls[method] += 1
            if self._failures.get(method, 0) > 0:
                self._failures[method] -= 1
                raise grpc.aio.AioRpcError(
                    self._code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="injected"
                )
            return real(*args, **kwargs)

        return call


def flaky(
    client: AsyncKVStoreClient,
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
    **failures: int,
) -> FlakyStub:
    stub = FlakyStub(client._conn.stub, failures, code)
    client._conn._stub = stub  # type: ignore[assignment]
    return stub


def flaky_session_calls(monkeypatch: pytest.MonkeyPatch, **failures: int) -> Counter[str]:
    """The first ``failures[method]`` calls on shm session sockets fail as a connection that
    went away does (UNAVAILABLE); returns the calls made, per method."""
    real, calls, left = SessionCalls.call, Counter[str](), dict(failures)

    async def call(self: SessionCalls, method: str, *args: Any) -> Any:
        calls[method] += 1
        if left.get(method, 0) > 0:
            left[method] -= 1
            raise UnavailableError("injected", method=method)
        return await real(self, method, *args)

    monkeypatch.setattr(SessionCalls, "call", call)
    return calls


def chain(namespace: Namespace, count: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    tokens = [seed * 1009 + i for i in range(count * namespace.model.block_tokens)]
    size = namespace.model.layout().payload_bytes
    return block_keys(tokens, namespace), [os.urandom(size) for _ in range(count)]


@pytest.fixture
def delays(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The backoff delays the client asks for (not slept: the tests stay fast). This patches
    ``asyncio.sleep`` itself for the test: such tests must not sleep otherwise."""
    asked: list[float] = []
    real_sleep = connection_module.asyncio.sleep

    async def sleep(delay: float) -> None:
        asked.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(connection_module.asyncio, "sleep", sleep)
    return asked


# Retries -------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
async def test_idempotent_calls_are_retried_with_growing_jittered_delays(
    client: AsyncKVStoreClient,
    small_namespace: Namespace,
    delays: list[float],
    code: grpc.StatusCode,
) -> None:
    keys, blocks = chain(small_namespace, 2)
    await client.put(small_namespace, keys, blocks)
    stub = flaky(client, code, Lookup=3, Stats=1, Delete=1, Prefetch=1)

    assert await client.lookup(small_namespace, keys) == 2
    await client.stats()
    await client.prefetch("s", small_namespace, [keys])
    assert await client.delete(small_namespace, keys[1:]) == 1

    assert stub.calls["Lookup"] == 4
    assert (stub.calls["Stats"], stub.calls["Prefetch"], stub.calls["Delete"]) == (2, 2, 2)
    base, cap = connection_module.BACKOFF_BASE, connection_module.BACKOFF_CAP
    for attempt, delay in enumerate(delays[:3]):
        assert base * 2**attempt / 2 <= delay <= min(cap, base * 2**attempt)


async def test_retries_are_bounded(
    client: AsyncKVStoreClient, small_namespace: Namespace, delays: list[float]
) -> None:
    keys, _ = chain(small_namespace, 1)
    await client.register(small_namespace)
    stub = flaky(client, Lookup=100)

    with pytest.raises(UnavailableError, match="injected") as raised:
        await client.lookup(small_namespace, keys)

    assert stub.calls["Lookup"] == 1 + 3  # the default retries
    assert raised.value.method == "Lookup"
    assert len(delays) == 3


async def test_errors_other_than_transient_are_not_retried(
    client: AsyncKVStoreClient, small_namespace: Namespace
) -> None:
    keys, _ = chain(small_namespace, 1)
    await client.register(small_namespace)
    stub = flaky(client, grpc.StatusCode.INVALID_ARGUMENT, Lookup=1)

    with pytest.raises(InvalidArgumentError):
        await client.lookup(small_namespace, keys)
    assert stub.calls["Lookup"] == 1


@pytest.mark.parametrize("method", ["Reserve", "Commit"])
async def test_shm_writes_are_never_retried_and_leave_nothing_behind(
    client: AsyncKVStoreClient,
    small_namespace: Namespace,
    delays: list[float],
    method: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, blocks = chain(small_namespace, 2)
    await client.register(small_namespace)
    calls = flaky_session_calls(monkeypatch, **{method: 1})  # the shm plane's writes go there

    with pytest.raises(UnavailableError):
        await client.put(small_namespace, keys, blocks)

    assert calls[method] == 1 and delays == []
    assert calls["Commit"] == (1 if method == "Commit" else 0)
    assert calls["Abort"] == 1  # what the failed call may have left is freed at once
    assert await client.lookup(small_namespace, keys) == 0
    stats = await client.stats()
    assert (stats.active_reservations, stats.active_leases) == (0, 0)  # aborted
    assert await client.put(small_namespace, keys, blocks) == [WriteStatus.STORED] * 2


async def test_a_streamed_put_is_never_retried(
    stream_client: AsyncKVStoreClient, small_namespace: Namespace, delays: list[float]
) -> None:
    keys, blocks = chain(small_namespace, 2)
    await stream_client.register(small_namespace)
    stub = flaky(stream_client, grpc.StatusCode.DEADLINE_EXCEEDED, Put=1)

    with pytest.raises(DeadlineExceededError):
        await stream_client.put(small_namespace, keys, blocks)
    assert stub.calls["Put"] == 1 and delays == []


async def test_an_acquire_is_never_retried_but_the_get_stream_is(
    daemon: Daemon,
    client: AsyncKVStoreClient,
    small_namespace: Namespace,
    delays: list[float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, blocks = chain(small_namespace, 2)
    await client.put(small_namespace, keys, blocks)
    calls = flaky_session_calls(monkeypatch, Acquire=1)  # the shm plane's Acquire goes there
    with pytest.raises(UnavailableError):
        await client.get(small_namespace, keys)
    assert calls["Acquire"] == 1
    assert await client.get(small_namespace, keys) == blocks  # the next call works

    async with AsyncKVStoreClient(daemon.address, use_shm=False) as streamer:
        stub = flaky(streamer, Get=2)
        assert await streamer.get(small_namespace, keys) == blocks
        assert stub.calls["Get"] == 3


# Restarts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("graceful", "use_shm"), [(True, True), (False, True), (True, False)])
async def test_a_restarted_daemon_is_met_transparently(
    tmp_path: Path, graceful: bool, use_shm: bool
) -> None:
    namespace = Namespace(SMALL, "restart")
    keys, blocks = chain(namespace, 3)
    with running_daemon(tmp_path) as daemon:
        async with AsyncKVStoreClient(daemon.address, use_shm=use_shm) as client:
            await client.put(namespace, keys, blocks)
            instance = client.server_info.instance_id

            daemon.restart(graceful=graceful)  # a new process: namespaces and arena are new

            # SIGTERM flushes write-back blocks to the SSD; SIGKILL loses the host tier.
            held = 3 if graceful else 0
            assert await client.lookup(namespace, keys) == held
            assert await client.get(namespace, keys) == blocks[:held]
            assert client.server_info.instance_id != instance
            assert client.data_plane == ("shm" if use_shm else "stream")
            statuses = await client.put(namespace, keys, blocks)
            assert statuses == [WriteStatus.DEDUP if graceful else WriteStatus.STORED] * 3
            assert await client.get(namespace, keys) == blocks


async def test_after_a_restart_slots_are_never_read_from_the_old_arena(tmp_path: Path) -> None:
    namespace = Namespace(SMALL, "stale")
    keys, blocks = chain(namespace, 2)
    others, other_blocks = chain(namespace, 4, seed=5)
    with running_daemon(tmp_path, ssd_capacity=None) as daemon:
        async with AsyncKVStoreClient(daemon.address) as idle:
            await idle.put(namespace, keys, blocks)
            old = idle.server_info.instance_id
            daemon.restart()
            # Another client registers the namespace first and fills the new arena so that
            # the same keys land at other offsets: the idle client never sees NOT_FOUND.
            async with AsyncKVStoreClient(daemon.address) as fresh:
                await fresh.put(namespace, others, other_blocks)
                await fresh.put(namespace, keys, blocks)
                assert fresh.server_info.instance_id != old

            assert await idle.get(namespace, keys) == blocks
            async with idle.view(namespace, keys) as views:
                assert [bytes(view) for view in views] == blocks
            assert idle.server_info.instance_id != old


async def test_a_stopped_daemon_is_unavailable_and_health_says_so(tmp_path: Path) -> None:
    namespace = Namespace(SMALL, "down")
    keys, _ = chain(namespace, 1)
    with running_daemon(tmp_path) as daemon:
        async with AsyncKVStoreClient(daemon.address, timeout=2.0) as client:
            assert await client.health()
            daemon.stop()
            assert not await client.health()
            with pytest.raises(UnavailableError):
                await client.lookup(namespace, keys)
            daemon.start()
            for _ in range(50):  # the channel reconnects within its 2 s backoff
                if await client.health():
                    break
                await asyncio.sleep(0.1)
            assert await client.health()
            assert await client.lookup(namespace, keys) == 0


# Tokens and TLS ------------------------------------------------------------------------------


async def test_tokens_authenticate_and_scope_tenants(tmp_path: Path) -> None:
    alice, bob = Namespace(SMALL, "alice"), Namespace(SMALL, "bob")
    keys, blocks = chain(alice, 2)
    with running_daemon(tmp_path, tokens=["tok-a:alice", "tok-b:bob"]) as daemon:
        for token in (None, "wrong"):
            with pytest.raises(UnauthenticatedError):
                await AsyncKVStoreClient(daemon.address, token=token).connect()

        async with AsyncKVStoreClient(daemon.address, token="tok-a") as client:
            assert await client.put(alice, keys, blocks) == [WriteStatus.STORED] * 2
            assert await client.get(alice, keys) == blocks
            with pytest.raises(PermissionDeniedError):
                await client.register(bob)
        async with AsyncKVStoreClient(daemon.address, token="tok-b") as other:
            with pytest.raises(PermissionDeniedError):
                await other.lookup(alice, keys)
            assert await other.lookup(bob, block_keys(range(32), bob)) == 0
        unauthenticated = AsyncKVStoreClient(daemon.address, token="tok-a")
        await unauthenticated.connect()
        unauthenticated._conn.metadata = None  # the daemon must check every call
        with pytest.raises(UnauthenticatedError):
            await unauthenticated.stats()
        assert await unauthenticated.health()  # probes need no token
        await unauthenticated.aclose()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_over_tcp_streams_with_a_token(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    address = f"localhost:{free_port()}"
    namespace = Namespace(SMALL, "tls")
    keys, blocks = chain(namespace, 2)
    settings = {"server": {"tls_cert": str(cert), "tls_key": str(key)}}
    with running_daemon(tmp_path / "d", tokens=["tok:tls"], tcp=[address], settings=settings):
        async with AsyncKVStoreClient(
            address, token="tok", tls_root_cert=cert.read_bytes(), use_shm=False
        ) as client:
            assert client.data_plane == "stream"
            assert await client.put(namespace, keys, blocks) == [WriteStatus.STORED] * 2
            assert await client.get(namespace, keys) == blocks
