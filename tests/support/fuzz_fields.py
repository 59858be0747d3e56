"""Well-formed requests with random field values, and what their answers must keep.

:class:`FieldFuzzer` fills any request by walking its descriptor (edge integers, NaN and
infinities, long, unicode and NUL strings, repeated fields of 0..N entries, nested
messages), mixed with hints from the :class:`~tests.support.fuzz_world.World` (a registered
namespace, stored keys, the shm session, granted lease ids) so that deeper code runs;
:func:`random_layout_request` registers extreme layouts (:func:`learn_layout` keeps those
that the daemon took). :func:`learn` keeps what OK
replies hand out for later requests; :func:`broken_promise` says what is wrong with one.
"""

from __future__ import annotations

import itertools
import math
import mmap
import random

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kvstore.client.wire import fingerprint_message
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.blocks import ROOT_KEY
from tests.support.fuzz_calls import Reply
from tests.support.fuzz_world import MODEL, OTHER_TENANT, TENANT, Code, World

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


def learn(
    world: World,
    request: Message,
    reply: Reply,
    arena: mmap.mmap,
    rng: random.Random,
) -> None:
    """Keeps what an OK reply hands out (leases, reserved keys) for later requests, and
    writes random payloads into the arena slots reserved, for the commits that follow."""
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
            if item.status == pb.RESERVED and slot.offset + slot.length <= len(arena):
                arena[slot.offset : slot.offset + slot.length] = rng.randbytes(slot.length)
                world.reserved.append(spec.key)


def broken_promise(request: Message, reply: Reply) -> str | None:
    """What is wrong with an OK reply to ``request`` (counts that do not match); None: fine."""
    if reply.code != Code.OK:
        return None
    if isinstance(request, pb.LookupRequest):
        found = pb.LookupResponse.FromString(reply.messages[0])
        runs = [(run.tier, run.blocks) for run in found.runs]
        tiers = [tier for tier, _ in runs]
        if (
            found.num_blocks > len(request.keys)
            or sum(count for _, count in runs) != found.num_blocks
            or any(count == 0 for _, count in runs)
            or any(a == b for a, b in itertools.pairwise(tiers))
            or found.tiers
        ):
            return f"{found.num_blocks} blocks, runs {runs} for {len(request.keys)} keys"
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


def learn_layout(world: World, request: pb.RegisterNamespaceRequest, reply: Reply) -> None:
    """Keeps the payload size and block tokens of a layout registered OK (for Put streams)."""
    if reply.code == Code.OK:
        digest = pb.RegisterNamespaceResponse.FromString(reply.messages[0]).namespace
        layout = request.model.layout
        size = (
            layout.num_layers * 2 * layout.num_kv_heads * layout.block_tokens
            * layout.head_dim * {"float32": 4}.get(layout.dtype, 2)
        )  # fmt: skip
        world.layouts[digest] = (size, layout.block_tokens)
