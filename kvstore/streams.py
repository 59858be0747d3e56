"""The streamed data plane's side of the host arena: blocks sent and received in place.

A remote client's Get and Put streams move the same bytes as the shared-memory data plane, so
with a host tier the daemon uses that plane itself instead of copying whole blocks in and out
of the arena:

- ``held(keys, namespace, block_bytes)``: the leading held blocks as read-only views of their
  arena slots, leased (and promoted, as Acquire does) ``LEASED_BYTES`` at a time, so that a
  long chain neither fills the arena nor waits for all of it; each slot is also pinned, so its
  bytes outlive a lease that expires under a slow reader. It stops at the first block it could
  not lease (a miss, or no room left): the caller reads the rest by copy;
- ``land(key, parent, meta)`` -> a :class:`Landing`: an arena slot reserved for a block whose
  chunks are copied straight into it; the stream then commits it, or aborts it when it fails.

Requests are checked by the caller (:class:`~kvstore.service.KVStoreService`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from kvstore.errors import UnknownLeaseError
from kvstore.index import BlockMeta
from kvstore.store import BlockStore
from kvstore.tiers.allocator import Slot
from kvstore.tiers.host import HostTier
from kvstore.wire.results import PutStatus

__all__ = ["ArenaStreams", "HeldBlock", "Landing"]

LEASED_BYTES = 64 << 20  # arena bytes that one Get stream holds leased at a time
LANDING_SECONDS = 3600.0  # a reservation the daemon's own stream commits or aborts


@dataclass(frozen=True, slots=True)
class HeldBlock:
    """A leased block for the Get stream: its bytes in the arena, not a copy."""

    tier: str  # where the block was found (it is in the arena now)
    payload: memoryview  # its slot, read-only; valid until the next block is asked for
    checksum: int  # xxh3-64 of the payload


@dataclass(frozen=True, slots=True)
class Landing:
    """An arena slot reserved for a block of the Put stream: write it, then commit or abort."""

    key: bytes
    namespace: bytes
    slot: memoryview  # writable; release it once the block is committed or aborted
    deadline: float  # time.monotonic() from which the reservation may be reclaimed
    owner: tuple[str, int] = field(default=("stream", 0))  # who may commit or abort it


class ArenaStreams:
    """Leases and reservations in the host arena on behalf of the streams; see the module doc."""

    def __init__(self, store: BlockStore, host: HostTier) -> None:
        self._store = store
        self._host = host
        self._landings = itertools.count(1)

    async def held(
        self, keys: Sequence[bytes], namespace: bytes, block_bytes: int
    ) -> AsyncGenerator[HeldBlock, None]:
        """The leading held blocks of ``keys`` as views of their arena slots; see the module doc.

        Close the iterator (``contextlib.aclosing``) when stopping early: that ends its lease.
        """
        batch = max(1, LEASED_BYTES // block_bytes)
        for start in range(0, len(keys), batch):
            asked = keys[start : start + batch]
            async with self._leased(asked, namespace) as blocks:
                for block in blocks:
                    yield block
            if len(blocks) < len(asked):
                return

    @contextlib.asynccontextmanager
    async def _leased(
        self, keys: Sequence[bytes], namespace: bytes
    ) -> AsyncIterator[list[HeldBlock]]:
        """The leading held blocks of ``keys``, leased and pinned until the context exits."""
        host = self._host
        found = await self._store.lookup(keys, namespace)  # before promotion moves them up
        acquired = await self._store.acquire(keys, namespace, owner=_OWNER)
        pinned: list[Slot] = []
        views: list[memoryview] = []
        try:
            for key in keys[: len(acquired.slots)]:
                slot = host.pin(key + namespace)
                if slot is None:  # cannot happen while leased: stop rather than skip a block
                    break
                pinned.append(slot)
                views.append(host.view(slot).toreadonly())
            tiers = [*found.tiers, *[host.name] * len(views)]  # adopted while promoting
            sums = acquired.checksums
            yield [HeldBlock(*held) for held in zip(tiers, views, sums, strict=False)]
        finally:
            for view in views:
                view.release()
            for slot in pinned:
                host.unpin(slot)
            with contextlib.suppress(UnknownLeaseError):  # it expired: the pins kept the bytes
                await self._store.release(acquired.lease.lease_id, owner=_OWNER)

    async def land(self, key: bytes, parent: bytes, meta: BlockMeta) -> Landing | PutStatus:
        """Reserves an arena slot for a block of the Put stream, to be written in place.

        The stream owns the reservation and ends it in every case, so it lives up to an hour,
        not the lease lifetime given to a client that writes a slot itself.

        Returns:
            The slot to write, then commit or abort by key; ``DEDUP`` when the block is held
            already; ``NO_SPACE`` when the arena has no room (store it whole instead).
        """
        deadline = time.monotonic() + LANDING_SECONDS  # the reservation's clock starts later
        owner = ("stream", next(self._landings))
        reserved = await self._store.reserve(key, parent, meta, ttl=LANDING_SECONDS, owner=owner)
        if reserved.slot is None:
            return reserved.status
        return Landing(key, meta.namespace, self._host.view(reserved.slot), deadline, owner)

    async def commit(self, landing: Landing, checksum: int = 0) -> PutStatus:
        """Makes a landed block visible (STORED), or CHECKSUM_MISMATCH (not stored)."""
        return await self._store.commit(
            landing.key, landing.namespace, owner=landing.owner, checksum=checksum
        )

    async def abort(self, landing: Landing) -> None:
        """Frees a landing the stream did not finish."""
        await self._store.abort(landing.key, landing.namespace, owner=landing.owner)


_OWNER = object()  # the owner of the daemon's own leases: no tenant can name it
