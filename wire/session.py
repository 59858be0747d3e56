"""The shm-session protocol: how a co-located client gets its shared memory from the daemon.

gRPC cannot pass file descriptors, so the daemon also listens on a unix socket of its own
(``HandshakeResponse.shm_socket``). One exchange opens a *session*:

1. client -> daemon, one JSON line (at most ``MAX_LINE_BYTES``)::

       {"version": 1, "token": "<bearer token, or empty>", "tenant": "<tenant>",
        "staging_bytes": <bytes the client wants to hold reserved at once, 0: the most>,
        "pin": <true when the client registers the arena with CUDA>}

2. daemon -> client, one JSON line, and on success two descriptors (``SCM_RIGHTS``) of the
   tenant's arena: read-only (for reads), then read-write (for puts, which write the slots
   Reserve holds for them in place); ``staging_bytes`` is the session's window, the bytes it
   may hold reserved at once (the name is from when puts went through a staging area)::

       {"ok": true, "instance_id": "<hex>", "session": "<hex>", "arena_id": "<hex>",
        "arena_bytes": <n>, "staging_bytes": <n>}
       {"ok": false, "code": "UNAUTHENTICATED", "message": "..."}   (no descriptors)

3. the connection stays open: it *is* the session. When the client closes it (or dies), the
   daemon aborts the session's reservations and lets go of the slots it held.
4. calls: a welcome with ``"calls": true`` also serves the data paths' control calls on this
   connection, at a fraction of a gRPC call's cost (tens of microseconds, not hundreds):
   ``CALLS`` (``Lookup``, ``Acquire``, ``Release``; ``Reserve``, ``Commit``, ``Abort``),
   their gRPC messages in frames. A request
   is ``FRAME`` (body bytes, call id, method: its index in ``CALLS`` plus one) and the
   request message; a reply is ``FRAME`` (body bytes, the same call id, status: 0 for OK,
   else a gRPC status code's number) and the reply message, or the error's UTF-8 text.
   Calls may overlap; replies come as they are ready, matched by call id. They run as the
   session's caller (the hello's token), with gRPC's checks and answers. A frame over
   ``MAX_FRAME_BYTES``, or a method not in ``CALLS``, ends the session.
5. attaching: a hello that names an open session (``"session": "<hex>"``, with the token
   and tenant that opened it) opens a further connection that only carries its calls (a
   thread of the client that calls without going through the client's event loop): the
   welcome comes without descriptors, and closing it ends nothing but itself.

``code`` is a gRPC status name: the daemon sends INVALID_ARGUMENT, UNAUTHENTICATED,
PERMISSION_DENIED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION or INTERNAL; the client raises
UNAVAILABLE, INTERNAL or UNKNOWN of its own (closed early, malformed reply, no code). Both
memory files are sealed against resizing, so neither side can make the other's mapping fault.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "CALLS",
    "FRAME",
    "MAX_FRAME_BYTES",
    "MAX_LINE_BYTES",
    "VERSION",
    "Hello",
    "SessionError",
    "SessionInfo",
    "decode_hello",
    "decode_reply",
    "encode_hello",
    "encode_refusal",
    "encode_welcome",
    "session_path",
]

VERSION = 1
MAX_LINE_BYTES = 64 * 1024
SUFFIX = ".shm"
# On the wire: index + 1 (a method is only ever appended: the numbers stay).
CALLS = ("Lookup", "Acquire", "Release", "Reserve", "Commit", "Abort")
FRAME = struct.Struct("<IIB")  # body bytes, call id, method (request) or status (reply)
MAX_FRAME_BYTES = 16 << 20  # a Lookup of the most keys a call takes is ~2.3 MiB


class SessionError(Exception):
    """A refused or malformed session exchange; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Hello:
    """What a client asks for."""

    token: str
    tenant: str
    staging_bytes: int
    pin: bool = False  # the client registers the arena with CUDA: keep its pages
    session: bytes = b""  # attach a calls-only connection to this open session


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What the daemon granted (the descriptors travel beside it)."""

    instance_id: bytes
    session: bytes
    arena_id: bytes
    arena_bytes: int
    staging_bytes: int
    calls: bool = False  # the daemon answers CALLS on the session socket


def session_path(socket_path: str) -> str:
    """The session socket beside the gRPC unix socket ``socket_path``."""
    return socket_path + SUFFIX


def encode_hello(hello: Hello) -> bytes:
    message = {
        "version": VERSION,
        "token": hello.token,
        "tenant": hello.tenant,
        "staging_bytes": hello.staging_bytes,
        "pin": hello.pin,
    }
    if hello.session:
        message["session"] = hello.session.hex()
    return _line(message)


def decode_hello(line: bytes) -> Hello:
    """Parses a client's request.

    Raises:
        SessionError: INVALID_ARGUMENT naming what is wrong.
    """
    message = _parse(line, "hello")
    if message.get("version") != VERSION:
        raise SessionError(
            "INVALID_ARGUMENT", f"version must be {VERSION}, got {message.get('version')!r}"
        )
    token, tenant, staging, pin, session = (
        message.get("token"),
        message.get("tenant"),
        message.get("staging_bytes"),
        message.get("pin", False),
        message.get("session", ""),
    )
    if not isinstance(token, str) or not isinstance(tenant, str):
        raise SessionError("INVALID_ARGUMENT", "token and tenant must be strings")
    if isinstance(staging, bool) or not isinstance(staging, int) or staging < 0:
        raise SessionError(
            "INVALID_ARGUMENT", f"staging_bytes must be an int >= 0, got {staging!r}"
        )
    if not isinstance(pin, bool):
        raise SessionError("INVALID_ARGUMENT", f"pin must be true or false, got {pin!r}")
    try:
        attach = bytes.fromhex(session) if isinstance(session, str) else None
    except ValueError:
        attach = None
    if attach is None:
        raise SessionError("INVALID_ARGUMENT", f"session must be a hex string, got {session!r}")
    return Hello(token, tenant, staging, pin, attach)


def encode_welcome(info: SessionInfo) -> bytes:
    message = {
        "ok": True,
        "instance_id": info.instance_id.hex(),
        "session": info.session.hex(),
        "arena_id": info.arena_id.hex(),
        "arena_bytes": info.arena_bytes,
        "staging_bytes": info.staging_bytes,
        "calls": info.calls,
    }
    return _line(message)


def encode_refusal(code: str, message: str) -> bytes:
    return _line({"ok": False, "code": code, "message": message})


def decode_reply(line: bytes) -> SessionInfo:
    """Parses the daemon's reply.

    Raises:
        SessionError: the daemon refused (its code and message), or the reply is malformed.
    """
    message = _parse(line, "reply")
    if message.get("ok") is not True:
        raise SessionError(str(message.get("code", "UNKNOWN")), str(message.get("message", "")))
    try:
        return SessionInfo(
            instance_id=bytes.fromhex(str(message["instance_id"])),
            session=bytes.fromhex(str(message["session"])),
            arena_id=bytes.fromhex(str(message["arena_id"])),
            arena_bytes=int(str(message["arena_bytes"])),
            staging_bytes=int(str(message["staging_bytes"])),
            calls=message.get("calls") is True,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise SessionError("INTERNAL", f"malformed session reply: {error}") from None


def read_line(sock: socket.socket) -> bytes:
    """Reads up to and including the first newline from a blocking socket.

    Raises:
        SessionError: the peer closed first, or sent more than ``MAX_LINE_BYTES``.
    """
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(MAX_LINE_BYTES)
        if not chunk:
            raise SessionError("UNAVAILABLE", "the session socket closed before a reply")
        data += chunk
        if len(data) > MAX_LINE_BYTES:
            raise SessionError("INVALID_ARGUMENT", f"a line over {MAX_LINE_BYTES} bytes")
    return bytes(data)


def _line(message: Mapping[str, object]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _parse(line: bytes, what: str) -> dict[str, object]:
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as error:  # not JSON, bad UTF-8, huge ints, nesting
        reason = str(error)[:200] or type(error).__name__
        raise SessionError(
            "INVALID_ARGUMENT", f"the {what} is not JSON we read: {reason}"
        ) from None
    if not isinstance(message, dict):
        raise SessionError("INVALID_ARGUMENT", f"the {what} must be a JSON object")
    return message
