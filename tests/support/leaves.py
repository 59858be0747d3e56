"""Brute-force recounts of what the block index keeps incrementally (for consistency tests)."""

from __future__ import annotations

from kvstore.index import BlockIndex


def tier_leaves(index: BlockIndex, tier: str) -> set[bytes]:
    """The ids of indexed nodes ``tier`` holds while no indexed child of theirs holds a copy
    there, found by walking every node."""
    nodes = {node.id: node for node in index.nodes()}
    held_below = {
        node.parent_id for node in nodes.values() if tier in node.tiers and node.parent_id in nodes
    }
    return {block for block, node in nodes.items() if tier in node.tiers} - held_below


def children_in(index: BlockIndex, block: bytes, tier: str) -> int:
    """How many indexed children of ``block`` hold a copy in ``tier``, by walking them."""
    return sum(
        1
        for child in index.children_of(block)
        if (node := index.get(child)) is not None and tier in node.tiers
    )
