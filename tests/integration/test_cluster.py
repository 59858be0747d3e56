"""Past one node: daemons that share a Redis Cluster (3 primaries, 3 replicas, real
processes) or a Sentinel-managed primary (1 primary, 1 replica, 3 sentinels) as their Redis
tier.

Two daemons stand for two nodes: each has its own host arena, socket and SSD directory,
and both name the same cluster seeds and key prefix. A chain one saves, the other finds by
key and reads bit-exact.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from kvstore.client import KVStoreClient, WriteStatus, block_keys
from kvstore.inference_adapter.bench.redis_cluster import LocalCluster, LocalSentinel
from kvstore.launch import kvstore_command
from tests.support.daemon import Daemon, running_daemon
from tests.support.waiting import wait_for
from tests.support.worker import NAMESPACE, own_tokens, payload


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
