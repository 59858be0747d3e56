"""The block index: which blocks the store holds, where, and how they chain.

A dict of nodes by block id, with each node's parent and children: block keys are chained
hashes (``h_i = H(h_{i-1} || namespace || tokens_i)``), so a prefix of tokens is a path of keys,
one edge per block (a node is a block, its parent the block before it), and the prefix-tree
behaviour of a radix cache comes from the keys alone. Identical prefixes hash to identical
keys and are stored once.

Every node belongs to one namespace (a model and a tenant), and the index is scoped by it: a
block is named by its *block id* ``key || namespace`` (64 bytes; the tiers store it under
that id), so the same key in two namespaces is two blocks. One tenant can neither find, nor
collide with, nor squat on another's blocks, whatever keys it sends.

The index is synchronous bookkeeping; the tier manager (:mod:`kvstore.store`) does the I/O.
Primitives:

- ``begin(key, parent, meta, size)`` -> a *pending* node (invisible to ``match``), then
  ``commit(block_id)`` once its bytes are stored, or ``discard(block_id)`` when the write failed;
  a block whose parent chain would lead back to itself is refused (``InvalidBlockError``):
  the tree stays a tree whatever parents a client names;
- ``match(keys, namespace)`` -> the committed nodes of the longest held prefix;
- ``find(key, namespace)``, ``get(block_id)``, ``children_of(block_id)``, ``remove(block_id)``
  (a parent outlives its children: only nodes without children may be removed),
  ``subtree(block_id)`` for deletes;
- per node: the tiers holding it, size, checksum, last access, hit count and lease count;
  a tier is added to or taken from a node with ``add_copy`` / ``drop_copy``, which keep the
  per-tier block counts (``blocks_in(tier)``, O(1): stats never walks the index);
- *tier leaves*: a node a tier holds while none of its children has a copy there (only
  those may leave the tier). The index keeps, per node, how many of its children each tier
  holds (``children_in(block_id, tier)``, O(1)), and tells ``leaf_events`` (a
  :class:`LeafEvents`) each time a node becomes or stops being a leaf of a tier, so the
  eviction order holds candidates only and never scans past a chain's ancestors.

Nodes and the dicts holding them are untracked by the cyclic garbage collector
(:mod:`kvstore.tiers.collector`): a full collection never walks the blocks held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.errors import InvalidBlockError
from kvstore.tiers import collector
from kvstore.wire.blocks import BlockLayout

ID_BYTES = 64


def block_id(key: bytes, namespace: bytes) -> bytes:
    """The id a block is indexed and stored under: its key, then its namespace."""
    return key + namespace


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What the daemon knows of a block's content: enough to rebuild its stored header."""

    namespace: bytes
    num_tokens: int
    layout: BlockLayout


@dataclass(slots=True, eq=False)
class Node:
    """One block in the index.

    Its lifetime fields change only through its methods: ``committed`` (:meth:`mark_committed`,
    by the index), ``doomed`` (:meth:`doom`, :meth:`revive`), ``leases`` (:meth:`hold`,
    :meth:`let_go`), ``busy`` (:meth:`working`) and ``flights`` (:meth:`start_flight`,
    :meth:`end_flight`); :attr:`live` and :attr:`idle` are what callers ask of them.
    """

    key: bytes
    parent: bytes
    meta: BlockMeta
    size: int  # raw payload bytes
    id: bytes = b""  # key || namespace, set by the index
    checksum: int = 0  # xxh3-64 of the raw payload, recorded at commit
    tiers: frozenset[str] = frozenset()  # one shared object per combination (see _TIER_SETS)
    committed: bool = False
    last_access: float = field(default_factory=time.monotonic)
    hits: int = 0
    leases: int = 0
    busy: int = 0  # tier copies in flight; a busy node is not evicted
    doomed: bool = False  # deleted while leased: removed when the last lease goes
    # tier -> how many of this node's children hold a copy there (None: none anywhere)
    held_children: dict[str, int] | None = None
    # Tier writes and the promotion in flight, by tier name (one of each at a time).
    flights: dict[str, asyncio.Task[bool]] = field(default_factory=dict)

    @property
    def namespace(self) -> bytes:
        return self.meta.namespace

    @property
    def parent_id(self) -> bytes:
        return self.parent + self.meta.namespace

    @property
    def pinned(self) -> bool:
        """A lease holds it or a tier copy of it is in flight: it is not evicted."""
        return self.leases > 0 or self.busy > 0

    @property
    def live(self) -> bool:
        """Visible to readers: committed and not deleted."""
        return self.committed and not self.doomed

    @property
    def idle(self) -> bool:
        """Nothing holds it: no lease, no tier copy and no flight in progress."""
        return not (self.leases or self.busy or self.flights)

    def mark_committed(self) -> None:
        """Its write is done: it becomes visible (the index's ``commit``)."""
        self.committed = True

    def doom(self) -> None:
        """Deleted: hidden at once, removed once nothing holds it."""
        self.doomed = True

    def revive(self, now: float) -> None:
        """Put again (a dedup put): not deleted any more, and accessed ``now``."""
        self.doomed = False
        self.last_access = now

    def hold(self) -> None:
        """A lease or a read in progress holds it until :meth:`let_go`."""
        self.leases += 1

    def let_go(self) -> None:
        """Ends one :meth:`hold`.

        Raises:
            RuntimeError: it was not held (a bookkeeping bug, not a request error).
        """
        if self.leases <= 0:
            raise RuntimeError(f"block {self.id.hex()} let go more often than held")
        self.leases -= 1

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """A tier copy of it is in flight meanwhile (it is not evicted)."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1

    def flight(self, what: str) -> asyncio.Task[bool] | None:
        """The tier write or promotion ``what`` in flight, if any."""
        return self.flights.get(what)

    def start_flight(self, what: str, task: asyncio.Task[bool]) -> None:
        self.flights[what] = task

    def end_flight(self, what: str, task: asyncio.Task[bool] | None) -> None:
        """``task`` (``what``) has ended; a later flight of the same ``what`` stays."""
        if self.flights.get(what) is task:
            del self.flights[what]


# Every node's ``tiers`` is one of these shared frozensets: a node is then one object the
# garbage collector tracks, not three (node, set, BlockMeta; the metas are shared too), and a
# full collection over a million blocks takes about a quarter of the time.
_TIER_SETS: dict[frozenset[str], frozenset[str]] = {}


def _tier_set(tiers: frozenset[str]) -> frozenset[str]:
    return _TIER_SETS.setdefault(tiers, tiers)


class LeafEvents(Protocol):
    """Told when an indexed node becomes, or stops being, a leaf of a tier."""

    def leaf_added(self, tier: str, node: Node, freed_by: Node | None) -> None:
        """``node`` is now a leaf of ``tier``: it gained a copy there with no child holding
        one, or ``freed_by``, its last child there, lost its copy."""

    def leaf_removed(self, tier: str, node: Node) -> None:
        """``node`` is no longer a leaf of ``tier``: it lost its copy, or a child gained one."""


class _NoLeafEvents:
    def leaf_added(self, tier: str, node: Node, freed_by: Node | None) -> None:
        return None

    def leaf_removed(self, tier: str, node: Node) -> None:
        return None


class BlockIndex:
    """Nodes by block id and by (namespace, key), with parent -> children links (children may
    arrive before parents)."""

    def __init__(self) -> None:
        self._nodes: dict[bytes, Node] = {}
        self._spaces: dict[bytes, dict[bytes, Node]] = {}  # namespace -> key -> node
        # parent id -> child ids (dicts of bytes, which the garbage collector never tracks)
        self._children: dict[bytes, dict[bytes, None]] = {}
        self._metas: dict[BlockMeta, BlockMeta] = {}  # one BlockMeta object per distinct value
        self._tier_blocks = Counter[str]()  # tier -> indexed nodes it holds a copy of
        self.leaf_events: LeafEvents = _NoLeafEvents()

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block: bytes) -> bool:
        return block in self._nodes

    def nodes(self) -> Iterator[Node]:
        return iter(list(self._nodes.values()))

    def namespaces(self) -> list[bytes]:
        """The namespaces that have nodes."""
        return list(self._spaces)

    def in_namespace(self, namespace: bytes) -> list[Node]:
        """The nodes of ``namespace``, committed or not."""
        return list(self._spaces.get(namespace, {}).values())

    def get(self, block: bytes) -> Node | None:
        return self._nodes.get(block)

    def find(self, key: bytes, namespace: bytes) -> Node | None:
        """The node of ``key`` in ``namespace``, committed or not."""
        space = self._spaces.get(namespace)
        return None if space is None else space.get(key)

    def committed(self, block: bytes) -> Node | None:
        node = self._nodes.get(block)
        return node if node is not None and node.live else None

    def begin(self, key: bytes, parent: bytes, meta: BlockMeta, size: int) -> Node:
        """Adds a pending node. The caller checked that the key is not in the namespace.

        Raises:
            InvalidBlockError: ``parent`` is ``key``, or descends from it (a cycle).
        """
        if self._cycles(key, parent, meta.namespace):
            raise InvalidBlockError(
                f"block {key.hex()[:16]} cannot have parent {parent.hex()[:16]}: that parent "
                f"is the block itself or one of its descendants"
            )
        meta = self._metas.setdefault(meta, meta)
        node = Node(key=key, parent=parent, meta=meta, size=size, id=block_id(key, meta.namespace))
        # The node refers to bytes, shared values and dicts of atoms, and the dicts hold
        # nodes or atoms only: no cycle to find, so the garbage collector never walks them.
        # Everything is allocated before the inserts (see collector.insert).
        collector.untrack(node)
        space = self._spaces.get(meta.namespace)
        if space is None:
            space = {}
            collector.insert(self._spaces, meta.namespace, space)
        siblings = self._children.get(node.parent_id)
        if siblings is None:
            siblings = {}
            collector.insert(self._children, node.parent_id, siblings)
        collector.insert(self._nodes, node.id, node)
        collector.insert(space, key, node)
        siblings[node.id] = None
        for child in self._children.get(node.id, ()):  # children that came first
            for tier in self._nodes[child].tiers:
                self._count_child(node, tier, +1)
        return node

    def _cycles(self, key: bytes, parent: bytes, namespace: bytes) -> bool:
        """Whether ``key`` is ``parent`` or one of its ancestors. Only a block that others
        already name as their parent (children sent before it) can close a cycle, so the
        walk up from ``parent`` runs only then; the tree is acyclic before, so it ends."""
        if parent == key:
            return True
        if not self._children.get(key + namespace):
            return False
        space = self._spaces.get(namespace, {})
        current: bytes | None = parent
        while current is not None:
            if current == key:
                return True
            node = space.get(current)
            current = None if node is None else node.parent
        return False

    def add_copy(self, node: Node, tier: str) -> None:
        """``tier`` now holds a copy of ``node``. A late event for a node no longer indexed
        (discarded meanwhile) changes its ``tiers`` only."""
        if tier in node.tiers:
            return
        node.tiers = _tier_set(node.tiers | {tier})
        if self._nodes.get(node.id) is node:
            self._counted(node, tier, +1)

    def drop_copy(self, node: Node, tier: str) -> None:
        """``tier`` no longer holds a copy of ``node``."""
        if tier not in node.tiers:
            return
        node.tiers = _tier_set(node.tiers - {tier})
        if self._nodes.get(node.id) is node:
            self._counted(node, tier, -1)

    def _counted(self, node: Node, tier: str, change: int) -> None:
        """Counts an indexed node's copy in ``tier`` as gained (+1) or lost (-1)."""
        self._tier_blocks[tier] += change
        if not self.children_in(node.id, tier):
            if change > 0:
                self.leaf_events.leaf_added(tier, node, None)
            else:
                self.leaf_events.leaf_removed(tier, node)
        parent = self._nodes.get(node.parent_id)
        if parent is not None:
            self._count_child(parent, tier, change, node)

    def _count_child(self, parent: Node, tier: str, change: int, child: Node | None = None) -> None:
        held = parent.held_children
        if held is None:
            held = parent.held_children = {}
        count = held.get(tier, 0) + change
        if count:
            held[tier] = count
        else:
            del held[tier]
            if not held:
                parent.held_children = None
        if tier in parent.tiers and count == (1 if change > 0 else 0):
            if change > 0:
                self.leaf_events.leaf_removed(tier, parent)
            else:
                self.leaf_events.leaf_added(tier, parent, child)

    def children_in(self, block: bytes, tier: str) -> int:
        """How many children of ``block`` hold a copy in ``tier``."""
        node = self._nodes.get(block)
        held = None if node is None else node.held_children
        return 0 if held is None else held.get(tier, 0)

    def blocks_in(self, tier: str) -> int:
        """Indexed blocks ``tier`` holds a copy of."""
        return self._tier_blocks[tier]

    def commit(self, block: bytes) -> Node:
        node = self._nodes[block]
        node.mark_committed()
        return node

    def discard(self, block: bytes) -> None:
        """Forgets a node whose write failed (or whose last copy is gone). Copies still
        recorded in its ``tiers`` stop counting (as if dropped) but stay listed."""
        node = self._nodes.get(block)
        if node is None:
            return
        for tier in sorted(node.tiers):
            self._counted(node, tier, -1)
        del self._nodes[block]
        space = self._spaces[node.namespace]
        del space[node.key]
        if not space:
            del self._spaces[node.namespace]
        siblings = self._children.get(node.parent_id)
        if siblings is not None:
            siblings.pop(block, None)
            if not siblings:
                del self._children[node.parent_id]

    def remove(self, block: bytes) -> None:
        """Removes a node; a parent outlives its children."""
        if self._children.get(block):
            raise ValueError(f"block {block.hex()[:16]} still has children; remove them first")
        self.discard(block)

    def children_of(self, block: bytes) -> Collection[bytes]:
        return self._children.get(block, {}).keys()

    def match(self, keys: Sequence[bytes], namespace: bytes) -> list[Node]:
        """The committed nodes of ``namespace`` for the longest prefix of ``keys`` it holds."""
        return self.match_runs(keys, namespace)[0]

    def match_runs(
        self, keys: Sequence[bytes], namespace: bytes
    ) -> tuple[list[Node], list[tuple[frozenset[str], int]]]:
        """:meth:`match`, and the matched nodes' tier sets as runs in key order: one
        ``(tiers, count)`` per change of tier set (a lookup's answer, without a pass per
        block to make it)."""
        matched: list[Node] = []
        runs: list[tuple[frozenset[str], int]] = []
        space = self._spaces.get(namespace)
        if space is None:
            return matched, runs
        last: frozenset[str] | None = None
        start = 0
        for key in keys:  # the checks of committed() inline: this runs per lookup key
            node = space.get(key)
            if node is None or not node.live:
                break
            tiers = node.tiers
            if tiers is not last:  # tier sets are shared objects (see _tier_set)
                if not tiers:
                    break
                if last is not None:
                    runs.append((last, len(matched) - start))
                last, start = tiers, len(matched)
            matched.append(node)
        if last is not None:
            runs.append((last, len(matched) - start))
        return matched, runs

    def subtree(self, block: bytes) -> list[Node]:
        """The node of ``block`` and all its descendants, children before parents."""
        order: list[Node] = []
        seen: set[bytes] = set()
        stack = [block]
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            node = self._nodes.get(current)
            if node is not None:
                order.append(node)
            stack.extend(self._children.get(current, ()))
        return order[::-1]
