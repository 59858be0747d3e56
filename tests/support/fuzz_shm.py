"""The shm session socket under fuzzing: sessions, raw hello exchanges, garbage hellos.

:func:`shm_session` opens a real session of tenant-a (its id and its arena, mapped writable);
:func:`hello_exchange` sends any bytes on a fresh connection; :func:`shm_garbage` lists the
hello lines to send, with whether a session should open, and :func:`check_shm_answer` says
what is wrong with the daemon's answer (a refusal line, or the connection closed).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import socket
from collections.abc import Iterator

from kvstore.wire.session import Hello, encode_hello, session_path
from tests.support.daemon import Daemon
from tests.support.fuzz_calls import show
from tests.support.fuzz_world import OTHER_TENANT, SHM_CODES, TENANT


@contextlib.contextmanager
def shm_session(daemon: Daemon, staging_bytes: int = 1 << 20) -> Iterator[tuple[bytes, mmap.mmap]]:
    """An open shm session of tenant-a (a window of ``staging_bytes``): its id and its
    tenant's arena, mapped writable (the descriptor a put writes its slots through)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10.0)
        sock.connect(session_path(str(daemon.socket_path)))
        sock.sendall(encode_hello(Hello("good", TENANT, staging_bytes)))
        line, fds, _, _ = socket.recv_fds(sock, 65536, 4)
        try:
            reply = json.loads(line.split(b"\n")[0])
            assert reply["ok"], reply
            arena = mmap.mmap(fds[1], reply["arena_bytes"])
        finally:
            for fd in fds:
                os.close(fd)
        with arena:
            yield bytes.fromhex(reply["session"]), arena


def hello_exchange(daemon: Daemon, data: bytes, *, half_close: bool = True) -> tuple[bytes, int]:
    """Sends ``data`` on a fresh session connection; what came back (until EOF) and how many
    descriptors came with it (closed here)."""
    received, count = bytearray(), 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10.0)
        sock.connect(session_path(str(daemon.socket_path)))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while True:
                chunk, fds, _, _ = socket.recv_fds(sock, 65536, 4)
                for fd in fds:
                    os.close(fd)
                count += len(fds)
                if not chunk:
                    break
                received += chunk
    return bytes(received), count


def hello(**fields: object) -> bytes:
    message: dict[str, object] = {"version": 1, "token": "good", "tenant": TENANT}
    message["staging_bytes"] = 4096
    message.update(fields)
    return json.dumps(message).encode() + b"\n"


def shm_garbage(rng: random.Random) -> list[tuple[str, bytes, bool | None]]:
    """(name, bytes, whether a session should open; None: either) for the session socket."""
    cases = [
        ("nothing", b"", False),
        ("an empty line", b"\n", False),
        ("not JSON", b"hello daemon\n", False),
        ("bad UTF-8", b"\xff\xfe\xfd\n", False),
        ("a JSON array", b"[1, 2, 3]\n", False),
        ("JSON null", b"null\n", False),
        ("a JSON string", b'"hello"\n', False),
        ("a float out of range", b'{"version": 1e999}\n', False),
        ("NaN", b'{"version": NaN, "token": "good", "tenant": "", "staging_bytes": NaN}\n', False),
        ("version 2", hello(version=2), False),
        ("version as a string", hello(version="1"), False),
        ("a numeric token", hello(token=5), False),
        ("a null tenant", hello(tenant=None), False),
        ("negative staging", hello(staging_bytes=-1), False),
        ("fractional staging", hello(staging_bytes=1.5), False),
        ("boolean staging", hello(staging_bytes=True), False),
        ("staging as a string", hello(staging_bytes="4096"), False),
        ("an unknown token", hello(token="nope"), False),
        ("an empty token", hello(token=""), False),
        ("another tenant", hello(tenant=OTHER_TENANT), False),
        ("a NUL in the tenant", hello(tenant="tenant-a\0"), False),
        ("a valid hello", hello(), True),
        ("staging 10^30", hello(staging_bytes=10**30), True),
        ("staging 0 (the daemon's most)", hello(staging_bytes=0), True),
        ("two lines in one write", hello() + b"garbage\n", None),  # either is right
        ("a line without its newline", b'{"version": 1', False),
        ("a line over 64 KiB", b"x" * (64 * 1024 + 10), False),
        ("a line over 64 KiB, newline last", b"[" + b" " * (64 * 1024 + 10) + b"]\n", False),
        ("JSON nested 400 deep", b"[" * 400 + b"]" * 400 + b"\n", False),
    ]
    for i in range(30):
        cases.append((f"random line #{i}", rng.randbytes(rng.randint(0, 300)) + b"\n", False))
    return cases


def check_shm_answer(
    name: str, data: bytes, answer: bytes, fds: int, opens: bool | None
) -> str | None:
    """What is wrong with the daemon's answer to ``data``; None when it is right."""
    case = f"shm hello {name!r}: {show(data)}"
    if not answer:
        return None if not opens else f"no welcome for {case}"
    try:
        reply = json.loads(answer.split(b"\n")[0])
    except ValueError:
        return f"an answer that is not a JSON line ({answer[:80]!r}) to {case}"
    if opens is None and reply.get("ok") is True:
        opens = True
    if opens:
        if reply.get("ok") is not True or fds != 2:
            return f"no session ({reply}, {fds} descriptors) for {case}"
        return None
    if reply.get("ok") is not False or reply.get("code") not in SHM_CODES or fds:
        return f"not a refusal ({reply}, {fds} descriptors) to {case}"
    return None
