"""The block index's per-tier block counts, child counts and tier leaves against a brute-force
walk, under random copy events."""

from __future__ import annotations

import contextlib
import gc
import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import InvalidBlockError
from kvstore.index import BlockIndex, BlockMeta, Node
from kvstore.wire.blocks import BlockLayout
from tests.support.leaves import children_in, tier_leaves
from tests.support.young import biggest_young_dict

LAYOUT = BlockLayout(1, 1, 4, 8, "float16")
NAMESPACE = b"n" * 32
TIERS = ("host", "ssd", "redis")


def recount(index: BlockIndex) -> Counter[str]:
    return Counter(tier for node in index.nodes() for tier in node.tiers)


def test_copies_added_dropped_and_nodes_discarded_keep_the_counts() -> None:
    index = BlockIndex()
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


def test_a_nodes_lifetime_moves_only_through_its_methods() -> None:
    index = BlockIndex()
    node = index.begin(b"a" * 32, b"\0" * 32, BlockMeta(NAMESPACE, 4, LAYOUT), 64)
    assert not node.live and node.idle  # begun: invisible, nothing holds it
    assert index.commit(node.id) is node and node.live
    node.hold()
    node.hold()
    node.let_go()
    assert node.pinned and not node.idle
    node.let_go()
    with pytest.raises(RuntimeError, match="let go more often than held"):
        node.let_go()  # a bookkeeping bug surfaces instead of a negative count
    assert node.leases == 0
    with contextlib.suppress(ValueError), node.working():
        assert node.pinned
        raise ValueError("a tier write failed")
    assert node.idle  # the copy ended, failed or not
    node.doom()
    assert not node.live and index.committed(node.id) is None
    node.revive(123.0)
    assert node.live and node.last_access == 123.0


def test_random_events_never_let_the_counts_drift() -> None:
    rng = random.Random(7)
    index = BlockIndex()
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


class Leaves:
    """LeafEvents that keep each tier's leaves in a set, and fail on an impossible event."""

    def __init__(self) -> None:
        self.sets: dict[str, set[bytes]] = {tier: set() for tier in TIERS}

    def leaf_added(self, tier: str, node: Node, freed_by: Node | None) -> None:
        assert node.id not in self.sets[tier], "added twice"
        assert freed_by is None or freed_by.parent_id == node.id
        self.sets[tier].add(node.id)

    def leaf_removed(self, tier: str, node: Node) -> None:
        assert node.id in self.sets[tier], "removed while not a leaf"
        self.sets[tier].remove(node.id)


class IndexEvents(RuleBasedStateMachine):
    """Random begins (children before parents too), copies gained and lost, discards, late
    events for discarded nodes: the leaves the events announce, the per-tier child counts
    and the block counts always equal a brute-force walk of the index."""

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex()
        self.leaves = Leaves()
        self.index.leaf_events = self.leaves
        self.meta = BlockMeta(NAMESPACE, 4, LAYOUT)
        self.nodes: list[Node] = []  # indexed or discarded (late events still arrive)

    @rule(key=st.integers(0, 40), parent=st.integers(-1, 40))
    def begin(self, key: int, parent: int) -> None:
        name = key.to_bytes(32, "big")
        parent_key = b"\xff" * 32 if parent < 0 else parent.to_bytes(32, "big")
        if self.index.find(name, NAMESPACE) is None and parent_key != name:
            with contextlib.suppress(InvalidBlockError):  # a cycle: refused, index unchanged
                self.nodes.append(self.index.begin(name, parent_key, self.meta, 64))

    @precondition(lambda self: self.nodes)
    @rule(pick=st.integers(0, 10**6), tier=st.sampled_from(TIERS), gain=st.booleans())
    def copy(self, pick: int, tier: str, gain: bool) -> None:
        node = self.nodes[pick % len(self.nodes)]
        (self.index.add_copy if gain else self.index.drop_copy)(node, tier)

    @precondition(lambda self: self.nodes)
    @rule(pick=st.integers(0, 10**6))
    def discard(self, pick: int) -> None:
        self.index.discard(self.nodes[pick % len(self.nodes)].id)

    @invariant()
    def leaves_and_counts_match_a_walk(self) -> None:
        for tier in TIERS:
            assert self.leaves.sets[tier] == tier_leaves(self.index, tier)
            assert self.index.blocks_in(tier) == recount(self.index)[tier]
            for node in self.index.nodes():
                assert self.index.children_in(node.id, tier) == children_in(
                    self.index, node.id, tier
                )


IndexEvents.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_leaf_events_match_a_brute_force_walk = IndexEvents.TestCase


def test_nodes_share_their_meta_and_tier_sets() -> None:
    """A node is the one object per block the garbage collector tracks: equal BlockMetas and
    equal tier sets are one object each (a full collection's cost is per tracked object)."""
    index = BlockIndex()
    nodes = []
    for i in range(500):
        meta = BlockMeta(NAMESPACE, 4, LAYOUT)  # a new, equal object per put, as the wire gives
        node = index.begin((i + 1).to_bytes(32, "big"), b"\0" * 32, meta, 64)
        for tier in TIERS[: i % 3 + 1]:
            index.add_copy(node, tier)
        if i % 5 == 0:
            index.drop_copy(node, "host")
        nodes.append(node)
    assert len({id(node.meta) for node in nodes}) == 1
    assert len({id(node.tiers) for node in nodes}) == len({node.tiers for node in nodes}) == 6
    children = index._children.values()  # parent -> children: dicts of bytes only
    assert children and not any(gc.is_tracked(ids) for ids in children)


def test_no_collection_finds_the_index_maps_tracked_while_blocks_go_in() -> None:
    """A young collection can run at any allocation; none, here one per allocation, finds
    the index's maps of 2,000 nodes in its generation (it would walk them all: at 200K
    blocks 10-20 ms a collection, most of the daemon's event-loop lag)."""
    index = BlockIndex()
    parents = [bytes(32)]
    with biggest_young_dict() as watch:
        for i in range(2000):
            key = (i + 1).to_bytes(32, "big")
            parent = parents[i // 2]  # a tree: some parents gain a second child
            index.commit(index.begin(key, parent, BlockMeta(NAMESPACE, 4, LAYOUT), 64).id)
            parents.append(key)
    assert len(index) == 2000
    assert watch.largest < 100
