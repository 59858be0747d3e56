"""The daemon's own records: blocks read from a tier, leases and what the arena hands out.

The values a call answers (put outcomes, lookups, statistics) are shared with the client:
:mod:`kvstore.wire.results`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.index import BlockMeta
from kvstore.tiers.allocator import Slot
from kvstore.wire.results import PutStatus


@dataclass(frozen=True, slots=True)
class Block:
    key: bytes
    parent: bytes
    meta: BlockMeta
    # raw layer-major KV: [layer][k|v][kv_head][token][head_dim]; a large block read from
    # the host tier is a read-only view of a new buffer (one copy, hashed as it is made)
    payload: bytes | memoryview
    tier: str  # where this read found it
    checksum: int = 0  # xxh3-64 of the payload


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: int
    num_blocks: int
    expires_at: float  # time.monotonic() deadline


@dataclass(frozen=True, slots=True)
class Acquired:
    """Leased blocks in a host arena: ``slots[i]`` holds the raw payload of block i, whose
    xxh3-64 is ``checksums[i]``; every slot lies in the arena named ``arena_id``."""

    lease: Lease
    slots: tuple[Slot, ...]
    arena_id: bytes = b""
    checksums: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Reserved:
    """Outcome of a reservation: ``slot`` is set when ``status`` is RESERVED."""

    status: PutStatus
    slot: Slot | None = None
