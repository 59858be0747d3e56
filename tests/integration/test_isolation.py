"""Tenant isolation, tested as the attacker: tenant bob's process, run as another user, with
bob's token, against a real daemon that holds alice's blocks.

The attacker (``tests/support/attacker.py``, a child process) tries everything a co-located
engine could: find an arena under /dev/shm, open the daemon's descriptors or memory through
/proc, open a shm session for alice with bob's token, scan bob's own arena for alice's bytes,
write or reopen its read-only descriptor writable, resize it, scribble over every byte of the
writable one (bob's own arena file, which his puts fill in place), attach to alice's session
or use her namespace and lease through the session socket's calls (and break that protocol),
and, over gRPC, use alice's namespace, probe alice's keys for existence (DEDUP) or squat on
them. Each attempt reports
what happened; the test asserts every one failed, and that alice still reads exactly what
she wrote.

Run as root, the attacker drops to uid/gid 65534 first (the threat model: engines run as
other users than the daemon). Run as an ordinary user it stays that user, and the checks
that only another user's process can pass (/proc access) are skipped: a process of the
daemon's own user can read its memory whatever the daemon does (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc

from kvstore.client import KVStoreClient, ModelFingerprint, Namespace, WriteStatus, block_keys
from kvstore.client.shm import ShmSession
from kvstore.client.wire import fingerprint_message
from kvstore.launch import kvstore_command
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.wire.session import Hello
from tests.support.daemon import running_daemon

MODEL = ModelFingerprint("isolation", 2, 2, 64, "float16", block_tokens=16)
ALICE = Namespace(MODEL, "alice")
TOKENS = ["alice-secret:alice", "bob-secret:bob"]
MARK = b"ALICE-PRIVATE-KV"  # starts every payload of alice's, so bob can search for it
ATTACKER = Path(__file__).resolve().parents[1] / "support" / "attacker.py"


def alice_payload(key: bytes) -> bytes:
    size = MODEL.layout().payload_bytes
    return (MARK + hashlib.shake_256(key).digest(size))[:size]


def test_another_tenant_can_neither_read_nor_write_nor_probe_alices_kv(tmp_path: Path) -> None:
    settings = {"server": {"socket_mode": "0666"}}
    with running_daemon(tmp_path, tokens=TOKENS, settings=settings) as daemon:
        os.chmod(daemon.socket_path.parent, 0o755)  # engines of other users reach the sockets
        keys = block_keys(list(range(6 * 16)), ALICE)
        keys, pending = keys[:5], keys[5]
        with KVStoreClient(daemon.address, token="alice-secret") as alice:
            assert alice.put(ALICE, keys, [alice_payload(k) for k in keys]) == (
                [WriteStatus.STORED] * len(keys)
            )
            assert alice.data_plane == "shm"
        # Alice also has a write in flight: block 5 reserved in her session, not committed.
        opened = ShmSession._open_blocking(
            str(daemon.socket_path) + ".shm", Hello("alice-secret", "alice", 1 << 20)
        )
        auth = (("authorization", "Bearer alice-secret"),)
        with grpc.insecure_channel(daemon.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            digest = stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model=fingerprint_message(MODEL), tenant="alice"),
                metadata=auth,
            ).namespace
            spec = pb.BlockSpec(key=pending, parent=keys[-1], num_tokens=16)
            reserved = stub.Reserve(
                pb.ReserveRequest(namespace=digest, blocks=[spec], session=opened.session_id),
                metadata=auth,
            )
            assert reserved.reservations[0].status == pb.RESERVED
        # ... and a lease of her blocks, taken with a lookup.
        alice_lease = KVStoreClient(daemon.address, token="alice-secret")
        alice_lease.connect()
        found = alice_lease.find(ALICE, keys)
        assert found.lease is not None and found.num_leased == len(keys)
        assert daemon.proc is not None
        done = subprocess.run(
            [sys.executable, "-P", str(ATTACKER), daemon.address, str(daemon.proc.pid),
             ",".join(k.hex() for k in keys), MARK.hex(), opened.session_id.hex(),
             pending.hex(), str(found.lease.lease_id)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["dev_shm"] == []
        if report["uid"] != os.geteuid():  # another user (root dropped to 65534)
            assert report["proc_fds"].startswith("refused"), report
            assert report["proc_mem"].startswith("refused"), report
            assert report["reopen_arena_writable"].startswith("refused"), report
        for name in ("session_for_alice", "session_no_token"):
            assert report[name].startswith("refused"), report
        assert report["alice_bytes_in_bobs_arena"] is False
        for name in ("map_arena_writable", "write_arena", "truncate_arena",
                     "truncate_arena_writer", "grow_arena_writer"):  # fmt: skip
            assert report[name].startswith("refused"), report
        assert report["scribbled_own_arena"] is True  # all bob's: alice's bytes are checked below
        for name in ("register_alice", "lookup_alice_ns", "acquire_alice_ns"):
            assert report[name] == "refused: _InactiveRpcError StatusCode.PERMISSION_DENIED", report
        assert report["commit_alice_reservation"].endswith("PERMISSION_DENIED"), report
        for name in ("commit_alice_key_in_bob_ns", "abort_alice_reservation"):
            assert report[name].endswith("FAILED_PRECONDITION"), report  # not bob's session
        assert report["commit_alice_key_with_bobs_session"] == ["EXPIRED"]  # not bob's
        for name in ("attach_alice_session", "attach_no_token"):
            assert report[name].startswith("refused: SessionError"), report
        for name in ("lane_lookup_alice_ns", "lane_acquire_alice_ns"):
            assert report[name] == "refused: PermissionDeniedError StatusCode.PERMISSION_DENIED"
        assert report["lane_release_alice_lease"] == (
            "refused: UnknownLeaseError StatusCode.NOT_FOUND"
        ), report
        assert report["frame_too_large"] == report["frame_unknown_method"] == "closed", report
        # Alice's lease survived bob's Release: hers to end, once.
        alice_lease.release(found)
        alice_lease.close()
        assert report["bob_lookup_of_alice_keys"] == 0
        assert report["bob_get_of_alice_keys"] == 0
        assert report["bob_put_of_alice_key"] == "STORED"
        assert report["bob_plane"] == "shm"
        # Alice's reservation is still hers to finish.
        slot = reserved.reservations[0].slot
        staged = opened.writer.tensor(slot.offset, slot.length)
        staged.numpy()[:] = memoryview(alice_payload(pending))
        with grpc.insecure_channel(daemon.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            done_commit = stub.Commit(
                pb.CommitRequest(namespace=digest, keys=[pending], session=opened.session_id),
                metadata=auth,
            )
            assert list(done_commit.statuses) == [pb.STORED]
        opened._socket.close()  # type: ignore[union-attr]
        keys.append(pending)
        # Alice's blocks are untouched, bit for bit, and hers alone.
        with KVStoreClient(daemon.address, token="alice-secret", verify=True) as alice:
            got = alice.get(ALICE, keys)
            assert [bytes(b) for b in got] == [alice_payload(k) for k in keys]
            assert alice.lookup(ALICE, keys) == len(keys)


OTHER_MODEL = ModelFingerprint("isolation-2", 2, 2, 64, "float16", block_tokens=16)
OPS_TOKENS = [*TOKENS, "ops-secret:*"]


def kvstore_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(kvstore_command(*args), capture_output=True,
                          text=True, env=env, timeout=60)  # fmt: skip


def test_operations_reach_only_the_callers_tenant_and_operators_reach_all(
    tmp_path: Path,
) -> None:
    """``kvstore namespaces/evict/flush`` as bob against alice's namespaces: he sees none,
    evicts none (not even by a digest prefix he guessed from his own listing), cannot flush;
    alice evicts hers by a prefix; an operator token sees and evicts every tenant's."""
    alice_other, bob_ns = Namespace(OTHER_MODEL, "alice"), Namespace(MODEL, "bob")
    size = MODEL.layout().payload_bytes
    settings = {"ssd": {"write_policy": "write_back"}}
    with running_daemon(tmp_path, tokens=OPS_TOKENS, settings=settings) as daemon:
        chains = {}
        puts = [("alice-secret", ALICE, 3), ("alice-secret", alice_other, 2),
                ("bob-secret", bob_ns, 4)]  # fmt: skip
        for token, namespace, count in puts:
            keys = block_keys(list(range(count * 16)), namespace)
            with KVStoreClient(daemon.address, token=token) as client:
                client.put(namespace, keys, [alice_payload(k) for k in keys])
            chains[namespace.digest()] = keys

        def listed(token: str) -> dict[str, dict[str, object]]:
            done = kvstore_cli("namespaces", "--address", daemon.address, "--token", token,
                               "--json")  # fmt: skip
            assert done.returncode == 0, done.stderr
            return {entry["namespace"]: entry for entry in json.loads(done.stdout)}

        mine = listed("alice-secret")
        assert set(mine) == {ALICE.digest().hex(), alice_other.digest().hex()}
        entry = mine[ALICE.digest().hex()]
        assert (entry["tenant"], entry["model_name"], entry["blocks"]) == ("alice", "isolation", 3)
        assert entry["bytes"] == 3 * size and entry["tiers"][0] == {"name": "host", "blocks": 3}
        assert set(listed("bob-secret")) == {bob_ns.digest().hex()}
        assert len(listed("ops-secret")) == 3
        table = kvstore_cli("namespaces", "--address", daemon.address, "--token", "ops-secret")
        rows = [line.split() for line in table.stdout.splitlines()[1:]]
        assert (
            [row[0] for row in rows]
            == [  # most bytes first, digests cut to 16 digits
                bob_ns.digest().hex()[:16],
                ALICE.digest().hex()[:16],
                alice_other.digest().hex()[:16],
            ]
        )
        assert rows[0][1:5] == ["bob", "isolation", "4", "64.0"]
        anonymous = kvstore_cli("namespaces", "--address", daemon.address)
        assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr

        def evict(token: str, *which: str) -> subprocess.CompletedProcess[str]:
            return kvstore_cli("evict", "--address", daemon.address, "--token", token, *which)

        # Bob, as the attacker: alice's full digest, her tenant, a prefix of hers, a flush.
        full = evict("bob-secret", "--namespace", ALICE.digest().hex())
        assert full.returncode == 1 and "PERMISSION_DENIED" in full.stderr
        tenant = evict("bob-secret", "--tenant", "alice")
        assert tenant.returncode == 1 and "PERMISSION_DENIED" in tenant.stderr
        prefix = evict("bob-secret", "--namespace", alice_other.digest().hex()[:8])
        assert prefix.returncode == 2 and "0 namespaces start with it" in prefix.stderr
        flush = kvstore_cli("flush", "--address", daemon.address, "--token", "bob-secret")
        assert flush.returncode == 1 and "PERMISSION_DENIED" in flush.stderr
        garbage = evict("bob-secret", "--namespace", "not-hex!")
        assert garbage.returncode == 2 and "expected 8 to 64 hex digits" in garbage.stderr
        with KVStoreClient(daemon.address, token="alice-secret") as alice:
            for namespace in (ALICE, alice_other):
                keys = chains[namespace.digest()]
                assert alice.get(namespace, keys) == [alice_payload(k) for k in keys]

        # Alice evicts one of hers by a prefix; the other and bob's stay.
        done = evict("alice-secret", "--namespace", ALICE.digest().hex()[:10])
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("evicted 3 blocks (1 namespaces)")
        with KVStoreClient(daemon.address, token="alice-secret") as alice:
            assert alice.lookup(ALICE, chains[ALICE.digest()]) == 0
            keys = chains[alice_other.digest()]
            assert alice.get(alice_other, keys) == [alice_payload(k) for k in keys]

        # The operator flushes (write-back: the blocks only the host tier held) and evicts bob.
        flushed = kvstore_cli("flush", "--address", daemon.address, "--token", "ops-secret")
        assert flushed.returncode == 0 and flushed.stdout == "flushed 6 blocks to the tier below\n"
        with KVStoreClient(daemon.address, token="bob-secret") as bob:
            assert set(bob.lookup_tiers(bob_ns, chains[bob_ns.digest()]).tiers) == {"host"}
        ops = listed("ops-secret")
        assert ops[bob_ns.digest().hex()]["tiers"][1] == {"name": "ssd", "blocks": 4}
        gone = evict("ops-secret", "--tenant", "bob")
        assert gone.returncode == 0 and gone.stdout.startswith("evicted 4 blocks (1 namespaces)")
        with KVStoreClient(daemon.address, token="bob-secret") as bob:
            assert bob.get(bob_ns, chains[bob_ns.digest()]) == []
        assert set(listed("ops-secret")) == {alice_other.digest().hex()}
        # The SSD copies went too: nothing of bob's is left in any tier after a restart.
        daemon.restart()
        with KVStoreClient(daemon.address, token="bob-secret") as bob:
            assert bob.lookup(bob_ns, chains[bob_ns.digest()]) == 0
