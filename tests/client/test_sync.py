"""The blocking client: the async client's methods run on a private event-loop thread."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvstore.client import (
    AsyncKVStoreClient,
    KVStoreClient,
    KVStoreError,
    LookupResult,
    Namespace,
    NotConnectedError,
    WriteStatus,
    block_keys,
)
from tests.support.daemon import Daemon


def keys_and_blocks(namespace: Namespace, count: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    tokens = [seed * 7919 + i for i in range(count * namespace.model.block_tokens)]
    size = namespace.model.layout().payload_bytes
    return block_keys(tokens, namespace), [os.urandom(size) for _ in range(count)]


@pytest.mark.parametrize("use_shm", [True, False])
def test_the_blocking_client_does_what_the_async_one_does(
    daemon: Daemon, namespace: Namespace, use_shm: bool
) -> None:
    keys, blocks = keys_and_blocks(namespace, 3, seed=1)
    with KVStoreClient(daemon.address, use_shm=use_shm) as client:
        assert client.data_plane == ("shm" if use_shm else "stream")
        assert client.health()
        assert client.lookup(namespace, keys) == 0
        assert client.put(namespace, keys[:2], blocks[:2]) == [WriteStatus.STORED] * 2
        assert client.lookup_tiers(namespace, keys) == LookupResult(2, (("host", 2),))
        assert client.get(namespace, keys) == blocks[:2]

        out = [torch.empty(len(blocks[0]), dtype=torch.uint8) for _ in keys]
        assert len(client.get(namespace, keys, out=out)) == 2
        assert bytes(out[1].numpy()) == blocks[1]
        with client.view(namespace, keys) as views:
            assert [bytes(view) for view in views] == blocks[:2]
        with client.view_tensors(namespace, keys) as tensors:
            assert bytes(tensors[0].numpy()) == blocks[0]
        assert client.stats().active_leases == 0
        assert client.delete(namespace, keys[1:2]) == 1
        assert client.prefetch("s", namespace, [keys]) >= 0
        assert client.server_info.chunk_bytes > 0
        assert "KVStoreClient" in repr(client)


def test_errors_keep_their_classes_and_views_end_on_errors(
    daemon: Daemon, namespace: Namespace
) -> None:
    keys, blocks = keys_and_blocks(namespace, 1, seed=2)
    with KVStoreClient(daemon.address) as client:
        client.put(namespace, keys, blocks)
        with pytest.raises(ValueError, match=r"blocks\[0\] must be"):
            client.put(namespace, keys, [b"short"])
        with pytest.raises(KeyError), client.view(namespace, keys):
            raise KeyError("inside")
        assert client.stats().active_leases == 0


def test_threads_may_share_one_client(daemon: Daemon, small_namespace: Namespace) -> None:
    with KVStoreClient(daemon.address) as client:

        def round_trip(seed: int) -> bool:
            keys, blocks = keys_and_blocks(small_namespace, 2, seed)
            client.put(small_namespace, keys, blocks)
            return client.get(small_namespace, keys) == blocks

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(round_trip, range(32)))


def test_close_is_idempotent_and_ends_the_thread(daemon: Daemon, namespace: Namespace) -> None:
    client = KVStoreClient(daemon.address)
    client.connect()
    thread = client._thread
    client.close()
    client.close()

    assert not thread.is_alive()
    with pytest.raises(NotConnectedError, match="closed"):
        client.stats()


def test_a_with_block_that_cannot_connect_leaves_no_thread(tmp_path: Path) -> None:
    """``with KVStoreClient(...)`` against a daemon that is not there raises, and the
    client's loop thread ends with it: no one holds a client to close."""
    address = Daemon(tmp_path).address  # never started
    before = set(threading.enumerate())
    for _ in range(3):
        with pytest.raises(KVStoreError), KVStoreClient(address, retries=0, timeout=1.0):
            pass
    left = [t.name for t in set(threading.enumerate()) - before]
    assert [name for name in left if name.startswith("kvstore-client")] == []


def test_close_from_another_thread_ends_the_calls_in_flight(
    tmp_path: Path, namespace: Namespace
) -> None:
    """Two threads share a client (vLLM's load and save threads share one); one closes it
    while the other's call sleeps between retries. That call ends at once, as a
    NotConnectedError; it used to wait forever on the stopped loop."""
    daemon = Daemon(tmp_path)
    daemon.start()
    client = KVStoreClient(daemon.address, retries=50, timeout=1.0)
    client.connect()
    daemon.kill()  # the lookup below retries, sleeping up to 2 s between attempts
    outcome: list[BaseException] = []

    def look_up() -> None:
        try:
            client.lookup(namespace, keys_and_blocks(namespace, 2, seed=9)[0])
        except BaseException as error:
            outcome.append(error)

    caller = threading.Thread(target=look_up, daemon=True)
    caller.start()
    try:
        time.sleep(1.0)  # several attempts failed: the call is in a backoff sleep now
        assert caller.is_alive() and not outcome
        client.close()
        caller.join(5.0)
        assert not caller.is_alive(), "the call waits on a stopped loop"
        assert len(outcome) == 1 and isinstance(outcome[0], NotConnectedError), outcome
        assert "closed during the call" in str(outcome[0])
    finally:
        client.close()
        daemon.close()


def test_a_method_called_on_the_loop_thread_is_refused(daemon: Daemon) -> None:
    with KVStoreClient(daemon.address) as client:

        async def call_blocking() -> None:
            assert threading.current_thread() is client._thread
            client.stats()

        async def close_blocking() -> None:
            client.close()

        for blocking in (call_blocking, close_blocking):
            future = asyncio.run_coroutine_threadsafe(blocking(), client._loop)
            with pytest.raises(RuntimeError, match="its own event loop"):
                future.result(timeout=10)
        assert client.stats().version  # the refused close closed nothing


def test_the_blocking_methods_are_the_async_ones() -> None:
    for name in ("get", "put", "lookup", "view", "register", "health"):
        assert getattr(KVStoreClient, name).__doc__ == getattr(AsyncKVStoreClient, name).__doc__
