"""kvstore.wire.chunks against protobuf's own GetChunk and PutChunk: the same bytes both ways."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.blocks import BlockSpec
from kvstore.wire.chunks import GetChunk, PutChunk, decode_get, decode_put, encode_get, encode_put

get_chunks = st.builds(
    GetChunk,
    index=st.integers(0, 2**32 - 1),
    data=st.binary(max_size=3000),
    last=st.booleans(),
    tier=st.text(max_size=20),
    checksum=st.integers(0, 2**64 - 1),
)
specs = st.builds(
    BlockSpec,
    key=st.binary(max_size=40),
    parent=st.binary(max_size=40),
    num_tokens=st.integers(0, 2**32 - 1),
)
put_chunks = st.builds(
    PutChunk,
    data=st.binary(max_size=3000),
    namespace=st.binary(max_size=40),
    block=st.none() | specs,
    checksum=st.integers(0, 2**64 - 1),
)


def get_fields(chunk: GetChunk | pb.GetChunk) -> tuple[int, bytes, bool, str, int]:
    return chunk.index, bytes(chunk.data), chunk.last, chunk.tier, chunk.checksum


def put_fields(chunk: PutChunk | pb.PutChunk) -> tuple[bytes, bytes, object, int]:
    if isinstance(chunk, pb.PutChunk):
        block = chunk.block if chunk.HasField("block") else None
        spec = None if block is None else BlockSpec(block.key, block.parent, block.num_tokens)
    else:
        spec = chunk.block
    return bytes(chunk.data), chunk.namespace, spec, chunk.checksum


@given(get_chunks)
@settings(max_examples=300, deadline=None)
def test_get_chunks_are_the_bytes_protobuf_writes_and_reads(chunk: GetChunk) -> None:
    names = ("index", "data", "last", "tier", "checksum")
    message = pb.GetChunk(**dict(zip(names, get_fields(chunk), strict=True)))
    assert encode_get(chunk) == message.SerializeToString()
    assert get_fields(decode_get(message.SerializeToString())) == get_fields(chunk)
    assert get_fields(pb.GetChunk.FromString(encode_get(chunk))) == get_fields(chunk)


@given(put_chunks)
@settings(max_examples=300, deadline=None)
def test_put_chunks_are_the_bytes_protobuf_writes_and_reads(chunk: PutChunk) -> None:
    message = pb.PutChunk(data=bytes(chunk.data), namespace=chunk.namespace,
                          checksum=chunk.checksum)  # fmt: skip
    if chunk.block is not None:
        spec = chunk.block
        message.block.CopyFrom(pb.BlockSpec(key=spec.key, parent=spec.parent,
                                            num_tokens=spec.num_tokens))  # fmt: skip
    assert encode_put(chunk) == message.SerializeToString()
    assert put_fields(decode_put(message.SerializeToString())) == put_fields(chunk)
    assert put_fields(pb.PutChunk.FromString(encode_put(chunk))) == put_fields(chunk)


def test_data_is_a_view_of_the_received_message_and_views_are_encoded_whole() -> None:
    message = encode_get(GetChunk(7, memoryview(bytearray(b"abcdef"))[1:4], True, "host", 9))
    chunk = decode_get(message)
    assert isinstance(chunk.data, memoryview) and chunk.data.obj is message
    assert get_fields(chunk) == (7, b"bcd", True, "host", 9)
    put = decode_put(encode_put(PutChunk(memoryview(b"xyz"), block=BlockSpec(b"", b"", 0))))
    assert put.block == BlockSpec(b"", b"", 0)  # an empty spec still starts a block


def test_unknown_fields_are_skipped_and_a_repeated_spec_merges_as_protobuf_does() -> None:
    extra = b"\x30\x05" + b"\x3a\x02hi" + b"\x45\x01\x02\x03\x04" + b"\x49" + bytes(8)
    message = encode_get(GetChunk(3, b"xyz", False, "ssd", 0)) + extra
    assert get_fields(decode_get(message)) == get_fields(pb.GetChunk.FromString(message))
    first = encode_put(PutChunk(b"ab", b"ns", BlockSpec(b"k" * 32, b"p" * 32, 16), 5))
    second = encode_put(PutChunk(b"", block=BlockSpec(b"", b"q" * 32, 0)))
    message = first + second + extra
    assert put_fields(decode_put(message)) == put_fields(pb.PutChunk.FromString(message))


@pytest.mark.parametrize(
    ("decode", "message", "match"),
    [
        (decode_get, b"\x08", "truncated or overlong varint at byte 1"),
        (decode_get, b"\x12\x05ab", "field 2 runs past the message"),
        (decode_get, b"\x29\x01\x02", "field 5 runs past the message"),
        (decode_get, b"\x0b", "wire type 3 at byte 1"),
        (decode_get, b"\x08" + b"\xff" * 11, "overlong varint"),
        (decode_get, b"\x22\x02\xff\xfe", "invalid start byte"),
        (decode_get, b"\x10\x01", "GetChunk field 2 has wire type 0, not 2"),
        (decode_put, b"\x12\x03\x0a\x05a", "BlockSpec field 1 runs past"),
        (decode_put, b"\x21\x01", "PutChunk field 4 runs past"),
    ],
)
def test_malformed_messages_raise_value_errors_naming_where(
    decode: object, message: bytes, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        decode(message)  # type: ignore[operator]


@given(st.binary(max_size=200))
@settings(max_examples=500, deadline=None)
def test_garbage_decodes_or_raises_value_error_never_anything_else(message: bytes) -> None:
    for decode in (decode_get, decode_put):
        try:
            chunk = decode(message)
        except ValueError:
            continue
        assert len(bytes(chunk.data)) <= len(message)
