"""Tenant bob's process attacking alice's KV: ``python attacker.py ADDRESS DAEMON_PID
ALICE_KEYS MARK ALICE_SESSION PENDING_KEY ALICE_LEASE`` (hex arguments, the lease in
decimal) prints one JSON report.

Run by ``tests/integration/test_isolation.py``, which asserts every attempt failed. As root it
first drops to uid/gid 65534, the engine of another user the threat model is about. Every
module is imported before that: the interpreter's own files may not be readable by that user.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import sys
from collections.abc import Callable

import grpc

from kvstore.client import KVStoreClient, KVStoreError, ModelFingerprint, Namespace
from kvstore.client.calls import BlockingCalls
from kvstore.client.shm import ShmSession
from kvstore.client.wire import fingerprint_message
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.wire.session import FRAME, MAX_FRAME_BYTES, Hello, SessionError

MODEL = ModelFingerprint("isolation", 2, 2, 64, "float16", block_tokens=16)
AUTH = (("authorization", "Bearer bob-secret"),)
Report = dict[str, object]


def attempt(report: Report, name: str, action: Callable[[], object]) -> None:
    """Runs ``action``; records "refused: <error> <code>" or "ALLOWED: <result>"."""
    try:
        result = action()
    except (OSError, SessionError, KVStoreError, grpc.RpcError) as error:
        code = getattr(error, "code", None)
        code = code() if callable(code) else code
        report[name] = f"refused: {type(error).__name__} {code or ''}".strip()
    else:
        report[name] = f"ALLOWED: {result!r}"[:200]


def open_daemon_fds(pid: int) -> int:
    opened = [
        os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY)
        for name in os.listdir(f"/proc/{pid}/fd")  # EACCES for another user
        if _openable(f"/proc/{pid}/fd/{name}")
    ]
    if not opened:
        raise PermissionError(errno.EACCES, "no descriptor of the daemon could be opened")
    return len(opened)


def _openable(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError:
        return False
    return True


def files_and_memory(report: Report, pid: int) -> None:
    report["dev_shm"] = sorted(n for n in os.listdir("/dev/shm") if "kvstore" in n)
    attempt(report, "proc_fds", lambda: open_daemon_fds(pid))
    attempt(report, "proc_mem", lambda: os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY)))


def sessions(report: Report, path: str, mark: bytes) -> ShmSession:
    """Alice's session with bob's token, or none; then bob's own arena, searched and abused."""
    for name, token in (("session_for_alice", "bob-secret"), ("session_no_token", "")):
        hello = Hello(token, "alice", 1 << 20)
        attempt(report, name, lambda h=hello: ShmSession._open_blocking(path, h))  # type: ignore[misc]
    session = ShmSession._open_blocking(path, Hello("bob-secret", "bob", 1 << 20))
    fd, size = session.arena._fd, session.arena.size
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as whole:
        report["alice_bytes_in_bobs_arena"] = whole.find(mark) != -1
    writable = mmap.PROT_READ | mmap.PROT_WRITE
    attempt(report, "map_arena_writable", lambda: mmap.mmap(fd, 4096, mmap.MAP_SHARED, writable))
    attempt(report, "write_arena", lambda: os.write(fd, b"x"))
    attempt(report, "truncate_arena", lambda: os.ftruncate(fd, 0))
    attempt(report, "reopen_arena_writable", lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
    writer = session.writer._fd  # bob's own arena, writable: his puts fill it in place
    attempt(report, "truncate_arena_writer", lambda: os.ftruncate(writer, 0))
    attempt(report, "grow_arena_writer", lambda: os.ftruncate(writer, 2 * size))
    # Every byte of his own arena file is bob's to write: none of it may be alice's.
    session.writer._open_bytes()[:] = 0xEE
    report["scribbled_own_arena"] = True
    return session


def session_calls(
    report: Report,
    path: str,
    own: bytes,
    alice_session: bytes,
    alice_keys: list[bytes],
    alice_lease: int,
) -> None:
    """The read path's calls on the session socket: attached to alice's session (with bob's
    token, or none), then on bob's own, naming alice's namespace and her lease; then frames
    that break the protocol."""
    for name, token in (("attach_alice_session", "bob-secret"), ("attach_no_token", "")):
        hello = Hello(token, "alice", 0, session=alice_session)
        attempt(report, name, lambda h=hello: BlockingCalls.attach(path, h, 5.0))  # type: ignore[misc]
    calls = BlockingCalls.attach(path, Hello("bob-secret", "bob", 0, session=own), 5.0)
    alice_ns = Namespace(MODEL, "alice").digest()
    lookup = pb.LookupRequest(namespace=alice_ns, keys=alice_keys, lease_id=12345)
    attempt(report, "lane_lookup_alice_ns",
            lambda: calls.call("Lookup", lookup, pb.LookupResponse, 5.0))  # fmt: skip
    acquire = pb.AcquireRequest(namespace=alice_ns, keys=alice_keys)
    attempt(report, "lane_acquire_alice_ns",
            lambda: calls.call("Acquire", acquire, pb.AcquireResponse, 5.0))  # fmt: skip
    release = pb.ReleaseRequest(lease_id=alice_lease)
    attempt(report, "lane_release_alice_lease",
            lambda: calls.call("Release", release, pb.ReleaseResponse, 5.0))  # fmt: skip
    calls.close()
    for name, frame in (
        ("frame_too_large", FRAME.pack(MAX_FRAME_BYTES + 1, 1, 1)),
        ("frame_unknown_method", FRAME.pack(0, 1, 99)),
    ):
        attached = BlockingCalls.attach(path, Hello("bob-secret", "bob", 0, session=own), 5.0)
        sock = attached._sock
        assert sock is not None
        sock.sendall(frame)
        report[name] = "closed" if sock.recv(16) == b"" else "answered"
        attached.close()


def namespaces(
    report: Report, stub: kvstore_pb2_grpc.KVStoreStub, alice_keys: list[bytes]
) -> tuple[bytes, bytes]:
    """Alice's namespace with bob's token; returns (alice's digest, bob's digest)."""
    model = fingerprint_message(MODEL)
    register = pb.RegisterNamespaceRequest(model=model, tenant="alice")
    attempt(report, "register_alice", lambda: stub.RegisterNamespace(register, metadata=AUTH))
    alice_ns = Namespace(MODEL, "alice").digest()
    lookup = pb.LookupRequest(namespace=alice_ns, keys=alice_keys)
    attempt(report, "lookup_alice_ns", lambda: stub.Lookup(lookup, metadata=AUTH))
    acquire = pb.AcquireRequest(namespace=alice_ns, keys=alice_keys)
    attempt(report, "acquire_alice_ns", lambda: stub.Acquire(acquire, metadata=AUTH))
    bob = pb.RegisterNamespaceRequest(model=model, tenant="bob")
    return alice_ns, stub.RegisterNamespace(bob, metadata=AUTH).namespace


def reservations(
    report: Report,
    stub: kvstore_pb2_grpc.KVStoreStub,
    spaces: tuple[bytes, bytes],
    sessions: tuple[bytes, bytes],
    pending: bytes,
) -> None:
    """Alice's reservation of ``pending``, through her (leaked) session id or under bob's."""
    (alice_ns, bob_ns), (alice_session, bob_session) = spaces, sessions

    def commit(space: bytes, session: bytes) -> list[str]:
        request = pb.CommitRequest(namespace=space, keys=[pending], session=session)
        reply = stub.Commit(request, metadata=AUTH)
        return [pb.WriteStatus.Name(s) for s in reply.statuses]

    attempt(report, "commit_alice_reservation", lambda: commit(alice_ns, alice_session))
    attempt(report, "commit_alice_key_in_bob_ns", lambda: commit(bob_ns, alice_session))
    abort = pb.AbortRequest(namespace=bob_ns, keys=[pending], session=alice_session)
    attempt(report, "abort_alice_reservation", lambda: stub.Abort(abort, metadata=AUTH))
    report["commit_alice_key_with_bobs_session"] = commit(bob_ns, bob_session)


def as_bob(report: Report, address: str, alice_keys: list[bytes]) -> None:
    """Alice's keys in bob's own namespace: misses, and a put of them is bob's block."""
    bob = Namespace(MODEL, "bob")
    with KVStoreClient(address, token="bob-secret") as client:
        report["bob_lookup_of_alice_keys"] = client.lookup(bob, alice_keys)
        report["bob_get_of_alice_keys"] = len(client.get(bob, alice_keys))
        size = bob.model.layout().payload_bytes
        report["bob_put_of_alice_key"] = client.put(bob, alice_keys[:1], [b"\xee" * size])[0].name
        report["bob_plane"] = client.data_plane


def main(argv: list[str]) -> None:
    address, pid = argv[1], int(argv[2])
    alice_keys = [bytes.fromhex(k) for k in argv[3].split(",")]
    mark, alice_session, pending = (bytes.fromhex(a) for a in argv[4:7])
    alice_lease = int(argv[7])
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    report: Report = {"uid": os.geteuid()}
    files_and_memory(report, pid)
    with grpc.insecure_channel(address) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        shake = stub.Handshake(pb.HandshakeRequest(), metadata=AUTH)
        session = sessions(report, shake.shm_socket, mark)
        spaces = namespaces(report, stub, alice_keys)
        session_calls(report, shake.shm_socket, session.session_id, alice_session,
                      alice_keys, alice_lease)  # fmt: skip
        reservations(report, stub, spaces, (alice_session, session.session_id), pending)
    as_bob(report, address, alice_keys)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv)
