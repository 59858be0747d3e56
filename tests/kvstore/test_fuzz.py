"""Fuzzing every RPC of a real daemon: garbage bytes, random field values, random Put streams.

One ``kvstore serve`` process (tests/support/daemon.py, tokens on) takes, for each of the 13
methods of ``kvstore.v1.KVStore``:

1. garbage bytes, sent through raw channel methods (no serializers, so the bytes reach the
   daemon's own parser as they are): random strings and crafted ones (truncated and
   over-long varints, every wire type on every field, a length prefix claiming 2^31 bytes,
   groups nested past the parser's limit, bad UTF-8, a message over max_message_bytes);
2. well-formed messages whose fields hold random values from a generator that walks each
   request's descriptor (edge integers, NaN and infinities, long, unicode and NUL strings,
   repeated fields of 0..N entries, nested messages), mixed with a registered namespace,
   stored keys, a real shm session and granted lease ids, so that deeper code runs;
3. Put streams of random chunk sequences (data before a block, short and long blocks, a
   second namespace mid-stream, random checksums, garbage chunks);

and every answer must be one of ``ALLOWED``: an error outside the daemon's error tree would
be INTERNAL, a hang DEADLINE_EXCEEDED (which ends the phase at once). Requests without the
good token must be UNAUTHENTICATED, whatever their bytes. The shm session socket gets garbage
hello lines too (a refusal line or a closed connection). Afterwards the daemon must still
run, answer its health check, store and return blocks bit-exact and have logged no traceback.

The tests share one daemon and run in file order (the last one checks it); requests are
sent one at a time, so a seed replays the same requests. Cases that once found a daemon bug
keep a test of their own, some on daemons of their own: hello lines that ``json`` cannot
decode, a Reserve far past the staging area, parent cycles (refused now; they used to
freeze Delete and pin the arena).

Each failure names what was sent (method, seed and case, a hex prefix of the bytes). With
``-s`` the statuses counted per phase and RPC are printed. ``KVSTORE_FUZZ_SEED`` and
``KVSTORE_FUZZ_ROUNDS`` change the seed and the number of random requests per RPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import mmap
import os
import random
import socket
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import xxhash
from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.blocks import ROOT_KEY
from kvstore.client.wire import fingerprint_message
from kvstore.namespace import ModelFingerprint, Namespace
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.shm_wire import Hello, encode_hello, session_path
from tests.support.daemon import Daemon, running_daemon

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


# -- the daemon and what the fuzzers know about it ---------------------------------------------


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


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    rng = random.Random(SEED)
    with running_daemon(tmp_path_factory.mktemp("fuzz"), tokens=TOKENS) as daemon:
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
        yield world


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


# -- calls and their verdicts ------------------------------------------------------------------


def show(data: bytes | Sequence[bytes]) -> str:
    """A short, reproducible description of what was sent."""
    if isinstance(data, bytes | bytearray):
        more = "…" if len(data) > 48 else ""
        return f"{len(data)} bytes {bytes(data[:48]).hex()}{more}"
    parts = [show(chunk) for chunk in data[:4]]
    if len(data) > 4:
        parts.append(f"… {len(data) - 4} more")
    return f"a stream of {len(data)} chunks [{'; '.join(parts)}]"


def described(message: Message) -> str:
    text = text_format.MessageToString(message, as_one_line=True, as_utf8=False)
    return text if len(text) <= 300 else text[:300] + "…"


Metadata = tuple[tuple[str, str], ...] | None


@dataclass
class Reply:
    code: grpc.StatusCode
    details: str
    messages: list[bytes]


@dataclass
class Channels:
    """An asyncio channel, and a sync one for the client-streaming Put.

    The asyncio client may report INTERNAL "Internal error from Core" in place of the status
    a server sent when it ends a client stream before the client has sent every chunk (a
    write fails after the status came: grpc/grpc#36066, fix proposed in grpc/grpc#43486);
    the sync client reports the server's status. A Put that the daemon refuses at its first
    chunk is exactly that, so Puts go through the sync client, in a thread.
    """

    aio: grpc.aio.Channel
    sync: grpc.Channel


@contextlib.asynccontextmanager
async def open_channels(address: str) -> AsyncIterator[Channels]:
    with grpc.insecure_channel(address) as sync:
        async with grpc.aio.insecure_channel(address) as aio:
            yield Channels(aio, sync)


def _stream_unary(
    channel: grpc.Channel, path: str, chunks: list[bytes], metadata: Metadata
) -> Reply:
    try:
        reply = channel.stream_unary(path)(iter(chunks), metadata=metadata, timeout=CALL_SECONDS)
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        return Reply(error.code(), error.details() or "", [])
    return Reply(Code.OK, "", [reply])


async def call(
    channels: Channels,
    method: MethodDescriptor,
    data: bytes | Sequence[bytes],
    metadata: Metadata = AUTH,
) -> Reply:
    """Sends raw bytes (a list of chunks for Put) to ``method``; the status and raw replies."""
    path = f"/{SERVICE}/{method.name}"
    if method.client_streaming:
        assert not isinstance(data, bytes)
        return await asyncio.to_thread(_stream_unary, channels.sync, path, list(data), metadata)
    assert isinstance(data, bytes)
    try:
        if method.server_streaming:
            stream = channels.aio.unary_stream(path)(data, metadata=metadata, timeout=CALL_SECONDS)
            return Reply(Code.OK, "", [chunk async for chunk in stream])
        reply = await channels.aio.unary_unary(path)(data, metadata=metadata, timeout=CALL_SECONDS)
        return Reply(Code.OK, "", [reply])
    except grpc.aio.AioRpcError as error:
        return Reply(error.code(), error.details() or "", [])


class Verdicts:
    """Counts the statuses of one phase and keeps every answer outside the allowed set."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.failures: list[str] = []

    def record(
        self, method: str, reply: Reply, case: str, allowed: frozenset[Code] = ALLOWED
    ) -> None:
        SUMMARY[self.phase][method][reply.code.name] += 1
        if reply.code not in allowed:
            self.failures.append(
                f"{method} answered {reply.code.name} ({reply.details!r}) to {case}"
            )
        if reply.code == Code.DEADLINE_EXCEEDED:  # a hang: what follows would only time out
            shown = "\n  ".join(self.failures[-20:])
            pytest.fail(
                f"{self.phase}: the daemon did not answer within {CALL_SECONDS:g} s; "
                f"failures so far, the last one the hang:\n  {shown}",
                pytrace=False,
            )

    def fail(self, problem: str) -> None:
        self.failures.append(problem)

    def check(self, daemon: Daemon) -> None:
        shown = "\n  ".join(self.failures[:20])
        more = f"\n  … and {len(self.failures) - 20} more" if len(self.failures) > 20 else ""
        assert not self.failures, (
            f"{self.phase}: {len(self.failures)} bad answers (seed {SEED}):\n  {shown}{more}\n"
            f"daemon log tail:\n{daemon.log()}"
        )
        assert daemon.running, f"the daemon died during {self.phase}:\n{daemon.log()}"


# -- 1. garbage bytes --------------------------------------------------------------------------


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def crafted_garbage(method: MethodDescriptor) -> list[tuple[str, bytes]]:
    """Hand-made bytes that are not a valid request of ``method`` (or barely are)."""
    fields = method.input_type.fields
    numbers = [f.number for f in fields] or [1]
    cases: list[tuple[str, bytes]] = [
        ("empty", b""),
        ("a lone tag", b"\x0a"),
        ("a truncated varint", b"\x08\xff\xff"),
        ("a varint of 11 bytes", b"\x08" + b"\xff" * 10 + b"\x01"),
        ("a truncated tag", b"\xff"),
        ("field number 0", b"\x00\x01"),
        ("the largest field number", tag(2**29 - 1, 0) + b"\x01"),
        ("a field number past 2^29", varint(2**29 << 3) + b"\x01"),
        ("length 2^31, 3 bytes follow", b"\x0a" + varint(2**31) + b"abc"),
        ("length 2^64-1", b"\x0a" + varint(2**64 - 1) + b"abc"),
        ("length 2^32+5", b"\x0a" + varint(2**32 + 5) + b"abcde"),
        ("length one past the end", b"\x0a\x05abcd"),
        ("an end-group without a start", b"\x0c"),
        ("a start-group never ended", b"\x7b\x08\x01"),
        ("a mismatched end-group", b"\x7b\x84\x01"),
        ("wire types 6 and 7", b"\x0e\x01\x0f\x01"),
        ("a truncated fixed64", b"\x79\x01\x02\x03"),
        ("a truncated fixed32", b"\x7d\x01"),
        ("all 0xff", b"\xff" * 64),
        ("all zeros", b"\x00" * 64),
        (
            "a StatsResponse",
            pb.StatsResponse(blocks=7, tiers=[pb.TierStats(name="x")]).SerializeToString(),
        ),
        (
            "unknown fields of every wire type",
            tag(100, 0)
            + b"\x05"
            + tag(101, 1)
            + b"\x00" * 8
            + tag(102, 2)
            + b"\x02hi"
            + tag(103, 5)
            + b"\x00" * 4
            + tag(104, 3)
            + tag(104, 4),
        ),
        ("an unknown enum value in an unknown field", tag(99, 0) + varint(2**32 - 1)),
    ]
    for depth in (50, 99, 100, 101, 1000, 30000):  # groups nested past the parser's limit
        cases.append((f"groups nested {depth} deep", tag(15, 3) * depth + tag(15, 4) * depth))
    cases.append(("groups nested 30000 deep, never closed", tag(15, 3) * 30000))
    nested = b"\x08\x01"
    for _ in range(200):  # length-delimited, 200 levels: the first field of each level
        nested = b"\x0a" + varint(len(nested)) + nested
    cases.append(("length-delimited nested 200 deep", nested))
    for number in numbers:
        for wire_type, body in [
            (0, b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"),
            (0, varint(2**64 - 1)),
            (1, b"\xff" * 8),
            (2, b"\x03abc"),
            (2, b"\x02\xff\xfe"),  # bad UTF-8 where the field is a string
            (2, b"\x03\x08\x80"),  # a truncated nested message
            (5, b"\xff" * 4),
            (3, tag(1, 0) + b"\x01" + tag(number, 4)),
        ]:
            cases.append(
                (
                    f"field {number} wire type {wire_type} {body[:8].hex()}",
                    tag(number, wire_type) + body,
                )
            )
    for f in fields:  # packed repeated fields whose length is not a multiple of the element
        if f.is_repeated and f.type in (FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_UINT64):
            cases.append((f"packed {f.name} of 3 bytes", tag(f.number, 2) + b"\x03abc"))
    return cases


def garbage_for(
    method: MethodDescriptor, rng: random.Random
) -> list[tuple[str, bytes | list[bytes]]]:
    """The garbage cases of one RPC (a Put gets them as streams)."""
    cases: list[tuple[str, bytes]] = crafted_garbage(method)
    for i in range(ROUNDS):
        length = (
            rng.choice([0, 1, 2, 3, 5, 8, 16, 33, 64, 128]) if i % 4 == 0 else rng.randint(0, 512)
        )
        cases.append((f"random #{i}", rng.randbytes(length)))
    cases.append(("a 32-byte field 1 then garbage", b"\x0a\x20" + b"\x01" * 32 + b"\xff\xff"))
    cases.append(
        (
            "a message over max_message_bytes",
            b"\x0a" + varint(MAX_MESSAGE + 16) + b"\0" * (MAX_MESSAGE + 16),
        )
    )
    if not method.client_streaming:
        return list(cases)
    streams: list[tuple[str, bytes | list[bytes]]] = [("an empty stream", [])]
    streams += [(f"one chunk: {name}", [data]) for name, data in cases]
    good_first = pb.PutChunk(
        namespace=b"\x11" * 32, block=pb.BlockSpec(key=b"\1" * 32, parent=ROOT_KEY, num_tokens=16)
    ).SerializeToString()
    for i in range(ROUNDS // 4):
        count = rng.randint(1, 5)
        chunks = [rng.randbytes(rng.randint(0, 256)) for _ in range(count)]
        if i % 2:
            chunks.insert(0, good_first)
        streams.append((f"random stream #{i}", chunks))
    return streams


async def test_garbage_bytes_to_every_rpc(world: World) -> None:
    rng = random.Random(f"{SEED}/garbage")
    verdicts = Verdicts("garbage bytes")
    async with open_channels(world.daemon.address) as channels:
        for method in METHODS:
            for name, data in garbage_for(method, rng):
                reply = await call(channels, method, data)
                verdicts.record(method.name, reply, f"garbage {name!r} (seed {SEED}): {show(data)}")
    verdicts.check(world.daemon)


async def test_garbage_without_a_good_token_is_unauthenticated(world: World) -> None:
    """The interceptor refuses before anything is parsed: UNAUTHENTICATED, and only that."""
    rng = random.Random(f"{SEED}/unauthenticated")
    verdicts = Verdicts("no good token")
    credentials = {
        "no token": None,
        "an unknown token": (("authorization", "Bearer nope"),),
        "another scheme": (("authorization", "Basic good"),),
        "an empty bearer": (("authorization", "Bearer "),),
    }
    async with open_channels(world.daemon.address) as channels:
        for method in METHODS:
            for who, metadata in credentials.items():
                for i in range(3):
                    data = rng.randbytes(rng.randint(0, 64)) if i else b""
                    sent: bytes | list[bytes] = [data] if method.client_streaming else data
                    reply = await call(channels, method, sent, metadata=metadata)
                    verdicts.record(
                        method.name,
                        reply,
                        f"{who}, garbage #{i}: {show(sent)}",
                        allowed=frozenset({Code.UNAUTHENTICATED}),
                    )
    verdicts.check(world.daemon)


# -- 2. random field values --------------------------------------------------------------------

U32 = [0, 1, 2, 3, 15, 16, 17, 255, 4096, 4097, 2**16, 2**30, 2**31 - 1, 2**31, 2**32 - 1]
U64 = [0, 1, 2, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1]
I64 = [0, 1, -1, -(2**31), 2**31 - 1, -(2**63), 2**63 - 1]
DOUBLES = [
    0.0, -0.0, 1.0, -1.0, 0.5, 3600.0, 3600.0001, 1e300, -1e300, 5e-324,
    math.nan, -math.nan, math.inf, -math.inf, 10000.0, 500000.0,
]  # fmt: skip
STRINGS = [
    "", "fuzz", TENANT, OTHER_TENANT, "float16", "bfloat16", "float32", "int8", "FLOAT16",
    "a\0b", "\0", "ünïcødé ✓ 🙂", "\u202e\ufeff", " " * 3, "x" * 5000, "🙂" * 2000,
]  # fmt: skip


class FieldFuzzer:
    """Random values for a message's fields, by their descriptor, with hints from ``world``."""

    def __init__(self, rng: random.Random, world: World) -> None:
        self.rng = rng
        self.world = world

    def message(self, cls: type[Message]) -> Message:
        message = cls()
        self._fill(message, depth=0)
        return message

    def _fill(self, message: Message, depth: int) -> None:
        rng = self.rng
        for f in message.DESCRIPTOR.fields:
            if rng.random() < 0.2:
                continue  # left unset
            if f.is_repeated:
                target = getattr(message, f.name)
                if f.type == FieldDescriptor.TYPE_MESSAGE:
                    for _ in range(self._count(depth)):
                        self._fill(target.add(), depth + 1)
                elif f.name == "keys":
                    target.extend(self._keys())
                else:
                    target.extend(self.scalar(f) for _ in range(self._count(depth)))
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(message, f.name).SetInParent()
                self._fill(getattr(message, f.name), depth + 1)
            else:
                setattr(message, f.name, self.scalar(f))

    def _count(self, depth: int) -> int:
        rng = self.rng
        roll = rng.random()
        if roll < 0.2:
            return 0
        if roll < 0.5 or depth > 1:
            return rng.randint(1, 3)
        return rng.randint(4, 24 if roll < 0.95 else 300)

    def _keys(self) -> list[bytes]:
        """A repeated ``keys`` field: often the stored chain (a prefix), then anything."""
        rng, world = self.rng, self.world
        roll = rng.random()
        count = self._count(0)
        if roll < 0.4:
            chain = world.keys[: rng.randint(0, len(world.keys))]
            return chain + [self.bytes_for("key") for _ in range(rng.randint(0, 2))]
        if roll < 0.5:  # the stored chain with a key repeated
            chain = list(world.keys)
            chain.insert(rng.randint(0, len(chain)), rng.choice(chain))
            return chain
        if roll < 0.6 and world.reserved:
            return rng.sample(world.reserved, min(len(world.reserved), count or 1))
        return [self.bytes_for("key") for _ in range(count)]

    def scalar(self, f: FieldDescriptor) -> object:
        rng, t = self.rng, f.type
        if t == FieldDescriptor.TYPE_BYTES:
            return self.bytes_for(f.name)
        if t == FieldDescriptor.TYPE_STRING:
            return self.string_for(f.name)
        if t == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return rng.choice(DOUBLES) if rng.random() < 0.7 else rng.uniform(-1e4, 1e4)
        if t == FieldDescriptor.TYPE_ENUM:
            known = [v.number for v in f.enum_type.values]
            return rng.choice([*known, 99, -1, 2**31 - 1])  # unknown values: open enums
        if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
            if f.name in ("num_tokens", "block_tokens") and rng.random() < 0.5:
                return 16
            if f.name in ("num_layers", "num_kv_heads", "head_dim") and rng.random() < 0.6:
                return rng.choice([1, 2, 16])
            return rng.choice(U32) if rng.random() < 0.7 else rng.randrange(2**32)
        if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
            if f.name == "lease_id" and self.world.lease_ids and rng.random() < 0.5:
                return rng.choice(self.world.lease_ids)
            return rng.choice(U64) if rng.random() < 0.7 else rng.randrange(2**64)
        if t in (
            FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_SINT32,
            FieldDescriptor.TYPE_SFIXED32,
        ):
            return rng.choice([0, 1, -1, -(2**31), 2**31 - 1])
        if t in (
            FieldDescriptor.TYPE_INT64,
            FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_SFIXED64,
        ):
            return rng.choice(I64)
        raise AssertionError(f"no generator for field {f.full_name} of type {t}")

    def bytes_for(self, name: str) -> bytes:
        rng, world = self.rng, self.world
        hinted = rng.random() < 0.6
        if hinted and name == "namespace":
            pool = [world.namespace] * 6 + [world.other_namespace, world.unknown_namespace]
            return rng.choice(pool + world.namespaces)
        if hinted and name in ("key", "parent"):
            return rng.choice([*world.keys, *world.reserved[-8:], ROOT_KEY, rng.randbytes(32)])
        if hinted and name == "session" and world.session:
            return world.session
        length = rng.choice([0, 1, 16, 31, 32, 32, 33, 64, 80, rng.randint(0, 80)])
        return rng.randbytes(length)

    def string_for(self, name: str) -> str:
        rng = self.rng
        if name == "tenant" and rng.random() < 0.6:
            return TENANT
        if name == "dtype" and rng.random() < 0.6:
            return rng.choice(["float16", "bfloat16", "float32"])
        if name == "model_name" and rng.random() < 0.4:
            return "fuzz"
        if name == "name" and rng.random() < 0.5:  # RopeScaling.name
            return rng.choice(["factor", "type", "original_max_position_embeddings"])
        if rng.random() < 0.6:
            return rng.choice(STRINGS)
        points = (rng.randrange(1, 0x1FFFF - 0x800) for _ in range(rng.randint(1, 40)))
        return "".join(chr(c + 0x800 if c >= 0xD800 else c) for c in points)  # no surrogates


def random_layout_request(rng: random.Random) -> pb.RegisterNamespaceRequest:
    """A plausible RegisterNamespace of tenant-a with extreme layout numbers."""
    sizes = [0, 1, 2, 16, 128, 4096, 4097, 2**16, 2**20, 2**30, 2**30 + 1, 2**32 - 1]
    layout = fingerprint_message(MODEL).layout
    names = ["num_layers", "num_kv_heads", "block_tokens", "head_dim"]
    # Half of them: the fuzz model with one or two numbers changed; the others: all random.
    for name in rng.sample(names, rng.choice([1, 2])) if rng.random() < 0.5 else names:
        setattr(layout, name, rng.choice(sizes))
    if rng.random() < 0.3:
        layout.dtype = rng.choice(["bfloat16", "float32", "fp8", "", "float16\0", "Float16"])
    model = pb.ModelFingerprint(
        model_name=rng.choice(["fuzz-layout", "fuzz-layout", "", "x" * 4096, "m\0"]),
        layout=layout,
        rope_theta=rng.choice(DOUBLES) if rng.random() < 0.3 else 10000.0,
    )
    for i in range(rng.choice([0, 0, 1, 3])):
        entry = model.rope_scaling.add(name=rng.choice(["factor", "type", "", "factor"]))
        if i % 2:
            entry.number = rng.choice(DOUBLES)
        elif rng.random() < 0.8:
            entry.text = rng.choice(STRINGS)
    return pb.RegisterNamespaceRequest(model=model, tenant=TENANT)


@contextlib.contextmanager
def shm_session(daemon: Daemon, staging_bytes: int = 1 << 20) -> Iterator[tuple[bytes, mmap.mmap]]:
    """An open shm session of tenant-a: its id and its staging area, mapped writable."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10.0)
        sock.connect(session_path(str(daemon.socket_path)))
        sock.sendall(encode_hello(Hello("good", TENANT, staging_bytes)))
        line, fds, _, _ = socket.recv_fds(sock, 65536, 4)
        try:
            reply = json.loads(line.split(b"\n")[0])
            assert reply["ok"], reply
            staging = mmap.mmap(fds[1], reply["staging_bytes"])
        finally:
            for fd in fds:
                os.close(fd)
        with staging:
            yield bytes.fromhex(reply["session"]), staging


def learn(
    world: World,
    request: Message,
    reply: Reply,
    staging: mmap.mmap,
    rng: random.Random,
) -> None:
    """Keeps what an OK reply hands out (leases, reserved keys) for later requests, and
    writes random payloads into the staging slots reserved, for the commits that follow."""
    method = request.DESCRIPTOR.name.removesuffix("Request")
    if reply.code != Code.OK:
        return
    if method == "Acquire":
        world.lease_ids.append(pb.AcquireResponse.FromString(reply.messages[0]).lease_id)
    elif method == "Reserve":
        reservations = pb.ReserveResponse.FromString(reply.messages[0]).reservations
        assert isinstance(request, pb.ReserveRequest)
        for spec, item in zip(request.blocks, reservations, strict=False):
            slot = item.slot
            if item.status == pb.RESERVED and slot.offset + slot.length <= len(staging):
                staging[slot.offset : slot.offset + slot.length] = rng.randbytes(slot.length)
                world.reserved.append(spec.key)


def broken_promise(request: Message, reply: Reply) -> str | None:
    """What is wrong with an OK reply to ``request`` (counts that do not match); None: fine."""
    if reply.code != Code.OK:
        return None
    if isinstance(request, pb.LookupRequest):
        found = pb.LookupResponse.FromString(reply.messages[0])
        if found.num_blocks > len(request.keys) or len(found.tiers) != found.num_blocks:
            return (
                f"{found.num_blocks} blocks, tiers {list(found.tiers)} for {len(request.keys)} keys"
            )
    elif isinstance(request, pb.AcquireRequest):
        acquired = pb.AcquireResponse.FromString(reply.messages[0])
        slots = len(acquired.slots)
        if slots > len(request.keys) or len(acquired.checksums) != slots:
            return (
                f"{slots} slots, {len(acquired.checksums)} checksums for {len(request.keys)} keys"
            )
    elif isinstance(request, pb.ReserveRequest):
        reserved = pb.ReserveResponse.FromString(reply.messages[0]).reservations
        if len(reserved) != len(request.blocks):
            return f"{len(reserved)} reservations for {len(request.blocks)} blocks"
    elif isinstance(request, pb.CommitRequest):
        statuses = pb.CommitResponse.FromString(reply.messages[0]).statuses
        if len(statuses) != len(request.keys):
            return f"{len(statuses)} statuses for {len(request.keys)} keys"
    elif isinstance(request, pb.GetRequest):
        indexes = [pb.GetChunk.FromString(chunk).index for chunk in reply.messages]
        if indexes != sorted(indexes) or any(i >= len(request.keys) for i in indexes):
            return f"chunks of blocks {indexes[:20]} for {len(request.keys)} keys"
    return None


async def test_random_field_values_to_every_rpc(world: World) -> None:
    rng = random.Random(f"{SEED}/fields")
    fuzzer = FieldFuzzer(rng, world)
    verdicts = Verdicts("random fields")
    unary = [m for m in METHODS if not m.client_streaming]
    put = next(m for m in METHODS if m.client_streaming)
    with shm_session(world.daemon) as (session, staging):
        world.session = session
        async with open_channels(world.daemon.address) as channels:
            for i in range(ROUNDS):
                for method in unary:
                    cls = getattr(pb, method.input_type.name)
                    request = fuzzer.message(cls)
                    if method.name == "Reserve" and rng.random() < 0.5:
                        request.namespace, request.session = world.namespace, session
                    data = request.SerializeToString()
                    assert len(data) < MAX_MESSAGE, f"the generator made {len(data)} bytes"
                    reply = await call(channels, method, data)
                    case = f"#{i} (seed {SEED}) {described(request)} = {show(data)}"
                    verdicts.record(method.name, reply, case)
                    if problem := broken_promise(request, reply):
                        verdicts.fail(f"{method.name} answered OK with {problem}: {case}")
                    learn(world, request, reply, staging, rng)
                chunks = [fuzzer.message(pb.PutChunk) for _ in range(rng.randint(1, 3))]
                data_chunks = [chunk.SerializeToString() for chunk in chunks]
                reply = await call(channels, put, data_chunks)
                case = f"#{i} (seed {SEED}) [{'; '.join(described(c) for c in chunks)}]"
                verdicts.record(put.name, reply, case)
            # Layouts: zeros, huge numbers, dtype garbage. Never a crash or a MemoryError.
            register = next(m for m in METHODS if m.name == "RegisterNamespace")
            for i in range(ROUNDS):
                request = random_layout_request(rng)
                reply = await call(channels, register, request.SerializeToString())
                verdicts.record(
                    "RegisterNamespace(layouts)", reply, f"#{i} (seed {SEED}) {described(request)}"
                )
                if reply.code == Code.OK:
                    digest = pb.RegisterNamespaceResponse.FromString(reply.messages[0]).namespace
                    layout = request.model.layout
                    size = (
                        layout.num_layers * 2 * layout.num_kv_heads * layout.block_tokens
                        * layout.head_dim * {"float32": 4}.get(layout.dtype, 2)
                    )  # fmt: skip
                    world.layouts[digest] = (size, layout.block_tokens)
            # The limits of one call: MAX_KEYS keys, and one past it.
            lookup = next(m for m in METHODS if m.name == "Lookup")
            for count in (2**16, 2**16 + 1):
                request = pb.LookupRequest(namespace=world.namespace, keys=[b"\7" * 32] * count)
                reply = await call(channels, lookup, request.SerializeToString())
                verdicts.record("Lookup", reply, f"{count} keys of 32 bytes")
        world.session = b""
    verdicts.check(world.daemon)


# -- 3. random Put streams ---------------------------------------------------------------------


@dataclass
class PlannedStream:
    chunks: list[bytes]
    story: list[str]  # what each step does, for the failure message
    well_formed: bool  # only complete blocks, one namespace, data inside blocks
    blocks: int
    wrong_checksum: list[bool]  # per block: a nonzero checksum that differs from the bytes


def plan_put_stream(rng: random.Random, world: World) -> PlannedStream:
    chunks: list[bytes] = []
    story: list[str] = []
    well_formed = True  # stays so for a stream the daemon must take (OK)
    wrong: list[bool] = []
    roll = rng.random()
    if roll < 0.6:
        ns = world.namespace
    elif roll < 0.8 and world.namespaces:
        ns = rng.choice(world.namespaces)
    else:
        ns = rng.choice([world.other_namespace, world.unknown_namespace, b"", rng.randbytes(31)])
    size, block_tokens = world.layouts.get(ns, (BLOCK, 16))
    big = size > 1 << 16  # blocks up to the arena's size: only their first 64 KiB are sent
    story.append(f"namespace {ns[:8].hex()}")
    first = pb.PutChunk(namespace=ns)  # merged into the first block's first chunk, or alone:
    if rng.random() < 0.1:
        first.data = rng.randbytes(rng.randint(1, 64))
        story.append("data before any block")
        well_formed = False
    if first.data or rng.random() < 0.5:
        chunks.append(first.SerializeToString())
        first = pb.PutChunk()
    parent = ROOT_KEY
    blocks = rng.choice([0, 1, 1, 2, 3, 5])
    for b in range(blocks):
        fresh = [rng.randbytes(32)] * 4
        key = rng.choice(
            [*fresh, *world.keys, *world.reserved[-2:], rng.randbytes(rng.randint(0, 40))]
        )
        tokens = block_tokens if rng.random() < 0.85 else rng.choice([0, 1, 15, 17, 2**32 - 1])
        spec = pb.BlockSpec(key=key, parent=parent, num_tokens=tokens)
        if len(key) != 32 or tokens != block_tokens:
            well_formed = False
        if key == parent or key in world.keys or key in world.reserved:
            well_formed = False  # its parent chain may lead back to it: refused as a cycle
        payload = rng.randbytes(min(size, 1 << 16))
        checksum = rng.choice([0, xxhash.xxh3_64_intdigest(payload), rng.randrange(1, 2**64)])
        wrong.append(checksum not in (0, xxhash.xxh3_64_intdigest(payload)))
        delta = 0 if rng.random() < 0.8 else rng.choice([-len(payload), -1, 1, 100])
        if delta or big:
            well_formed = False
        body = payload[: len(payload) + delta] + rng.randbytes(max(0, delta))
        sent = len(body)
        pieces = []
        while body:
            cut = rng.choice([len(body), rng.randint(1, len(body)), 1, 1000])
            pieces.append(body[:cut])
            body = body[cut:]
        head = pb.PutChunk(block=spec, checksum=checksum)
        head.MergeFrom(first)
        first = pb.PutChunk()
        if pieces and rng.random() < 0.7:
            head.data = pieces.pop(0)
        chunks.append(head.SerializeToString())
        story.append(f"block {b} key {key[:4].hex()} tokens {tokens} {sent} of {size} bytes")
        for piece in pieces:
            extra = pb.PutChunk(data=piece)
            if rng.random() < 0.05:
                extra.namespace = rng.choice([ns, world.other_namespace, world.unknown_namespace])
                story.append(f"namespace {extra.namespace[:8].hex()} mid-stream")
                well_formed = well_formed and extra.namespace == ns
            chunks.append(extra.SerializeToString())
        if rng.random() < 0.05:
            chunks.append(b"")
            story.append("an empty chunk")
        if rng.random() < 0.05:
            chunks.append(rng.randbytes(rng.randint(1, 40)))
            story.append("a garbage chunk")
            well_formed = False
        parent = key if len(key) == 32 else parent
    if first.ByteSize():
        chunks.append(first.SerializeToString())
    if rng.random() < 0.05:
        chunks.append(pb.PutChunk(data=b"tail").SerializeToString())
        story.append("data after the last block")
        well_formed = False
    if ns not in (world.namespace, *world.namespaces):
        well_formed = False
    return PlannedStream(chunks, story, well_formed, blocks, wrong)


async def test_random_put_streams(world: World) -> None:
    rng = random.Random(f"{SEED}/put-streams")
    verdicts = Verdicts("put streams")
    put = next(m for m in METHODS if m.client_streaming)
    async with open_channels(world.daemon.address) as channels:
        for i in range(ROUNDS + ROUNDS // 2):
            plan = plan_put_stream(rng, world)
            reply = await call(channels, put, plan.chunks)
            case = f"stream #{i} (seed {SEED}) {plan.story}: {show(plan.chunks)}"
            verdicts.record("Put(streams)", reply, case)
            if reply.code != Code.OK:
                if plan.well_formed and reply.code == Code.INVALID_ARGUMENT:
                    verdicts.fail(f"a well-formed stream was refused: {reply.details!r}: {case}")
                continue
            statuses = list(pb.PutResponse.FromString(reply.messages[0]).statuses)
            if len(statuses) != plan.blocks:
                verdicts.fail(f"{len(statuses)} statuses for {plan.blocks} blocks: {case}")
            for b, (status, wrong) in enumerate(zip(statuses, plan.wrong_checksum, strict=False)):
                if wrong and status == pb.STORED:
                    verdicts.fail(f"block {b} with a wrong checksum was STORED: {case}")
    verdicts.check(world.daemon)


async def test_a_reserve_past_the_staging_area_does_not_stall_the_daemon(world: World) -> None:
    """A valid Reserve of many more blocks than the session's staging area holds: NO_SPACE
    for the rest, while the daemon keeps answering other calls (here: its health check)."""
    rng = random.Random(f"{SEED}/reserve-many")
    count = 20_000  # 1024 staging slots of 4 KiB: ~19M slot checks on the event loop today
    blocks = [
        pb.BlockSpec(key=rng.randbytes(32), parent=ROOT_KEY, num_tokens=16) for _ in range(count)
    ]
    with shm_session(world.daemon, staging_bytes=4 << 20) as (session, _staging):
        request = pb.ReserveRequest(namespace=world.namespace, blocks=blocks, session=session)
        async with grpc.aio.insecure_channel(world.daemon.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            reserve = stub.Reserve(request, metadata=AUTH, timeout=120)
            await asyncio.sleep(0.5)
            started = time.monotonic()
            try:
                await health.Check(health_pb2.HealthCheckRequest(), timeout=3)
            except grpc.aio.AioRpcError as error:
                waited = time.monotonic() - started
                pytest.fail(
                    f"health check {error.code().name} after {waited:.1f} s while a Reserve "
                    f"of {count} blocks ran (one 4 MiB staging area)"
                )
            finally:
                reply = await reserve
                keys = [spec.key for spec in blocks]
                await stub.Abort(
                    pb.AbortRequest(namespace=world.namespace, keys=keys, session=session),
                    metadata=AUTH,
                    timeout=60,
                )
            statuses = Counter(pb.WriteStatus.Name(r.status) for r in reply.reservations)
            SUMMARY["big reserve"]["Reserve"].update(statuses)
            assert sum(statuses.values()) == count


CYCLE_A, CYCLE_B = b"\xaa" * 32, b"\xbb" * 32


def put_one(
    stub: kvstore_pb2_grpc.KVStoreStub, ns: bytes, key: bytes, parent: bytes, metadata: Metadata
) -> str:
    """One block through the Put stream: its WriteStatus name, or the status code's name."""
    chunk = pb.PutChunk(
        namespace=ns, block=pb.BlockSpec(key=key, parent=parent, num_tokens=16), data=bytes(BLOCK)
    )
    try:
        reply = stub.Put(iter([chunk]), metadata=metadata, timeout=10)
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        assert error.code() == Code.INVALID_ARGUMENT, f"Put of {key.hex()[:8]}: {error}"
        return "INVALID_ARGUMENT"  # refusing a parent cycle is right too
    return pb.WriteStatus.Name(reply.statuses[0])


@pytest.mark.parametrize(
    "links",
    [
        pytest.param([(CYCLE_A, CYCLE_A)], id="its-own-parent"),
        pytest.param([(CYCLE_A, CYCLE_B), (CYCLE_B, CYCLE_A)], id="each-others-parent"),
    ],
)
def test_a_parent_cycle_does_not_freeze_delete(
    tmp_path: Path, links: list[tuple[bytes, bytes]]
) -> None:
    with running_daemon(tmp_path, tokens=TOKENS) as daemon:
        try:
            with grpc.insecure_channel(daemon.address) as channel:
                stub = kvstore_pb2_grpc.KVStoreStub(channel)
                request = pb.RegisterNamespaceRequest(
                    model=fingerprint_message(MODEL), tenant=TENANT
                )
                ns = stub.RegisterNamespace(request, metadata=AUTH).namespace
                written = [put_one(stub, ns, key, parent, AUTH) for key, parent in links]
                sent = ", ".join(f"{k.hex()[:4]} <- parent {p.hex()[:4]}" for k, p in links)
                try:
                    deleted = stub.Delete(
                        pb.DeleteRequest(namespace=ns, keys=[CYCLE_A]), metadata=AUTH, timeout=5
                    )
                except grpc.RpcError as error:
                    assert isinstance(error, grpc.Call)
                    pytest.fail(
                        f"Delete of {CYCLE_A.hex()[:4]} answered {error.code().name} after Puts "
                        f"of {sent} ({written}): the daemon froze",
                        pytrace=False,
                    )
                assert deleted.num_blocks <= len(links)
                health = health_pb2_grpc.HealthStub(channel)
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                found = stub.Lookup(
                    pb.LookupRequest(namespace=ns, keys=[CYCLE_A]), metadata=AUTH, timeout=5
                )
                assert found.num_blocks == 0, f"{CYCLE_A.hex()[:4]} is still held after Delete"
            assert "Traceback" not in daemon.log(tail=10**7), daemon.log()
        finally:
            daemon.kill()  # a frozen daemon would not answer SIGTERM: no 30 s wait


def test_blocks_that_are_their_own_parents_do_not_pin_the_arena(tmp_path: Path) -> None:
    """One tenant's self-parented blocks must not keep another tenant out of the host tier."""
    rng = random.Random(f"{SEED}/self-parents")
    with (
        running_daemon(tmp_path, tokens=TOKENS, host_capacity="1MiB") as daemon,
        grpc.insecure_channel(daemon.address) as channel,
    ):
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        model = fingerprint_message(MODEL)
        ns_a = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model=model, tenant=TENANT), metadata=AUTH
        ).namespace
        ns_b = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model=model, tenant=OTHER_TENANT), metadata=OTHER_AUTH
        ).namespace
        capacity = (1 << 20) // BLOCK
        selfish: Counter[str] = Counter()
        for _ in range(capacity + 16):
            key = rng.randbytes(32)
            selfish[put_one(stub, ns_a, key, key, AUTH)] += 1
        others = Counter(
            put_one(stub, ns_b, rng.randbytes(32), ROOT_KEY, OTHER_AUTH) for _ in range(16)
        )
        assert others == {"STORED": 16}, (
            f"tenant-b's Puts got {dict(others)} after tenant-a's {dict(selfish)} Puts of "
            f"blocks that are their own parents, into a host tier of {capacity} blocks"
        )


# -- the shm session socket --------------------------------------------------------------------


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


def test_garbage_on_the_shm_session_socket(world: World) -> None:
    rng = random.Random(f"{SEED}/shm")
    verdicts = Verdicts("shm socket")
    for name, data, opens in shm_garbage(rng):
        answer, fds = hello_exchange(world.daemon, data)
        code = "closed" if not answer else "session" if fds else "refused"
        SUMMARY["shm socket"]["hello"][code] += 1
        problem = check_shm_answer(name, data, answer, fds, opens)
        if problem:
            verdicts.fail(problem)
    verdicts.check(world.daemon)
    answer, fds = hello_exchange(world.daemon, hello())
    assert fds == 2 and json.loads(answer)["ok"], f"no session after the garbage: {answer!r}"


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b'{"version": 1, "staging_bytes": ' + b"9" * 5000 + b"}\n", id="int-digits"),
        pytest.param(b"[" * 30000 + b"]" * 30000 + b"\n", id="nesting"),
    ],
)
def test_shm_hello_that_json_cannot_decode_is_refused(tmp_path: Path, line: bytes) -> None:
    """On a daemon of its own, so that a traceback here does not fail the checks above."""
    with running_daemon(tmp_path, tokens=TOKENS) as daemon:
        answer, fds = hello_exchange(daemon, line)
        problem = check_shm_answer("undecodable", line, answer, fds, opens=False)
        answer_after, fds_after = hello_exchange(daemon, hello())
        for _ in range(20):  # an unhandled task exception is logged once the task is collected
            if "Traceback" in daemon.log(tail=10**7):
                break
            time.sleep(0.05)
        log = daemon.log(tail=10**7)
        assert daemon.running, f"the daemon died:\n{log}"
        assert fds_after == 2, f"no session after the undecodable hello: {answer_after!r}"
        assert problem is None, problem  # a refusal line, or the connection closed
        assert "Traceback" not in log, f"the daemon logged a traceback for {show(line)}:\n{log}"


# -- 4. the daemon afterwards ------------------------------------------------------------------


async def test_the_daemon_still_serves_after_the_fuzzing(world: World) -> None:
    daemon = world.daemon
    assert daemon.running, f"the daemon died:\n{daemon.log()}"
    async with grpc.aio.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        rng = random.Random(f"{SEED}/after")
        keys = [rng.randbytes(32) for _ in range(3)]
        payloads = [rng.randbytes(BLOCK) for _ in keys]
        put = await stub.Put(
            block_chunks(world.namespace, keys, payloads), metadata=AUTH, timeout=10
        )
        assert list(put.statuses) == [pb.STORED] * 3
        got: dict[int, bytearray] = defaultdict(bytearray)
        request = pb.GetRequest(namespace=world.namespace, keys=keys)
        async for chunk in stub.Get(request, metadata=AUTH, timeout=10):
            got[chunk.index] += chunk.data
        assert [bytes(got[i]) for i in range(3)] == payloads, "Get returned other bytes than Put"
        stats = await stub.Stats(pb.StatsRequest(), metadata=AUTH, timeout=10)
        assert stats.blocks >= 3 and stats.puts >= 3
    log = daemon.log(tail=10**7)
    assert "Traceback" not in log, f"the daemon logged a traceback:\n{log[-20000:]}"
    assert "failed on a bug" not in log, f"the daemon logged a bug:\n{log[-20000:]}"
    print_summary()


def print_summary() -> None:
    print(f"\nkvstore fuzz summary (seed {SEED}, {ROUNDS} rounds): statuses per phase and RPC")
    for phase, methods in SUMMARY.items():
        print(f"  {phase}:")
        for method, counts in methods.items():
            shown = ", ".join(f"{code} {n}" for code, n in counts.most_common())
            print(f"    {method:28s} {sum(counts.values()):5d}  {shown}")
