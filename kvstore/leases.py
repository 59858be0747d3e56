"""Leases: blocks a reader is using, protected from eviction and deletion until released.

``grant(nodes, ttl)`` raises each node's lease count and returns a :class:`Lease`;
``release(lease_id)`` lowers them again (a deleted block is freed when its last lease goes);
``expire(now)`` ends leases whose holder never released them (a crashed client).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import UnknownLeaseError
from kvstore.index import Node, RadixIndex
from kvstore.results import Lease
from kvstore.tiering import Placement

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    keys: tuple[bytes, ...]
    expires_at: float


class LeaseTable:
    """Outstanding leases by id."""

    def __init__(self, index: RadixIndex, placement: Placement, default_ttl: float) -> None:
        self._index = index
        self._placement = placement
        self.default_ttl = default_ttl
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def grant(self, nodes: Sequence[Node], ttl: float | None = None) -> Lease:
        """Leases ``nodes`` for ``ttl`` seconds (default ``default_ttl``)."""
        for node in nodes:
            node.leases += 1
        expires_at = time.monotonic() + (self.default_ttl if ttl is None or ttl <= 0 else ttl)
        lease_id = next(self._ids)
        self._entries[lease_id] = _Entry(tuple(node.key for node in nodes), expires_at)
        return Lease(lease_id, len(nodes), expires_at)

    async def release(self, lease_id: int) -> None:
        """Ends a lease.

        Raises:
            UnknownLeaseError: the lease was never issued, or already ended.
        """
        entry = self._entries.pop(lease_id, None)
        if entry is None:
            raise UnknownLeaseError(f"lease {lease_id} is unknown, released or expired")
        for key in entry.keys:
            node = self._index.get(key)
            if node is not None:
                node.leases -= 1
                await self._placement.settle(node)

    async def expire(self, now: float) -> int:
        """Ends every lease past its deadline; returns how many."""
        expired = [lease_id for lease_id, e in self._entries.items() if e.expires_at <= now]
        for lease_id in expired:
            log.info("lease %d expired", lease_id)
            await self.release(lease_id)
        return len(expired)
