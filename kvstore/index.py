"""The radix index: which blocks the store holds, where, and how they chain.

Block keys are chained hashes (``h_i = H(h_{i-1} || namespace || tokens_i)``), so a prefix of
tokens is a path of keys and the radix tree needs one edge per block: a node is a block, its
parent is the block before it. Identical prefixes hash to identical keys and are stored once.

The index is synchronous bookkeeping; the tier manager (:mod:`kvstore.store`) does the I/O.
Primitives:

- ``begin(key, parent, meta, size)`` -> a *pending* node (invisible to ``match``), then
  ``commit(key)`` once its bytes are stored, or ``discard(key)`` when the write failed;
- ``match(keys)`` -> the committed nodes of the longest held prefix;
- ``get(key)``, ``children_of(key)``, ``remove(key)`` (a parent outlives its children: only
  nodes without children may be removed), ``subtree(key)`` for deletes;
- per node: the tiers holding it, size, last access, hit count and lease count.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.blocks import BlockLayout


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What the daemon knows of a block's content: enough to rebuild its stored header."""

    namespace: bytes
    num_tokens: int
    layout: BlockLayout


@dataclass(slots=True, eq=False)
class Node:
    """One block in the index."""

    key: bytes
    parent: bytes
    meta: BlockMeta
    size: int  # raw payload bytes
    tiers: set[str] = field(default_factory=set)
    committed: bool = False
    last_access: float = field(default_factory=time.monotonic)
    hits: int = 0
    leases: int = 0
    busy: int = 0  # tier copies in flight; a busy node is not evicted
    doomed: bool = False  # deleted while leased: removed when the last lease goes

    @property
    def pinned(self) -> bool:
        return self.leases > 0 or self.busy > 0


class RadixIndex:
    """Nodes by key, with parent -> children links (children may arrive before parents)."""

    def __init__(self) -> None:
        self._nodes: dict[bytes, Node] = {}
        self._children: dict[bytes, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._nodes

    def nodes(self) -> Iterator[Node]:
        return iter(list(self._nodes.values()))

    def get(self, key: bytes) -> Node | None:
        return self._nodes.get(key)

    def committed(self, key: bytes) -> Node | None:
        node = self._nodes.get(key)
        return node if node is not None and node.committed and not node.doomed else None

    def begin(self, key: bytes, parent: bytes, meta: BlockMeta, size: int) -> Node:
        """Adds a pending node. The caller checked that ``key`` is not present."""
        node = Node(key=key, parent=parent, meta=meta, size=size)
        self._nodes[key] = node
        self._children.setdefault(parent, set()).add(key)
        return node

    def commit(self, key: bytes) -> Node:
        node = self._nodes[key]
        node.committed = True
        return node

    def discard(self, key: bytes) -> None:
        """Forgets a node whose write failed (or whose last copy is gone)."""
        node = self._nodes.pop(key, None)
        if node is None:
            return
        siblings = self._children.get(node.parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[node.parent]

    def remove(self, key: bytes) -> None:
        """Removes a node; a parent outlives its children."""
        if self._children.get(key):
            raise ValueError(f"block {key.hex()[:16]} still has children; remove them first")
        self.discard(key)

    def children_of(self, key: bytes) -> set[bytes]:
        return self._children.get(key, set())

    def has_children_in(self, key: bytes, tier: str) -> bool:
        return any(
            (child := self._nodes.get(k)) is not None and tier in child.tiers
            for k in self._children.get(key, ())
        )

    def match(self, keys: Sequence[bytes], namespace: bytes | None = None) -> list[Node]:
        """The committed nodes for the longest prefix of ``keys`` that the index holds
        (only blocks of ``namespace`` when given)."""
        matched: list[Node] = []
        nodes = self._nodes  # the checks of committed() inline: this runs per lookup key
        for key in keys:
            node = nodes.get(key)
            if node is None or not node.committed or node.doomed or not node.tiers:
                break
            if namespace is not None and node.meta.namespace != namespace:
                break
            matched.append(node)
        return matched

    def subtree(self, key: bytes) -> list[Node]:
        """``key``'s node and all its descendants, children before parents."""
        order: list[Node] = []
        stack = [key]
        while stack:
            current = stack.pop()
            node = self._nodes.get(current)
            if node is not None:
                order.append(node)
            stack.extend(self._children.get(current, ()))
        return order[::-1]
