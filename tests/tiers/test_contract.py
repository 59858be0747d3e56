"""One contract, every tier: the same scenarios run on host, ssd and redis.

Each scenario builds a fresh tier through ``make_tier(capacity)`` (a real shared-memory
arena, a real directory, a real redis-server) and checks bytes, ranges, deletes, capacity and
concurrency against a plain dict model.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.tiers import InvalidKeyError, InvalidRangeError, Tier, TierClosedError
from kvstore.tiers.host import HostTier
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.ssd import SsdTier

MakeTier = Callable[[int], AbstractAsyncContextManager[Tier]]
KIB = 1024


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like a block key


@pytest.fixture(params=["host", "ssd", "redis", "redis-cluster"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> MakeTier:
    kind = request.param
    counter = iter(range(1_000_000))

    @asynccontextmanager
    async def factory(capacity: int) -> AsyncIterator[Tier]:
        tier: Tier
        if kind == "host":
            tier = HostTier(capacity)
        elif kind == "ssd":
            tier = SsdTier(tmp_path / f"ssd-{next(counter)}", capacity)
        elif kind == "redis":
            server = request.getfixturevalue("redis_server")
            if server.proc is None:
                server.start()
            server.flushall()
            tier = RedisTier(server.url, capacity, key_prefix=f"contract{next(counter)}")
        else:  # keys spread over the three primaries' slots
            cluster = request.getfixturevalue("redis_cluster")
            cluster.flushall()
            tier = RedisTier(cluster.url, capacity, key_prefix=f"contract{next(counter)}")
        async with tier:
            yield tier

    return factory


async def test_round_trip_is_bit_exact(make_tier: MakeTier) -> None:
    async with make_tier(4 * 1024 * KIB) as tier:
        blobs = {key(i): os.urandom(size) for i, size in enumerate([1, 4095, 4096, 70_001])}
        for k, blob in blobs.items():
            assert await tier.put(k, blob) is True
        for k, blob in blobs.items():
            assert await tier.get(k) == blob
            assert await tier.contains(k)
        assert sorted(tier.keys()) == sorted(blobs)
        assert await tier.get(key(99)) is None
        assert not await tier.contains(key(99))
        probe = [key(0), key(99), key(3), key(2)]
        assert await tier.contains_many(probe) == [True, False, True, True]


async def test_put_accepts_memoryview_and_bytearray(make_tier: MakeTier) -> None:
    async with make_tier(1024 * KIB) as tier:
        data = bytearray(os.urandom(10_000))
        assert await tier.put(key(1), memoryview(data)[100:5100])
        assert await tier.put(key(2), data)
        assert await tier.get(key(1)) == bytes(data[100:5100])
        assert await tier.get(key(2)) == bytes(data)


async def test_ranges(make_tier: MakeTier) -> None:
    async with make_tier(1024 * KIB) as tier:
        blob = os.urandom(50_000)
        await tier.put(key(1), blob)
        assert await tier.get_range(key(1), 0, 10) == blob[:10]
        assert await tier.get_range(key(1), 12_345, 20_000) == blob[12_345:32_345]
        assert await tier.get_range(key(1), 49_990, 100) == blob[49_990:]
        assert await tier.get_range(key(1), 50_000, 10) == b""
        assert await tier.get_range(key(1), 7, 0) == b""
        assert await tier.get_range(key(2), 0, 10) is None
        with pytest.raises(InvalidRangeError, match="offset=-1"):
            await tier.get_range(key(1), -1, 10)


async def test_replace_and_delete(make_tier: MakeTier) -> None:
    async with make_tier(1024 * KIB) as tier:
        await tier.put(key(1), b"a" * 1000)
        used = tier.usage()
        await tier.put(key(1), b"b" * 1000)
        assert await tier.get(key(1)) == b"b" * 1000
        assert tier.usage() == used
        assert await tier.delete(key(1)) is True
        assert await tier.delete(key(1)) is False
        assert await tier.get(key(1)) is None
        assert tier.usage() == 0


async def test_full_tier_refuses_and_keeps_nothing(make_tier: MakeTier) -> None:
    async with make_tier(256 * KIB) as tier:
        stored = []
        for i in range(64):
            if await tier.put(key(i), bytes([i]) * (20 * KIB)):
                stored.append(i)
            else:
                assert await tier.get(key(i)) is None
            assert tier.usage() <= tier.capacity()
        assert 6 <= len(stored) < 64
        for i in stored:
            assert await tier.get(key(i)) == bytes([i]) * (20 * KIB)
        for i in stored:
            await tier.delete(key(i))
        assert tier.usage() == 0
        assert await tier.put(key(100), b"x" * (20 * KIB))


async def test_bad_keys_name_the_problem(make_tier: MakeTier) -> None:
    async with make_tier(64 * KIB) as tier:
        with pytest.raises(InvalidKeyError, match="must be bytes, got str"):
            await tier.put("abc", b"x")  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError, match="got 65 bytes"):
            await tier.get(b"k" * 65)
        with pytest.raises(InvalidKeyError, match="got 0 bytes"):
            await tier.contains(b"")


async def test_closed_tier_raises(make_tier: MakeTier) -> None:
    async with make_tier(64 * KIB) as tier:
        pass
    with pytest.raises(TierClosedError):
        await tier.put(key(1), b"x")


async def test_concurrent_puts_and_gets(make_tier: MakeTier) -> None:
    async with make_tier(8 * 1024 * KIB) as tier:
        rng = random.Random(7)
        blobs = {key(i): rng.randbytes(rng.randrange(1, 60_000)) for i in range(64)}

        async def worker(k: bytes, blob: bytes) -> None:
            assert await tier.put(k, blob)
            for _ in range(3):
                assert await tier.get(k) == blob
                await asyncio.sleep(0)

        await asyncio.gather(*(worker(k, b) for k, b in blobs.items()))
        results = await asyncio.gather(*(tier.get(k) for k in blobs))
        assert results == list(blobs.values())
        assert tier.usage() <= tier.capacity()


operations = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "delete"]),
        st.integers(0, 11),
        st.sampled_from([1, 3000, 4096, 9000, 33_000]),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations)
def test_capacity_never_exceeded(make_tier: MakeTier, ops: list[tuple[str, int, int]]) -> None:
    async def run() -> None:
        async with make_tier(96 * KIB) as tier:
            model: dict[bytes, bytes] = {}
            for op, i, size in ops:
                if op == "put":
                    blob = bytes([i]) * size
                    if await tier.put(key(i), blob):
                        model[key(i)] = blob
                    elif key(i) in model:
                        # A refused replace keeps the old blob or drops it; never a mix.
                        old = await tier.get(key(i))
                        assert old in (model[key(i)], None)
                        if old is None:
                            del model[key(i)]
                else:
                    assert await tier.delete(key(i)) == (key(i) in model)
                    model.pop(key(i), None)
                assert tier.usage() <= tier.capacity()
            for k, blob in model.items():
                assert await tier.get(k) == blob
            assert sorted(tier.keys()) == sorted(model)

    asyncio.run(run())
