"""The daemon's logic behind the RPCs, in plain Python types (the gRPC servicer is a thin shell).

``KVStoreService`` checks every request once, here, and then calls the block store:

- ``register_namespace(model, tenant)`` -> the namespace digest that every other call
  carries; the registry maps digest -> (tenant, block layout), and the store puts the
  namespace's blocks in that tenant's host arena;
- ``lookup`` -> how many leading blocks are held; ``acquire`` -> lease + arena slots,
  ``release(lease_id)``; leases are the caller's tenant's, under an id the client may choose;
- ``reserve`` -> arena slots held for the caller's shm session, which writes them in place,
  then ``commit`` (the writer's checksums recorded, no byte read) or ``abort``; only that
  session can finish them;
- ``get`` -> the leading held blocks; ``put`` -> one block from the streamed data plane;
  with a host tier, ``held`` and ``land`` let the streams read and write blocks in the arena;
- ``prefetch`` -> hints run as named background tasks; ``delete``; ``stats``;
- operations: ``namespaces`` (with usage), ``evict`` (a namespace or a tenant), ``flush``.
  With tokens on, a tenant's token reaches its own tenant's namespaces only, and an operator
  token (tenant :data:`OPERATOR`, ``"token:*"``) every tenant's; ``flush`` needs the latter;
- ``aclose()`` cancels prefetches and waits for the background work to end.

Checks (:mod:`kvstore.checks`), all before any work: keys and parents are 32 bytes, at most
``MAX_KEYS`` keys per call, a block holds exactly ``layout.block_tokens`` tokens and
``layout.payload_bytes`` bytes, a namespace's block fits ``server.max_block_bytes`` and the
top tier, a tenant holds at most ``MAX_NAMESPACES`` namespaces and ``MAX_LEASES`` leases, and
at most ``MAX_TENANTS`` tenants hold namespaces (each has a host arena).
With authentication on, each call carries the caller's tenant: a namespace registered by one
tenant cannot be used, a lease cannot be released and a session cannot be written through,
with the token of another. Errors are the :mod:`kvstore.errors` tree, with messages that name
the bad value.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Self, TypeVar

from kvstore import __version__
from kvstore.budget import LoopBudget
from kvstore.checks import MAX_KEYS, check_count, check_key, check_keys, check_spec
from kvstore.config import Config
from kvstore.errors import (
    InvalidBlockError,
    InvalidRequestError,
    NoArenaError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnknownNamespaceError,
)
from kvstore.index import BlockMeta
from kvstore.results import Acquired, Block, Reserved
from kvstore.sessions import Session, SessionServer
from kvstore.store import BlockStore, Commit, HeldBlock, Landing
from kvstore.tiers.base import Buffer
from kvstore.wire.blocks import KEY_BYTES, BlockLayout, BlockSpec, Spec
from kvstore.wire.namespace import ModelFingerprint, Namespace
from kvstore.wire.results import LookupResult, NamespaceUsage, PutStatus, StoreStats

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
T = TypeVar("T")

MAX_LEASE_SECONDS = 3600.0
MAX_PREFETCH_TASKS = 64  # hints past this many in flight are dropped (they are only hints)
MAX_NAMESPACES = 1024  # per tenant
MAX_TENANTS = 256  # with namespaces registered at once (each has a host arena of its own)
MAX_LEASES = 1 << 16  # per tenant, live at once
OPERATOR = "*"  # the tenant of tokens that may run the operations on every tenant


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a client needs to know before it uses the daemon (the Handshake)."""

    server_version: str
    shm_socket: str  # "": no shared-memory data plane (no host tier, or no unix listener)
    instance_id: bytes
    max_message_bytes: int
    chunk_bytes: int
    lease_seconds: float
    max_block_bytes: int


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
    uptime_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Registered:
    tenant: str
    layout: BlockLayout
    model_name: str = ""


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """A namespace's usage and whose it is (``tenant`` "": found in a tier, not registered
    since the daemon started)."""

    usage: NamespaceUsage
    tenant: str
    model_name: str


class KVStoreService:
    """Validates requests, enforces tenants and calls the block store; see the module doc.

    Args:
        store: A started block store; the service does not own it (``serve`` closes it).
        config: The daemon's configuration (server limits and lease lifetime).
        instance_id: Names this daemon process in the Handshake and shm sessions.
    """

    def __init__(self, store: BlockStore, config: Config, instance_id: bytes = b"") -> None:
        self._store = store
        self._server = config.server
        self._started = time.monotonic()
        self.instance_id = instance_id or secrets.token_bytes(16)
        self.sessions: SessionServer | None = None  # set by the server when it listens on one
        self._namespaces: dict[bytes, _Registered] = {}
        self._per_tenant: Counter[str] = Counter()
        self._prefetches: set[asyncio.Task[int]] = set()
        self._cleanups: set[asyncio.Task[None]] = set()
        self._task_ids = itertools.count(1)
        self._buffered = 0  # bytes of streamed blocks assembled in memory now
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
            shm_socket="" if self.sessions is None else str(self.sessions.path),
            instance_id=self.instance_id,
            max_message_bytes=self._server.max_message_bytes,
            chunk_bytes=self._server.chunk_bytes,
            lease_seconds=self._server.lease_ttl,
            max_block_bytes=self._max_block_bytes(),
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
            ResourceExhaustedError: the model's blocks are larger than the daemon takes, or
                the tenant has ``MAX_NAMESPACES`` already.
        """
        if caller is not None and tenant != caller:
            raise PermissionDeniedError(
                f"a token of tenant {caller!r} cannot register a namespace for tenant {tenant!r}"
            )
        digest = Namespace(model, tenant).digest()
        if digest in self._namespaces:
            return digest
        layout = model.layout()
        if layout.payload_bytes > self._max_block_bytes():
            raise ResourceExhaustedError(
                f"a block of {model.model_name!r} is {layout.payload_bytes} bytes; this daemon "
                f"takes at most {self._max_block_bytes()} (server.max_block_bytes, and the "
                f"{self._store.tiers[0].name} tier's capacity)"
            )
        if self._per_tenant[tenant] >= MAX_NAMESPACES:
            raise ResourceExhaustedError(
                f"tenant {tenant!r} has {MAX_NAMESPACES} namespaces registered already"
            )
        if tenant not in self._per_tenant and len(self._per_tenant) >= MAX_TENANTS:
            raise ResourceExhaustedError(
                f"{MAX_TENANTS} tenants have namespaces registered already; {tenant!r} cannot"
            )
        self._namespaces[digest] = _Registered(tenant, layout, model.model_name)
        self._per_tenant[tenant] += 1
        self._store.register_namespace(digest, tenant)
        log.info("registered namespace %s: %s for tenant %r", digest.hex(), model, tenant)
        return digest

    def layout_of(self, namespace: bytes, *, tenant: str | None = None) -> BlockLayout:
        """The block layout of a registered namespace that ``tenant`` may use.

        Raises:
            InvalidRequestError: ``namespace`` is not 32 bytes.
            UnknownNamespaceError: it was never registered.
            PermissionDeniedError: it belongs to another tenant.
        """
        return self._registered(namespace, tenant).layout

    def _registered(self, namespace: bytes, tenant: str | None) -> _Registered:
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
        return entry

    def _max_block_bytes(self) -> int:
        top = self._store.tiers[0].tier
        return min(self._server.max_block_bytes, top.capacity())

    # -- reads ------------------------------------------------------------------------------

    async def lookup(
        self, namespace: bytes, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> LookupResult:
        """How many leading blocks of ``keys`` are held, and the highest tier of each."""
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        result = await self._store.lookup(keys, namespace)
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
        lease_id: int = 0,
    ) -> Acquired:
        """Leases the leading held blocks, promoted into the arena; their slots in key order.

        The lease is the caller's tenant's, under ``lease_id`` when the client chose one. A
        caller that goes away (deadline, cancel) while blocks are promoted gets its
        cancellation at once; the promotion finishes in the background and its lease is
        released, so nothing stays pinned.

        Raises:
            InvalidRequestError: ``lease_seconds`` is negative, not finite or above an hour,
                or ``lease_id`` names a live lease of the caller.
            ResourceExhaustedError: the tenant holds ``MAX_LEASES`` leases.
            NoArenaError: the daemon has no host tier.
        """
        ttl = self._lease_checks(namespace, keys, lease_seconds, tenant)
        work = asyncio.ensure_future(
            self._store.acquire(keys, namespace, ttl, owner=tenant, lease_id=lease_id)
        )
        return await self._shielded(work, tenant, lambda acquired: acquired)

    async def lookup_and_lease(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        lease_seconds: float = 0.0,
        *,
        tenant: str | None = None,
        lease_id: int = 0,
    ) -> tuple[LookupResult, Acquired | None]:
        """:meth:`lookup`, and the leading blocks already in the arena leased as
        :meth:`acquire` leases them (nothing promoted; None when the first block is not in
        the arena): a host hit in one call.

        Raises:
            InvalidRequestError, ResourceExhaustedError, NoArenaError: as :meth:`acquire`.
        """
        ttl = self._lease_checks(namespace, keys, lease_seconds, tenant)
        work = asyncio.ensure_future(
            self._store.lookup_and_lease(keys, namespace, ttl, owner=tenant, lease_id=lease_id)
        )
        found, acquired = await self._shielded(work, tenant, lambda answer: answer[1])
        self._lookups += 1
        self._lookup_hit_blocks += found.num_blocks
        return found, acquired

    async def release(self, lease_id: int, *, tenant: str | None = None) -> None:
        """Ends one of the caller's leases.

        Raises:
            UnknownLeaseError: not a live lease of the caller's tenant (never issued to it,
                released or expired); a grant still on its way under that id is released
                as soon as it is made.
        """
        await self._store.release(lease_id, owner=tenant)

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
            block = await self._store.get(key, namespace)
            if block is None:
                return
            yield block

    @property
    def has_arena(self) -> bool:
        """Whether there is a host tier, for :meth:`held` and :meth:`land`."""
        return self._store.has_arena

    def held(
        self, namespace: bytes, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> AsyncGenerator[HeldBlock, None]:
        """:meth:`get` without copies: the leading held blocks as views of their leased arena
        slots; it may stop early, the rest is read with :meth:`get` (see :mod:`kvstore.reads`).

        Raises:
            NoArenaError: the daemon has no host tier.
        """
        layout = self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        return self._store.held(keys, namespace, layout.payload_bytes)

    # -- writes through an shm session ------------------------------------------------------

    async def reserve(
        self,
        namespace: bytes,
        blocks: Sequence[Spec],
        *,
        tenant: str | None = None,
        session: bytes = b"",
    ) -> Reservations:
        """Reserves each block: an arena slot that the client writes the payload into, in
        place, before :meth:`commit`; the slot is held for ``session`` until then.

        Every block is checked before any is reserved, so a bad request reserves nothing. A
        block beyond the session's window (the bytes it may hold reserved at once) is
        NO_SPACE (write it later).

        Raises:
            UnknownSessionError: ``session`` is not one of the caller's open sessions.
        """
        layout = self.layout_of(namespace, tenant=tenant)
        check_count("blocks", len(blocks))
        tokens = layout.block_tokens
        for i, spec in enumerate(blocks):
            key, parent = spec.key, spec.parent
            if len(key) != KEY_BYTES or len(parent) != KEY_BYTES or parent == key:
                check_spec(f"blocks[{i}]", spec, layout)  # raises, naming the field
            if spec.num_tokens != tokens:
                check_spec(f"blocks[{i}]", spec, layout)
        writer = self._session(session, tenant)
        ttl = self._server.lease_ttl
        meta = BlockMeta(namespace, tokens, layout)  # every block's: only full blocks are taken
        writes, size = self._store.writes, layout.payload_bytes
        items: list[Reserved] = []
        budget = LoopBudget()  # 512 blocks are ~10 ms of work: others' calls run between
        for spec in blocks:
            key = spec.key  # a wire message makes a new bytes object at each read
            block = key + namespace
            if block in writer.slots:  # named twice: this session writes it
                items.append(Reserved(PutStatus.DEDUP))
                continue
            if not writer.claim(block, size):  # the window is full: the rest waits
                items += [Reserved(PutStatus.NO_SPACE)] * (len(blocks) - len(items))
                break
            try:
                # No await when the arena has room; else it makes room first.
                reserved = writes.reserve_now(key, spec.parent, meta, ttl, writer.id)
                if reserved is None:
                    reserved = await writes.reserve(key, spec.parent, meta, ttl, writer.id)
            except BaseException:
                writer.give(block)
                raise
            if reserved.slot is None:  # DEDUP or NO_SPACE
                writer.give(block)
            elif writer.claims(block):
                writes.hold(reserved.slot)
                writer.slots[block] = reserved.slot
            else:  # its claim ended while it made room (an Abort, the session's end)
                await writes.abort(key, namespace, writer.id)
                reserved = Reserved(PutStatus.NO_SPACE)
            items.append(reserved)
            await budget.tick()
        return Reservations(tuple(items), ttl)

    async def commit(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        *,
        tenant: str | None = None,
        session: bytes = b"",
        checksums: Sequence[int] = (),
    ) -> list[PutStatus]:
        """Makes each block ``session`` wrote in its reserved slot visible: STORED; EXPIRED
        without a live reservation of this session. ``checksums`` (one per key) are the
        writer's sums of what it wrote, recorded as the blocks' without reading them again;
        without them the daemon sums each slot in place.

        Raises:
            InvalidRequestError: ``checksums`` is neither empty nor one per key.
            UnknownSessionError: ``session`` is not one of the caller's open sessions.
        """
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        if checksums and len(checksums) != len(keys):
            raise InvalidRequestError(
                f"checksums must be empty or one per key: {len(keys)} keys, "
                f"{len(checksums)} checksums"
            )
        writer = self._session(session, tenant)
        sums = list(checksums) or [0] * len(keys)
        held = {key for key in keys if writer.slots.get(key + namespace) is not None}
        writes = [
            Commit(key, namespace, writer.id, checksum=total, written=True)
            for key, total in zip(keys, sums, strict=True)
            if key in held
        ]
        try:
            found = iter(await self._store.commit(writes))
        finally:
            self._let_go(writer, namespace, list(held))
        return [next(found) if key in held else PutStatus.EXPIRED for key in keys]

    async def abort(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        *,
        tenant: str | None = None,
        session: bytes = b"",
    ) -> None:
        """Frees ``session``'s reservations of ``keys``; keys without one are ignored."""
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        writer = self._session(session, tenant)
        budget = LoopBudget()
        for key in keys:
            await self._store.abort(key, namespace, owner=writer.id)
            self._let_go(writer, namespace, [key])
            await budget.tick()

    async def close_session(self, session: Session) -> None:
        """Aborts what a closed session left reserved (its client went away) and lets go of
        the slots it held."""
        budget = LoopBudget()
        for block in list(session.slots):
            key, space = block[:KEY_BYTES], block[KEY_BYTES:]
            await self._store.abort(key, space, owner=session.id, abandoned=True)
            self._let_go(session, space, [key])
            await budget.tick()

    def _let_go(self, writer: Session, namespace: bytes, keys: Sequence[bytes]) -> None:
        """Ends ``writer``'s claims on ``keys``: their slots' ranges may pass to other blocks
        once their reservations ended too."""
        for key in keys:
            slot = writer.give(key + namespace)
            if slot is not None:
                self._store.writes.let_go(slot)

    def _session(self, session: bytes, tenant: str | None) -> Session:
        if self.sessions is None:
            raise NoArenaError(
                "this daemon has no shm sessions (no host tier or no unix listener); "
                "write with the Put stream"
            )
        return self.sessions.get(session, tenant)

    # -- writes through the Put stream ------------------------------------------------------

    async def land(
        self, namespace: bytes, spec: BlockSpec, *, tenant: str | None = None
    ) -> Landing | PutStatus:
        """:meth:`put` without copies: an arena slot the caller writes the block into, then
        commits or aborts; or DEDUP, or NO_SPACE (see :mod:`kvstore.writes`).

        Raises:
            InvalidBlockError: as :meth:`put`.
            NoArenaError: the daemon has no host tier.
        """
        layout = self.layout_of(namespace, tenant=tenant)
        check_spec("block", spec, layout)
        self._store.check_arena()
        meta = BlockMeta(namespace, spec.num_tokens, layout)
        return await self._store.writes.land(spec.key, spec.parent, meta)

    async def commit_landing(self, landing: Landing, checksum: int = 0) -> PutStatus:
        """Makes a block landed by the Put stream visible (or CHECKSUM_MISMATCH)."""
        write = Commit(landing.key, landing.namespace, landing.owner, checksum=checksum)
        (status,) = await self._store.commit([write])
        return status

    async def abort_landing(self, landing: Landing) -> None:
        """Frees a landing the Put stream did not finish."""
        await self._store.abort(landing.key, landing.namespace, owner=landing.owner)

    async def put(
        self,
        namespace: bytes,
        spec: BlockSpec,
        payload: Buffer,
        *,
        tenant: str | None = None,
        checksum: int = 0,
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
        return await self._store.put(spec.key, spec.parent, meta, payload, checksum=checksum)

    @contextlib.contextmanager
    def buffered(self, size: int) -> Iterator[bytearray]:
        """A buffer to assemble one streamed block in, within ``server.max_buffered_bytes``.

        Raises:
            ResourceExhaustedError: that many bytes are buffered already.
        """
        limit = self._server.max_buffered_bytes
        if self._buffered + size > limit:
            raise ResourceExhaustedError(
                f"{self._buffered} bytes of streamed blocks are buffered; a {size}-byte block "
                f"would pass server.max_buffered_bytes ({limit})"
            )
        self._buffered += size
        try:
            yield bytearray(size)
        finally:
            self._buffered -= size

    async def delete(
        self, namespace: bytes, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> int:
        """Deletes blocks and their descendants; returns how many blocks went."""
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        return sum([await self._store.delete(key, namespace) for key in keys])

    # -- operations ---------------------------------------------------------------------------

    async def namespaces(self, *, caller: str | None = None) -> list[NamespaceInfo]:
        """The namespaces holding blocks that ``caller`` may see, most bytes first."""
        found: list[NamespaceInfo] = []
        for namespace in self._store.namespaces():
            entry = self._namespaces.get(namespace)
            tenant = "" if entry is None else entry.tenant
            if not _administers(caller, tenant):
                continue
            usage = await self._store.usage_of(namespace)
            if usage.blocks:
                found.append(
                    NamespaceInfo(usage, tenant, "" if entry is None else entry.model_name)
                )
        found.sort(key=lambda info: (-info.usage.size, info.usage.namespace))
        return found

    async def evict(
        self, *, namespace: bytes = b"", tenant: str = "", caller: str | None = None
    ) -> tuple[int, int]:
        """Deletes every block of ``namespace``, or of every namespace ``tenant`` registered,
        from every tier; returns (namespaces, blocks).

        Raises:
            InvalidRequestError: not exactly one of the two is named.
            InvalidBlockError: ``namespace`` is not 32 bytes.
            PermissionDeniedError: it is another tenant's (or not registered, with a tenant's
                token: the same answer, so a token learns nothing of others' namespaces).
        """
        if bool(namespace) == bool(tenant):
            raise InvalidRequestError("evict names exactly one: a namespace or a tenant")
        if namespace:
            check_key("namespace", namespace)
            entry = self._namespaces.get(namespace)
            if not _administers(caller, "" if entry is None else entry.tenant):
                raise PermissionDeniedError(
                    f"namespace {namespace.hex()} is not one of tenant {caller!r}"
                )
            targets = [namespace]
        else:
            if not _administers(caller, tenant):
                raise PermissionDeniedError(
                    f"a token of tenant {caller!r} cannot evict tenant {tenant!r}"
                )
            targets = [ns for ns, entry in self._namespaces.items() if entry.tenant == tenant]
        blocks = 0
        for target in targets:
            blocks += await self._store.evict_namespace(target)
        log.info("evicted %d blocks of %s", blocks,
                 f"namespace {namespace.hex()}" if namespace else f"tenant {tenant!r}")  # fmt: skip
        return len(targets), blocks

    async def flush(self, *, caller: str | None = None) -> int:
        """Copies the blocks only the top tier holds to the tier below (as at shutdown).

        Raises:
            PermissionDeniedError: tokens are on and ``caller`` is not an operator.
        """
        if caller not in (None, OPERATOR):
            raise PermissionDeniedError(f"flush needs an operator token (tenant {OPERATOR!r})")
        return await self._store.flush()

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
            found = await self._store.lookup(chain, namespace)
            below = found.below(top)
            if below:
                queued.append(chain[: found.num_blocks])
                count += below
        if not queued:
            return 0
        if len(self._prefetches) >= MAX_PREFETCH_TASKS:
            self._dropped += 1
            log.debug("prefetch hint of session %r dropped: too many in flight", session_id)
            return 0
        name = f"prefetch-{next(self._task_ids)}-{session_id[:64] or 'anonymous'}"
        task = asyncio.create_task(self._promote(namespace, queued), name=name)
        self._prefetches.add(task)
        task.add_done_callback(self._prefetch_done)
        return count

    async def _promote(self, namespace: bytes, chains: list[Sequence[bytes]]) -> int:
        return sum([await self._store.prefetch(chain, namespace) for chain in chains])

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
            uptime_seconds=time.monotonic() - self._started,
        )

    # -- internals --------------------------------------------------------------------------

    def _ttl(self, lease_seconds: float) -> float:
        if not math.isfinite(lease_seconds) or not 0 <= lease_seconds <= MAX_LEASE_SECONDS:
            raise InvalidRequestError(
                f"lease_seconds must be in 0..{MAX_LEASE_SECONDS:g} (0: the daemon's default "
                f"{self._server.lease_ttl:g}), got {lease_seconds}"
            )
        return lease_seconds or self._server.lease_ttl

    def _lease_checks(
        self, namespace: bytes, keys: Sequence[bytes], lease_seconds: float, tenant: str | None
    ) -> float:
        """Checks a leasing call's arguments and the tenant's lease count; the lease's TTL."""
        self.layout_of(namespace, tenant=tenant)
        check_keys(keys)
        ttl = self._ttl(lease_seconds)
        if self._store.leases_of(tenant) >= MAX_LEASES:
            raise ResourceExhaustedError(
                f"tenant {tenant!r} holds {MAX_LEASES} leases; release some first"
            )
        return ttl

    async def _shielded(
        self,
        work: asyncio.Future[T],
        tenant: str | None,
        lease_of: Callable[[T], Acquired | None],
    ) -> T:
        """``work``'s answer; a caller that goes away (deadline, cancel) gets its
        cancellation at once, and the lease ``work`` grants is released when it is done."""
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            self._release_when_done(work, tenant, lease_of)
            raise

    def _release_when_done(
        self,
        work: asyncio.Future[T],
        tenant: str | None,
        lease_of: Callable[[T], Acquired | None],
    ) -> None:
        async def release() -> None:
            with contextlib.suppress(Exception):
                acquired = lease_of(await work)
                if acquired is not None:
                    await self._store.release(acquired.lease.lease_id, owner=tenant)

        task = asyncio.create_task(release(), name=f"release-abandoned-{next(self._task_ids)}")
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)


def _administers(caller: str | None, tenant: str) -> bool:
    """Whether ``caller`` (None: tokens are off) may see and evict ``tenant``'s namespaces."""
    return caller is None or caller == OPERATOR or (bool(tenant) and caller == tenant)
