"""Fixtures of the client tests: one real daemon per module, a fresh namespace per test."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator

import pytest

from kvstore.client import AsyncKVStoreClient, ModelFingerprint, Namespace
from tests.support.daemon import Daemon

# 4 layers x 2 x 4 kv heads x 64 tokens x 128 head dim x fp16 = 512 KiB per block: two blocks
# take the client's threaded copy path, and a block spans several 64 KiB streamed chunks.
MODEL = ModelFingerprint("test-llama", 4, 4, 128, "float16", block_tokens=64)
SMALL = ModelFingerprint("test-tiny", 2, 2, 16, "float16", block_tokens=16)  # 8 KiB blocks
_tenants = itertools.count()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon shared by a test module: 32 MiB arena, SSD, 64 KiB streamed chunks."""
    daemon = Daemon(
        tmp_path_factory.mktemp("daemon"),
        host_capacity="32MiB",
        settings={"server": {"chunk_bytes": "64KiB"}},
    )
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.close()


@pytest.fixture
def namespace() -> Namespace:
    """A namespace no other test uses (its own tenant), so tests share the daemon safely."""
    return Namespace(MODEL, f"tenant-{next(_tenants)}")


@pytest.fixture
def small_namespace() -> Namespace:
    return Namespace(SMALL, f"tenant-{next(_tenants)}")


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[AsyncKVStoreClient]:
    async with AsyncKVStoreClient(daemon.address) as client:
        assert client.data_plane == "shm"
        yield client


@pytest.fixture
async def stream_client(daemon: Daemon) -> AsyncIterator[AsyncKVStoreClient]:
    async with AsyncKVStoreClient(daemon.address, use_shm=False) as client:
        assert client.data_plane == "stream"
        yield client


@pytest.fixture(params=["shm", "stream"])
async def any_client(
    request: pytest.FixtureRequest, daemon: Daemon
) -> AsyncIterator[AsyncKVStoreClient]:
    """The client on each data plane in turn."""
    async with AsyncKVStoreClient(daemon.address, use_shm=request.param == "shm") as client:
        assert client.data_plane == request.param
        yield client
