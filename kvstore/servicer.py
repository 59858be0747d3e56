"""The gRPC servicer: protos in, :class:`~kvstore.service.KVStoreService` calls, protos out.

Nothing here decides anything: each method resolves the caller's tenant, converts the request,
calls the service and converts the result. ``STATUS_CODES`` is the one table from the
:mod:`kvstore.errors` tree to gRPC status codes; an error outside it is a bug, logged by gRPC
and seen by the client as UNKNOWN.

The streamed data plane: ``Get`` sends each leading held block as ``chunk_bytes`` pieces
(``tier`` on the first, ``last`` on the final one); ``Put`` assembles a block from the chunks
that follow its ``BlockSpec`` and stores it once it has ``layout.payload_bytes`` bytes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TypeAlias

import grpc

from kvstore.blocks import BlockLayout
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
from kvstore.service import BlockSpec, KVStoreService, check_spec

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
            blocks = self._service.get(request.namespace, list(request.keys), tenant=tenant)
            index = 0
            async for block in blocks:
                payload, step = block.payload, self._chunk_bytes
                for start in range(0, max(len(payload), 1), step):
                    yield pb.GetChunk(
                        index=index,
                        data=payload[start : start + step],
                        last=start + step >= len(payload),
                        tier=block.tier if start == 0 else "",
                    )
                index += 1

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


class _PutStream:
    """Assembles the blocks of one ``Put`` stream and stores each as soon as it is whole."""

    def __init__(self, service: KVStoreService, tenant: str | None) -> None:
        self._service = service
        self._tenant = tenant
        self._namespace = b""
        self._spec: BlockSpec | None = None
        self._layout: BlockLayout | None = None
        self._size = 0  # payload bytes of one block of the stream's layout
        self._payload = bytearray()
        self._filled = 0
        self.statuses: list[PutStatus] = []

    async def run(self, chunks: AsyncIterator[pb.PutChunk]) -> list[PutStatus]:
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
                self._begin(chunk.block)
            if chunk.data:
                self._append(chunk.data, position)
            if self._spec is not None and self._filled == self._size:
                await self._store()
            position += 1
        if self._spec is not None:
            self._begin(None)  # raises: the stream ended inside a block
        return self.statuses

    def _begin(self, block: pb.BlockSpec | None) -> None:
        if self._spec is not None:
            raise InvalidBlockError(
                f"block {len(self.statuses)} ended after {self._filled} payload bytes; its "
                f"layout needs {self._size}"
            )
        if block is not None:
            spec = BlockSpec(block.key, block.parent, block.num_tokens)
            assert self._layout is not None  # set by the stream's first chunk
            check_spec(f"blocks[{len(self.statuses)}]", spec, self._layout)
            self._spec = spec
            self._payload = bytearray(self._size)  # fresh: the store may keep a reference
            self._filled = 0

    def _append(self, data: bytes, position: int) -> None:
        if self._spec is None:
            raise InvalidRequestError(
                f"chunk {position} carries data outside a block (set PutChunk.block on each "
                f"block's first chunk)"
            )
        end = self._filled + len(data)
        if end > self._size:
            raise InvalidBlockError(
                f"block {len(self.statuses)} got more than {self._size} payload bytes "
                f"(its layout's size) at chunk {position}"
            )
        self._payload[self._filled : end] = data
        self._filled = end

    async def _store(self) -> None:
        assert self._spec is not None
        spec, self._spec = self._spec, None
        status = await self._service.put(self._namespace, spec, self._payload, tenant=self._tenant)
        self.statuses.append(status)


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
