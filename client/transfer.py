"""The two data planes' protocols, each for one namespace digest and one key chain.

shm (an shm session with the daemon is open):

- reads: ``acquire`` (or ``find``: a lookup that also leases what is in the arena) ->
  (lease, slots in the arena) -> copy or view the slots -> ``end_lease``. On a session whose
  socket carries calls, these go there (:mod:`kvstore.client.calls`), else over gRPC. The
  lease id is chosen here, before the call, so that whatever happens to the caller (a
  cancel, a timeout, a reply that never arrives) the lease is released by that id in a task
  of its own: nothing stays held until it expires. A read that ends while the lease is sure
  to hold still (``Leased.alive_until``) does not wait for the Release: one round trip a
  read;
- writes: ``put_shm``: Reserve (arena slots held for this session) -> copy the payloads into
  them through the session's writable mapping, each summed as it lands -> Commit with the
  sums (the daemon records them; it reads no byte); Abort when anything fails before the
  commit or the commit itself fails (the daemon ignores the abort of keys it did commit).
  Puts are batched so that they fit the session's window.

stream (remote clients, or ``use_shm=False``): ``get_stream`` and ``put_stream``, the payloads
in chunks of the handshake's ``chunk_bytes``.

With ``verify``, every block read is checked against the checksum the daemon recorded when
it was committed, and streamed writes send their checksums for the daemon to check (an shm
write always sends its own, the block's checksum from then on).

Acquire, Reserve, Commit and Put are never retried; the Get stream is (it only reads).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from google.protobuf.message import Message

from kvstore.client import wire
from kvstore.client.calls import BlockingCalls
from kvstore.client.connection import Connection, UnknownSessionError
from kvstore.client.errors import FailedPreconditionError, KVStoreError
from kvstore.client.shm import Arena, Payload, ShmSession, TargetT, require_torch
from kvstore.client.wire import LookupResult, Slots, WriteStatus
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    import torch

    from kvstore.client.tensors import HostBlocks

__all__ = [
    "Found",
    "Leased",
    "SharedLease",
    "acquire",
    "end_lease",
    "find",
    "find_here",
    "get_stream",
    "leased_blocks",
    "put_shm",
    "put_stream",
    "release",
]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
PIPELINE_BYTES = 32 << 20  # the most bytes of a put per Reserve/Commit round trip, about
MIN_BATCH_BYTES = 4 << 20  # the least, unless the put is smaller
PIPELINE_BATCHES = 4  # a put is cut into this many batches when the sizes above allow
WINDOW_SHARE = 3  # a batch takes at most 1 / WINDOW_SHARE of the session's window


@dataclass(frozen=True, slots=True)
class Leased:
    """Leased blocks: their slots in ``arena`` and the checksums recorded for them."""

    lease_id: int
    slots: Slots
    checksums: tuple[int, ...]
    arena: Arena
    # time.monotonic() before which the lease cannot have expired: the Acquire's send time
    # plus the reply's expires_in (the daemon granted it after the send, on the same clock)
    alive_until: float = 0.0
    session: ShmSession | None = None  # whose socket releases it (None: gRPC)


@dataclass(frozen=True, slots=True)
class Found:
    """A lookup's answer, with the lease of its leading blocks in host memory (``lease``:
    None when none was taken: the first block is below the arena, or the client streams).
    ``AsyncKVStoreClient.release`` ends the lease."""

    result: LookupResult
    lease: Leased | None = None

    @property
    def num_blocks(self) -> int:
        """Leading blocks held, in any tier."""
        return self.result.num_blocks

    @property
    def tiers(self) -> tuple[str, ...]:
        """Per held block, the highest tier holding it (at the lookup)."""
        return self.result.tiers

    @property
    def num_leased(self) -> int:
        """Leading blocks leased in host memory (the first of the held ones)."""
        return 0 if self.lease is None else len(self.lease.slots)

    def host_blocks(self) -> HostBlocks:
        """Where the leased blocks lie, for a loader that moves them itself (see
        ``AsyncKVStoreClient.host_blocks``); valid until the lease is released. Needs torch.

        Raises:
            ValueError: nothing is leased.
        """
        if self.lease is None:
            raise ValueError("nothing is leased")
        return leased_blocks(self.lease.arena, self.lease.slots)

    def shared(self) -> SharedLease | None:
        """The lease as another process of the tenant can use it (None: nothing leased)."""
        lease = self.lease
        if lease is None:
            return None
        offsets = tuple(offset for offset, _ in lease.slots)
        return SharedLease(lease.lease_id, lease.arena.arena_id, offsets, lease.alive_until)


@dataclass(frozen=True, slots=True)
class SharedLease:
    """A lease one process took that another process of the same tenant reads and ends (a
    vLLM scheduler's lookup, loaded by its workers): leases belong to the tenant, and every
    session of the tenant maps the same arena. Plain values, to pickle across processes."""

    lease_id: int
    arena_id: bytes
    offsets: tuple[int, ...]  # each leased block's slot in the arena
    alive_until: float  # time.monotonic() (the host's clock) before which it holds


def leased_blocks(arena: Arena, slots: Slots) -> HostBlocks:
    """Leased slots of ``arena`` as :class:`~kvstore.client.tensors.HostBlocks`: the whole
    mapping, each block's offset, and the mapping as device kernels read it (when pinned)."""
    require_torch("host_blocks")
    from kvstore.client import tensors

    source = arena.tensor(0, arena.size)
    return tensors.HostBlocks(source, tuple(offset for offset, _ in slots), arena.mapped())


def new_lease_id() -> int:
    """A random nonzero 63-bit lease id (the daemon scopes ids by tenant)."""
    return secrets.randbits(63) | 1


async def acquire(
    conn: Connection,
    session: ShmSession,
    digest: bytes,
    keys: list[bytes],
    size: int,
    *,
    verify: bool = False,
) -> Leased:
    """Leases the leading held blocks (and checks them, with ``verify``).

    Raises:
        StaleArenaError: the reply names another arena (the daemon restarted).
        ProtocolError: the daemon answered slots outside the arena or of the wrong size.
    """
    lease_id = new_lease_id()
    request = pb.AcquireRequest(namespace=digest, keys=keys, lease_id=lease_id)
    sent = time.monotonic()
    try:
        reply = await conn.call(session, "Acquire", request, pb.AcquireResponse)
        return await _leased(conn, session, reply, len(keys), size, sent, "Acquire", verify)
    except BaseException:  # granted or not, it is released: nothing stays held
        await conn.release_quietly(lease_id, session)
        raise


async def find(
    conn: Connection,
    session: ShmSession,
    digest: bytes,
    keys: list[bytes],
    size: int,
    *,
    verify: bool = False,
) -> Found:
    """A lookup that leases the leading blocks already in the arena (one call for a host
    hit; the rest is promoted by an :func:`acquire` of its own). The lease is None when the
    daemon leased nothing (the first block is not in the arena).

    Raises:
        StaleArenaError, ProtocolError: as :func:`acquire`.
    """
    lease_id = new_lease_id()
    request = pb.LookupRequest(namespace=digest, keys=keys, lease_id=lease_id)
    sent = time.monotonic()
    try:
        reply = await conn.call(session, "Lookup", request, pb.LookupResponse)
        found = _found(conn, session, reply, len(keys), size, sent)
        if verify and found.lease is not None:
            await _verify(found.lease, "Lookup")
        return found
    except BaseException:
        await conn.release_quietly(lease_id, session)
        raise


def find_here(
    conn: Connection,
    session: ShmSession,
    calls: BlockingCalls,
    digest: bytes,
    keys: list[bytes],
    size: int,
    lease_id: int,
) -> Found:
    """:func:`find` made from the calling thread on the session's calls connection of its
    own (no event loop), under the lease id the caller chose; without ``verify``.

    Raises:
        KVStoreError, StaleArenaError: as :func:`find`; the caller then releases
            ``lease_id`` (the daemon may have granted it).
    """
    request = pb.LookupRequest(namespace=digest, keys=keys, lease_id=lease_id)
    sent = time.monotonic()
    reply = calls.call("Lookup", request, pb.LookupResponse, conn.timeout)
    return _found(conn, session, reply, len(keys), size, sent)


def _found(
    conn: Connection,
    session: ShmSession,
    reply: pb.LookupResponse,
    num_keys: int,
    size: int,
    sent: float,
) -> Found:
    """The checked answer of a Lookup with a lease."""
    found = wire.lookup_result(reply, num_keys)
    if not reply.HasField("lease"):
        return Found(found)
    return Found(found, _lease(conn, session, reply.lease, found.num_blocks, size, sent, "Lookup"))


async def _leased(
    conn: Connection,
    session: ShmSession,
    reply: pb.AcquireResponse,
    count: int,
    size: int,
    sent: float,
    method: str,
    verify: bool,
) -> Leased:
    """The checked lease of a reply (``count`` blocks at most, ``size`` bytes each)."""
    leased = _lease(conn, session, reply, count, size, sent, method)
    if verify:
        await _verify(leased, method)
    return leased


def _lease(
    conn: Connection,
    session: ShmSession,
    reply: pb.AcquireResponse,
    count: int,
    size: int,
    sent: float,
    method: str,
) -> Leased:
    conn.check_fresh(session, method, reply.arena_id)
    slots = wire.check_slots(reply.slots, count, size, session.arena)
    sums = wire.check_checksums(reply.checksums, len(slots))
    alive_until = sent + reply.expires_in
    return Leased(reply.lease_id, slots, sums, session.arena, alive_until, session)


async def _verify(leased: Leased, method: str) -> None:
    await leased.arena.verify(leased.slots, leased.checksums, method)


async def end_lease(conn: Connection, leased: Leased) -> None:
    """Ends a lease once its blocks were read: while it is sure to hold still
    (``leased.alive_until``), the Release goes out in a task of its own and this returns at
    once; later, the Release is awaited.

    Raises:
        UnknownLeaseError: the lease expired before it was released (only past
            ``alive_until``): the slots may have been reused meanwhile, so what was read
            under it must not be used.
    """
    if time.monotonic() < leased.alive_until:
        conn.release_soon(leased.lease_id, leased.session)
    else:
        await release(conn, leased.lease_id, leased.session)


async def release(conn: Connection, lease_id: int, session: ShmSession | None = None) -> None:
    """Ends a lease in a task a cancelled caller cannot stop.

    Raises:
        UnknownLeaseError: the lease expired before it was released: the slots may have been
            reused meanwhile, so what was read under it must not be used.
    """
    request = pb.ReleaseRequest(lease_id=lease_id)
    call = conn.call(session, "Release", request, pb.ReleaseResponse)
    await asyncio.shield(asyncio.ensure_future(call))


async def get_stream(
    conn: Connection,
    digest: bytes,
    keys: list[bytes],
    size: int,
    out: Sequence[TargetT] | None,
    *,
    verify: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> list[bytes] | list[TargetT]:
    """The leading held blocks through the Get stream (retried whole: it only reads); chunks
    into CUDA tensors are copied on ``stream``."""
    request = pb.GetRequest(namespace=digest, keys=keys)

    async def collect() -> list[bytes] | list[TargetT]:
        call = conn.stub.Get(request, metadata=conn.metadata, timeout=conn.timeout)
        return await wire.assemble(call, len(keys), size, out, verify=verify, stream=stream)

    return await conn.retrying("Get", collect, idempotent=True)


async def put_shm(
    conn: Connection,
    session: ShmSession,
    digest: bytes,
    specs: list[pb.BlockSpec],
    blocks: Sequence[Payload],
    size: int,
    *,
    stream: torch.cuda.Stream | None = None,
) -> list[WriteStatus]:
    """Reserve -> write -> Commit, in batches that fit the session's window; one final
    status per block of ``size`` bytes. Blocks on CUDA are copied out on ``stream``.

    The batches form a pipeline: while this process copies batch k into its arena slots
    (one batch at a time, in order, on every copy lane), batch k - 1's Commit and batch
    k + 1's Reserve are in flight (each Reserve is sent once the one before was answered:
    sent all at once, the daemon interleaved them and the first answer came last). A batch
    holds its share of the window from its Reserve to its Commit's reply; batches take their
    shares in order, so no batch waits for bytes a later batch of the same put holds. A put
    is cut into about ``PIPELINE_BATCHES`` batches (of ``MIN_BATCH_BYTES`` to
    ``PIPELINE_BYTES``), the first a quarter of the others, so that copying starts soon and
    a short put overlaps too.
    """
    budget = session.budget
    slot = budget.slot_bytes(size)
    wanted = slot * len(specs) // PIPELINE_BATCHES
    most = budget.total // WINDOW_SHARE
    per_batch = max(1, min(PIPELINE_BYTES, max(MIN_BATCH_BYTES, wanted), most) // slot)
    parts = _batches(len(specs), per_batch)
    answered = [asyncio.Event() for _ in parts]  # batch i's Reserve is answered, or it is over
    copied = [asyncio.Event() for _ in parts]  # batch i is in the arena, or is over

    async def batch(i: int, part: slice) -> list[WriteStatus]:
        try:
            if i:
                await answered[i - 1].wait()
            async with budget.hold(slot * len(specs[part])):
                return await _put_batch(
                    conn, session, digest, specs[part], blocks[part], size,
                    after=copied[i - 1] if i else None, copied=copied[i],
                    answered=answered[i], stream=stream,
                )  # fmt: skip
        finally:
            answered[i].set()
            copied[i].set()

    done = await asyncio.gather(*(batch(i, part) for i, part in enumerate(parts)))
    return [status for statuses in done for status in statuses]


def _batches(count: int, per_batch: int) -> list[slice]:
    """``count`` blocks in batches of ``per_batch``, the first a quarter of that: its Reserve
    is answered, and its copy begun, sooner."""
    first = max(1, per_batch // 4) if count > per_batch else count
    starts = [0, *range(first, count, per_batch)]
    return [slice(start, start + (first if not i else per_batch)) for i, start in enumerate(starts)]


async def _put_batch(
    conn: Connection,
    session: ShmSession,
    digest: bytes,
    specs: list[pb.BlockSpec],
    blocks: Sequence[Payload],
    size: int,
    *,
    after: asyncio.Event | None = None,
    copied: asyncio.Event | None = None,
    answered: asyncio.Event | None = None,
    stream: torch.cuda.Stream | None = None,
) -> list[WriteStatus]:
    """One batch: Reserve (``answered`` set on its reply: the next batch's Reserve goes then,
    and the daemon reserves it while this one copies); once ``after`` is set (the batch
    before is copied), the copy into its arena slots, then ``copied`` is set; Commit with the
    sums taken as it landed."""
    request = pb.ReserveRequest(namespace=digest, blocks=specs, session=session.session_id)

    async def undo(reply: pb.ReserveResponse) -> None:
        held = [
            spec.key
            for spec, r in zip(specs, reply.reservations, strict=False)
            if r.status == pb.RESERVED
        ]
        await _abort(conn, session, digest, held)

    try:
        reply = await _session_call(
            "Reserve",
            conn.unary_undone_on_cancel("Reserve", request, pb.ReserveResponse, undo, session),
        )
    except KVStoreError as error:  # a deadline, say: what it may have reserved is freed
        if not isinstance(error, UnknownSessionError):  # else the daemon freed it all
            await _abort(conn, session, digest, [spec.key for spec in specs])
        raise
    if answered is not None:
        answered.set()
    reserved, slots, statuses = wire.reservations(reply, len(specs), size, session.writer)
    if reserved:
        keys = [specs[index].key for index in reserved]
        try:
            conn.check_fresh(session, "Reserve")
            if after is not None:
                await after.wait()
            try:
                sources = [blocks[index] for index in reserved]
                sums = await session.writer.write(slots, sources, stream)
            finally:
                if copied is not None:
                    copied.set()
        except BaseException:
            await _abort(conn, session, digest, keys)
            raise
        commit = pb.CommitRequest(
            namespace=digest, keys=keys, session=session.session_id, checksums=sums
        )
        try:
            committed = await _session_call(
                "Commit", conn.call(session, "Commit", commit, pb.CommitResponse)
            )
        except BaseException:
            await _abort(conn, session, digest, keys)  # ignored for keys the commit did store
            raise
        statuses.update(
            zip(reserved, wire.write_statuses(committed.statuses, len(keys)), strict=True)
        )
    return [statuses[index] for index in range(len(specs))]


async def put_stream(
    conn: Connection,
    digest: bytes,
    specs: list[pb.BlockSpec],
    blocks: Sequence[Payload],
    *,
    verify: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> list[WriteStatus]:
    """The Put stream; one final status per block. Blocks on CUDA are copied out on
    ``stream``."""
    chunks = wire.put_chunks(
        digest, specs, blocks, conn.info.chunk_bytes, checksums=verify, stream=stream
    )
    reply = await conn.unary("Put", chunks, pb.PutResponse)
    return wire.write_statuses(reply.statuses, len(specs))


async def _session_call(method: str, call: Awaitable[M]) -> M:
    """Awaits a Reserve or Commit; FAILED_PRECONDITION there means the daemon does not know
    the session (it restarted): :class:`UnknownSessionError`, which opens a new one."""
    try:
        return await call
    except FailedPreconditionError as error:
        raise UnknownSessionError(f"{method}: {error}") from error


async def _abort(conn: Connection, session: ShmSession, digest: bytes, keys: list[bytes]) -> None:
    request = pb.AbortRequest(namespace=digest, keys=keys, session=session.session_id)
    try:
        await conn.call(session, "Abort", request, pb.AbortResponse)
    except KVStoreError as error:  # the reservations expire, or end with the session
        log.warning("could not abort %d reservations: %s", len(keys), error)
