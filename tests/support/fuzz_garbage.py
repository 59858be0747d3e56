"""Garbage bytes for every RPC: crafted wire-format traps and random strings.

:func:`crafted_garbage` makes bytes that are not a valid request (or barely are): truncated
and over-long varints, every wire type on every field, a length prefix claiming 2^31 bytes,
groups nested past the parser's limit, bad UTF-8; :func:`garbage_for` adds random bytes and
a message over max_message_bytes, and makes streams of them for the client-streaming Put.
"""

from __future__ import annotations

import random

from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor

from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.blocks import ROOT_KEY
from tests.support.fuzz_world import MAX_MESSAGE, ROUNDS


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
