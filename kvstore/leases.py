"""Leases: blocks a reader is using, protected from eviction, deletion and slot reuse.

A lease belongs to an *owner* (the daemon: the caller's tenant, ``None`` without
authentication) and is named by a 64-bit id, which the owner may choose itself *before* the
call that grants it: then a caller that gives up (cancelled, timed out, its reply lost) can
release the lease by that id whether or not it was granted yet, and nothing stays held.

- ``grant(nodes, ttl, owner=..., lease_id=..., slots=...)`` raises each node's lease count,
  pins the host slots the reader will touch, and returns a :class:`Lease`; a grant under an
  id its owner already released (a *tombstone*) is released at once;
- ``release(lease_id, owner=...)`` lowers the counts and unpins the slots (a deleted block is
  freed when its last lease goes); an unknown id leaves a tombstone for ``default_ttl``;
- ``expire(now)`` ends leases whose holder never released them (a crashed client).

Leases are per owner: one owner can neither see nor end another's.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.budget import LoopBudget
from kvstore.errors import InvalidRequestError, UnknownLeaseError
from kvstore.index import BlockIndex, Node
from kvstore.results import Lease
from kvstore.tiering import Placement
from kvstore.tiers.allocator import Slot

log = logging.getLogger(__name__)

MAX_TOMBSTONES = 1 << 16  # ids released before their grant, remembered for one lease lifetime
LeaseKey = tuple[object, int]


@dataclass(slots=True)
class _Entry:
    blocks: tuple[bytes, ...]
    slots: tuple[Slot, ...]
    expires_at: float


class LeaseTable:
    """Outstanding leases by (owner, id)."""

    def __init__(
        self,
        index: BlockIndex,
        placement: Placement,
        default_ttl: float,
        unpin: Callable[[Slot], None] | None = None,
    ) -> None:
        self._index = index
        self._placement = placement
        self.default_ttl = default_ttl
        self._unpin = unpin
        self._entries: dict[LeaseKey, _Entry] = {}
        self._per_owner: Counter[object] = Counter()
        self._tombstones: OrderedDict[LeaseKey, float] = OrderedDict()
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, owner: object) -> int:
        """Leases ``owner`` holds now."""
        return self._per_owner[owner]

    def grant(
        self,
        nodes: Sequence[Node],
        ttl: float | None = None,
        *,
        owner: object = None,
        lease_id: int = 0,
        slots: Sequence[Slot] = (),
    ) -> Lease:
        """Leases ``nodes`` (and keeps ``slots``, already pinned, until the lease ends).

        Args:
            nodes: The leased blocks.
            ttl: Seconds the lease lives (default ``default_ttl``).
            owner: Who may release it.
            lease_id: The id the owner chose, or 0 for a new one.
            slots: Host slots pinned for the reader; unpinned when the lease ends.

        Raises:
            InvalidRequestError: ``lease_id`` names a live lease of ``owner``.
        """
        lease_id = lease_id or next(self._ids)
        key = (owner, lease_id)
        if key in self._entries:
            raise InvalidRequestError(f"lease id {lease_id} is in use; choose another")
        expires_at = time.monotonic() + (self.default_ttl if ttl is None or ttl <= 0 else ttl)
        for node in nodes:
            node.hold()
        self._entries[key] = _Entry(tuple(n.id for n in nodes), tuple(slots), expires_at)
        self._per_owner[owner] += 1
        return Lease(lease_id, len(nodes), expires_at)

    def released_early(self, lease_id: int, owner: object) -> bool:
        """Whether ``owner`` released ``lease_id`` before it was granted (and forgets that)."""
        return self._tombstones.pop((owner, lease_id), None) is not None

    async def release(self, lease_id: int, *, owner: object = None) -> None:
        """Ends a lease.

        Raises:
            UnknownLeaseError: the lease is not (or no longer) held by ``owner``; its id is
                remembered, so a grant still on its way under it is released at once.
        """
        entry = self._entries.pop((owner, lease_id), None)
        if entry is None:
            self._remember(owner, lease_id)
            raise UnknownLeaseError(f"lease {lease_id} is unknown, released or expired")
        await self._end(owner, entry)

    async def expire(self, now: float) -> int:
        """Ends every lease past its deadline; returns how many."""
        expired = [key for key, e in self._entries.items() if e.expires_at <= now]
        ended = 0
        budget = LoopBudget()  # thousands of leases may end at once
        for key in expired:
            entry = self._entries.pop(key, None)
            if entry is None:  # released while the sweep yielded
                continue
            log.info("lease %d expired", key[1])
            await self._end(key[0], entry)
            ended += 1
            await budget.tick()
        while self._tombstones and next(iter(self._tombstones.values())) <= now:
            self._tombstones.popitem(last=False)
        return ended

    async def _end(self, owner: object, entry: _Entry) -> None:
        self._per_owner[owner] -= 1
        if not self._per_owner[owner]:
            del self._per_owner[owner]
        if self._unpin is not None:
            for slot in entry.slots:
                self._unpin(slot)
        get, settle = self._index.get, self._placement.settle
        for block in entry.blocks:
            node = get(block)
            if node is not None:
                node.let_go()
                if node.doomed or not node.tiers:  # else settling it would do nothing
                    await settle(node)

    def _remember(self, owner: object, lease_id: int) -> None:
        self._tombstones[(owner, lease_id)] = time.monotonic() + self.default_ttl
        self._tombstones.move_to_end((owner, lease_id))
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
