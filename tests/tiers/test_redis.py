"""Redis tier scenarios beyond the contract: batches, TTL, two nodes, Redis down and back.

A real redis-server process (session fixture); tests that stop it start it again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

import pytest
from redis.asyncio import Redis

from kvstore.tiers import BlobTooLargeError, InvalidKeyError, InvalidRangeError, TierClosedError
from kvstore.tiers.redis import RedisTier

KIB = 1024

pytestmark = pytest.mark.redis


class RedisServer(Protocol):
    """The session's redis-server process (see ``tests/conftest.py``)."""

    url: str
    proc: subprocess.Popen[bytes] | None

    def start(self) -> None: ...

    def stop(self) -> None: ...


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like a block key


def fast_tier(url: str) -> RedisTier:
    """A tier that gives up on Redis quickly and probes it again soon."""
    return RedisTier(url, 64 * KIB, timeout_s=0.2, retry_interval_s=0.1)


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[Redis]:
    """A plain client on the same server, playing "another node" or an operator."""
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def server(redis_url: str, redis_server: RedisServer) -> Iterator[RedisServer]:
    """The running server, for tests that stop it; it runs again when the test ends."""
    yield redis_server
    if redis_server.proc is not None:
        redis_server.proc.send_signal(signal.SIGCONT)
    else:
        redis_server.start()


async def test_pipelined_batch_round_trip(redis_url: str, raw: Redis) -> None:
    blobs = {key(i): os.urandom(1000 + i) for i in range(20)}
    async with RedisTier(redis_url, 1024 * KIB, key_prefix="batch") as tier:
        assert await tier.put_many(list(blobs.items())) == [True] * 20
        probe = [key(3), key(99), key(19)]
        assert await tier.get_many(probe) == [blobs[key(3)], None, blobs[key(19)]]
        assert await tier.contains_many(probe) == [True, False, True]
        assert sorted(tier.keys()) == sorted(blobs)
        assert tier.usage() == sum(len(b"batch:") + 32 + len(b) for b in blobs.values())
        assert await raw.get(b"batch:" + key(7)) == blobs[key(7)]


async def test_batch_put_takes_what_fits_in_order(redis_url: str) -> None:
    record = len(b"kvstore:") + 32 + 10 * KIB
    async with RedisTier(redis_url, 3 * record) as tier:
        items = [(key(i), bytes([i]) * (10 * KIB)) for i in range(5)]
        assert await tier.put_many(items) == [True, True, True, False, False]
        assert tier.usage() == 3 * record
        assert await tier.get_many([key(2), key(3)]) == [bytes([2]) * (10 * KIB), None]
        with pytest.raises(BlobTooLargeError, match="exceeds the capacity"):
            await tier.put_many([(key(8), b"x"), (key(9), b"y" * (4 * record))])
        assert not await tier.contains(key(8))
        assert tier.usage() == 3 * record


async def test_empty_blob_and_range_edges(redis_url: str) -> None:
    async with RedisTier(redis_url, 64 * KIB) as tier:
        assert await tier.put(key(1), b"")
        assert await tier.get(key(1)) == b""
        assert await tier.get_range(key(1), 0, 10) == b""
        assert await tier.get_range(key(2), 0, 0) is None
        await tier.put(key(2), b"0123456789")
        assert await tier.get_range(key(2), 9, 1) == b"9"
        assert await tier.get_range(key(2), 2**62, 2**62) == b""


async def test_ttl_expiry_drops_the_key_and_its_accounting(redis_url: str) -> None:
    async with RedisTier(redis_url, 64 * KIB, ttl_s=0.3) as tier:
        await tier.put(key(1), b"x" * 1000)
        assert await tier.contains(key(1))
        assert tier.usage() > 0
        await asyncio.sleep(0.5)
        assert await tier.get(key(1)) is None
        assert list(tier.keys()) == []
        assert tier.usage() == 0


async def test_key_deleted_elsewhere_leaves_the_accounting_on_read(
    redis_url: str, raw: Redis
) -> None:
    async with RedisTier(redis_url, 64 * KIB) as tier:
        await tier.put(key(1), b"x" * 1000)
        await tier.put(key(2), b"y" * 1000)
        await raw.delete(b"kvstore:" + key(1), b"kvstore:" + key(2))
        assert await tier.contains_many([key(1)]) == [False]
        assert await tier.get_range(key(2), 0, 10) is None
        assert tier.usage() == 0
        assert list(tier.keys()) == []


async def test_two_nodes_with_one_prefix_share_blobs(redis_url: str) -> None:
    node_a = RedisTier(redis_url, 64 * KIB, key_prefix="shared")
    node_b = RedisTier(redis_url, 64 * KIB, key_prefix="shared")
    other = RedisTier(redis_url, 64 * KIB, key_prefix="other")
    async with node_a, node_b, other:
        blob = os.urandom(5000)
        assert await node_a.put(key(1), blob)
        assert await node_b.get(key(1)) == blob
        assert await node_b.get_range(key(1), 100, 10) == blob[100:110]
        assert await node_b.contains(key(1))
        assert await other.get(key(1)) is None
        assert list(node_b.keys()) == []  # B tracks only what B wrote
        assert node_b.usage() == 0

        assert await node_b.delete(key(1)) is True
        assert await node_a.get(key(1)) is None
        assert node_a.usage() == 0


async def test_redis_killed_then_back(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvstore.tiers.redis")
    async with fast_tier(server.url) as tier:
        assert await tier.put(key(1), b"before")
        assert tier.healthy()

        # Step 1: Redis dies. Every call answers a miss; nothing raises.
        server.stop()
        assert await tier.get(key(1)) is None
        assert not tier.healthy()
        assert await tier.get_range(key(1), 0, 3) is None
        assert await tier.contains(key(1)) is False
        assert await tier.contains_many([key(1), key(2)]) == [False, False]
        assert await tier.get_many([key(1)]) == [None]
        assert await tier.put(key(2), b"during") is False
        assert await tier.put_many([(key(3), b"a"), (key(4), b"b")]) == [False, False]
        assert await tier.delete(key(1)) is False
        assert list(tier.keys()) == [key(1)]  # not seen gone: Redis did not answer

        # Step 2: caller errors still raise while degraded.
        with pytest.raises(InvalidKeyError):
            await tier.get(b"")
        with pytest.raises(InvalidRangeError):
            await tier.get_range(key(1), 0, -1)

        # Step 3: calls inside the retry interval do not touch the network.
        started = time.monotonic()
        for _ in range(100):
            assert await tier.get(key(1)) is None
        assert time.monotonic() - started < 0.2

        # Step 4: Redis is back (empty: no persistence); after the interval writes resume.
        server.start()
        await asyncio.sleep(0.15)
        assert await tier.put(key(5), b"after")
        assert tier.healthy()
        assert await tier.get(key(5)) == b"after"
        assert await tier.get(key(1)) is None
        assert sorted(tier.keys()) == [key(5)]

    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "unreachable" in warnings[0].getMessage()
    assert any("answers again" in r.getMessage() for r in caplog.records)


async def test_hung_redis_times_out_into_misses(server: RedisServer) -> None:
    async with fast_tier(server.url) as tier:
        assert await tier.put(key(1), b"x")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert await tier.get(key(1)) is None
            assert time.monotonic() - started < 1.0
            assert not tier.healthy()
        finally:
            server.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.15)
        assert await tier.get(key(1)) == b"x"
        assert tier.healthy()


async def test_start_with_redis_down_is_degraded_then_recovers(server: RedisServer) -> None:
    server.stop()
    async with fast_tier(server.url) as tier:
        assert not tier.healthy()
        assert await tier.put(key(1), b"x") is False
        assert tier.usage() == 0
        server.start()
        await asyncio.sleep(0.15)
        assert await tier.put(key(1), b"x")
        assert tier.healthy()


async def test_concurrent_puts_never_overshoot_capacity(redis_url: str) -> None:
    record = len(b"kvstore:") + 32 + 20 * KIB
    async with RedisTier(redis_url, 5 * record + 10, pool_size=4) as tier:
        results = await asyncio.gather(*(tier.put(key(i), os.urandom(20 * KIB)) for i in range(30)))
        assert results.count(True) == 5
        assert tier.usage() == 5 * record
        assert len(list(tier.keys())) == 5


async def test_closed_tier_raises(redis_url: str) -> None:
    tier = RedisTier(redis_url, 64 * KIB)
    with pytest.raises(TierClosedError, match="not started"):
        await tier.get(key(1))
    assert not tier.healthy()
    async with tier:
        assert tier.healthy()
    with pytest.raises(TierClosedError):
        await tier.put_many([(key(1), b"x")])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": "http://localhost"}, "got 'http://localhost'"),
        ({"capacity_bytes": 0}, "capacity_bytes out of range, got 0"),
        ({"capacity_bytes": 2.5}, "capacity_bytes must be an int, got 2.5"),
        ({"key_prefix": ""}, "key_prefix out of range, got ''"),
        ({"ttl_s": 0}, "ttl_s out of range, got 0"),
        ({"pool_size": 0}, "pool_size out of range, got 0"),
        ({"timeout_s": -1.0}, "timeout_s out of range, got -1.0"),
        ({"retry_interval_s": -0.5}, "retry_interval_s out of range, got -0.5"),
    ],
)
def test_bad_constructor_args_name_the_value(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"url": "redis://127.0.0.1:1/0", "capacity_bytes": KIB, **kwargs}
    with pytest.raises(ValueError, match=message):
        RedisTier(**args)  # type: ignore[arg-type]
