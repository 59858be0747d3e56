"""The daemon's logic behind the RPCs, in plain Python types (the gRPC servicer is a thin shell).

``KVStoreService`` checks every request once, here, and then calls the block store:

- ``register_namespace(model, tenant)`` -> the namespace digest that every other call
  carries; the registry maps digest -> (tenant, block layout);
- ``lookup`` -> how many leading blocks are held; ``acquire`` -> lease + arena slots,
  ``release(lease_id)``;
- ``reserve`` -> arena slots to write, then ``commit`` (or ``abort``);
- ``get`` -> the leading held blocks; ``put`` -> one block from the streamed data plane;
  with a host tier, ``held`` and ``land`` let the streams read and write blocks in the arena;
- ``prefetch`` -> hints run as named background tasks; ``delete``; ``stats``;
- ``aclose()`` cancels prefetches and waits for the background work to end.

Checks (:mod:`kvstore.checks`): keys and parents are 32 bytes, at most ``MAX_KEYS`` keys per
call, a block holds exactly ``layout.block_tokens`` tokens and ``layout.payload_bytes`` bytes.
With authentication on, each call carries the caller's tenant: a namespace registered by one
tenant cannot be used, and a lease cannot be released, with the token of another. Errors are
the :mod:`kvstore.errors` tree, with messages that name the bad value.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Self

from kvstore import __version__
from kvstore.blocks import BlockLayout
from kvstore.checks import (
    KEY_BYTES,
    MAX_KEYS,
    BlockSpec,
    check_count,
    check_key,
    check_keys,
    check_spec,
)
from kvstore.config import Config
from kvstore.errors import (
    InvalidBlockError,
    InvalidRequestError,
    NoArenaError,
    PermissionDeniedError,
    UnknownNamespaceError,
)
from kvstore.index import BlockMeta
from kvstore.namespace import ModelFingerprint, Namespace
from kvstore.results import (
    Acquired,
    ArenaInfo,
    Block,
    LookupResult,
    PutStatus,
    Reserved,
    StoreStats,
)
from kvstore.store import BlockStore
from kvstore.streams import ArenaStreams, HeldBlock, Landing
from kvstore.tiers.base import Buffer
from kvstore.tiers.host import HostTier

__all__ = [
    "MAX_KEYS",
    "BlockSpec",
    "KVStoreService",
    "Reservations",
    "ServerInfo",
    "ServiceStats",
    "check_spec",
]

log = logging.getLogger(__name__)

MAX_LEASE_SECONDS = 3600.0
MAX_PREFETCH_TASKS = 64  # hints past this many in flight are dropped (they are only hints)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a client needs to know before it uses the daemon (the Handshake)."""

    server_version: str
    arena: ArenaInfo | None  # None: no host tier, so no shared-memory data plane
    max_message_bytes: int
    chunk_bytes: int
    lease_seconds: float


@dataclass(frozen=True, slots=True)
class Reservations:
    """One outcome per reserved block, and how long the reservations live."""

    items: tuple[Reserved, ...]
    expires_in: float


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """The store's statistics and the service's own counters."""

    store: StoreStats
    lookups: int
    lookup_hit_blocks: int
    prefetches_in_flight: int
    prefetches_dropped: int


@dataclass(frozen=True, slots=True)
class _Registered:
    tenant: str
    layout: BlockLayout


class KVStoreService:
    """Validates requests, enforces tenants and calls the block store; see the module doc.

    Args:
        store: A started block store; the service does not own it (``serve`` closes it).
        config: The daemon's configuration (server limits and lease lifetime).
    """

    def __init__(self, store: BlockStore, config: Config) -> None:
        self._store = store
        self._server = config.server
        top = store.tiers[0].tier
        self._streams = ArenaStreams(store, top) if isinstance(top, HostTier) else None
        self._namespaces: dict[bytes, _Registered] = {}
        self._lease_owners: dict[int, tuple[str | None, float]] = {}  # id -> (tenant, expiry)
        self._prune_at = 1024
        self._prefetches: set[asyncio.Task[int]] = set()
        self._cleanups: set[asyncio.Task[None]] = set()
        self._task_ids = itertools.count(1)
        self._lookups = self._lookup_hit_blocks = self._dropped = 0

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancels prefetches in flight and waits for every background task to end."""
        for task in self._prefetches:
            task.cancel()
        pending = [*self._prefetches, *self._cleanups]
        await asyncio.gather(*pending, return_exceptions=True)

    # -- namespaces -------------------------------------------------------------------------

    def handshake(self) -> ServerInfo:
        return ServerInfo(
            server_version=__version__,
            arena=self._store.arena(),
            max_message_bytes=self._server.max_message_bytes,
            chunk_bytes=self._server.chunk_bytes,
            lease_seconds=self._server.lease_ttl,
        )

    def register_namespace(
        self, model: ModelFingerprint, tenant: str, *, caller: str | None = None
    ) -> bytes:
        """Registers ``model`` for ``tenant``; returns the 32-byte namespace digest.

        Registering again is harmless and returns the same digest.

        Args:
            model: The model fingerprint.
            tenant: The tenant salt the client also uses to compute its block keys.
            caller: The authenticated tenant, or None when authentication is off.

        Raises:
            PermissionDeniedError: ``caller`` registers for another tenant.
        """
        if caller is not None and tenant != caller:
            raise PermissionDeniedError(
                f"a token of tenant {caller!r} cannot register a namespace for tenant {tenant!r}"
            )
        digest = Namespace(model, tenant).digest()
        if digest not in self._namespaces:
            self._namespaces[digest] = _Registered(tenant, model.layout())
            log.info("registered namespace %s: %s for tenant %r", digest.hex(), model, tenant)
        return digest

    def layout_of(self, namespace: bytes, *, tenant: str | None = None) -> BlockLayout:
        """The block layout of a registered namespace that ``tenant`` may use.

        Raises:
            InvalidRequestError: ``namespace`` is not 32 bytes.
            UnknownNamespaceError: it was never registered.
            PermissionDeniedError: it belongs to another tenant.
        """
        if len(namespace) != KEY_BYTES:
            raise InvalidRequestError(
                f"namespace must be a {KEY_BYTES}-byte digest, got {len(namespace)} bytes"
            )
        entry = self._namespaces.get(namespace)
        if entry is None:
            raise UnknownNamespaceError(
                f"namespace {namespace.hex()} is not registered; call RegisterNamespace first"
            )
        if tenant is not None and entry.tenant != tenant:
            raise PermissionDeniedError(
                f"namespace {namespace.hex()} belongs to another tenant than {tenant!r}"
            )
        return entry.layout

    # -- reads ------------------------------------------------------------------------------

    async def lookup(
        self, namespace: bytes, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> LookupResult:
        """How many leading blocks of ``keys`` are held, and the highest tier of each."""
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        result = await self._store.lookup(keys, namespace=namespace)
        self._lookups += 1
        self._lookup_hit_blocks += result.num_blocks
        return result

    async def acquire(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        lease_seconds: float = 0.0,
        *,
        tenant: str | None = None,
    ) -> Acquired:
        """Leases the leading held blocks, promoted into the arena; their slots in key order.

        A caller that goes away (deadline, cancel) while blocks are promoted gets its
        cancellation at once; the promotion finishes in the background and its lease is
        released, so nothing stays pinned.

        Raises:
            InvalidRequestError: ``lease_seconds`` is negative, not finite or above an hour.
            NoArenaError: the daemon has no host tier.
        """
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        ttl = self._ttl(lease_seconds)
        work = asyncio.ensure_future(self._store.acquire(keys, namespace=namespace, ttl=ttl))
        try:
            acquired = await asyncio.shield(work)
        except asyncio.CancelledError:
            self._release_when_done(work)
            raise
        self._own_lease(acquired, tenant)
        return acquired

    async def release(self, lease_id: int, *, tenant: str | None = None) -> None:
        """Ends a lease.

        Raises:
            UnknownLeaseError: never issued, already released or expired.
            PermissionDeniedError: the lease was granted to another tenant.
        """
        owner = self._lease_owners.get(lease_id)
        if tenant is not None and owner is not None and owner[0] != tenant:
            raise PermissionDeniedError(f"lease {lease_id} belongs to another tenant")
        try:
            await self._store.release(lease_id)
        finally:
            self._lease_owners.pop(lease_id, None)

    def get(
        self, namespace: bytes, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> AsyncIterator[Block]:
        """The leading held blocks of ``keys``, in order; stops at the first miss.

        The request is checked before this returns; blocks are read as they are iterated.
        """
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        return self._blocks(namespace, keys)

    async def _blocks(self, namespace: bytes, keys: Sequence[bytes]) -> AsyncIterator[Block]:
        for key in keys:
            block = await self._store.get(key, namespace=namespace)
            if block is None:
                return
            yield block

    @property
    def has_arena(self) -> bool:
        """Whether there is a host tier, for :meth:`held` and :meth:`land`."""
        return self._streams is not None

    def held(
        self, namespace: bytes, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> AsyncGenerator[HeldBlock, None]:
        """:meth:`get` without copies: the leading held blocks as views of their leased arena
        slots; it may stop early, the rest is read with :meth:`get` (see :mod:`kvstore.streams`).

        Raises:
            NoArenaError: the daemon has no host tier.
        """
        layout = self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        return self._require_streams().held(keys, namespace, layout.payload_bytes)

    # -- writes -----------------------------------------------------------------------------

    async def reserve(
        self, namespace: bytes, blocks: Sequence[BlockSpec], *, tenant: str | None = None
    ) -> Reservations:
        """Holds arena slots for blocks the client writes in place, then commits.

        Every block is checked before any is reserved, so a bad request reserves nothing.
        """
        layout = self.layout_of(namespace, tenant=tenant)
        check_count("blocks", len(blocks))
        for i, spec in enumerate(blocks):
            check_spec(f"blocks[{i}]", spec, layout)
        ttl = self._server.lease_ttl
        items = []
        for spec in blocks:
            meta = BlockMeta(namespace, spec.num_tokens, layout)
            items.append(await self._store.reserve(spec.key, spec.parent, meta, ttl=ttl))
        return Reservations(tuple(items), ttl)

    async def commit(
        self, namespace: bytes, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> list[PutStatus]:
        """Makes reserved blocks visible: STORED each, or EXPIRED without a live reservation."""
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        return [await self._store.commit(key) for key in keys]

    async def abort(
        self, namespace: bytes, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        """Frees reservations; keys without one are ignored."""
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        for key in keys:
            await self._store.abort(key)

    async def land(
        self, namespace: bytes, spec: BlockSpec, *, tenant: str | None = None
    ) -> Landing | PutStatus:
        """:meth:`put` without copies: an arena slot the caller writes the block into, then
        commits or aborts; or DEDUP, or NO_SPACE (see :mod:`kvstore.streams`).

        Raises:
            InvalidBlockError: as :meth:`put`.
            NoArenaError: the daemon has no host tier.
        """
        layout = self.layout_of(namespace, tenant=tenant)
        check_spec("block", spec, layout)
        meta = BlockMeta(namespace, spec.num_tokens, layout)
        return await self._require_streams().land(spec.key, spec.parent, meta)

    async def put(
        self, namespace: bytes, spec: BlockSpec, payload: Buffer, *, tenant: str | None = None
    ) -> PutStatus:
        """Stores one block received through the streamed data plane.

        Raises:
            InvalidBlockError: a malformed key or parent, a token count other than
                ``block_tokens``, or a payload of the wrong size.
        """
        layout = self.layout_of(namespace, tenant=tenant)
        check_spec("block", spec, layout)
        size = memoryview(payload).nbytes
        if size != layout.payload_bytes:
            raise InvalidBlockError(
                f"block {spec.key.hex()[:16]} has {size} payload bytes; its layout "
                f"needs {layout.payload_bytes}"
            )
        meta = BlockMeta(namespace, spec.num_tokens, layout)
        return await self._store.put(spec.key, spec.parent, meta, payload)

    async def delete(
        self, namespace: bytes, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> int:
        """Deletes blocks and their descendants; returns how many blocks went."""
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        return sum([await self._store.delete(key, namespace=namespace) for key in keys])

    # -- hints and statistics ---------------------------------------------------------------

    async def prefetch(
        self,
        namespace: bytes,
        chains: Sequence[Sequence[bytes]],
        *,
        session_id: str = "",
        tenant: str | None = None,
    ) -> int:
        """Queues the held blocks of ``chains`` that live below the host tier for promotion.

        Returns:
            How many blocks were queued; 0 when the hint was dropped (too many in flight).
        """
        self.layout_of(namespace, tenant=tenant)
        check_count("keys in chains", sum(len(chain) for chain in chains))
        for c, chain in enumerate(chains):
            for i, key in enumerate(chain):
                check_key(f"chains[{c}].keys[{i}]", key)
        top = self._store.tiers[0].name
        queued: list[Sequence[bytes]] = []
        count = 0
        for chain in chains:
            found = await self._store.lookup(chain, namespace=namespace)
            below = sum(tier != top for tier in found.tiers)
            if below:
                queued.append(chain[: found.num_blocks])
                count += below
        if not queued:
            return 0
        if len(self._prefetches) >= MAX_PREFETCH_TASKS:
            self._dropped += 1
            log.debug("prefetch hint of session %r dropped: too many in flight", session_id)
            return 0
        name = f"prefetch-{next(self._task_ids)}-{session_id or 'anonymous'}"
        task = asyncio.create_task(self._promote(namespace, queued), name=name)
        self._prefetches.add(task)
        task.add_done_callback(self._prefetch_done)
        return count

    async def _promote(self, namespace: bytes, chains: list[Sequence[bytes]]) -> int:
        return sum([await self._store.prefetch(chain, namespace=namespace) for chain in chains])

    def _prefetch_done(self, task: asyncio.Task[int]) -> None:
        self._prefetches.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.warning("%s failed: %s", task.get_name(), error)

    async def wait_prefetches(self) -> None:
        """Waits until the prefetches queued so far are done (for tests and shutdown)."""
        await asyncio.gather(*self._prefetches, return_exceptions=True)

    def stats(self) -> ServiceStats:
        return ServiceStats(
            store=self._store.stats(),
            lookups=self._lookups,
            lookup_hit_blocks=self._lookup_hit_blocks,
            prefetches_in_flight=len(self._prefetches),
            prefetches_dropped=self._dropped,
        )

    # -- internals --------------------------------------------------------------------------

    def _ttl(self, lease_seconds: float) -> float:
        if not math.isfinite(lease_seconds) or not 0 <= lease_seconds <= MAX_LEASE_SECONDS:
            raise InvalidRequestError(
                f"lease_seconds must be in 0..{MAX_LEASE_SECONDS:g} (0: the daemon's default "
                f"{self._server.lease_ttl:g}), got {lease_seconds}"
            )
        return lease_seconds or self._server.lease_ttl

    def _require_streams(self) -> ArenaStreams:
        if self._streams is None:
            raise NoArenaError("the arena data plane needs the host tier (host.enabled)")
        return self._streams

    def _own_lease(self, acquired: Acquired, tenant: str | None) -> None:
        now = time.monotonic()
        if len(self._lease_owners) >= self._prune_at:  # expired leases: amortised O(1)
            live = {i: o for i, o in self._lease_owners.items() if o[1] > now}
            self._lease_owners = live
            self._prune_at = max(1024, 2 * len(live))
        self._lease_owners[acquired.lease.lease_id] = (tenant, acquired.lease.expires_at)

    def _release_when_done(self, work: asyncio.Future[Acquired]) -> None:
        async def release() -> None:
            with contextlib.suppress(Exception):
                acquired = await work
                await self._store.release(acquired.lease.lease_id)

        task = asyncio.create_task(release(), name=f"release-abandoned-{next(self._task_ids)}")
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
