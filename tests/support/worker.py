"""A client process for integration tests: ``python worker.py MODE ADDRESS [ARGS...]``.

Modes:

- ``roundtrip ADDRESS NAME SHM``: puts the shared chain and a chain of its own, reads both
  back through the chosen data plane, and prints a JSON report (statuses, bit-exactness).
- ``hold ADDRESS SECONDS``: puts two blocks, leases them, reserves two more through an shm
  session and half-writes one into its arena slot, in place, prints a report, then swaps its lease
  for one of ``SECONDS``, prints that lease's slots and sleeps, so a test can SIGKILL it
  while it holds all of that.
- ``stall ADDRESS COUNT``: opens an shm session with the daemon's largest window, reserves
  ``COUNT`` blocks of its own in one Reserve and prints their statuses; then waits for a line
  on stdin (a test SIGSTOPs it meanwhile: a hung writer), writes every byte of each slot it
  was given (late: its reservations have expired), commits them and prints what the Commit
  answered.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import grpc

from kvstore.client import ROOT_KEY, KVStoreClient, ModelFingerprint, Namespace, block_keys
from kvstore.client.shm import ShmSession
from kvstore.client.wire import block_specs, fingerprint_message
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.wire.session import Hello

MODEL = ModelFingerprint(
    "tiny-test", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16
)
NAMESPACE = Namespace(MODEL, tenant="tests")
BLOCK = MODEL.layout().payload_bytes
SHARED_TOKENS = list(range(1000, 1000 + 8 * 16))  # 8 blocks every worker shares


def payload(key: bytes) -> bytes:
    """The bytes stored under ``key``: derived from it, so anyone can check them."""
    return hashlib.shake_256(key).digest(BLOCK)


def own_tokens(name: str, count: int = 4) -> list[int]:
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "little")
    return SHARED_TOKENS + [seed * 7 + i for i in range(count * 16)]


def roundtrip(address: str, name: str, use_shm: bool) -> dict[str, object]:
    keys = block_keys(own_tokens(name), NAMESPACE)
    with KVStoreClient(address, use_shm=use_shm) as client:
        statuses = client.put(NAMESPACE, keys, [payload(k) for k in keys])
        held = client.lookup(NAMESPACE, keys)
        blocks = client.get(NAMESPACE, keys)
        plane = client.data_plane
    return {
        "plane": plane,
        "statuses": [s.name for s in statuses],
        "held": held,
        "exact": [bytes(b) == payload(k) for k, b in zip(keys, blocks, strict=False)],
    }


def raw_calls(address: str) -> tuple[kvstore_pb2_grpc.KVStoreStub, pb.HandshakeResponse, bytes]:
    """A stub on a channel of its own, the daemon's handshake, and NAMESPACE's digest."""
    stub = kvstore_pb2_grpc.KVStoreStub(grpc.insecure_channel(address))
    info = stub.Handshake(pb.HandshakeRequest())
    ns = stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(model=fingerprint_message(MODEL), tenant="tests")
    ).namespace
    return stub, info, ns


def hold(address: str, lease_s: float) -> None:
    keys = block_keys(own_tokens("holder", 4), NAMESPACE)[8:]  # 4 blocks after the shared ones
    with KVStoreClient(address) as client:
        parent = block_keys(SHARED_TOKENS, NAMESPACE)[-1]
        client.put(NAMESPACE, keys[:2], [payload(k) for k in keys[:2]], parent=parent)
    stub, info, ns = raw_calls(address)
    acquired = stub.Acquire(pb.AcquireRequest(namespace=ns, keys=keys[:2]))
    session = ShmSession._open_blocking(info.shm_socket, Hello("", "tests", 1 << 20))
    specs = block_specs(keys[2:], keys[1], MODEL.block_tokens)
    reserved = stub.Reserve(
        pb.ReserveRequest(namespace=ns, blocks=specs, session=session.session_id)
    )
    slot = reserved.reservations[0].slot
    with session.writer.view(slot.offset, slot.length) as view:
        assert view.readonly  # a view is for reading: write through the mapping
    half = session.writer.tensor(slot.offset, BLOCK // 2)
    half.numpy()[:] = memoryview(payload(keys[2])[: BLOCK // 2])
    stats = stub.Stats(pb.StatsRequest())
    host = next(t for t in stats.tiers if t.name == "host")
    report = {"lease_slots": len(acquired.slots), "reserved": len(reserved.reservations),
              "active": [stats.active_leases, stats.active_reservations],
              "host_bytes": host.usage_bytes}  # fmt: skip
    print(json.dumps(report), flush=True)
    # The lease a test sees expire is taken only now: everything above ran under the
    # daemon's lease_ttl, long enough for any machine, whatever time it took here.
    short = stub.Acquire(pb.AcquireRequest(namespace=ns, keys=keys[:2], lease_seconds=lease_s))
    stub.Release(pb.ReleaseRequest(lease_id=acquired.lease_id))
    print(json.dumps({"lease_slots": len(short.slots)}), flush=True)
    time.sleep(3600)


def stall(address: str, count: int) -> None:
    keys = block_keys(own_tokens("stalled", count), NAMESPACE)[8:]
    stub, info, ns = raw_calls(address)
    session = ShmSession._open_blocking(info.shm_socket, Hello("", "tests", 0))
    specs = block_specs(keys, ROOT_KEY, MODEL.block_tokens)
    reply = stub.Reserve(pb.ReserveRequest(namespace=ns, blocks=specs, session=session.session_id))
    statuses = [pb.WriteStatus.Name(r.status) for r in reply.reservations]
    print(json.dumps({"reserved": statuses}), flush=True)
    sys.stdin.readline()  # stopped here, then continued
    held = [(spec.key, r.slot) for spec, r in zip(specs, reply.reservations, strict=True)
            if r.status == pb.RESERVED]  # fmt: skip
    for _, slot in held:
        session.writer.tensor(slot.offset, slot.length).numpy()[:] = 0xEE
    commit = stub.Commit(
        pb.CommitRequest(namespace=ns, keys=[key for key, _ in held], session=session.session_id)
    )
    print(json.dumps({"committed": [pb.WriteStatus.Name(s) for s in commit.statuses]}), flush=True)


if __name__ == "__main__":
    mode, address = sys.argv[1], sys.argv[2]
    if mode == "roundtrip":
        print(json.dumps(roundtrip(address, sys.argv[3], sys.argv[4] == "shm")), flush=True)
    elif mode == "hold":
        hold(address, float(sys.argv[3]))
    elif mode == "stall":
        stall(address, int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
