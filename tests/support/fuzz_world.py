"""What the fuzz test (tests/kvstore/test_fuzz.py) knows of its daemon, and its settings.

The seed and the number of random requests per RPC (``KVSTORE_FUZZ_SEED``,
``KVSTORE_FUZZ_ROUNDS``), the tenants and tokens, the fuzz model, the status codes allowed
as answers, :class:`World` (the daemon and the values that let fuzzed requests reach past
the first checks; :func:`make_world` sets it up), :func:`block_chunks` (a well-formed Put
stream) and ``SUMMARY``, the statuses counted per phase and RPC (:func:`print_summary`).
"""

from __future__ import annotations

import os
import random
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import xxhash
from google.protobuf.descriptor import MethodDescriptor

from kvstore.client.wire import fingerprint_message
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.wire.blocks import ROOT_KEY
from kvstore.wire.namespace import ModelFingerprint, Namespace
from tests.support.daemon import Daemon

SEED = int(os.environ.get("KVSTORE_FUZZ_SEED", "20240611"))
ROUNDS = int(os.environ.get("KVSTORE_FUZZ_ROUNDS", "300"))  # random requests per RPC and phase
CALL_SECONDS = 15.0  # past this a call is a hang: DEADLINE_EXCEEDED is not allowed

SERVICE = "kvstore.v1.KVStore"
METHODS: tuple[MethodDescriptor, ...] = tuple(pb.DESCRIPTOR.services_by_name["KVStore"].methods)
TENANT, OTHER_TENANT = "tenant-a", "tenant-b"
TOKENS = [f"good:{TENANT}", f"other:{OTHER_TENANT}"]
AUTH = (("authorization", "Bearer good"),)
OTHER_AUTH = (("authorization", "Bearer other"),)
MODEL = ModelFingerprint("fuzz", 2, 2, 16, "float16", block_tokens=16)
BLOCK = MODEL.layout().payload_bytes  # 4096
MAX_MESSAGE = 8 * 2**20  # the daemon's default server.max_message_bytes

Code = grpc.StatusCode
ALLOWED = frozenset(
    {
        Code.OK,
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.PERMISSION_DENIED,
        Code.RESOURCE_EXHAUSTED,
        Code.FAILED_PRECONDITION,
    }
)
SHM_CODES = frozenset(
    {"UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
)

SUMMARY: defaultdict[str, defaultdict[str, Counter[str]]] = defaultdict(
    lambda: defaultdict(Counter)
)
"""phase -> RPC -> status name -> count, printed by the last test."""


@dataclass
class World:
    """The daemon and the values that let fuzzed requests reach past the first checks."""

    daemon: Daemon
    namespace: bytes  # MODEL, registered by tenant-a (the good token's)
    other_namespace: bytes  # MODEL, registered by tenant-b: PERMISSION_DENIED for tenant-a
    unknown_namespace: bytes  # never registered: NOT_FOUND
    keys: list[bytes]  # a stored chain in `namespace`
    payloads: list[bytes]
    # registered namespace -> (payload bytes, block tokens) of its layout
    layouts: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    session: bytes = b""  # an open shm session of tenant-a, while the field fuzz runs
    lease_ids: list[int] = field(default_factory=list)  # granted by fuzzed Acquires
    reserved: list[bytes] = field(default_factory=list)  # keys reserved by fuzzed Reserves

    @property
    def namespaces(self) -> list[bytes]:
        return list(self.layouts)


def make_world(daemon: Daemon, rng: random.Random) -> World:
    """Registers a namespace of each tenant on ``daemon`` and stores a chain of 4 blocks in
    tenant-a's."""
    with grpc.insecure_channel(daemon.address) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        model = fingerprint_message(MODEL)
        ns = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model=model, tenant=TENANT), metadata=AUTH
        ).namespace
        other = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model=model, tenant=OTHER_TENANT),
            metadata=OTHER_AUTH,
        ).namespace
        keys = [rng.randbytes(32) for _ in range(4)]
        payloads = [rng.randbytes(BLOCK) for _ in keys]
        reply = stub.Put(iter(block_chunks(ns, keys, payloads)), metadata=AUTH)
        assert list(reply.statuses) == [pb.STORED] * len(keys)
    unknown = Namespace(MODEL, "nobody").digest()
    world = World(
        daemon,
        ns,
        other,
        unknown,
        keys,
        payloads,
        layouts={ns: (BLOCK, 16), other: (BLOCK, 16)},
    )
    return world


def block_chunks(
    ns: bytes, keys: Sequence[bytes], payloads: Sequence[bytes], parent: bytes = ROOT_KEY
) -> Iterator[pb.PutChunk]:
    """A well-formed Put stream of a key chain (checksums set), two chunks per block."""
    for i, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
        spec = pb.BlockSpec(key=key, parent=keys[i - 1] if i else parent, num_tokens=16)
        half = len(payload) // 2
        yield pb.PutChunk(
            namespace=ns if i == 0 else b"",
            block=spec,
            data=payload[:half],
            checksum=xxhash.xxh3_64_intdigest(payload),
        )
        yield pb.PutChunk(data=payload[half:])


def print_summary() -> None:
    print(f"\nkvstore fuzz summary (seed {SEED}, {ROUNDS} rounds): statuses per phase and RPC")
    for phase, methods in SUMMARY.items():
        print(f"  {phase}:")
        for method, counts in methods.items():
            shown = ", ".join(f"{code} {n}" for code, n in counts.most_common())
            print(f"    {method:28s} {sum(counts.values()):5d}  {shown}")
