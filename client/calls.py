"""Control calls on the shm session's own sockets: the read path at socket speed.

A daemon whose session welcome says ``calls`` answers the shm data paths' calls
(:data:`~kvstore.wire.session.CALLS`: ``Lookup``, ``Acquire``, ``Release``; ``Reserve``,
``Commit``, ``Abort``) on the session's
connection, the same messages and statuses as over gRPC in small frames
(:mod:`kvstore.wire.session`). A round trip there costs tens of microseconds against several
hundred for a gRPC call, and a store hit is one such call: this is where its fixed cost goes.

:class:`SessionCalls` runs on the client's event loop: ``call`` writes a frame and waits for
its reply (matched by call id; calls may overlap), at most the client's timeout
(``DeadlineExceededError``). One reader task takes the replies. When the connection ends (the
daemon stopped, or closed the session), every call waiting and every later one fails with
``UnavailableError`` and ``on_closed`` runs once, so the connection shakes hands again.

:class:`BlockingCalls` makes the same calls from whatever thread calls it, on a connection of
its own attached to the session (one call at a time): for the blocking client, whose calls
would otherwise cross to its loop's thread and back (two thread wake-ups a call). A failed or
late call closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore.client.errors import (
    DeadlineExceededError,
    ProtocolError,
    ResourceExhaustedError,
    UnavailableError,
    error_from_status,
)
from kvstore.wire.session import (
    CALLS,
    FRAME,
    MAX_FRAME_BYTES,
    Hello,
    SessionError,
    SessionInfo,
    decode_reply,
    encode_hello,
    read_line,
)

__all__ = ["BlockingCalls", "SessionCalls"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
_METHOD_IDS = {name: index + 1 for index, name in enumerate(CALLS)}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SessionCalls:
    """Calls on a session socket (see the module docstring).

    Args:
        sock: The session's connected socket (nothing else reads it once this starts).
        on_closed: Called once when the connection ends.
    """

    def __init__(self, sock: socket.socket, on_closed: Callable[[], None] | None = None) -> None:
        self._sock = sock
        self._on_closed = on_closed
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._closed: str | None = None  # why, once the connection ended

    async def start(self) -> None:
        """Takes the socket over on the running loop and starts reading replies."""
        self._sock.setblocking(False)
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        self._reading = asyncio.create_task(self._read(reader), name="kvstore-session-calls")

    @property
    def open(self) -> bool:
        return self._closed is None and self._writer is not None

    async def call(self, method: str, request: Message, reply_type: type[M], seconds: float) -> M:
        """One call; its reply, or the client error of its status.

        Raises:
            UnavailableError: the connection is closed, or closed before the reply.
            DeadlineExceededError: no reply within ``seconds``.
            ResourceExhaustedError: the request is larger than a frame may be.
            KVStoreError: the daemon's status (as over gRPC).
        """
        if self._closed is not None or self._writer is None:
            raise UnavailableError(f"{method}: {self._closed or 'the session is not open'}",
                                   code=grpc.StatusCode.UNAVAILABLE, method=method)  # fmt: skip
        call_id = next(self._ids) & 0xFFFFFFFF
        frame = _frame(method, request, call_id)
        reply = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = reply
        try:
            self._writer.write(frame)
            async with asyncio.timeout(seconds):
                status, data = await reply
        except TimeoutError:
            raise _late(method, seconds) from None
        finally:
            self._waiting.pop(call_id, None)
        return _reply(method, status, data, reply_type)

    async def aclose(self) -> None:
        """Closes the connection; calls still waiting fail with ``UnavailableError``
        (``on_closed`` is not called: it is for the daemon's end of it)."""
        self._on_closed = None
        self._end("the session was closed")
        if self._writer is not None:
            self._writer.close()
        reading, self._reading = self._reading, None
        if reading is not None:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the daemon closed the session"
        try:
            while True:
                length, call_id, status = FRAME.unpack(await reader.readexactly(FRAME.size))
                data = await reader.readexactly(length)
                waiting = self._waiting.get(call_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result((status, data))
        except (asyncio.IncompleteReadError, OSError) as error:
            if isinstance(error, OSError):
                why = f"the session socket failed: {error}"
        finally:
            self._end(why)

    def _end(self, why: str) -> None:
        if self._closed is not None:
            return
        self._closed = why
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(UnavailableError(why, code=grpc.StatusCode.UNAVAILABLE))
        if self._on_closed is not None:
            self._on_closed()


class BlockingCalls:
    """The calls of a session on a connection of their own, made from the calling thread; see
    the module docstring. Thread-safe: one call at a time.

    Args:
        sock: A connected socket that was welcomed as attached to the session.
        info: The welcome.
    """

    def __init__(self, sock: socket.socket, info: SessionInfo) -> None:
        self._sock: socket.socket | None = sock
        self.info = info
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    @classmethod
    def attach(cls, path: str, hello: Hello, timeout: float) -> BlockingCalls:
        """Opens a connection to the session ``hello.session`` on the session socket ``path``.

        Raises:
            OSError: the socket cannot be reached.
            SessionError: the daemon refused (no such session, or another tenant's).
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(encode_hello(hello))
            info = decode_reply(read_line(sock))
            if info.session != hello.session or not info.calls:
                raise SessionError("INTERNAL", "the daemon attached another session")
            return cls(sock, info)
        except BaseException:
            sock.close()
            raise

    @property
    def open(self) -> bool:
        return self._sock is not None

    def call(self, method: str, request: Message, reply_type: type[M], seconds: float) -> M:
        """One call, as :meth:`SessionCalls.call`; a connection that fails or answers late
        is closed (``UnavailableError``, ``DeadlineExceededError``)."""
        with self._lock:
            sock = self._sock
            if sock is None:
                raise UnavailableError(f"{method}: the calls connection is closed",
                                       code=grpc.StatusCode.UNAVAILABLE, method=method)  # fmt: skip
            call_id = next(self._ids) & 0xFFFFFFFF
            try:
                sock.settimeout(seconds)
                sock.sendall(_frame(method, request, call_id))
                length, answered, status = FRAME.unpack(_receive(sock, FRAME.size))
                data = _receive(sock, length)
            except TimeoutError:
                self._close()
                raise _late(method, seconds) from None
            except OSError as error:
                self._close()
                raise UnavailableError(
                    f"{method}: the calls connection failed: {error}",
                    code=grpc.StatusCode.UNAVAILABLE,
                    method=method,
                ) from None
            if answered != call_id:
                self._close()
                raise ProtocolError(f"{method}: the reply of call {answered}, not {call_id}",
                                    method=method)  # fmt: skip
        return _reply(method, status, data, reply_type)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def _frame(method: str, request: Message, call_id: int) -> bytes:
    body: bytes = request.SerializeToString()
    if len(body) > MAX_FRAME_BYTES:
        raise ResourceExhaustedError(
            f"{method}: a request of {len(body)} bytes is over the session socket's "
            f"{MAX_FRAME_BYTES}", method=method,
        )  # fmt: skip
    return FRAME.pack(len(body), call_id, _METHOD_IDS[method]) + body


def _reply(method: str, status: int, data: bytes, reply_type: type[M]) -> M:
    """The reply message, or the client error of ``status``."""
    if status:
        code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
        raise error_from_status(code, data.decode(errors="replace"), method)
    try:
        reply: M = reply_type.FromString(data)
    except DecodeError as error:
        raise ProtocolError(f"{method}: a reply that does not parse ({error})",
                            method=method) from None  # fmt: skip
    return reply


def _late(method: str, seconds: float) -> DeadlineExceededError:
    return DeadlineExceededError(
        f"{method}: no reply on the session socket within {seconds:g} s",
        code=grpc.StatusCode.DEADLINE_EXCEEDED, method=method,
    )  # fmt: skip


def _receive(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise OSError("the daemon closed the connection")
        data += chunk
    return bytes(data)
