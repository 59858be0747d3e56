"""Redis URLs: what is refused, with a reason that never carries the password."""

from __future__ import annotations

import pytest

from kvstore.tiers.redis_url import (
    check_url,
    cluster_credentials,
    cluster_seeds,
    sentinel_service,
    without_secrets,
)


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "rediss://cache.example:6380", "redis://localhost",
     "redis://:pw@h:1/15", "unix:///run/redis/redis.sock", "redis+cluster://a:7000,b:7001",
     "rediss+cluster://u:pw@a:7000/0", "redis+cluster://a", "redis+sentinel://s1,s2:26380/main",
     "rediss+sentinel://:pw@s1:26379/main/2"],
)  # fmt: skip
def test_good_urls_pass(url: str) -> None:
    check_url(url)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://u:hunter2@h:6379/0", "http://***@h:6379/0: the scheme must be one of redis"),
        ("redis://u:hunter2@h:sixthree/0", "redis://***@h:sixthree/0: the port must be a number"),
        ("redis://a:1,b:2/0", "one host:port (for seed nodes, use redis+cluster://)"),
        ("redis+cluster://:hunter2@a:1,b:x", "redis+cluster://***@a:1,b:x: the port must be"),
        ("redis+cluster://a:1,:2", "no host"),
        ("redis+cluster://a:1/3", "a Redis Cluster has database 0 only, got '3'"),
        ("redis+sentinel://:hunter2@s1:26379", "name the service the sentinels monitor"),
        ("redis+sentinel://s1:26379/main/x", "the database must be a number, got 'x'"),
        ("redis://h:0/0", "the port must be a number in 1-65535"),
        ("redis://h:70000/0", "the port must be a number in 1-65535"),
        ("redis://:hunter2@:6379/0", "no host"),
        ("redis://h:6379/zero", "the database must be a number, got 'zero'"),
        ("unix://", "a unix URL needs a socket path"),
        ("hunter2", "the url: the scheme must be one of"),
    ],
)
def test_bad_urls_are_refused_without_the_password(url: str, reason: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_url(url)
    assert reason in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_without_secrets_keeps_host_port_and_path_only() -> None:
    assert without_secrets("redis://admin:hunter2@cache:6379/3") == "redis://***@cache:6379/3"
    assert without_secrets("redis://cache:6379/3") == "redis://cache:6379/3"
    assert without_secrets("rediss://:pw@cache/0") == "rediss://***@cache/0"


def test_cluster_urls_give_their_seeds_and_credentials() -> None:
    url = "rediss+cluster://ops:p%40ss@10.0.0.1:7000, 10.0.0.2:7001,[::1]:7002,cache"
    assert cluster_seeds(url) == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002),
                                  ("cache", 6379)]  # fmt: skip
    assert cluster_credentials(url) == ("ops", "p@ss")
    assert cluster_credentials("redis+cluster://a:1") == (None, None)
    assert without_secrets(url).startswith("rediss+cluster://***@10.0.0.1:7000,")


def test_sentinel_urls_give_the_sentinels_service_and_database() -> None:
    url = "redis+sentinel://u:pw@s1,s2:26380/kvstore-primary/3"
    assert cluster_seeds(url) == [("s1", 26379), ("s2", 26380)]
    assert sentinel_service(url) == ("kvstore-primary", 3)
    assert sentinel_service("redis+sentinel://s1/main") == ("main", 0)
    assert cluster_credentials(url) == ("u", "pw")
