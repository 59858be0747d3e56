"""Redis tier scenarios beyond the contract: batches, TTL, two nodes, Redis down and back.

A real redis-server process (session fixture); tests that stop it start it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Protocol

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvstore.inference_adapter.bench.redis_cluster import LocalCluster, LocalSentinel, command
from kvstore.tiers import BlobTooLargeError, InvalidKeyError, InvalidRangeError, TierClosedError
from kvstore.tiers.redis import RedisTier
from tests.support.net import free_port, self_signed, silent_listener
from tests.support.waiting import until, wait_for

KIB = 1024

pytestmark = pytest.mark.redis


class RedisServer(Protocol):
    """The session's redis-server process (see ``tests/conftest.py``)."""

    url: str
    port: int
    proc: subprocess.Popen[bytes] | None

    def start(self) -> None: ...

    def stop(self) -> None: ...


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like a block key


FAST_TIMEOUT_S = 0.2


def fast_tier(url: str) -> RedisTier:
    """A tier that gives up on Redis quickly and probes it again soon."""
    return RedisTier(url, 64 * KIB, timeout_s=FAST_TIMEOUT_S, retry_interval_s=0.1)


def tier_healthy(tier: RedisTier) -> Callable[[], Awaitable[bool]]:
    async def healthy() -> bool:
        return tier.healthy()

    return healthy


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

        # Step 3: Redis is back (empty: no persistence); once the probe finds it, writes resume.
        server.start()
        await until(tier_healthy(tier), within=30)
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
            # The documented bound, from the tier's own timeout (+1 s for a loaded machine).
            assert time.monotonic() - started < FAST_TIMEOUT_S + 1.0
            assert not tier.healthy()
        finally:
            server.proc.send_signal(signal.SIGCONT)
        await until(tier_healthy(tier), within=30)
        assert await tier.get(key(1)) == b"x"
        assert tier.healthy()


async def test_start_with_redis_down_is_degraded_then_recovers(server: RedisServer) -> None:
    server.stop()
    async with fast_tier(server.url) as tier:
        assert not tier.healthy()
        assert await tier.put(key(1), b"x") is False
        assert tier.usage() == 0
        server.start()
        await until(tier_healthy(tier), within=30)
        assert await tier.put(key(1), b"x")


async def test_a_silent_node_costs_one_timeout_then_no_request_touches_the_network(
    server: RedisServer,
) -> None:
    """Redis hangs (accepts, never answers): the first batch of each kind fails within the
    tier's timeout (+1 s of slack for a loaded machine); every call after it answers a miss
    without a connection, since only the background probe (here once a minute) tries."""
    timeout_s = 0.5
    tier = RedisTier(server.url, 64 * KIB, timeout_s=timeout_s, retry_interval_s=60)
    async with tier:
        assert await tier.put(key(1), b"x")
        server.stop()
        with silent_listener(server.port) as accepted:
            started = time.monotonic()
            assert await tier.put_many([(key(i), b"y") for i in range(2, 10)]) == [False] * 8
            assert time.monotonic() - started < timeout_s + 1.0
            assert not tier.healthy() and len(accepted) >= 1
            tried = len(accepted)
            for _ in range(20):
                assert await tier.get_many([key(1), key(2)]) == [None, None]
                assert await tier.contains_many([key(1)]) == [False]
                assert await tier.put(key(3), b"z") is False
            assert len(accepted) == tried  # no request opened a connection


async def test_a_restarted_server_costs_no_write(server: RedisServer) -> None:
    """The server restarts between two calls: the pooled connections it closed are found
    closed by the next call, which retries once on a fresh connection instead of counting
    the server as down (before, the writes of the next retry interval were lost)."""
    async with fast_tier(server.url) as tier:
        assert await tier.put_many([(key(i), b"a") for i in range(4)]) == [True] * 4
        server.stop()
        server.start()
        assert await tier.put(key(9), b"after the restart") is True
        assert tier.healthy()
        assert await tier.get(key(9)) == b"after the restart"


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
        ({"url": "http://localhost"}, "http://localhost: the scheme must be one of redis, "),
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


@pytest.fixture
def small_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server of its own with maxmemory 4 MiB and allkeys-lru; yields its URL."""
    port = free_port()
    options = ["--port", str(port), "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]
    with own_redis(tmp_path, options, lambda: command(port, "PING") == "+PONG"):
        yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def own_redis(workdir: Path, options: list[str], ready: Callable[[], bool]) -> Iterator[None]:
    """A redis-server of a test's own (no persistence) with ``options``, once ``ready()``;
    killed on exit."""
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), *options],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for(ready)
        yield
    finally:
        proc.kill()
        proc.wait()


async def test_capacity_bounds_what_this_instance_wrote_and_redis_bounds_the_rest(
    small_redis: str,
) -> None:
    """What ``capacity`` bounds, as the docs say: the bytes this instance wrote that it has
    not seen disappear. Two instances (two daemons) sharing one Redis each count their own
    only, so together they may hold twice one capacity; Redis's maxmemory (allkeys-lru) is
    what bounds the shared tier, and keys Redis evicted leave a writer's count when a read
    finds them gone."""
    url, blob = small_redis, 64 * KIB
    node_a = RedisTier(url, 3 * 1024 * KIB, key_prefix="shared")
    node_b = RedisTier(url, 3 * 1024 * KIB, key_prefix="shared")
    async with node_a, node_b:
        record = len(b"shared:") + 32 + blob  # a Redis key and its value
        a_keys = [b"a" * 28 + i.to_bytes(4, "big") for i in range(50)]
        b_keys = [b"b" * 28 + i.to_bytes(4, "big") for i in range(50)]
        a_stored = await node_a.put_many([(k, os.urandom(blob)) for k in a_keys])
        b_stored = await node_b.put_many([(k, os.urandom(blob)) for k in b_keys])
        fit = 3 * 1024 * KIB // record  # 47: each stops at its own capacity
        assert a_stored == b_stored == [True] * fit + [False] * (50 - fit)
        assert node_a.usage() == node_b.usage() == fit * record
        assert set(node_a.keys()).isdisjoint(node_b.keys())
        # Together about 6 MiB > maxmemory 4 MiB: Redis evicted some (no tier is told).
        held = [await node_a.contains_many(a_keys), await node_b.contains_many(b_keys)]
        assert 0 < sum(map(sum, held)) * record < 4 * 1024 * KIB
        # The reads found the evicted keys gone: each count is now what Redis holds of it.
        assert node_a.usage() == sum(held[0]) * record
        assert node_b.usage() == sum(held[1]) * record


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path, Path, Path]]:
    """A redis-server that speaks TLS only, with a self-signed certificate for localhost
    (its own CA) and client certificates optional; yields (port, cert, key, a foreign CA)."""
    cert, key = self_signed(tmp_path)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    other_ca, _ = self_signed(foreign)
    port = free_port()
    options = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
               "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
               "--tls-auth-clients", "optional"]  # fmt: skip
    with own_redis(tmp_path, options, lambda: tls_answers(port, cert)):
        yield port, cert, key, other_ca


def tls_answers(port: int, ca: Path) -> bool:
    try:
        with SyncRedis(port=port, ssl=True, ssl_ca_certs=str(ca), socket_timeout=1) as client:
            return bool(client.ping())
    except OSError:
        return False
    except RedisError:
        return False


async def test_rediss_with_the_servers_ca_round_trips_and_a_foreign_ca_only_misses(
    tls_redis: tuple[int, Path, Path, Path],
) -> None:
    """``rediss://`` to a TLS-only server: with ``tls_ca`` naming its CA, blobs round-trip
    (and with a client certificate too); with another CA the handshake fails, which is a
    miss and an unhealthy tier, never an error or bytes; plain ``redis://`` to the TLS port
    is the same. A ``tls_ca`` that is no file is refused at construction, by name."""
    port, cert, private_key, other_ca = tls_redis
    url = f"rediss://localhost:{port}/0"
    async with RedisTier(url, 64 * KIB, key_prefix="tls", tls_ca=str(cert)) as tier:
        assert await tier.put(key(1), b"over tls") and tier.healthy()
        assert await tier.get(key(1)) == b"over tls"
    mutual = RedisTier(url, 64 * KIB, key_prefix="tls", tls_ca=str(cert), tls_cert=str(cert),
                       tls_key=str(private_key))  # fmt: skip
    async with mutual:
        assert await mutual.get(key(1)) == b"over tls"
    for wrong in (
        RedisTier(url, 64 * KIB, key_prefix="tls", tls_ca=str(other_ca), timeout_s=2.0),
        RedisTier(f"redis://localhost:{port}/0", 64 * KIB, key_prefix="tls", timeout_s=2.0),
    ):
        async with wrong:
            assert await wrong.get(key(1)) is None and not wrong.healthy()
            assert await wrong.put(key(2), b"x") is False
    with pytest.raises(ValueError, match="tls_ca"):
        RedisTier(url, 64 * KIB, tls_ca=str(port))  # no such file
    with pytest.raises(ValueError, match="tls_ca"):
        RedisTier(f"redis://localhost:{port}/0", 64 * KIB, tls_ca=str(cert))  # TLS off


async def put_derived(tier: RedisTier, count: int) -> dict[bytes, bytes]:
    """Puts ``count`` blobs derived from their keys; returns them by key."""
    keys = [bytes([i]) * 32 for i in range(count)]
    blobs = {key: hashlib.sha256(key).digest() * 40 for key in keys}
    assert await tier.put_many(list(blobs.items())) == [True] * len(blobs)
    return blobs


async def reads_miss_or_match(tier: RedisTier, blobs: dict[bytes, bytes]) -> tuple[int, bool]:
    """Reads every key once: each must be a miss or its own bytes, never another's and
    never an exception. Returns the misses and whether the tier says it is degraded."""
    results = await asyncio.gather(*(tier.get(k) for k in blobs))
    for k, got in zip(blobs, results, strict=True):
        assert got is None or got == blobs[k]
    return sum(got is None for got in results), not tier.healthy()


async def test_a_cluster_primary_killed_costs_misses_then_its_replica_serves(
    tmp_path: Path,
) -> None:
    """A real cluster (3 primaries, 3 replicas) loses a primary: reads of its slots miss
    (never raise, never return other bytes) until its replica is promoted; then they are
    served again and writes to those slots land."""
    cluster = LocalCluster(tmp_path)
    cluster.start()
    try:
        tier = RedisTier(cluster.url, 64 * 1024 * KIB, key_prefix="failover", timeout_s=2.0,
                         retry_interval_s=0.2)  # fmt: skip
        async with tier:
            blobs = await put_derived(tier, 60)
            primaries = [p for p in cluster.ports if "master" in cluster.command(p, "ROLE")]
            replicas = [p for p in cluster.ports if p not in primaries]
            wait_for(lambda: sum(cluster.dbsize(p) for p in replicas) == len(blobs))
            victim = primaries[0]
            lost = cluster.dbsize(victim)
            assert lost > 0
            cluster.procs.pop(victim).kill()
            misses = served = 0
            saw_degraded = False
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                missed, degraded = await reads_miss_or_match(tier, blobs)
                misses += missed
                saw_degraded |= degraded
                if not missed:
                    served += 1
                    if served >= 2:  # stable: the replica took over the slots
                        break
                await asyncio.sleep(0.1)
            assert served >= 2, f"the killed primary's slots were not served again ({misses})"
            assert misses > 0 and saw_degraded  # the outage was seen, as misses
            fresh = {bytes([200 + i]) * 32: bytes([i]) * 5000 for i in range(30)}
            assert await tier.put_many(list(fresh.items())) == [True] * len(fresh)
            assert await tier.get_many(list(fresh)) == list(fresh.values())
            assert tier.healthy()
    finally:
        cluster.stop()


def patient_tier(cluster: LocalCluster, prefix: str) -> RedisTier:
    """A tier over ``cluster`` for killing a node: a killed node refuses at once, and a long
    timeout keeps a slow answer of a live node (a loaded machine) from counting as that node
    down. No probe of the dead node."""
    return RedisTier(
        cluster.url, 64 * 1024 * KIB, key_prefix=prefix, timeout_s=5.0, retry_interval_s=60
    )


async def test_a_dead_cluster_primary_costs_only_the_misses_of_its_own_keys(
    tmp_path: Path,
) -> None:
    """One primary of three killed: batches that span every node keep getting the other
    nodes' keys (their bytes, at once, every time) and miss only the dead node's keys; puts
    land on the live nodes; the tier names the dead node as down. (Before, one node's
    failure made the whole tier answer misses for ``retry_interval_s``.)"""
    cluster = LocalCluster(tmp_path)
    cluster.start()
    try:
        async with patient_tier(cluster, "iso") as tier:
            blobs = await put_derived(tier, 90)
            primaries = [p for p in cluster.ports if "master" in cluster.command(p, "ROLE")]
            victim = primaries[0]
            with SyncRedis(port=victim) as node:
                on_victim = {bytes(k)[len(b"iso:") :] for k in node.keys("iso:*")}
            assert 0 < len(on_victim) < len(blobs)
            cluster.procs.pop(victim).kill()
            keys = list(blobs)
            for _ in range(5):
                got = await tier.get_many(keys)
                assert got == [None if k in on_victim else blobs[k] for k in keys]
                assert await tier.contains_many(keys) == [k not in on_victim for k in keys]
            assert tier.down_nodes() == [f"127.0.0.1:{victim}"] and not tier.healthy()
            fresh = [(bytes([150 + i]) * 32, bytes([i]) * 3000) for i in range(60)]
            stored = await tier.put_many(fresh)
            assert any(stored) and not all(stored)
            assert await tier.get_many([k for k, _ in fresh]) == [
                blob if ok else None for (_, blob), ok in zip(fresh, stored, strict=True)
            ]
    finally:
        cluster.stop()


async def test_a_write_to_a_dead_cluster_primary_marks_it_down_at_once(tmp_path: Path) -> None:
    """The first call after a primary died is a put of a key in its slots, over the
    connection an earlier put opened: it is not stored, and the tier names that node as down
    at once. (A cluster pipeline hands a failure on an open connection back as each key's
    answer; before, such a write failed without the node counting as down, so health stayed
    SERVING until a read came.)"""
    cluster = LocalCluster(tmp_path)
    cluster.start()
    try:
        async with patient_tier(cluster, "w") as tier:
            victim = next(p for p in cluster.ports if "master" in cluster.command(p, "ROLE"))
            with SyncRedis(port=victim) as node:
                owned = [(int(r[0]), int(r[1])) for r in node.execute_command("CLUSTER", "SLOTS")
                         if int(r[2][1]) == victim]  # fmt: skip
                candidates = [bytes([i]) * 32 for i in range(200)]
                slots = [int(node.execute_command("CLUSTER", "KEYSLOT", b"w:" + k))
                         for k in candidates]  # fmt: skip
            first, second = [k for k, slot in zip(candidates, slots, strict=True)
                              if any(lo <= slot <= hi for lo, hi in owned)][:2]  # fmt: skip
            assert await tier.put(first, b"kept" * 100) is True
            dead = cluster.procs.pop(victim)
            dead.kill()
            dead.wait(10)
            assert tier.healthy()
            assert await tier.put(second, b"lost" * 100) is False
            assert tier.down_nodes() == [f"127.0.0.1:{victim}"] and not tier.healthy()
            assert tier.usage() == len(b"w:") + 32 + 400  # the lost put not counted
    finally:
        cluster.stop()


async def test_a_sentinel_failover_costs_misses_then_writes_reach_the_new_primary(
    tmp_path: Path,
) -> None:
    """Sentinels (3) watch a primary and its replica: the primary killed, reads miss or
    return the right bytes (never another's, never an exception) until the sentinels
    promote the replica; then reads and writes go to it."""
    setup = LocalSentinel(tmp_path)
    setup.start()
    try:
        tier = RedisTier(setup.url, 64 * 1024 * KIB, key_prefix="sentinel", timeout_s=2.0,
                         retry_interval_s=0.2)  # fmt: skip
        async with tier:
            blobs = await put_derived(tier, 40)
            keys = list(blobs)
            wait_for(lambda: setup.dbsize(setup.replica) == len(blobs))
            setup.procs.pop(setup.primary).kill()
            misses, saw_degraded, wrote = 0, False, False
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline and not wrote:
                missed, degraded = await reads_miss_or_match(tier, blobs)
                misses += missed
                saw_degraded |= degraded
                wrote = await tier.put(b"\xee" * 32, b"after the failover")
                await asyncio.sleep(0.2)
            assert wrote, "no write reached a new primary within 45 s"
            assert misses > 0 and saw_degraded
            assert "role:master" in setup.command(setup.replica, "INFO", "replication")
            assert await tier.get_many(keys) == [blobs[k] for k in keys]
            assert await tier.get(b"\xee" * 32) == b"after the failover"
    finally:
        setup.stop()
