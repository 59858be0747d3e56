"""One channel to the daemon: calls, retries, the handshake's arena and namespace registrations.

:class:`Connection` is what the client's operations stand on:

1. ``open()``: channel, Handshake, and a watcher that marks the shm sessions stale whenever
   the connection drops (the daemon may come back as another process, with other arenas).
   ``aclose()`` undoes it all.
2. ``unary(method, request, reply_type, idempotent=...)``: one call with the bearer token,
   the timeout, retries for idempotent calls and grpc errors mapped to the client's tree.
3. ``register(namespace)`` -> digest (cached); ``in_namespace(namespace, call)`` runs
   ``call(digest)`` and, when the daemon forgot the namespace or restarted meanwhile, shakes
   hands again, re-registers and runs it once more.
4. ``session(tenant)`` before a data-plane call: the shm session of that tenant (opened on
   first use, after a new handshake if the daemon may have restarted), or ``None`` to stream;
   ``check_fresh(session, ...)`` after the daemon answered: a lease's slots are never read
   from an arena the daemon no longer owns.
5. ``release_soon(lease_id)``: ends a lease in the background, whatever happens to the
   caller; ``aclose`` waits for those releases.
6. ``call(session, method, ...)``: the shm data paths' calls (Lookup with a lease, Acquire,
   Release; Reserve, Commit, Abort) on the session's own socket when the daemon serves them there
   (:mod:`kvstore.client.calls`: a round trip of tens of microseconds), else over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import grpc
from google.protobuf.message import Message

from kvstore.client import wire
from kvstore.client.errors import (
    TRANSIENT,
    KVStoreError,
    NotConnectedError,
    ProtocolError,
    UnavailableError,
    UnknownNamespaceError,
    error_from_rpc,
)
from kvstore.client.shm import ShmSession, torch_imported
from kvstore.client.wire import ServerInfo
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.wire import chunks
from kvstore.wire.channels import open_channel
from kvstore.wire.namespace import Namespace
from kvstore.wire.session import Hello, SessionError

__all__ = ["Connection", "StaleArenaError"]

log = logging.getLogger(__name__)

R = TypeVar("R")
M = TypeVar("M", bound=Message)

SERVICE: Final = "/kvstore.v1.KVStore"
BACKOFF_BASE, BACKOFF_CAP = 0.05, 2.0  # seconds: first retry delay, and the most of any


class StaleArenaError(Exception):
    """The connection dropped during a data-plane call: its slots may name another arena."""


class UnknownSessionError(Exception):
    """The daemon does not know the shm session a call named (it restarted, or closed it)."""


class Connection:
    """See the module docstring; the arguments are :class:`AsyncKVStoreClient`'s."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None,
        use_shm: bool,
        tls_root_cert: bytes | None,
        timeout: float,
        retries: int,
        staging_bytes: int = 256 << 20,
        pin_arena: bool = False,
        session_calls: bool = True,
    ) -> None:
        if not address.startswith("unix:") and not address.rpartition(":")[2].isdigit():
            raise ValueError(
                f"address must be 'unix:/path/to.sock' or 'host:port', got {address!r}"
            )
        if timeout <= 0 or retries < 0:
            raise ValueError(f"need timeout > 0 and retries >= 0, got {timeout} and {retries}")
        self.address = address
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.timeout = timeout
        self.retries = retries
        self.sessions: dict[str, ShmSession] = {}
        self._token = token or ""
        self._staging_bytes = staging_bytes
        self._pin_arena = pin_arena
        self._session_calls = session_calls
        self._use_shm = use_shm
        self._no_shm: set[str] = set()  # tenants whose session the daemon refused
        self._warned_no_shm = False  # the WARNING that shm is out has been logged
        self._releases: set[asyncio.Task[None]] = set()
        self._tls_root_cert = tls_root_cert
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None
        self._info: ServerInfo | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._namespaces: dict[Namespace, bytes] = {}
        self._stale = False
        self._stale_always = False
        self._refresh_lock = asyncio.Lock()
        self._session_lock = asyncio.Lock()

    async def open(self) -> None:
        """Opens the channel and shakes hands; a second call does nothing."""
        if self._channel is not None:
            return
        self._channel = open_channel(self.address, root_cert=self._tls_root_cert)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)  # type: ignore[no-untyped-call]
        # Get's and Put's chunks are written and read with one copy of their data (not
        # protobuf's three; see kvstore.wire.chunks).
        self._stub.Get = self._channel.unary_stream(
            f"{SERVICE}/Get",
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=chunks.decode_get,
        )
        self._stub.Put = self._channel.stream_unary(
            f"{SERVICE}/Put",
            request_serializer=chunks.encode_put,
            response_deserializer=pb.PutResponse.FromString,
        )
        try:
            await self.refresh()
        except BaseException:
            await self.aclose()
            raise
        self._watcher = asyncio.create_task(self._watch(), name=f"kvstore-watch {self.address}")

    async def aclose(self) -> None:
        """Stops the watcher, waits for background releases, ends the shm sessions once their
        copies are done, closes the channel."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
        await self._close_sessions()
        channel, self._channel, self._stub, self._info = self._channel, None, None, None
        if channel is not None:
            await channel.close()
        self._namespaces.clear()

    @property
    def info(self) -> ServerInfo:
        """The last handshake (``NotConnectedError`` before ``open()``)."""
        if self._info is None:
            raise NotConnectedError(f"the client of {self.address} is not connected")
        return self._info

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            raise NotConnectedError(f"the client of {self.address} is not connected")
        return self._channel

    @property
    def stub(self) -> kvstore_pb2_grpc.KVStoreStub:
        if self._stub is None:
            raise NotConnectedError(f"the client of {self.address} is not connected")
        return self._stub

    # Calls ----------------------------------------------------------------------------------

    async def unary(
        self, method: str, request: object, reply_type: type[M], *, idempotent: bool = False
    ) -> M:
        """One call (unary, or a request stream), retried when idempotent; its checked reply."""
        rpc = getattr(self.stub, method)

        async def call() -> object:
            return await rpc(request, metadata=self.metadata, timeout=self.timeout)

        reply = await self.retrying(method, call, idempotent=idempotent)
        if not isinstance(reply, reply_type):
            raise ProtocolError(f"{method} answered a {type(reply).__name__}", method=method)
        return reply

    async def retrying(
        self, method: str, call: Callable[[], Awaitable[R]], *, idempotent: bool
    ) -> R:
        """Runs ``call``, mapping grpc errors; on UNAVAILABLE or DEADLINE_EXCEEDED an idempotent
        call runs again, up to ``retries`` times, after jittered exponential backoff."""
        attempt = 0
        while True:
            try:
                return await call()
            except grpc.RpcError as exc:
                error = error_from_rpc(exc, method)
                if isinstance(error, TRANSIENT):
                    self._stale = True  # the daemon may come back as another process
                if not (idempotent and isinstance(error, TRANSIENT) and attempt < self.retries):
                    raise error from exc
            delay = min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt) * random.uniform(0.5, 1.0)
            log.debug("%s: %s; retrying in %.3f s", method, error, delay)
            await asyncio.sleep(delay)
            attempt += 1

    async def call(
        self, session: ShmSession | None, method: str, request: Message, reply_type: type[M]
    ) -> M:
        """A call of the shm data paths (:data:`~kvstore.wire.session.CALLS`), never retried:
        on ``session``'s socket when it carries calls, else over gRPC. A connection that
        failed marks the daemon as possibly restarted."""
        calls = None if session is None else session.calls
        if calls is None or not calls.open:
            return await self.unary(method, request, reply_type)
        try:
            return await calls.call(method, request, reply_type, self.timeout)
        except TRANSIENT:
            self._stale = True
            raise

    async def unary_undone_on_cancel(
        self,
        method: str,
        request: object,
        reply_type: type[M],
        undo: Callable[[M], Awaitable[None]],
        session: ShmSession | None = None,
    ) -> M:
        """:meth:`call` for a call that grants something (a lease, reservations): a caller
        cancelled meanwhile still waits for the reply and runs ``undo(reply)`` before the
        cancellation propagates, so nothing stays held until it expires."""
        task = asyncio.ensure_future(self.call(session, method, request, reply_type))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            while not task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({task})
            if not task.cancelled() and task.exception() is None:
                await undo(task.result())
            raise

    # Namespaces -----------------------------------------------------------------------------

    async def register(self, namespace: Namespace) -> bytes:
        """The daemon's digest of ``namespace``, registering it on first use."""
        digest = self._namespaces.get(namespace)
        if digest is None:
            request = pb.RegisterNamespaceRequest(
                model=wire.fingerprint_message(namespace.model), tenant=namespace.tenant
            )
            reply = await self.unary(
                "RegisterNamespace", request, pb.RegisterNamespaceResponse, idempotent=True
            )
            digest = self._namespaces[namespace] = reply.namespace
        return digest

    def registered(self, namespace: Namespace) -> bytes | None:
        """The digest of ``namespace`` when it is registered and the connection looks fresh
        (readable from any thread); None otherwise."""
        if self._stale or self._stale_always:
            return None
        return self._namespaces.get(namespace)

    async def in_namespace(self, namespace: Namespace, call: Callable[[bytes], Awaitable[R]]) -> R:
        """Runs ``call(digest)``; when the daemon forgot the namespace or the shm session, or
        restarted meanwhile, shakes hands again, re-registers and runs it once more."""
        try:
            return await call(await self.register(namespace))
        except (UnknownNamespaceError, StaleArenaError, UnknownSessionError) as error:
            log.info("%s: %s; shaking hands and registering again", self.address, error)
        await self.refresh(force_sessions=True)
        try:
            return await call(await self.register(namespace))
        except (StaleArenaError, UnknownSessionError) as error:
            raise UnavailableError(str(error)) from None

    # Shared memory --------------------------------------------------------------------------

    @property
    def shm_possible(self) -> bool:
        """Whether the daemon offers shm sessions on this host (and they are wanted)."""
        info = self._info
        return bool(
            self._use_shm
            and info is not None
            and info.shm_socket
            and os.path.exists(info.shm_socket)
        )

    async def session(self, tenant: str) -> ShmSession | None:
        """The shm session of ``tenant`` to use now, opened on first use (after a new
        handshake if the daemon may have restarted); ``None``: stream instead."""
        if self._stale or self._stale_always:
            await self.refresh()
        found = self.sessions.get(tenant)
        if found is not None and found.calls is not None and not found.calls.open:
            await self._drop_session(found)  # the daemon ended it: open another
            found = None
        if found is not None or tenant in self._no_shm:
            return found
        if not self.shm_possible:
            info = self._info
            if self._use_shm and info is not None and info.shm_socket:  # offered, not seen
                self._cannot_map(info.shm_socket, "no such file in this process's view")
            return None
        async with self._session_lock:
            if tenant not in self.sessions:
                opened = await self._open_session(tenant)
                if opened is not None:
                    self.sessions[tenant] = opened
            return self.sessions.get(tenant)

    def _can_pin(self) -> bool:
        """Whether to register arenas with CUDA: asked for, and CUDA usable in this process
        (the daemon keeps a registered arena's pages, so it is only asked to when it is)."""
        if not (self._pin_arena and torch_imported()):
            return False
        from kvstore.client import tensors

        return tensors.cuda_ready()

    async def _open_session(self, tenant: str) -> ShmSession | None:
        info = self.info
        hello = Hello(self._token, tenant, self._staging_bytes, pin=self._can_pin())
        try:
            opened = await ShmSession.open(
                info.shm_socket, hello, self._session_closed, calls=self._session_calls
            )
        except (OSError, SessionError) as error:
            self._cannot_map(info.shm_socket, str(error))
            if isinstance(error, SessionError):
                self._no_shm.add(tenant)
            return None
        if opened.info.instance_id != info.instance_id:  # another daemon at that path
            log.info("%s: %s is another daemon's; streaming", self.address, info.shm_socket)
            await opened.aclose()
            self._no_shm.add(tenant)
            return None
        return opened

    def _session_closed(self) -> None:
        """A session's socket closed under its calls: the daemon may have restarted."""
        self._stale = True

    def _cannot_map(self, shm_socket: str, why: str) -> None:
        """Says why KV bytes stream instead of being mapped: once per connection at WARNING
        (streaming is several times slower), then at DEBUG (later calls try again, since a
        restarting daemon heals)."""
        level = logging.DEBUG if self._warned_no_shm else logging.WARNING
        self._warned_no_shm = True
        log.log(level, "%s: cannot map the daemon's shared memory through %s (%s); "
                "streaming instead", self.address, shm_socket, why)  # fmt: skip

    def check_fresh(self, session: ShmSession, method: str, arena_id: bytes = b"") -> None:
        """Raises :class:`StaleArenaError` unless the slots the daemon just named lie in this
        session's areas: the reply names its arena (``arena_id``), and a dropped connection
        means the daemon may have restarted with new ones."""
        if self._stale or self.sessions.get(session.tenant) is not session:
            raise StaleArenaError(f"the daemon at {self.address} went away during {method}")
        if arena_id and arena_id != session.arena.arena_id:
            raise StaleArenaError(
                f"{method} named slots in arena {arena_id.hex()[:16]} but the mapped arena is "
                f"{session.arena.arena_id.hex()[:16]}: the daemon restarted"
            )

    def release_soon(self, lease_id: int, session: ShmSession | None = None) -> asyncio.Task[None]:
        """Releases a lease (on ``session``'s socket when it can) in a task of its own (a
        cancelled caller cannot stop it); a failure is logged, the lease then expires on the
        daemon."""

        async def release() -> None:
            try:
                request = pb.ReleaseRequest(lease_id=lease_id)
                await self.call(session, "Release", request, pb.ReleaseResponse)
            except KVStoreError as error:
                log.debug("could not release lease %d: %s", lease_id, error)

        task = asyncio.ensure_future(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return task

    async def release_quietly(self, lease_id: int, session: ShmSession | None = None) -> None:
        """:meth:`release_soon`, waiting for it unless the caller is cancelled again."""
        await asyncio.shield(self.release_soon(lease_id, session))

    async def refresh(self, *, force_sessions: bool = False) -> None:
        """Handshake; ends the shm sessions when the daemon is another process now (or when
        ``force_sessions``: the daemon forgot one)."""
        async with self._refresh_lock:
            self._stale = False
            request = pb.HandshakeRequest()
            reply = await self.unary("Handshake", request, pb.HandshakeResponse, idempotent=True)
            info = wire.server_info(reply)
            self._namespaces.clear()
            old, self._info = self._info, info
            if force_sessions or old is None or old.instance_id != info.instance_id:
                await self._close_sessions()

    async def _drop_session(self, session: ShmSession) -> None:
        if self.sessions.get(session.tenant) is session:
            del self.sessions[session.tenant]
        await session.aclose()

    async def _close_sessions(self) -> None:
        sessions, self.sessions = self.sessions, {}
        self._no_shm.clear()
        for session in sessions.values():
            await session.aclose()

    async def _watch(self) -> None:
        channel = self.channel
        state = channel.get_state()
        try:
            while True:
                await channel.wait_for_state_change(state)
                new = channel.get_state()
                if state is grpc.ChannelConnectivity.READY and new is not state:
                    self._stale = True
                state = new
        except Exception:  # without the watcher, shake hands before every data-plane call
            log.exception("%s: the connection watcher failed", self.address)
            self._stale_always = True
