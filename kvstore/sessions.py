"""Shared-memory sessions: each co-located client's access to its tenant's arena, handed
over a unix socket (protocol: :mod:`kvstore.wire.session`).

What a session gives a client, and nothing more:

- its tenant's host arena, as two descriptors (see :mod:`kvstore.tiers.host`): a read-only
  one, to read leased slots in place, and a read-write one, to write the slots ``Reserve``
  names in place; neither can resize the file or reopen it otherwise, and a client never
  receives another tenant's arena, so it can write no other tenant's bytes;
- a *window*: the most bytes it may hold reserved at once (``server.max_staging_bytes``, or
  less if it asked for less). A slot it reserved is held for it (its range passes to no
  other block) until it commits or aborts it or the session ends, even when the reservation
  expired meanwhile: a late write of a slow writer lands in bytes no one else uses. A block
  turns visible only at its Commit, with the checksum its writer took as it wrote it.

``SessionServer`` owns the socket and the sessions: ``start()`` binds it (mode
``socket_mode``) and accepts; each connection authenticates once with a bearer token (or,
without tokens, names its tenant), gets the arena's two descriptors, and stays open as
the session.
Given ``calls``, it also answers the read path's control calls on the session's connection
(:data:`~kvstore.wire.session.CALLS`, framed gRPC messages; the protocol is in
:mod:`kvstore.wire.session`): each one runs in a task of its own, as the caller the hello's
token names, at most ``MAX_CALLS_IN_FLIGHT`` at once per session (then the connection is not
read until one ends).
``get(session_id, tenant)`` finds a caller's session (a session of another tenant is "not
found"); when a connection closes, ``on_close(session)`` lets the service abort what the
session left reserved and let go of the slots it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvstore.errors import (
    InvalidRequestError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StoreError,
    UnauthenticatedError,
    UnknownSessionError,
)
from kvstore.sockets import prepare_socket_path, set_access
from kvstore.store import BlockStore
from kvstore.tiers.allocator import Slot
from kvstore.wire.session import (
    CALLS,
    FRAME,
    MAX_FRAME_BYTES,
    MAX_LINE_BYTES,
    Hello,
    SessionError,
    SessionInfo,
    decode_hello,
    encode_refusal,
    encode_welcome,
)

__all__ = ["Session", "SessionServer"]

log = logging.getLogger(__name__)

HELLO_SECONDS = 5.0  # a connection that has not said hello by then is dropped
MAX_CALLS_IN_FLIGHT = 64  # per session
# (method, request body, the hello's token) -> (status: 0 or a gRPC code's number, reply body)
CallHandler = Callable[[str, bytes, str], Awaitable[tuple[int, bytes]]]
PAGE = mmap.PAGESIZE
_CODES: dict[type[StoreError], str] = {
    UnauthenticatedError: "UNAUTHENTICATED",
    PermissionDeniedError: "PERMISSION_DENIED",
    ResourceExhaustedError: "RESOURCE_EXHAUSTED",
    InvalidRequestError: "INVALID_ARGUMENT",
}


class Session:
    """One client's session: the arena slots it is writing in place, within its window."""

    def __init__(self, tenant: str, window_bytes: int, peer: str, token: str = "") -> None:
        self.id = secrets.token_bytes(16)
        self.tenant = tenant
        self.token = token  # the hello's: the session's calls run as its caller
        self.peer = peer
        self.window_bytes = window_bytes  # the most bytes it may hold reserved at once
        # block id -> the arena slot it writes (held until committed or aborted; None while
        # its Reserve makes room)
        self.slots: dict[bytes, Slot | None] = {}
        self.held_bytes = 0
        self._sizes: dict[bytes, int] = {}
        self.keeps_pages = False  # the client registered the arena with CUDA (hello's pin)
        self.closed = False

    def claim(self, block: bytes, size: int) -> bool:
        """Takes ``size`` bytes of the window for ``block``; False when it is full (or the
        session writes ``block`` already)."""
        if block in self.slots or self.held_bytes + size > self.window_bytes:
            return False
        self.slots[block] = None
        self._sizes[block] = size
        self.held_bytes += size
        return True

    def claims(self, block: bytes) -> bool:
        """Whether ``block`` is claimed and has no slot yet (its Reserve is under way)."""
        return block in self.slots and self.slots[block] is None

    def give(self, block: bytes) -> Slot | None:
        """Ends ``block``'s claim; its slot, for the caller to let go of (None: it had none)."""
        slot = self.slots.pop(block, None)
        self.held_bytes -= self._sizes.pop(block, 0)
        return slot

    def close(self) -> None:
        self.closed = True


class SessionServer:
    """The session socket and its sessions; see the module docstring.

    Args:
        path: The unix socket to listen on.
        socket_mode: Its permissions, e.g. ``0o600``.
        socket_gid: Its group (``server.socket_group``); None: the daemon's.
        store: The block store (its host tier's arenas).
        tenant_of: The tenant of a bearer token (``None``: tokens are off); raises
            ``UnauthenticatedError`` for a bad token.
        on_close: Called when a session ends.
        instance_id: Names this daemon process (as the Handshake does).
        max_staging_bytes: The most bytes one session may hold reserved at once.
        max_sessions: The most sessions open at once.
        calls: Answers a session's calls (None: the socket serves none).
    """

    def __init__(
        self,
        path: Path,
        *,
        socket_mode: int,
        socket_gid: int | None = None,
        store: BlockStore,
        tenant_of: Callable[[str], str | None],
        on_close: Callable[[Session], Awaitable[None]],
        instance_id: bytes,
        max_staging_bytes: int,
        max_sessions: int,
        calls: CallHandler | None = None,
    ) -> None:
        self.path = path
        self._calls = calls
        self._mode, self._gid = socket_mode, socket_gid
        self._store = store
        self._tenant_of = tenant_of
        self._on_close = on_close
        self._instance_id = instance_id
        self._max_staging = max_staging_bytes
        self._max_sessions = max_sessions
        self._sessions: dict[bytes, Session] = {}
        self._socket: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._sessions)

    async def start(self) -> None:
        """Binds the socket (refusing a path a live daemon holds) and starts accepting."""
        prepare_socket_path(self.path, self._mode, self._gid)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            set_access(self.path, self._mode, self._gid)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._socket = sock
        self._accepting = asyncio.create_task(self._accept(), name="shm-sessions-accept")
        log.info("shm sessions on %s", self.path)

    async def aclose(self) -> None:
        """Stops accepting, ends every session and removes the socket."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()
            self._socket = None
            self.path.unlink(missing_ok=True)

    def get(self, session_id: bytes, tenant: str | None) -> Session:
        """The caller's open session ``session_id``.

        Raises:
            UnknownSessionError: no such open session, or it is another tenant's.
        """
        session = self._sessions.get(session_id)
        if session is None or session.closed or (tenant is not None and session.tenant != tenant):
            raise UnknownSessionError(
                f"shm session {session_id.hex()[:16] or '(none)'} is not open; open one on "
                f"the daemon's shm_socket"
            )
        return session

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._socket is not None
        while True:
            conn, _ = await loop.sock_accept(self._socket)
            if len(self._handlers) >= 2 * self._max_sessions:  # sessions and hellos pending
                log.warning("shm session refused: %d connections open", len(self._handlers))
                conn.close()
                continue
            task = asyncio.create_task(self._serve(conn), name="shm-session")
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        session: Session | None = None
        with conn:
            conn.setblocking(False)
            peer = _peer(conn)
            try:
                line = await asyncio.wait_for(_read_line(loop, conn), HELLO_SECONDS)
                hello = decode_hello(line)
                if hello.session:  # a calls-only connection of an open session
                    await self._serve_attached(loop, conn, hello, peer)
                    return
                session = self._open(hello, peer)
                await self._welcome(loop, conn, session)
            except (TimeoutError, OSError) as error:
                log.info("shm session from %s dropped before it opened: %s", peer, error)
                if session is not None:
                    await self._end(session)
                return
            except SessionError as error:
                await _send_quietly(loop, conn, encode_refusal(error.code, str(error)))
                log.info("shm session from %s refused: %s", peer, error)
                return
            except Exception:  # a bug: the daemon serves on, this connection ends
                log.exception("shm session from %s failed", peer)
                if session is not None:
                    await self._end(session)
                return
            try:
                if self._calls is None:
                    while await loop.sock_recv(conn, 4096):
                        pass  # the session lasts until the client closes the connection
                else:
                    await self._answer_calls(conn, session, self._calls, session.token)
            except OSError:
                pass
            finally:
                await self._end(session)

    async def _serve_attached(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, hello: Hello, peer: str
    ) -> None:
        """A further connection of an open session that only carries its calls, as the
        caller its own token names; closing it ends nothing else."""
        if self._calls is None:
            raise SessionError("FAILED_PRECONDITION", "this daemon serves no calls on sessions")
        caller = self._caller(hello)
        tenant = hello.tenant if caller is None else caller
        session = self._sessions.get(hello.session)
        if session is None or session.closed or session.tenant != tenant:
            raise SessionError(
                "FAILED_PRECONDITION",
                f"no open shm session {hello.session.hex()[:16]} of tenant {tenant!r} to attach to",
            )
        await loop.sock_sendall(conn, encode_welcome(self._info(session)))
        log.debug("calls attached to shm session %s by %s", session.id.hex()[:8], peer)
        with contextlib.suppress(OSError):
            await self._answer_calls(conn, session, self._calls, hello.token)

    async def _answer_calls(
        self, conn: socket.socket, session: Session, calls: CallHandler, token: str
    ) -> None:
        """Reads call frames until the client closes the connection (or breaks the
        protocol), answering each from a task of its own."""
        reader, writer = await asyncio.open_unix_connection(sock=conn)
        in_flight: set[asyncio.Task[None]] = set()
        room = asyncio.Semaphore(MAX_CALLS_IN_FLIGHT)
        try:
            while True:
                try:
                    header = await reader.readexactly(FRAME.size)
                except asyncio.IncompleteReadError:
                    return  # closed by the client
                length, call_id, method = FRAME.unpack(header)
                if length > MAX_FRAME_BYTES or not 0 < method <= len(CALLS):
                    log.warning("shm session %s: a frame of %d bytes for method %d; closing it",
                                session.id.hex()[:8], length, method)  # fmt: skip
                    return
                body = await reader.readexactly(length)
                await room.acquire()
                task = asyncio.create_task(
                    self._answer(writer, calls, CALLS[method - 1], call_id, body, token),
                    name="shm-session-call",
                )
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                task.add_done_callback(lambda _: room.release())
        finally:
            for task in in_flight:
                task.cancel()  # a lease granted to a call cancelled here is released
            await asyncio.gather(*in_flight, return_exceptions=True)
            writer.close()

    @staticmethod
    async def _answer(
        writer: asyncio.StreamWriter,
        calls: CallHandler,
        method: str,
        call_id: int,
        body: bytes,
        token: str,
    ) -> None:
        status, reply = await calls(method, body, token)
        if not writer.is_closing():
            writer.write(FRAME.pack(len(reply), call_id, status) + reply)
            await writer.drain()

    def _caller(self, hello: Hello) -> str | None:
        """The tenant the hello's token names (None: tokens are off).

        Raises:
            SessionError: an unknown token, or one of another tenant than ``hello.tenant``.
        """
        try:
            caller = self._tenant_of(hello.token)
            if caller is not None and hello.tenant not in ("", caller):
                raise PermissionDeniedError(
                    f"a token of tenant {caller!r} cannot open a session for {hello.tenant!r}"
                )
        except StoreError as error:
            raise SessionError(_code(error), str(error)) from None
        return caller

    def _open(self, hello: Hello, peer: str) -> Session:
        caller = self._caller(hello)
        if len(self._sessions) >= self._max_sessions:
            raise SessionError(
                "RESOURCE_EXHAUSTED",
                f"{len(self._sessions)} shm sessions are open (server.max_sessions)",
            )
        tenant = hello.tenant if caller is None else caller
        if not self._store.has_arena:
            raise SessionError("FAILED_PRECONDITION", "the daemon has no host tier")
        wanted = min(hello.staging_bytes or self._max_staging, self._max_staging)
        session = Session(tenant, max(PAGE, wanted), peer, hello.token)
        self._sessions[session.id] = session
        if hello.pin:  # before the arena is sent: no page of it is given back from now on
            session.keeps_pages = True
            self._store.keep_arena_pages(tenant, True)
        log.debug("shm session %s opened for tenant %r by %s", session.id.hex()[:8], tenant, peer)
        return session

    def _info(self, session: Session) -> SessionInfo:
        arena = self._store.arena(session.tenant)
        assert arena is not None
        return SessionInfo(
            self._instance_id,
            session.id,
            arena.arena_id,
            arena.size,
            session.window_bytes,
            calls=self._calls is not None,
        )

    async def _welcome(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, session: Session
    ) -> None:
        arena = self._store.arena(session.tenant)
        assert arena is not None
        welcome = encode_welcome(self._info(session))
        await _send_with_fds(loop, conn, welcome, [arena.fd, arena.writer_fd])

    async def _end(self, session: Session) -> None:
        self._sessions.pop(session.id, None)
        if session.keeps_pages:  # the client unregisters before it closes the session
            session.keeps_pages = False
            self._store.keep_arena_pages(session.tenant, False)
        try:
            await self._on_close(session)
        except Exception:
            log.exception("cleaning up shm session %s failed", session.id.hex()[:8])
        session.close()
        log.debug("shm session %s closed", session.id.hex()[:8])


def _code(error: StoreError) -> str:
    for cls in type(error).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return "INTERNAL"


def _peer(conn: socket.socket) -> str:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return "an unknown peer"
    pid, uid, _gid = struct.unpack("3i", creds)
    return f"pid {pid} uid {uid}"


async def _read_line(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, MAX_LINE_BYTES)
        if not chunk:
            raise OSError("the client closed the connection")
        data += chunk
        if len(data) > MAX_LINE_BYTES:
            raise SessionError("INVALID_ARGUMENT", f"a hello over {MAX_LINE_BYTES} bytes")
    return bytes(data)


async def _send_with_fds(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes, fds: list[int]
) -> None:
    """Sends ``data`` with ``fds`` attached (one small message: it fits the socket buffer)."""
    for _ in range(1000):
        try:
            sent = socket.send_fds(conn, [data], fds)
        except BlockingIOError:
            await asyncio.sleep(0.001)
            continue
        if sent < len(data):
            await loop.sock_sendall(conn, data[sent:])
        return
    raise OSError("the shm session socket stayed full")


async def _send_quietly(loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        await asyncio.wait_for(loop.sock_sendall(conn, data), HELLO_SECONDS)
