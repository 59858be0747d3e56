"""The asyncio client of the kvstore daemon: gRPC control plane, shared-memory data plane.

Primitives, in the order an engine uses them:

1. ``connect()``: Handshake. When the daemon is on this host (``data_plane`` says ``"shm"``),
   the first data-plane call of a tenant opens an shm session: the tenant's arena mapped
   read-only for reads, and writable for puts (which write the slots reserved for them in
   place); else KV bytes are streamed over gRPC
   (``"stream"``). ``aclose()`` or ``async with`` ends it.
2. ``register(namespace)`` -> the digest other calls carry (cached; a daemon that forgot it,
   e.g. after a restart, is answered by re-registering and retrying once, transparently).
3. ``lookup(namespace, keys)`` -> how many leading blocks are held (``lookup_tiers``: and where;
   ``find``: and the leading ones in host memory leased, one round trip, ``release`` after).
4. ``get(namespace, keys, out=...)`` -> the leading held blocks' payloads (a miss is a shorter
   list); ``view(namespace, keys)`` / ``view_tensors(...)`` -> zero-copy views under a lease.
5. ``put(namespace, keys, blocks, parent=...)`` -> one :class:`WriteStatus` per block.
6. ``prefetch``, ``delete``, ``stats``, ``health``.

Idempotent calls (Handshake, RegisterNamespace, Lookup, the Get stream, Prefetch, Delete,
Stats) are retried with jittered exponential backoff on UNAVAILABLE and DEADLINE_EXCEEDED;
Acquire, Reserve, Commit and Put never are. A lease is always released, also when its call is
cancelled or times out (the client names it before the call). With ``verify=True`` every
block read is checked against the checksum recorded when it was stored
(:class:`CorruptBlockError` on a mismatch) and streamed puts send their checksums (an shm
put always does: the daemon records them without reading the bytes). Errors are
:mod:`kvstore.client.errors` classes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Literal, Self, overload

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import transfer, wire
from kvstore.client.connection import Connection
from kvstore.client.errors import TRANSIENT, error_from_rpc
from kvstore.client.shm import (
    Arena,
    Payload,
    TargetT,
    caller_stream,
    check_payloads,
    require_torch,
)
from kvstore.client.transfer import Found, SharedLease
from kvstore.client.wire import LookupResult, ServerInfo, Slots, Stats, WriteStatus
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.blocks import ROOT_KEY
from kvstore.wire.namespace import Namespace

if TYPE_CHECKING:
    import torch

    from kvstore.client.tensors import HostBlocks

__all__ = ["AsyncKVStoreClient"]


class AsyncKVStoreClient:
    """A connection to one daemon; see the module docstring.

    Args:
        address: ``"unix:/path/to.sock"`` or ``"host:port"``.
        token: Sent as ``authorization: Bearer <token>`` on every call.
        use_shm: Map the daemon's arena when it is on this host; ``False`` always streams.
        tls_root_cert: PEM root certificate(s); set for a TLS TCP listener.
        timeout: Seconds per call attempt.
        retries: Extra attempts of idempotent calls on UNAVAILABLE or DEADLINE_EXCEEDED.
        verify: Check every block read against its stored checksum; send checksums on
            streamed puts.
        staging_bytes: The window to ask for per shm session: the bytes its puts may hold
            reserved in the arena at once.
        pin_arena: Register each shm arena's mappings with CUDA as page-locked memory when
            torch is imported and CUDA is usable, so copies between it and the GPU are DMA (on
            failure: a warning, once, and unpinned copies). This locks the tenant's whole
            arena (``host.capacity``) in memory, and is only right when the daemon's host tier
            holds this one tenant: a byte range that passes to another tenant's arena is given
            back by the daemon, and a registration keeps reading the pages it had.
        session_calls: Make the shm data paths' calls (Lookup, Acquire, Release; Reserve,
            Commit, Abort) on the shm session's own socket when the daemon serves them there
            (a round trip of tens of microseconds); ``False`` makes them over gRPC (as remote
            clients do).

    Raises:
        ValueError: A malformed address, a timeout <= 0 or retries < 0.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        use_shm: bool = True,
        tls_root_cert: bytes | None = None,
        timeout: float = 10.0,
        retries: int = 3,
        verify: bool = False,
        staging_bytes: int = 256 << 20,
        pin_arena: bool = False,
        session_calls: bool = True,
    ) -> None:
        self._conn = Connection(
            address,
            token=token,
            use_shm=use_shm,
            tls_root_cert=tls_root_cert,
            timeout=timeout,
            retries=retries,
            staging_bytes=staging_bytes,
            pin_arena=pin_arena,
            session_calls=session_calls,
        )
        self.verify = verify

    async def connect(self) -> None:
        """Opens the channel, shakes hands and maps the arena if it can; again: no-op.

        Raises:
            KVStoreError: The daemon cannot be reached (after retries) or refused the token.
        """
        await self._conn.open()

    async def aclose(self) -> None:
        """Closes the channel and unmaps the arena (once copies in flight are done)."""
        await self._conn.aclose()

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncKVStoreClient({self.address!r}, data_plane={self.data_plane!r})"

    @property
    def address(self) -> str:
        return self._conn.address

    @property
    def timeout(self) -> float:
        """Seconds per call attempt; may be changed between calls (e.g. a long one to
        connect, then a short deadline for calls on a latency-critical path)."""
        return self._conn.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {seconds!r}")
        self._conn.timeout = float(seconds)

    @property
    def data_plane(self) -> Literal["shm", "stream"]:
        """``"shm"`` when KV bytes move through shared memory, else ``"stream"``."""
        return "shm" if self._conn.shm_possible else "stream"

    @property
    def server_info(self) -> ServerInfo:
        """The daemon's last handshake (``NotConnectedError`` before ``connect()``)."""
        return self._conn.info

    # Control plane --------------------------------------------------------------------------

    async def register(self, namespace: Namespace) -> bytes:
        """Registers a model + tenant with the daemon (once per namespace; cached).

        Returns:
            The 32-byte namespace digest the daemon uses.

        Raises:
            PermissionDeniedError: The token belongs to another tenant.
        """
        return await self._conn.register(namespace)

    async def open_session(self, namespace: Namespace) -> bool:
        """Registers ``namespace`` and opens its tenant's shm session now, as the first call
        that needs them would: an engine calls this at start, so that no request pays for
        them.

        Returns:
            Whether KV moves through shared memory (else it streams).
        """
        await self._conn.register(namespace)
        return await self._conn.session(namespace.tenant) is not None

    async def lookup(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        """How many leading blocks of a key chain the daemon holds (0 on a miss).

        Raises:
            ValueError: A key is not 32 bytes.
        """
        return (await self.lookup_tiers(namespace, keys)).num_blocks

    async def lookup_tiers(self, namespace: Namespace, keys: Sequence[bytes]) -> LookupResult:
        """How many leading blocks are held, and per block the highest tier holding it.

        Raises:
            ValueError: A key is not 32 bytes.
        """
        keys = wire.check_keys(keys)
        if not keys:
            return LookupResult(0, ())

        async def lookup(digest: bytes) -> pb.LookupResponse:
            request = pb.LookupRequest(namespace=digest, keys=keys)
            return await self._conn.unary("Lookup", request, pb.LookupResponse, idempotent=True)

        return wire.lookup_result(await self._conn.in_namespace(namespace, lookup), len(keys))

    async def find(self, namespace: Namespace, keys: Sequence[bytes]) -> Found:
        """:meth:`lookup_tiers`, with the leading blocks already in host memory leased in
        the same round trip (on the shm plane; the stream plane leases nothing): a loader's
        one call for a host hit. ``found.host_blocks()`` says where they lie; blocks held
        below host memory are not moved up (:meth:`host_blocks` them, or :meth:`prefetch`).
        End the lease with :meth:`release`, within ``server_info.lease_seconds``.

        Raises:
            ValueError: A key is not 32 bytes.
        """
        keys = wire.check_keys(keys)
        if not keys:
            return Found(LookupResult(0, ()))
        size = namespace.model.layout().payload_bytes

        async def find(digest: bytes) -> Found:
            session = await self._conn.session(namespace.tenant)
            if session is None:
                return Found(await self.lookup_tiers(namespace, keys))
            return await transfer.find(self._conn, session, digest, keys, size, verify=self.verify)

        return await self._conn.in_namespace(namespace, find)

    def find_here(self, namespace: Namespace, keys: Sequence[bytes], lease_id: int) -> Found | None:
        """:meth:`find` from the calling thread, with no event loop between (any thread, not
        only the loop's): on a connection of its own to the tenant's shm session, under
        ``lease_id`` (:func:`~kvstore.client.transfer.new_lease_id`). None when that cannot be
        done now (no session or registered namespace yet, the daemon serves no calls there,
        ``verify`` on): use :meth:`find`.

        Raises:
            KVStoreError: the call failed; the daemon may have granted the lease: release
                ``lease_id``.
        """
        conn = self._conn
        digest = conn.registered(namespace)
        session = conn.sessions.get(namespace.tenant)
        if digest is None or session is None or self.verify:
            return None
        calls = session.blocking_calls(conn.timeout)
        if calls is None:
            return None
        size = namespace.model.layout().payload_bytes
        keys = wire.check_keys(keys)
        return transfer.find_here(conn, session, calls, digest, keys, size, lease_id)

    async def release_lease(self, lease_id: int) -> None:
        """Releases a lease of the tenant by its id, in the background (after :meth:`find_here`
        failed: the daemon may have granted it; or a :class:`SharedLease` once read)."""
        self._conn.release_soon(lease_id)

    async def shared_blocks(self, namespace: Namespace, lease: SharedLease) -> HostBlocks | None:
        """Where the blocks another process of the tenant leased lie in this client's mapping
        of the same arena (opening the tenant's session if needed); None when this client
        maps another arena (the daemon restarted since) or streams. The lease stays the
        tenant's: end it with :meth:`release_lease` once read (while it holds:
        ``lease.alive_until``).

        Raises:
            ProtocolError: an offset that does not lie in the arena.
        """
        session = await self._conn.session(namespace.tenant)
        if session is None or session.arena.arena_id != lease.arena_id:
            return None
        size = namespace.model.layout().payload_bytes
        slots = wire.check_pairs([(offset, size) for offset in lease.offsets], size, session.arena)
        return transfer.leased_blocks(session.arena, slots)

    async def release(self, found: Found) -> None:
        """Ends the lease :meth:`find` took (nothing when it took none): in the background
        while the lease is sure to hold still, else waited for.

        Raises:
            UnknownLeaseError: the lease expired before this: what was read under it may
                have been overwritten and must not be used.
        """
        if found.lease is not None:
            await transfer.end_lease(self._conn, found.lease)

    async def prefetch(
        self, session_id: str, namespace: Namespace, chains: Sequence[Sequence[bytes]]
    ) -> int:
        """Hints that a session runs soon: the daemon moves its chains up to the host tier.

        Returns:
            How many blocks the daemon queued for promotion.
        """
        checked = [pb.KeyChain(keys=wire.check_keys(chain, "chain")) for chain in chains]

        async def prefetch(digest: bytes) -> pb.PrefetchResponse:
            request = pb.PrefetchRequest(session_id=session_id, namespace=digest, chains=checked)
            return await self._conn.unary("Prefetch", request, pb.PrefetchResponse, idempotent=True)

        return (await self._conn.in_namespace(namespace, prefetch)).num_blocks

    async def delete(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        """Deletes blocks from every tier; returns how many were deleted."""
        keys = wire.check_keys(keys)

        async def delete(digest: bytes) -> pb.DeleteResponse:
            request = pb.DeleteRequest(namespace=digest, keys=keys)
            return await self._conn.unary("Delete", request, pb.DeleteResponse, idempotent=True)

        return (await self._conn.in_namespace(namespace, delete)).num_blocks

    async def stats(self) -> Stats:
        """The daemon's counters and per-tier usage."""
        reply = await self._conn.unary(
            "Stats", pb.StatsRequest(), pb.StatsResponse, idempotent=True
        )
        return wire.stats(reply)

    async def health(self) -> bool:
        """``True`` when the daemon says it serves; ``False`` when it cannot be reached.

        Asks the standard ``grpc.health.v1`` service, or shakes hands when there is none.

        Raises:
            UnauthenticatedError, PermissionDeniedError: The daemon refused the token.
        """
        stub = health_pb2_grpc.HealthStub(self._conn.channel)
        request = health_pb2.HealthCheckRequest(service="")
        try:
            reply = await stub.Check(
                request, metadata=self._conn.metadata, timeout=self._conn.timeout
            )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                error = error_from_rpc(exc, "Check")
                if isinstance(error, TRANSIENT):
                    return False
                raise error from exc
        try:
            await self._conn.unary("Handshake", pb.HandshakeRequest(), pb.HandshakeResponse)
        except TRANSIENT:
            return False
        return True

    # Data plane -----------------------------------------------------------------------------

    @overload
    async def get(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        *,
        out: None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> list[bytes]: ...

    @overload
    async def get(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        *,
        out: Sequence[TargetT],
        stream: torch.cuda.Stream | None = None,
    ) -> list[TargetT]: ...

    async def get(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        *,
        out: Sequence[TargetT] | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> list[bytes] | list[TargetT]:
        """The payloads of the leading held blocks of a key chain.

        Args:
            namespace: The model and tenant.
            keys: A key chain, block 0 first.
            out: One destination per key (writable buffers, or contiguous tensors on any
                device, of exactly ``payload_bytes``); the blocks are copied into them.
            stream: The CUDA stream that copies into CUDA tensors queue on, after the work
                already queued there; default: the calling thread's current stream. The
                copies are done when this returns.

        Returns:
            One payload per leading held block (fewer than ``keys`` on a partial hit, empty on
            a miss): new bytes, or the first entries of ``out``, filled.

        Raises:
            ValueError: A key is not 32 bytes, or ``out`` does not fit.
            UnknownLeaseError: The lease expired before the copy finished (nothing returned).
        """
        keys = wire.check_keys(keys)
        size = namespace.model.layout().payload_bytes
        if stream is None:
            stream = caller_stream()
        if out is not None:
            if len(out) != len(keys):
                raise ValueError(f"out needs one buffer per key: {len(keys)}, got {len(out)}")
            check_payloads(out, size, what="out", writable=True)
        if not keys:
            return []

        async def get(digest: bytes) -> list[bytes] | list[TargetT]:
            session = await self._conn.session(namespace.tenant)
            if session is None:
                return await transfer.get_stream(
                    self._conn, digest, keys, size, out, verify=self.verify, stream=stream
                )
            leased = await transfer.acquire(
                self._conn, session, digest, keys, size, verify=self.verify
            )
            try:
                if out is None:
                    result: list[bytes] | list[TargetT] = await leased.arena.read(leased.slots)
                else:
                    await leased.arena.copy_out(leased.slots, out[: len(leased.slots)], stream)
                    result = list(out[: len(leased.slots)])
            except BaseException:
                await self._conn.release_quietly(leased.lease_id, leased.session)
                raise
            await transfer.end_lease(self._conn, leased)  # it expired: raises
            return result

        return await self._conn.in_namespace(namespace, get)

    @contextlib.asynccontextmanager
    async def view(
        self, namespace: Namespace, keys: Sequence[bytes]
    ) -> AsyncIterator[list[memoryview]]:
        """Read-only views of the leading held blocks, valid inside the ``async with``.

        On the shm plane they point into the arena (no copy) under a lease that ends on exit,
        when the views are released too; finish within ``server_info.lease_seconds``. On the
        stream plane they view downloaded bytes.

        Raises:
            ValueError: A key is not 32 bytes.
            UnknownLeaseError: On exit, when the lease expired while the views were in use.
        """
        async with self._leased(namespace, keys) as leased:
            if leased is None:
                yield [memoryview(block) for block in await self.get(namespace, keys)]
                return
            arena, slots = leased
            views = [arena.view(*slot) for slot in slots]
            try:
                yield views
            finally:
                for view in views:
                    with contextlib.suppress(BufferError):  # the caller still exports it
                        view.release()

    @contextlib.asynccontextmanager
    async def view_tensors(
        self, namespace: Namespace, keys: Sequence[bytes]
    ) -> AsyncIterator[list[torch.Tensor]]:
        """Like :meth:`view`, as flat uint8 CPU tensors of ``payload_bytes`` each.

        On the shm plane they share the arena's memory: do not write them, and do not use them
        after the ``async with`` (the slots may be reused). On the stream plane they are copies.

        Raises:
            ModuleNotFoundError: torch is not installed.
        """
        require_torch("view_tensors")
        from kvstore.client import tensors

        async with self._leased(namespace, keys) as leased:
            if leased is None:
                size = namespace.model.layout().payload_bytes
                out = [tensors.empty(size) for _ in keys]
                yield await self.get(namespace, keys, out=out)
            else:
                arena, slots = leased
                yield [arena.tensor(*slot) for slot in slots]

    @contextlib.asynccontextmanager
    async def host_blocks(
        self, namespace: Namespace, keys: Sequence[bytes]
    ) -> AsyncIterator[HostBlocks]:
        """Where the leading held blocks lie in host memory, valid inside the ``async with``:
        for a loader that moves them to a device itself (one kernel per layer, say).

        On the shm plane the blocks stay in the arena, under a lease that ends on exit: the
        source is the whole arena, mapped for device kernels when it is pinned. On the stream
        plane they are downloaded into one buffer, page-locked (so mapped) when CUDA is usable.
        Nothing may read them after the ``async with`` (wait for device work first).

        Raises:
            ModuleNotFoundError: torch is not installed.
            ValueError: A key is not 32 bytes.
            UnknownLeaseError: On exit, when the lease expired while they were in use.
        """
        require_torch("host_blocks")
        from kvstore.client import tensors

        async with self._leased(namespace, keys) as leased:
            if leased is not None:
                yield transfer.leased_blocks(*leased)
                return
            size = namespace.model.layout().payload_bytes
            pinned = tensors.cuda_ready()
            buffer = tensors.empty(size * len(keys), pinned=pinned)
            out = [buffer[i * size : (i + 1) * size] for i in range(len(keys))]
            got = len(await self.get(namespace, keys, out=out))
            mapped = tensors.HostMapped(buffer.data_ptr(), buffer.numel()) if pinned else None
            yield tensors.HostBlocks(buffer, tuple(i * size for i in range(got)), mapped)

    async def put(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        blocks: Sequence[Payload],
        *,
        parent: bytes = ROOT_KEY,
        stream: torch.cuda.Stream | None = None,
    ) -> list[WriteStatus]:
        """Stores full blocks of a key chain; visible to every client once this returns.

        Args:
            namespace: The model and tenant.
            keys: A contiguous key chain; ``keys[i]``'s parent is ``keys[i - 1]``.
            blocks: One raw payload per key, ``layout.payload_bytes`` each: buffers, or
                contiguous tensors on any device
                (``[num_layers, 2, block_tokens, num_kv_heads, head_dim]``).
            parent: The key before ``keys[0]``; ``ROOT_KEY`` when ``keys[0]`` is block 0.
            stream: The CUDA stream that copies from CUDA tensors queue on, after the work
                already queued there (what fills them); default: the calling thread's
                current stream. The copies are done when this returns.

        Returns:
            One status per block: STORED, DEDUP (already held), NO_SPACE or EXPIRED.

        Raises:
            ValueError: A key is not 32 bytes, or a block has the wrong size (index named).
        """
        keys = wire.check_keys(keys)
        (parent,) = wire.check_keys([parent], "parent")
        if len(blocks) != len(keys):
            raise ValueError(f"put needs one block per key: {len(keys)} keys, {len(blocks)} blocks")
        size = namespace.model.layout().payload_bytes
        check_payloads(blocks, size, what="blocks")
        if not keys:
            return []
        if stream is None:
            stream = caller_stream()
        specs = wire.block_specs(keys, parent, namespace.model.block_tokens)

        async def put(digest: bytes) -> list[WriteStatus]:
            session = await self._conn.session(namespace.tenant)
            if session is None or session.budget.slot_bytes(size) > session.budget.total:
                return await transfer.put_stream(
                    self._conn, digest, specs, blocks, verify=self.verify, stream=stream
                )
            return await transfer.put_shm(
                self._conn, session, digest, specs, blocks, size, stream=stream
            )

        return await self._conn.in_namespace(namespace, put)

    @contextlib.asynccontextmanager
    async def _leased(
        self, namespace: Namespace, keys: Sequence[bytes]
    ) -> AsyncIterator[tuple[Arena, Slots] | None]:
        """(arena, slots) of the leading held blocks under a lease; ``None`` when streaming."""
        keys = wire.check_keys(keys)
        size = namespace.model.layout().payload_bytes
        if not keys or self.data_plane == "stream":
            yield None
            return

        async def acquire(digest: bytes) -> transfer.Leased | None:
            session = await self._conn.session(namespace.tenant)
            if session is None:
                return None
            return await transfer.acquire(
                self._conn, session, digest, keys, size, verify=self.verify
            )

        leased = await self._conn.in_namespace(namespace, acquire)
        if leased is None:
            yield None
            return
        try:
            yield leased.arena, leased.slots
        except BaseException:
            await self._conn.release_quietly(leased.lease_id, leased.session)
            raise
        await transfer.end_lease(self._conn, leased)  # it expired: raises
