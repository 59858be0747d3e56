"""Past one node: daemons that share a Redis Cluster (3 primaries, 3 replicas, real
processes) or a Sentinel-managed primary (1 primary, 1 replica, 3 sentinels) as their Redis
tier.

Two daemons stand for two nodes: each has its own host arena, socket and SSD directory,
and both name the same cluster seeds and key prefix. A chain one saves, the other finds by
key and reads bit-exact.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvstore.client import KVStoreClient, WriteStatus, block_keys
from kvstore.inference_adapter.bench.redis_cluster import LocalCluster, LocalSentinel
from kvstore.launch import kvstore_command
from tests.support.daemon import Daemon, running_daemon
from tests.support.net import free_port, silent_listener
from tests.support.waiting import wait_for
from tests.support.worker import NAMESPACE, own_tokens, payload

T = TypeVar("T")
SLACK_S = 1.0  # what a bound allows beyond redis.timeout: a loaded machine's scheduling


def cluster_settings(cluster: LocalCluster, prefix: str) -> dict[str, dict[str, object]]:
    redis = {"enabled": True, "url": cluster.url, "key_prefix": prefix, "ttl": "0s",
             "write_policy": "write_through", "capacity": "64MiB"}  # fmt: skip
    return {"redis": redis}


def health_line(daemon: Daemon) -> tuple[int, str]:
    """``kvstore health`` against ``daemon``: its exit status and line."""
    done = subprocess.run(
        kvstore_command("health", "--address", daemon.address),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return done.returncode, done.stdout.strip() + done.stderr.strip()


def within(bound_s: float, call: Callable[[], T]) -> T:
    """``call()``, asserted to return within ``bound_s`` seconds."""
    started = time.monotonic()
    result = call()
    took = time.monotonic() - started
    assert took < bound_s, f"took {took:.2f} s, bound {bound_s:.2f} s"
    return result


def redis_stats(daemon_client: KVStoreClient) -> tuple[bool, int]:
    """The daemon's Redis tier: whether it is healthy, and its failed writes."""
    tier = next(t for t in daemon_client.stats().tiers if t.name == "redis")
    return tier.healthy, tier.failed_writes


def test_a_chain_saved_by_one_daemon_is_read_bit_exact_by_another(
    tmp_path: Path, redis_cluster: LocalCluster
) -> None:
    redis_cluster.flushall()  # the session's cluster: what other tests left goes
    settings = cluster_settings(redis_cluster, "two-nodes")
    keys = block_keys(own_tokens("cluster-chain", 12), NAMESPACE)
    with (
        running_daemon(tmp_path / "a", settings=settings) as node_a,
        running_daemon(tmp_path / "b", settings=settings) as node_b,
    ):
        with KVStoreClient(node_a.address) as a:
            a.put(NAMESPACE, keys, [payload(k) for k in keys])
        with KVStoreClient(node_b.address) as b:
            found = b.lookup_tiers(NAMESPACE, keys)
            assert found.num_blocks == len(keys) and set(found.tiers) == {"redis"}
            assert [bytes(x) for x in b.get(NAMESPACE, keys)] == [payload(k) for k in keys]
            # Promoted into node B's own arena on the way: now read from its host tier.
            assert set(b.lookup_tiers(NAMESPACE, keys).tiers) == {"host"}
            stats = b.stats()
            redis = next(t for t in stats.tiers if t.name == "redis")
            assert redis.healthy and redis.hits == len(keys)
    # The blocks are spread over the primaries, and their replicas hold copies.
    primaries = [p for p in redis_cluster.ports if "master" in redis_cluster.command(p, "ROLE")]
    per_primary = [redis_cluster.dbsize(port) for port in primaries]
    assert len(primaries) == 3 and sum(per_primary) == len(keys)
    assert sum(1 for count in per_primary if count) >= 2
    replicas = [p for p in redis_cluster.ports if p not in primaries]
    wait_for(lambda: sum(redis_cluster.dbsize(port) for port in replicas) == len(keys))


def test_the_whole_cluster_down_costs_the_redis_tier_only(tmp_path: Path) -> None:
    """Every cluster node killed: the daemon keeps serving from host and SSD, bit-exact,
    takes new blocks, reports the Redis tier down, and health stays SERVING, degraded."""
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.start()
    settings = cluster_settings(cluster, "down")
    settings["redis"].update(timeout="2s")  # killed nodes refuse at once
    settings["ssd"] = {"write_policy": "write_through"}
    try:
        with running_daemon(tmp_path / "node", settings=settings) as daemon:
            keys = block_keys(own_tokens("cluster-down", 6), NAMESPACE)
            with KVStoreClient(daemon.address) as client:
                client.put(NAMESPACE, keys, [payload(k) for k in keys])
                cluster.stop()
                assert [bytes(x) for x in client.get(NAMESPACE, keys)] == [payload(k) for k in keys]
                more = block_keys(own_tokens("after-the-outage", 4), NAMESPACE)
                statuses = client.put(NAMESPACE, more, [payload(k) for k in more])
                assert statuses[-4:] == [WriteStatus.STORED] * 4  # past the shared prefix
                assert [bytes(x) for x in client.get(NAMESPACE, more)] == [payload(k) for k in more]
                wait_for(
                    lambda: not next(t for t in client.stats().tiers if t.name == "redis").healthy
                )
                assert client.health()
                wait_for(lambda: "degraded" in health_line(daemon)[1])
                status, line = health_line(daemon)
                assert status == 0 and line.endswith(
                    "SERVING, degraded: redis tier down (hits come from the others)"
                )
    finally:
        cluster.stop()


def test_a_primary_killed_degrades_health_until_its_replica_serves(tmp_path: Path) -> None:
    """Node A saved a chain through the cluster; a primary holding part of it is killed.
    Node B's reads of the chain stop at the dead node's first block (the blocks before it
    bit-exact, never another's, never an error) and its health says degraded; once the
    replica is promoted, B reads the whole chain again, health is plain SERVING, and new
    chains A saves reach B through Redis."""
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.start()
    settings = cluster_settings(cluster, "failover")
    settings["redis"].update(timeout="2s")  # killed nodes refuse at once
    try:
        with (
            running_daemon(tmp_path / "a", settings=settings) as node_a,
            running_daemon(tmp_path / "b", settings=settings) as node_b,
            KVStoreClient(node_a.address) as a,
            KVStoreClient(node_b.address) as b,
        ):
            keys = block_keys(own_tokens("failover-chain", 24), NAMESPACE)
            a.put(NAMESPACE, keys, [payload(k) for k in keys])
            primaries = [p for p in cluster.ports if "master" in cluster.command(p, "ROLE")]
            replicas = [p for p in cluster.ports if p not in primaries]
            wait_for(lambda: sum(cluster.dbsize(port) for port in replicas) == len(keys))
            victim = max(primaries, key=cluster.dbsize)
            cluster.procs.pop(victim).kill()
            shortest, saw_degraded, whole = len(keys), False, 0
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline and whole < 2:
                got = [bytes(x) for x in b.get(NAMESPACE, keys)]
                assert got == [payload(k) for k in keys[: len(got)]]
                shortest = min(shortest, len(got))
                status, line = health_line(node_b)
                assert status == 0 and line.startswith(f"{node_b.address}: SERVING"), line
                saw_degraded |= "degraded: redis tier down" in line
                whole = whole + 1 if len(got) == len(keys) and "degraded" not in line else 0
                time.sleep(0.2)
            assert whole == 2, f"the chain was not whole again within 45 s ({shortest} blocks)"
            assert shortest < len(keys) and saw_degraded  # the outage was seen
            assert "role:master" in "".join(cluster.command(p, "INFO", "replication")
                                            for p in replicas)  # fmt: skip
            # Node A's slot map is from before the failover: its first save finds the old
            # primary gone, reloads the map and saves there again, losing nothing.
            fresh = block_keys(own_tokens("after-failover", 12), NAMESPACE)
            a.put(NAMESPACE, fresh, [payload(k) for k in fresh])
            found = b.lookup_tiers(NAMESPACE, fresh)
            new = [i for i, k in enumerate(fresh) if k not in keys]
            assert found.num_blocks == len(fresh) and len(new) >= 12
            assert {found.tiers[i] for i in new} == {"redis"}
            assert [bytes(x) for x in b.get(NAMESPACE, fresh)] == [payload(k) for k in fresh]
    finally:
        cluster.stop()


def test_a_sentinel_failover_under_two_daemons(tmp_path: Path) -> None:
    """The same with Sentinel (1 primary, 1 replica, 3 sentinels), more briefly: node A
    saved a chain; the primary is killed; node B's reads are a prefix of the chain or
    nothing, bit-exact, and its health says degraded, until the sentinels promote the
    replica; then B reads the whole chain, health is plain SERVING, and A's next chain
    reaches B."""
    setup = LocalSentinel(tmp_path / "sentinel")
    setup.start()
    redis = {"enabled": True, "url": setup.url, "key_prefix": "sentinel-nodes", "ttl": "0s",
             "write_policy": "write_through", "capacity": "64MiB", "timeout": "2s"}  # fmt: skip
    try:
        with (
            running_daemon(tmp_path / "a", settings={"redis": redis}) as node_a,
            running_daemon(tmp_path / "b", settings={"redis": redis}) as node_b,
            KVStoreClient(node_a.address) as a,
            KVStoreClient(node_b.address) as b,
        ):
            keys = block_keys(own_tokens("sentinel-chain", 12), NAMESPACE)
            a.put(NAMESPACE, keys, [payload(k) for k in keys])
            wait_for(lambda: setup.dbsize(setup.replica) == len(keys))
            setup.procs.pop(setup.primary).kill()
            saw_degraded, whole = False, 0
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and whole < 2:
                got = [bytes(x) for x in b.get(NAMESPACE, keys)]
                assert got == [payload(k) for k in keys[: len(got)]]
                status, line = health_line(node_b)
                assert status == 0 and line.startswith(f"{node_b.address}: SERVING"), line
                saw_degraded |= "degraded: redis tier down" in line
                # B's host tier holds what it read; the rest must come from the new primary.
                whole = whole + 1 if len(got) == len(keys) and "degraded" not in line else 0
                time.sleep(0.3)
            assert whole == 2, "the chain was not whole again within 60 s"
            assert saw_degraded
            assert "role:master" in setup.command(setup.replica, "INFO", "replication")
            fresh = block_keys(own_tokens("after-sentinel-failover", 12), NAMESPACE)
            a.put(NAMESPACE, fresh, [payload(k) for k in fresh])
            new = [i for i, k in enumerate(fresh) if k not in keys]
            found = b.lookup_tiers(NAMESPACE, fresh)
            assert found.num_blocks == len(fresh) and {found.tiers[i] for i in new} == {"redis"}
            assert [bytes(x) for x in b.get(NAMESPACE, fresh)] == [payload(k) for k in fresh]
    finally:
        setup.stop()


def test_a_silent_cluster_costs_each_call_at_most_the_timeout(tmp_path: Path) -> None:
    """Every node of the cluster hangs (SIGSTOP: a partition, a frozen host). Puts, gets and
    lookups each return within ``redis.timeout`` (+ slack), never an error; host and SSD
    data are served bit-exact; health says degraded. After SIGCONT the tier serves again,
    and every block saved meanwhile either reached Redis or is counted in its
    ``failed_writes`` (none silently lost)."""
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.start()
    timeout_s = 1.0
    settings = cluster_settings(cluster, "silent")
    settings["redis"].update(timeout=f"{timeout_s}s")
    settings["ssd"] = {"write_policy": "write_through"}
    bound = timeout_s + SLACK_S
    try:
        with (
            running_daemon(tmp_path / "node", settings=settings) as daemon,
            KVStoreClient(daemon.address, retries=0, timeout=30.0) as client,
        ):
            before = block_keys(own_tokens("before-the-silence", 8), NAMESPACE)
            client.put(NAMESPACE, before, [payload(k) for k in before])
            primaries = [p for p in cluster.ports if "master" in cluster.command(p, "ROLE")]
            assert sum(cluster.dbsize(p) for p in primaries) == len(before)
            for proc in cluster.procs.values():
                proc.send_signal(signal.SIGSTOP)
            try:
                during = block_keys(own_tokens("during-the-silence", 8), NAMESPACE)
                statuses = within(
                    bound, lambda: client.put(NAMESPACE, during, [payload(k) for k in during])
                )
                new = [k for k in during if k not in before]  # past the shared prefix
                assert statuses[-len(new) :] == [WriteStatus.STORED] * len(new)
                unknown = block_keys(list(range(10**6, 10**6 + 64)), NAMESPACE)
                assert within(bound, lambda: client.lookup(NAMESPACE, unknown)) == 0
                assert within(bound, lambda: client.lookup(NAMESPACE, during)) == len(during)
                for chain in (before, during):
                    got = within(bound, lambda c=chain: client.get(NAMESPACE, c))
                    assert [bytes(x) for x in got] == [payload(k) for k in chain]
                assert not redis_stats(client)[0]
                status, line = health_line(daemon)
                assert status == 0 and line.endswith(
                    "SERVING, degraded: redis tier down (hits come from the others)"
                )
            finally:
                for proc in cluster.procs.values():
                    proc.send_signal(signal.SIGCONT)
            wait_for(lambda: redis_stats(client)[0], timeout=60)
            stored = sum(cluster.dbsize(p) for p in primaries) - len(before)
            failed = redis_stats(client)[1]
            # A write that timed out may still land (the node read it once it ran again):
            # counted as failed, found in Redis. What is missing must all be counted.
            assert failed > 0 and len(new) - stored <= failed
            after = block_keys(own_tokens("after-the-silence", 8), NAMESPACE)
            client.put(NAMESPACE, after, [payload(k) for k in after])
            fresh = len(set(after) - set(before) - set(during))
            assert sum(cluster.dbsize(p) for p in primaries) == len(before) + stored + fresh
            assert redis_stats(client)[1] == failed
    finally:
        cluster.stop()


def test_a_silent_seed_costs_each_call_at_most_the_timeout(tmp_path: Path) -> None:
    """The only seed accepts connections and never answers (a hung host): a put, a get and
    a lookup each return within ``redis.timeout`` (+ slack) with the host tier's bytes, and
    health says degraded."""
    timeout_s = 1.0
    port = free_port()
    redis = {"enabled": True, "url": f"redis+cluster://127.0.0.1:{port}", "timeout": "1s",
             "write_policy": "write_through", "capacity": "64MiB"}  # fmt: skip
    bound = timeout_s + SLACK_S
    with (
        silent_listener(port) as accepted,
        running_daemon(tmp_path / "node", settings={"redis": redis}) as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=30.0) as client,
    ):
        keys = block_keys(own_tokens("silent-seed", 8), NAMESPACE)
        statuses = within(bound, lambda: client.put(NAMESPACE, keys, [payload(k) for k in keys]))
        assert statuses == [WriteStatus.STORED] * len(keys)  # a new daemon: all are new
        unknown = block_keys(list(range(10**6, 10**6 + 64)), NAMESPACE)
        assert within(bound, lambda: client.lookup(NAMESPACE, unknown)) == 0
        got = within(bound, lambda: client.get(NAMESPACE, keys))
        assert [bytes(x) for x in got] == [payload(k) for k in keys]
        assert accepted  # the seed was tried
        assert not redis_stats(client)[0]
        assert health_line(daemon)[1].endswith(
            "SERVING, degraded: redis tier down (hits come from the others)"
        )


def test_a_full_cluster_restart_loses_no_write_through(tmp_path: Path) -> None:
    """Every node restarts (empty) with no traffic in between: the daemon's pooled
    connections are closed, and the next saves find that out. None is lost silently: each
    block reaches Redis or is counted in ``failed_writes`` (before, the write-throughs of
    the first second or so were dropped while health said SERVING)."""
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.start()
    try:
        with (
            running_daemon(tmp_path / "node", settings=cluster_settings(cluster, "restart")) as d,
            KVStoreClient(d.address, retries=0, timeout=30.0) as client,
        ):
            before = block_keys(own_tokens("before-the-restart", 8), NAMESPACE)
            client.put(NAMESPACE, before, [payload(k) for k in before])
            for port in list(cluster.procs):
                proc = cluster.procs.pop(port)
                proc.kill()
                proc.wait(10)
            for port in cluster.ports:
                cluster.start_node(port)
            wait_for(
                lambda: all(cluster.info(p).get("cluster_state") == "ok" for p in cluster.ports),
                timeout=60,
            )
            primaries = [p for p in cluster.ports if "master" in cluster.command(p, "ROLE")]
            after = block_keys(own_tokens("after-the-restart", 12), NAMESPACE)
            client.put(NAMESPACE, after, [payload(k) for k in after])
            stored = sum(cluster.dbsize(p) for p in primaries)
            failed = redis_stats(client)[1]
            assert stored + failed == len(set(after) - set(before))
            assert failed == 0  # the closed connections were retried on fresh ones
    finally:
        cluster.stop()
