"""Eviction orders: read lazily in growing snapshots, robust to changes between keys."""

from __future__ import annotations

import random
from collections import OrderedDict

from kvstore.policies import FIRST_SNAPSHOT, LruPolicy, SchedulerAwarePolicy, in_snapshots


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:06d}".encode() for i in range(n)]


def test_snapshots_yield_every_key_once_in_order() -> None:
    for n in (0, 1, FIRST_SNAPSHOT - 1, FIRST_SNAPSHOT, FIRST_SNAPSHOT + 1, 1000):
        order = OrderedDict.fromkeys(keys(n))
        assert list(in_snapshots(order)) == keys(n)


def test_changes_between_keys_never_raise_repeat_or_miss_a_key_that_stayed() -> None:
    rng = random.Random(3)
    order = OrderedDict.fromkeys(keys(2000))
    stayed = set(order)
    yielded: list[bytes] = []
    added = 0
    for key in in_snapshots(order):
        yielded.append(key)
        action = rng.random()
        if action < 0.3:  # the caller evicts it (or finds it stale)
            order.pop(key, None)
            stayed.discard(key)
        elif action < 0.4:  # another task touches a key: it moves to the end
            touched = rng.choice(list(order))
            order.move_to_end(touched)
        elif action < 0.5:  # a new block arrives
            order[f"new{added:06d}".encode()] = None
            added += 1
    assert len(yielded) == len(set(yielded))  # never twice
    assert stayed <= set(yielded)  # whatever stayed in the order was offered


def test_a_scan_that_stops_early_reads_only_the_head() -> None:
    order = OrderedDict.fromkeys(keys(100_000))
    scan = in_snapshots(order)
    assert next(scan) == b"k000000"
    order.clear()  # a live dict iterator would raise on the next key; snapshots do not
    assert next(scan) == b"k000001"


def test_lru_and_scheduler_aware_orders() -> None:
    lru, aware = LruPolicy(), SchedulerAwarePolicy()
    for policy in (lru, aware):
        for key in keys(5):
            policy.inserted("host", key)
        policy.accessed(b"k000001")
    assert list(lru.victims("host")) == [b"k000000", b"k000002", b"k000003", b"k000004", b"k000001"]
    aware.protect([b"k000002", b"k000000"], until=float("inf"))
    assert list(aware.victims("host")) == [
        b"k000003",
        b"k000004",
        b"k000001",
        b"k000000",
        b"k000002",
    ]
