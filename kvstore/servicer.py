"""The gRPC servicer: protos in, :class:`~kvstore.service.KVStoreService` calls, protos out.

Nothing here decides anything: each method resolves the caller's tenant, converts the request,
calls the service and converts the result. ``STATUS_CODES`` is the one table from the
:mod:`kvstore.errors` tree to gRPC status codes. Requests are parsed here, not by gRPC
(``add_to_server`` registers the methods with a parser that never raises): bytes that are
not a valid message are answered INVALID_ARGUMENT, as are out-of-range values; an exception
outside the error tree is a bug, logged and answered INTERNAL.

The streamed data plane: ``Get`` sends each leading held block as ``chunk_bytes`` pieces
(``tier`` on the first, ``last`` on the final one); ``Put`` assembles a block from the chunks
that follow its ``BlockSpec`` and stores it once it has ``layout.payload_bytes`` bytes. With a
host tier both work in the arena: ``Get`` cuts its chunks from the leased slots
(:mod:`kvstore.reads`) and ``Put`` copies each chunk into a slot reserved for its block
(:mod:`kvstore.writes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore import __version__
from kvstore.budget import LoopBudget
from kvstore.checks import check_spec
from kvstore.errors import (
    InvalidBlockError,
    InvalidRequestError,
    NoArenaError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StoreClosedError,
    StoreError,
    UnauthenticatedError,
    UnknownLeaseError,
    UnknownNamespaceError,
    UnknownSessionError,
)
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.results import Acquired
from kvstore.service import KVStoreService
from kvstore.wire import chunks
from kvstore.wire.blocks import BlockLayout, BlockSpec
from kvstore.wire.chunks import GetChunk
from kvstore.wire.namespace import ModelFingerprint
from kvstore.wire.results import PutStatus
from kvstore.wire.session import CALLS
from kvstore.writes import Landing

__all__ = [
    "STATUS_CODES",
    "KVStoreServicer",
    "Metadata",
    "SessionCalls",
    "add_to_server",
    "status_of",
]

log = logging.getLogger(__name__)

Metadata: TypeAlias = Iterable[tuple[str, str | bytes]] | None
Context: TypeAlias = grpc.aio.ServicerContext
M = TypeVar("M", bound=Message)
SERVICE = "kvstore.v1.KVStore"

STATUS_CODES: dict[type[StoreError], grpc.StatusCode] = {
    InvalidBlockError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownNamespaceError: grpc.StatusCode.NOT_FOUND,
    UnknownLeaseError: grpc.StatusCode.NOT_FOUND,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    NoArenaError: grpc.StatusCode.FAILED_PRECONDITION,
    UnknownSessionError: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
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


@dataclass(frozen=True, slots=True)
class Malformed:
    """What the parser hands on for bytes that are not a valid request message."""

    message_type: str
    error: str


def _parser(cls: type[M]) -> Callable[[bytes], M | Malformed]:
    def parse(data: bytes) -> M | Malformed:
        try:
            message: M = cls.FromString(data)
            return message
        except (DecodeError, ValueError, RuntimeError) as error:
            return Malformed(cls.__name__, str(error) or type(error).__name__)

    return parse


def _put_parser(data: bytes) -> chunks.PutChunk | Malformed:
    """Put's chunks, their data left in the received message (see kvstore.wire.chunks)."""
    try:
        return chunks.decode_put(data)
    except ValueError as error:
        return Malformed("PutChunk", str(error))


def checked(request: object, cls: type[M]) -> M:
    """The request as a ``cls``, or :class:`InvalidRequestError` for bytes that did not parse."""
    if isinstance(request, Malformed):
        raise InvalidRequestError(f"not a valid {request.message_type}: {request.error}")
    if not isinstance(request, cls):
        raise InvalidRequestError(f"expected a {cls.__name__}, got {type(request).__name__}")
    return request


def add_to_server(servicer: KVStoreServicer, server: grpc.aio.Server) -> None:
    """Registers every method of ``kvstore.v1.KVStore`` with a parser that never raises."""
    methods = pb.DESCRIPTOR.services_by_name["KVStore"].methods
    handlers = {}
    for method in methods:
        request = getattr(pb, method.input_type.name)
        reply = getattr(pb, method.output_type.name)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_put_parser if request is pb.PutChunk else _parser(request),
            # Get's chunks are written straight from the arena (see kvstore.wire.chunks).
            response_serializer=chunks.encode_get
            if reply is pb.GetChunk
            else reply.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _SessionContext:
    """What the servicer's methods use of a gRPC context, for a call on a session socket:
    the session's token as the call's metadata, and an abort that ends the call with its
    status."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        raise _Aborted(code, details)

    def code(self) -> grpc.StatusCode | None:
        return self._code


Behavior: TypeAlias = Callable[[object, Any], Awaitable[Message]]


class SessionCalls:
    """The calls a shm session's socket carries (:data:`kvstore.wire.session.CALLS`): the
    servicer's own methods, run with a :class:`_SessionContext`, so that they check and
    answer exactly as over gRPC; a :class:`~kvstore.sessions.SessionServer`'s ``calls``.

    Args:
        servicer: The daemon's servicer.
        timed: Wraps each method as the gRPC server's metrics interceptor does (None: as is).
    """

    def __init__(
        self,
        servicer: KVStoreServicer,
        timed: Callable[[str, Behavior], Behavior] | None = None,
    ) -> None:
        self._methods: dict[str, tuple[Behavior, Callable[[bytes], object]]] = {}
        for name in CALLS:
            behavior: Behavior = getattr(servicer, name)
            parse = _parser(getattr(pb, f"{name}Request"))
            self._methods[name] = (behavior if timed is None else timed(name, behavior), parse)

    async def __call__(self, method: str, body: bytes, token: str) -> tuple[int, bytes]:
        """``(0, reply)`` or ``(a gRPC status code's number, the error's text)``."""
        behavior, parse = self._methods[method]
        try:
            reply = await behavior(parse(body), _SessionContext(token))
        except _Aborted as aborted:
            return aborted.code.value[0], aborted.details.encode()
        return 0, reply.SerializeToString()


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

    @contextlib.asynccontextmanager
    async def _call(self, context: Context) -> AsyncIterator[str | None]:
        """Yields the caller's tenant; turns daemon errors into the call's status, and any
        other error (a bug) into INTERNAL, logged."""
        try:
            yield self._tenant_of(context.invocation_metadata())
        except StoreError as error:
            await context.abort(status_of(error), str(error))
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception:
            log.exception("a kvstore call failed on a bug")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by the daemon)")

    async def Handshake(self, request: object, context: Context) -> pb.HandshakeResponse:
        async with self._call(context):
            checked(request, pb.HandshakeRequest)
            info = self._service.handshake()
            return pb.HandshakeResponse(
                server_version=info.server_version,
                max_message_bytes=info.max_message_bytes,
                chunk_bytes=info.chunk_bytes,
                lease_seconds=info.lease_seconds,
                shm_socket=info.shm_socket,
                instance_id=info.instance_id,
                max_block_bytes=info.max_block_bytes,
            )

    async def RegisterNamespace(
        self, request: object, context: Context
    ) -> pb.RegisterNamespaceResponse:
        async with self._call(context) as caller:
            request = checked(request, pb.RegisterNamespaceRequest)
            model = _fingerprint(request.model)
            digest = self._service.register_namespace(model, request.tenant, caller=caller)
            return pb.RegisterNamespaceResponse(namespace=digest)

    async def Lookup(self, request: object, context: Context) -> pb.LookupResponse:
        async with self._call(context) as tenant:
            request = checked(request, pb.LookupRequest)
            namespace, keys = request.namespace, list(request.keys)
            acquired = None
            if request.lease_id:
                found, acquired = await self._service.lookup_and_lease(
                    namespace, keys, request.lease_seconds, tenant=tenant,
                    lease_id=request.lease_id,
                )  # fmt: skip
            else:
                found = await self._service.lookup(namespace, keys, tenant=tenant)
            runs = [pb.TierRun(tier=tier, blocks=count) for tier, count in found.runs]
            reply = pb.LookupResponse(num_blocks=found.num_blocks, runs=runs)
            if acquired is not None:
                _fill_lease(reply.lease, acquired)
            return reply

    async def Acquire(self, request: object, context: Context) -> pb.AcquireResponse:
        async with self._call(context) as tenant:
            request = checked(request, pb.AcquireRequest)
            acquired = await self._service.acquire(
                request.namespace,
                list(request.keys),
                request.lease_seconds,
                tenant=tenant,
                lease_id=request.lease_id,
            )
            reply = pb.AcquireResponse()
            _fill_lease(reply, acquired)
            return reply

    async def Release(self, request: object, context: Context) -> pb.ReleaseResponse:
        async with self._call(context) as tenant:
            request = checked(request, pb.ReleaseRequest)
            await self._service.release(request.lease_id, tenant=tenant)
            return pb.ReleaseResponse()

    async def Reserve(self, request: object, context: Context) -> pb.ReserveResponse:
        async with self._call(context) as tenant:
            request = checked(request, pb.ReserveRequest)
            reserved = await self._service.reserve(  # the messages are the specs: no copies
                request.namespace, request.blocks, tenant=tenant, session=request.session
            )
            reply = pb.ReserveResponse(expires_in=reserved.expires_in)
            add = reply.reservations.add
            budget = LoopBudget()  # 512 answers are ~1 ms
            for r in reserved.items:  # built in place: a third of the cost of new messages
                answer = add(status=_WRITE_STATUS[r.status])
                if r.slot:
                    answer.slot.offset, answer.slot.length = r.slot.offset, r.slot.length
                await budget.tick()
            return reply

    async def Commit(self, request: object, context: Context) -> pb.CommitResponse:
        async with self._call(context) as tenant:
            request = checked(request, pb.CommitRequest)
            statuses = await self._service.commit(
                request.namespace,
                list(request.keys),
                tenant=tenant,
                session=request.session,
                checksums=list(request.checksums),
            )
            return pb.CommitResponse(statuses=[_WRITE_STATUS[s] for s in statuses])

    async def Abort(self, request: object, context: Context) -> pb.AbortResponse:
        async with self._call(context) as tenant:
            request = checked(request, pb.AbortRequest)
            await self._service.abort(
                request.namespace, list(request.keys), tenant=tenant, session=request.session
            )
            return pb.AbortResponse()

    async def Get(self, request: object, context: Context) -> AsyncIterator[GetChunk]:
        async with self._call(context) as tenant:
            request = checked(request, pb.GetRequest)
            namespace, keys = request.namespace, list(request.keys)
            sent = 0
            if self._service.has_arena:  # chunks cut from leased arena slots
                held = self._service.held(namespace, keys, tenant=tenant)
                async with contextlib.aclosing(held):
                    async for found in held:
                        for chunk in self._chunks(sent, found.payload, found.tier, found.checksum):
                            yield chunk
                        sent += 1
            # Without a host tier, or past what the arena leased (a miss, no room): copies.
            async for block in self._service.get(namespace, keys[sent:], tenant=tenant):
                for chunk in self._chunks(sent, block.payload, block.tier, block.checksum):
                    yield chunk
                sent += 1

    def _chunks(
        self, index: int, payload: bytes | memoryview, tier: str, checksum: int
    ) -> Iterator[GetChunk]:
        """One block's chunks, each a view of its piece of ``payload``: the serializer
        (``chunks.encode_get``) copies it into the message, before the stream goes on (and
        before a leased slot is released)."""
        view = memoryview(payload).cast("B")
        size, step = view.nbytes, self._chunk_bytes
        for start in range(0, max(size, 1), step):
            first = start == 0
            yield GetChunk(
                index=index,
                data=view[start : start + step],
                last=start + step >= size,
                tier=tier if first else "",
                checksum=checksum if first else 0,
            )

    async def Put(
        self, request_iterator: AsyncIterator[object], context: Context
    ) -> pb.PutResponse:
        async with self._call(context) as tenant:
            try:
                statuses = await _PutStream(self._service, tenant).run(request_iterator)
            except StoreError:
                # Let the client finish sending before the error ends the call: a grpc.aio
                # client that writes after the status arrived reports INTERNAL instead of
                # it (grpc/grpc#36066), and would miss e.g. NOT_FOUND, its cue to register.
                async for _ in request_iterator:
                    pass
                raise
            return pb.PutResponse(statuses=[_WRITE_STATUS[s] for s in statuses])

    async def Prefetch(self, request: object, context: Context) -> pb.PrefetchResponse:
        async with self._call(context) as tenant:
            request = checked(request, pb.PrefetchRequest)
            count = await self._service.prefetch(
                request.namespace,
                [list(chain.keys) for chain in request.chains],
                session_id=request.session_id,
                tenant=tenant,
            )
            return pb.PrefetchResponse(num_blocks=count)

    async def Delete(self, request: object, context: Context) -> pb.DeleteResponse:
        async with self._call(context) as tenant:
            request = checked(request, pb.DeleteRequest)
            count = await self._service.delete(request.namespace, list(request.keys), tenant=tenant)
            return pb.DeleteResponse(num_blocks=count)

    async def Namespaces(self, request: object, context: Context) -> pb.NamespacesResponse:
        async with self._call(context) as tenant:
            checked(request, pb.NamespacesRequest)
            found = await self._service.namespaces(caller=tenant)
            return pb.NamespacesResponse(
                namespaces=[
                    pb.NamespaceUsage(
                        namespace=info.usage.namespace,
                        tenant=info.tenant,
                        model_name=info.model_name,
                        blocks=info.usage.blocks,
                        bytes=info.usage.size,
                        tiers=[pb.TierUsage(name=n, blocks=b) for n, b in info.usage.tiers],
                    )
                    for info in found
                ]
            )

    async def Evict(self, request: object, context: Context) -> pb.EvictResponse:
        async with self._call(context) as tenant:
            request = checked(request, pb.EvictRequest)
            namespaces, blocks = await self._service.evict(
                namespace=request.namespace, tenant=request.tenant, caller=tenant
            )
            return pb.EvictResponse(namespaces=namespaces, blocks=blocks)

    async def Flush(self, request: object, context: Context) -> pb.FlushResponse:
        async with self._call(context) as tenant:
            checked(request, pb.FlushRequest)
            return pb.FlushResponse(blocks=await self._service.flush(caller=tenant))

    async def Stats(self, request: object, context: Context) -> pb.StatsResponse:
        async with self._call(context):
            checked(request, pb.StatsRequest)
            stats = self._service.stats()
            store = stats.store
            counters = {f.name: getattr(store, f.name) for f in dataclasses.fields(store)[1:]}
            return pb.StatsResponse(
                tiers=[pb.TierStats(**dataclasses.asdict(tier)) for tier in store.tiers],
                lookups=stats.lookups,
                lookup_hit_blocks=stats.lookup_hit_blocks,
                uptime_seconds=stats.uptime_seconds,
                version=__version__,
                **counters,
            )


@dataclass(slots=True)
class _Incoming:
    """The block a ``Put`` stream is in the middle of, and where its bytes go."""

    spec: BlockSpec
    checksum: int  # the writer's xxh3-64 of the payload; 0: unchecked
    sink: memoryview | None  # an arena slot or a buffer; None: held already, bytes dropped
    landing: Landing | None = None  # the reserved slot, committed when the block is whole
    buffer: bytearray | None = None  # no arena room: the block is put whole from here
    done: contextlib.ExitStack | None = None  # gives the buffer's bytes back to the budget
    filled: int = 0

    def release(self) -> None:
        if self.sink is not None:
            self.sink.release()
        if self.done is not None:
            self.done.close()


class _PutStream:
    """Stores the blocks of one ``Put`` stream, each as soon as it is whole.

    With a host tier each block's chunks are copied into an arena slot reserved on its first
    chunk, committed once it is whole and aborted if the stream fails first; a block the arena
    has no room for (or any block, without a host tier) is assembled in memory, within
    ``server.max_buffered_bytes``, and put.
    """

    def __init__(self, service: KVStoreService, tenant: str | None) -> None:
        self._service = service
        self._tenant = tenant
        self._namespace = b""
        self._layout: BlockLayout | None = None
        self._size = 0  # payload bytes of one block of the stream's layout
        self._block: _Incoming | None = None
        self.statuses: list[PutStatus] = []

    async def run(self, messages: AsyncIterator[object]) -> list[PutStatus]:
        try:
            await self._receive(messages)
        finally:
            await self._drop()
        return self.statuses

    async def _receive(self, messages: AsyncIterator[object]) -> None:
        position = 0
        async for message in messages:
            chunk = checked(message, chunks.PutChunk)
            if position == 0:
                self._namespace = chunk.namespace
                self._layout = self._service.layout_of(chunk.namespace, tenant=self._tenant)
                self._size = self._layout.payload_bytes
            elif chunk.namespace and chunk.namespace != self._namespace:
                raise InvalidRequestError(
                    f"chunk {position} names namespace {chunk.namespace.hex()}; a Put stream "
                    f"carries one namespace, {self._namespace.hex()}"
                )
            if chunk.block is not None:
                await self._begin(chunk.block, chunk.checksum)
            data = chunk.data  # a view of the received message
            if data:
                self._append(data, position)
            if self._block is not None and self._block.filled == self._size:
                await self._store()
            position += 1
        self._check_ended()

    async def _begin(self, spec: BlockSpec, checksum: int) -> None:
        self._check_ended()
        assert self._layout is not None  # set by the stream's first chunk
        check_spec(f"blocks[{len(self.statuses)}]", spec, self._layout)
        landed = (
            await self._service.land(self._namespace, spec, tenant=self._tenant)
            if self._service.has_arena
            else PutStatus.NO_SPACE
        )
        if isinstance(landed, Landing):
            self._block = _Incoming(spec, checksum, landed.slot, landing=landed)
        elif landed is PutStatus.DEDUP:
            self._block = _Incoming(spec, checksum, None)
        else:
            done = contextlib.ExitStack()
            buffer = done.enter_context(self._service.buffered(self._size))
            self._block = _Incoming(spec, checksum, memoryview(buffer), buffer=buffer, done=done)

    def _check_ended(self) -> None:
        if self._block is not None:
            raise InvalidBlockError(
                f"block {len(self.statuses)} ended after {self._block.filled} payload bytes; "
                f"its layout needs {self._size}"
            )

    def _append(self, data: bytes | memoryview, position: int) -> None:
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
            return await self._service.commit_landing(block.landing, block.checksum)
        if block.buffer is None:
            return PutStatus.DEDUP
        return await self._service.put(
            self._namespace, block.spec, block.buffer, tenant=self._tenant, checksum=block.checksum
        )

    async def _drop(self) -> None:
        """Ends the block the stream stopped inside of (an error, a cancel, a short block)."""
        block, self._block = self._block, None
        if block is not None:
            block.release()
            if block.landing is not None:
                await self._service.abort_landing(block.landing)


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


def _fill_lease(reply: pb.AcquireResponse, acquired: Acquired) -> None:
    """``reply`` (a new message, or a field of one) says what ``acquired`` leased."""
    reply.lease_id = acquired.lease.lease_id
    reply.expires_in = _seconds_until(acquired.lease.expires_at)
    reply.arena_id = acquired.arena_id
    reply.checksums.extend(acquired.checksums)
    add = reply.slots.add  # built in place: half the cost of new Slot messages
    for slot in acquired.slots:
        add(offset=slot.offset, length=slot.length)


def _seconds_until(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
