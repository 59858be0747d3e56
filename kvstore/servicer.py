"""The gRPC servicer: protos in, :class:`~kvstore.service.KVStoreService` calls, protos out.

Nothing here decides anything: each method resolves the caller's tenant, converts the request,
calls the service and converts the result. ``STATUS_CODES`` is the one table from the
:mod:`kvstore.errors` tree to gRPC status codes; an error outside it is a bug, logged by gRPC
and seen by the client as UNKNOWN.

The streamed data plane: ``Get`` sends each leading held block as ``chunk_bytes`` pieces
(``tier`` on the first, ``last`` on the final one); ``Put`` assembles a block from the chunks
that follow its ``BlockSpec`` and stores it once it has ``layout.payload_bytes`` bytes. With a
host tier both work in the arena (:mod:`kvstore.streams`): ``Get`` cuts its chunks from the
leased slots and ``Put`` copies each chunk into a slot reserved for its block.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

import grpc

from kvstore.blocks import BlockLayout
from kvstore.checks import BlockSpec, check_spec
from kvstore.errors import (
    InvalidBlockError,
    InvalidRequestError,
    NoArenaError,
    PermissionDeniedError,
    StoreClosedError,
    StoreError,
    UnauthenticatedError,
    UnknownLeaseError,
    UnknownNamespaceError,
)
from kvstore.namespace import ModelFingerprint
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.results import PutStatus
from kvstore.service import KVStoreService
from kvstore.streams import Landing

__all__ = ["STATUS_CODES", "KVStoreServicer", "Metadata", "status_of"]

Metadata: TypeAlias = Iterable[tuple[str, str | bytes]] | None
Context: TypeAlias = grpc.aio.ServicerContext

STATUS_CODES: dict[type[StoreError], grpc.StatusCode] = {
    InvalidBlockError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownNamespaceError: grpc.StatusCode.NOT_FOUND,
    UnknownLeaseError: grpc.StatusCode.NOT_FOUND,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    NoArenaError: grpc.StatusCode.FAILED_PRECONDITION,
    StoreClosedError: grpc.StatusCode.UNAVAILABLE,
}
"""The one table from daemon errors to gRPC status codes; the client maps them back."""

_WRITE_STATUS = {status: pb.WriteStatus.Value(status.name) for status in PutStatus}


def status_of(error: StoreError) -> grpc.StatusCode:
    """The code of ``error``'s nearest class in :data:`STATUS_CODES` (INTERNAL if none)."""
    for cls in type(error).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """The ``kvstore.v1.KVStore`` service over a :class:`KVStoreService`.

    Args:
        service: The daemon's logic.
        tenant_of: The caller's tenant from the call's metadata (``None``: no auth).
        chunk_bytes: Payload bytes per streamed ``GetChunk``.
    """

    def __init__(
        self,
        service: KVStoreService,
        tenant_of: Callable[[Metadata], str | None],
        chunk_bytes: int,
    ) -> None:
        self._service = service
        self._tenant_of = tenant_of
        self._chunk_bytes = chunk_bytes
        self._arena: tuple[int, int] | None = None

    def _arena_identity(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the arena; fixed for the daemon's life, so read once."""
        if self._arena is None:
            arena = self._service.handshake().arena
            self._arena = (0, 0) if arena is None else (arena.device, arena.inode)
        return self._arena

    @contextlib.asynccontextmanager
    async def _call(self, context: Context) -> AsyncIterator[str | None]:
        """Yields the caller's tenant; turns daemon errors into the call's status."""
        try:
            yield self._tenant_of(context.invocation_metadata())
        except StoreError as error:
            await context.abort(status_of(error), str(error))

    async def Handshake(
        self, request: pb.HandshakeRequest, context: Context
    ) -> pb.HandshakeResponse:
        async with self._call(context):
            info = self._service.handshake()
            arena = info.arena
            return pb.HandshakeResponse(
                server_version=info.server_version,
                arena_path=arena.path if arena else "",
                arena_bytes=arena.size if arena else 0,
                arena_device=arena.device if arena else 0,
                arena_inode=arena.inode if arena else 0,
                max_message_bytes=info.max_message_bytes,
                chunk_bytes=info.chunk_bytes,
                lease_seconds=info.lease_seconds,
            )

    async def RegisterNamespace(
        self, request: pb.RegisterNamespaceRequest, context: Context
    ) -> pb.RegisterNamespaceResponse:
        async with self._call(context) as caller:
            model = _fingerprint(request.model)
            digest = self._service.register_namespace(model, request.tenant, caller=caller)
            return pb.RegisterNamespaceResponse(namespace=digest)

    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        async with self._call(context) as tenant:
            found = await self._service.lookup(request.namespace, list(request.keys), tenant=tenant)
            return pb.LookupResponse(num_blocks=found.num_blocks, tiers=found.tiers)

    async def Acquire(self, request: pb.AcquireRequest, context: Context) -> pb.AcquireResponse:
        async with self._call(context) as tenant:
            acquired = await self._service.acquire(
                request.namespace, list(request.keys), request.lease_seconds, tenant=tenant
            )
            device, inode = self._arena_identity()
            return pb.AcquireResponse(
                lease_id=acquired.lease.lease_id,
                slots=[pb.Slot(offset=s.offset, length=s.length) for s in acquired.slots],
                expires_in=_seconds_until(acquired.lease.expires_at),
                arena_device=device,
                arena_inode=inode,
            )

    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:
        async with self._call(context) as tenant:
            await self._service.release(request.lease_id, tenant=tenant)
            return pb.ReleaseResponse()

    async def Reserve(self, request: pb.ReserveRequest, context: Context) -> pb.ReserveResponse:
        async with self._call(context) as tenant:
            specs = [BlockSpec(b.key, b.parent, b.num_tokens) for b in request.blocks]
            reserved = await self._service.reserve(request.namespace, specs, tenant=tenant)
            device, inode = self._arena_identity()
            return pb.ReserveResponse(
                arena_device=device,
                arena_inode=inode,
                reservations=[
                    pb.Reservation(
                        status=_WRITE_STATUS[r.status],
                        slot=pb.Slot(offset=r.slot.offset, length=r.slot.length)
                        if r.slot
                        else None,
                    )
                    for r in reserved.items
                ],
                expires_in=reserved.expires_in,
            )

    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        async with self._call(context) as tenant:
            statuses = await self._service.commit(
                request.namespace, list(request.keys), tenant=tenant
            )
            return pb.CommitResponse(statuses=[_WRITE_STATUS[s] for s in statuses])

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        async with self._call(context) as tenant:
            await self._service.abort(request.namespace, list(request.keys), tenant=tenant)
            return pb.AbortResponse()

    async def Get(self, request: pb.GetRequest, context: Context) -> AsyncIterator[pb.GetChunk]:
        async with self._call(context) as tenant:
            namespace, keys = request.namespace, list(request.keys)
            sent = 0
            if self._service.has_arena:  # chunks cut from leased arena slots
                held = self._service.held(namespace, keys, tenant=tenant)
                async with contextlib.aclosing(held):
                    async for found in held:
                        for chunk in self._chunks(sent, found.payload, found.tier):
                            yield chunk
                        sent += 1
            # Without a host tier, or past what the arena leased (a miss, no room): copies.
            async for block in self._service.get(namespace, keys[sent:], tenant=tenant):
                for chunk in self._chunks(sent, block.payload, block.tier):
                    yield chunk
                sent += 1

    def _chunks(self, index: int, payload: bytes | memoryview, tier: str) -> Iterator[pb.GetChunk]:
        """One block's ``GetChunk`` messages, each holding a copy of its piece of ``payload``."""
        size, step = len(payload), self._chunk_bytes
        for start in range(0, max(size, 1), step):
            yield pb.GetChunk(
                index=index,
                data=bytes(payload[start : start + step]),  # a bytes slice is kept as is
                last=start + step >= size,
                tier=tier if start == 0 else "",
            )

    async def Put(
        self, request_iterator: AsyncIterator[pb.PutChunk], context: Context
    ) -> pb.PutResponse:
        async with self._call(context) as tenant:
            statuses = await _PutStream(self._service, tenant).run(request_iterator)
            return pb.PutResponse(statuses=[_WRITE_STATUS[s] for s in statuses])

    async def Prefetch(self, request: pb.PrefetchRequest, context: Context) -> pb.PrefetchResponse:
        async with self._call(context) as tenant:
            count = await self._service.prefetch(
                request.namespace,
                [list(chain.keys) for chain in request.chains],
                session_id=request.session_id,
                tenant=tenant,
            )
            return pb.PrefetchResponse(num_blocks=count)

    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteResponse:
        async with self._call(context) as tenant:
            count = await self._service.delete(request.namespace, list(request.keys), tenant=tenant)
            return pb.DeleteResponse(num_blocks=count)

    async def Stats(self, request: pb.StatsRequest, context: Context) -> pb.StatsResponse:
        async with self._call(context):
            stats = self._service.stats()
            store = stats.store
            return pb.StatsResponse(
                tiers=[
                    pb.TierStats(
                        name=t.name,
                        usage_bytes=t.usage_bytes,
                        capacity_bytes=t.capacity_bytes,
                        blocks=t.blocks,
                        hits=t.hits,
                        evictions=t.evictions,
                        healthy=t.healthy,
                    )
                    for t in store.tiers
                ],
                blocks=store.blocks,
                puts=store.puts,
                dedup_puts=store.dedup_puts,
                gets=store.gets,
                misses=store.misses,
                promotions=store.promotions,
                demotions=store.demotions,
                dropped_saves=store.dropped_saves,
                corrupt_blocks=store.corrupt_blocks,
                active_leases=store.active_leases,
                active_reservations=store.active_reservations,
                lookups=stats.lookups,
                lookup_hit_blocks=stats.lookup_hit_blocks,
            )


@dataclass(slots=True)
class _Incoming:
    """The block a ``Put`` stream is in the middle of, and where its bytes go."""

    spec: BlockSpec
    sink: memoryview | None  # an arena slot or a buffer; None: held already, bytes dropped
    landing: Landing | None = None  # the reserved slot, committed when the block is whole
    buffer: bytearray | None = None  # no arena room: the block is put whole from here
    filled: int = 0

    def release(self) -> None:
        if self.sink is not None:
            self.sink.release()


class _PutStream:
    """Stores the blocks of one ``Put`` stream, each as soon as it is whole.

    With a host tier each block's chunks are copied into an arena slot reserved on its first
    chunk, committed once it is whole and aborted if the stream fails first; a block the arena
    has no room for (or any block, without a host tier) is assembled in memory and put.
    """

    def __init__(self, service: KVStoreService, tenant: str | None) -> None:
        self._service = service
        self._tenant = tenant
        self._namespace = b""
        self._layout: BlockLayout | None = None
        self._size = 0  # payload bytes of one block of the stream's layout
        self._block: _Incoming | None = None
        self.statuses: list[PutStatus] = []

    async def run(self, chunks: AsyncIterator[pb.PutChunk]) -> list[PutStatus]:
        try:
            await self._receive(chunks)
        finally:
            await self._drop()
        return self.statuses

    async def _receive(self, chunks: AsyncIterator[pb.PutChunk]) -> None:
        position = 0
        async for chunk in chunks:
            if position == 0:
                self._namespace = chunk.namespace
                self._layout = self._service.layout_of(chunk.namespace, tenant=self._tenant)
                self._size = self._layout.payload_bytes
            elif chunk.namespace and chunk.namespace != self._namespace:
                raise InvalidRequestError(
                    f"chunk {position} names namespace {chunk.namespace.hex()}; a Put stream "
                    f"carries one namespace, {self._namespace.hex()}"
                )
            if chunk.HasField("block"):
                await self._begin(chunk.block)
            data = chunk.data  # each read of a bytes field copies it out of the message
            if data:
                self._append(data, position)
            if self._block is not None and self._block.filled == self._size:
                await self._store()
            position += 1
        self._check_ended()

    async def _begin(self, block: pb.BlockSpec) -> None:
        self._check_ended()
        spec = BlockSpec(block.key, block.parent, block.num_tokens)
        assert self._layout is not None  # set by the stream's first chunk
        check_spec(f"blocks[{len(self.statuses)}]", spec, self._layout)
        landed = (
            await self._service.land(self._namespace, spec, tenant=self._tenant)
            if self._service.has_arena
            else PutStatus.NO_SPACE
        )
        if isinstance(landed, Landing):
            self._block = _Incoming(spec, landed.slot, landing=landed)
        elif landed is PutStatus.DEDUP:
            self._block = _Incoming(spec, None)
        else:
            buffer = bytearray(self._size)  # fresh: the store may keep a reference
            self._block = _Incoming(spec, memoryview(buffer), buffer=buffer)

    def _check_ended(self) -> None:
        if self._block is not None:
            raise InvalidBlockError(
                f"block {len(self.statuses)} ended after {self._block.filled} payload bytes; "
                f"its layout needs {self._size}"
            )

    def _append(self, data: bytes, position: int) -> None:
        block = self._block
        if block is None:
            raise InvalidRequestError(
                f"chunk {position} carries data outside a block (set PutChunk.block on each "
                f"block's first chunk)"
            )
        end = block.filled + len(data)
        if end > self._size:
            raise InvalidBlockError(
                f"block {len(self.statuses)} got more than {self._size} payload bytes "
                f"(its layout's size) at chunk {position}"
            )
        if block.landing is not None and time.monotonic() >= block.landing.deadline:
            raise InvalidRequestError(f"block {len(self.statuses)} took over an hour to arrive")
        if block.sink is not None:
            block.sink[block.filled : end] = data
        block.filled = end

    async def _store(self) -> None:
        block, self._block = self._block, None
        assert block is not None
        try:
            self.statuses.append(await self._commit(block))  # a commit leaves nothing to abort
        finally:
            block.release()

    async def _commit(self, block: _Incoming) -> PutStatus:
        if block.landing is not None:
            keys = [block.landing.key]
            (status,) = await self._service.commit(self._namespace, keys, tenant=self._tenant)
            return status
        if block.buffer is None:
            return PutStatus.DEDUP
        return await self._service.put(
            self._namespace, block.spec, block.buffer, tenant=self._tenant
        )

    async def _drop(self) -> None:
        """Ends the block the stream stopped inside of (an error, a cancel, a short block)."""
        block, self._block = self._block, None
        if block is not None:
            block.release()
            if block.landing is not None:
                keys = [block.landing.key]
                await self._service.abort(self._namespace, keys, tenant=self._tenant)


def _fingerprint(model: pb.ModelFingerprint) -> ModelFingerprint:
    layout = model.layout
    try:
        return ModelFingerprint(
            model_name=model.model_name,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=layout.dtype,
            block_tokens=layout.block_tokens,
            rope_theta=model.rope_theta or 10000.0,
            rope_scaling=tuple((s.name, _scaling_value(s)) for s in model.rope_scaling),
        )
    except ValueError as error:
        raise InvalidRequestError(f"model fingerprint: {error}") from error


def _scaling_value(entry: pb.RopeScaling) -> str | float:
    kind = entry.WhichOneof("value")
    if kind is None:
        raise InvalidRequestError(f"rope_scaling {entry.name!r} has no value")
    return entry.number if kind == "number" else entry.text


def _seconds_until(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
