"""The radix index's per-tier block counts against a recount, under random copy events."""

from __future__ import annotations

import random
from collections import Counter

from kvstore.blocks import BlockLayout
from kvstore.index import BlockMeta, Node, RadixIndex

LAYOUT = BlockLayout(1, 1, 4, 8, "float16")
NAMESPACE = b"n" * 32
TIERS = ("host", "ssd", "redis")


def recount(index: RadixIndex) -> Counter[str]:
    return Counter(tier for node in index.nodes() for tier in node.tiers)


def test_copies_added_dropped_and_nodes_discarded_keep_the_counts() -> None:
    index = RadixIndex()
    meta = BlockMeta(NAMESPACE, 4, LAYOUT)
    root = index.begin(b"a" * 32, b"\0" * 32, meta, 64)
    child = index.begin(b"b" * 32, b"a" * 32, meta, 64)
    index.add_copy(root, "host")
    index.add_copy(root, "host")  # twice is once
    index.add_copy(root, "ssd")
    index.add_copy(child, "host")
    assert [index.blocks_in(t) for t in TIERS] == [2, 1, 0]
    index.drop_copy(child, "host")
    index.drop_copy(child, "host")
    index.drop_copy(child, "ssd")  # never held there
    assert [index.blocks_in(t) for t in TIERS] == [1, 1, 0]
    index.add_copy(child, "redis")
    index.discard(child.id)  # forgotten with a copy still recorded
    assert [index.blocks_in(t) for t in TIERS] == [1, 1, 0]
    index.drop_copy(child, "redis")  # a late event for a discarded node changes nothing
    index.add_copy(child, "ssd")
    assert [index.blocks_in(t) for t in TIERS] == [1, 1, 0] == [recount(index)[t] for t in TIERS]


def test_random_events_never_let_the_counts_drift() -> None:
    rng = random.Random(7)
    index = RadixIndex()
    meta = BlockMeta(NAMESPACE, 4, LAYOUT)
    nodes: list[Node] = []
    for step in range(5000):
        action = rng.random()
        if action < 0.2 or not nodes:
            key = rng.randbytes(32)
            parent = rng.choice(nodes).key if nodes and rng.random() < 0.7 else b"\0" * 32
            if index.find(key, NAMESPACE) is None:
                nodes.append(index.begin(key, parent, meta, 64))
        elif action < 0.55:
            index.add_copy(rng.choice(nodes), rng.choice(TIERS))
        elif action < 0.85:
            index.drop_copy(rng.choice(nodes), rng.choice(TIERS))
        else:
            node = rng.choice(nodes)
            if not index.children_of(node.id):
                index.discard(node.id)
                if rng.random() < 0.5:
                    nodes.remove(node)  # else keep sending it late events
        if step % 250 == 0:
            assert {t: index.blocks_in(t) for t in TIERS} == {t: recount(index)[t] for t in TIERS}
    assert {t: index.blocks_in(t) for t in TIERS} == {t: recount(index)[t] for t in TIERS}
