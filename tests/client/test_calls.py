"""A hit in one round trip: ``find`` (a Lookup that leases what is in host memory) and the
read path's calls on the shm session's own sockets, against a real daemon.

Faults are real: a daemon stopped mid-call (SIGSTOP, a hung peer), killed and restarted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvstore.client import (
    AsyncKVStoreClient,
    DeadlineExceededError,
    KVStoreClient,
    ModelFingerprint,
    Namespace,
    block_keys,
)
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from tests.support.daemon import Daemon, rpcs, running_daemon, scrape
from tests.support.net import free_port
from tests.support.waiting import wait_for

SMALL = ModelFingerprint("test-calls", 2, 2, 16, "float16", block_tokens=16)  # 8 KiB blocks


def chain(namespace: Namespace, count: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    tokens = [seed * 1009 + i for i in range(count * namespace.model.block_tokens)]
    size = namespace.model.layout().payload_bytes
    return block_keys(tokens, namespace), [os.urandom(size) for _ in range(count)]


async def leases(client: AsyncKVStoreClient) -> int:
    return (await client.stats()).active_leases


async def test_find_leases_the_leading_blocks_in_host_memory(
    client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 3)
    await client.put(namespace, keys, blocks)
    missing = block_keys(list(range(999, 999 + 64)), namespace)
    found = await client.find(namespace, [*keys, *missing])
    assert (found.num_blocks, found.tiers, found.num_leased) == (3, ("host",) * 3, 3)
    held = found.host_blocks()
    size = namespace.model.layout().payload_bytes
    got = [bytes(held.source[at : at + size].numpy()) for at in held.offsets]
    assert got == blocks
    assert await leases(client) == 1
    await client.release(found)
    async with asyncio.timeout(10.0):  # the Release goes out in the background
        while await leases(client):  # noqa: ASYNC110  # the daemon's count: no event to await
            await asyncio.sleep(0.01)
    assert (await client.find(namespace, missing)).lease is None  # a miss leases nothing


async def test_find_reports_blocks_below_host_memory_and_leaves_them_there(
    client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    """The arena is 32 MiB: 64 more blocks push a chain's blocks down to the SSD. ``find``
    says where they are and leases none (nothing is promoted on the lookup's path); an
    Acquire of them (``host_blocks``) moves them up."""
    keys, blocks = chain(namespace, 2)
    await client.put(namespace, keys, blocks)
    others, filler = chain(namespace, 64, seed=1)
    await client.put(namespace, others, filler)
    found = await client.find(namespace, keys)
    assert (found.num_blocks, found.tiers, found.lease) == (2, ("ssd", "ssd"), None)
    assert (await client.lookup_tiers(namespace, keys)).tiers == ("ssd", "ssd")  # not moved
    async with client.host_blocks(namespace, keys) as held:
        assert len(held) == 2
    assert (await client.lookup_tiers(namespace, keys)).tiers == ("host", "host")


async def test_a_lease_id_in_use_is_refused_and_nothing_more_is_leased(
    client: AsyncKVStoreClient, namespace: Namespace
) -> None:
    keys, blocks = chain(namespace, 2)
    await client.put(namespace, keys, blocks)
    found = await client.find(namespace, keys)
    assert found.lease is not None
    digest = await client.register(namespace)
    session = client._conn.sessions[namespace.tenant]
    again = pb.LookupRequest(namespace=digest, keys=keys, lease_id=found.lease.lease_id)
    with pytest.raises(Exception, match="lease"):
        await client._conn.call(session, "Lookup", again, pb.LookupResponse)
    assert await leases(client) == 1
    await client.release(found)


def test_the_blocking_client_finds_on_a_connection_of_its_own(
    daemon: Daemon, namespace: Namespace
) -> None:
    """From the caller's thread: no crossing to the client's loop. Its Lookups are counted
    by the daemon like any other (here: the sessions' calls, per method)."""
    keys, blocks = chain(namespace, 2)
    with KVStoreClient(daemon.address) as client:
        client.put(namespace, keys, blocks)
        assert client.open_session(namespace)
        session = client._client._conn.sessions[namespace.tenant]
        assert session.blocking_calls(1.0) is not None
        loop_thread = client._thread
        seen: list[threading.Thread] = []
        call = session.blocking_calls(1.0)
        assert call is not None
        real = call.call

        def spied(*args: object) -> object:
            seen.append(threading.current_thread())
            return real(*args)  # type: ignore[arg-type]

        call.call = spied  # type: ignore[method-assign]
        found = client.find(namespace, keys)
        assert found.num_leased == 2 and seen == [threading.current_thread()] != [loop_thread]
        client.release(found)


def test_a_hung_daemon_costs_a_find_its_timeout_then_the_lease_goes(tmp_path: Path) -> None:
    """SIGSTOP: the daemon reads nothing. ``find`` gives up after the client's timeout (once,
    not once per path), and once the daemon runs again the lease it may have granted is
    released (the client named it before the call)."""
    namespace = Namespace(SMALL, "hung")
    keys, blocks = chain(namespace, 2)
    port = free_port()
    metrics = {"metrics": {"listen": f"127.0.0.1:{port}"}}
    with (
        running_daemon(tmp_path, settings=metrics) as daemon,
        KVStoreClient(daemon.address, timeout=5.0, retries=0) as client,
    ):
        client.put(namespace, keys, blocks)
        client.open_session(namespace)
        client.timeout = 0.5
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(DeadlineExceededError):
                client.find(namespace, keys)
            waited = time.monotonic() - started
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert waited < 10 * client.timeout  # one timeout, not a retry per path
        client.timeout = 5.0
        wait_for(lambda: client.stats().active_leases == 0, timeout=10.0)
        found = client.find(namespace, keys)  # its calls connection is opened again
        assert found.num_leased == 2
        client.release(found)
        calls = rpcs(scrape(port))  # the session sockets' calls are counted as gRPC's are
        assert calls["Lookup"] >= 2 and calls["Release"] >= 1, calls


@pytest.mark.parametrize("graceful", [True, False])
def test_find_meets_a_restarted_daemon_like_every_call(tmp_path: Path, graceful: bool) -> None:
    """The session's sockets end with the daemon: the next find shakes hands again,
    re-registers, opens a new session and finds what the new daemon holds."""
    namespace = Namespace(SMALL, "restart")
    keys, blocks = chain(namespace, 3)
    with running_daemon(tmp_path) as daemon, KVStoreClient(daemon.address) as client:
        client.put(namespace, keys, blocks)
        first = client.find(namespace, keys)
        assert first.num_leased == 3
        daemon.restart(graceful=graceful)
        client.release(first)  # its daemon is gone: nothing to end, nothing raised
        found = client.find(namespace, keys)
        if graceful:  # SIGTERM flushed to the SSD: found there, read up into host memory
            assert (found.num_blocks, found.tiers, found.lease) == (3, ("ssd",) * 3, None)
            assert client.get(namespace, keys) == blocks
        else:  # SIGKILL lost host memory
            assert found.num_blocks == 0
            client.put(namespace, keys, blocks)
        again = client.find(namespace, keys)
        assert again.num_leased == 3
        client.release(again)


def test_a_find_of_many_blocks_is_one_call(daemon: Daemon) -> None:
    namespace = Namespace(SMALL, "many")
    keys, blocks = chain(namespace, 40)
    with KVStoreClient(daemon.address) as client:
        client.put(namespace, keys, blocks)
        found = client.find(namespace, keys)
        assert found.num_leased == found.num_blocks == 40
        client.release(found)
