"""kvstore.get_chunks against protobuf's own GetChunk: the same bytes both ways."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.get_chunks import GetChunk, decode, encode
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb

chunks = st.builds(
    GetChunk,
    index=st.integers(0, 2**32 - 1),
    data=st.binary(max_size=3000),
    last=st.booleans(),
    tier=st.text(max_size=20),
    checksum=st.integers(0, 2**64 - 1),
)


def fields(chunk: GetChunk | pb.GetChunk) -> tuple[int, bytes, bool, str, int]:
    return chunk.index, bytes(chunk.data), chunk.last, chunk.tier, chunk.checksum


@given(chunks)
@settings(max_examples=300, deadline=None)
def test_encode_writes_what_protobuf_writes_and_decode_reads_it(chunk: GetChunk) -> None:
    names = ("index", "data", "last", "tier", "checksum")
    message = pb.GetChunk(**dict(zip(names, fields(chunk), strict=True)))
    assert encode(chunk) == message.SerializeToString()
    assert fields(decode(message.SerializeToString())) == fields(chunk)
    assert fields(pb.GetChunk.FromString(encode(chunk))) == fields(chunk)


def test_data_is_a_view_of_the_received_message_and_views_are_encoded_whole() -> None:
    message = encode(GetChunk(7, memoryview(bytearray(b"abcdef"))[1:4], True, "host", 9))
    chunk = decode(message)
    assert isinstance(chunk.data, memoryview) and chunk.data.obj is message
    assert fields(chunk) == (7, b"bcd", True, "host", 9)


def test_unknown_fields_are_skipped_as_protobuf_does() -> None:
    extra = b"\x30\x05" + b"\x3a\x02hi" + b"\x45\x01\x02\x03\x04" + b"\x49" + bytes(8)
    message = encode(GetChunk(3, b"xyz", False, "ssd", 0)) + extra
    assert fields(decode(message)) == fields(pb.GetChunk.FromString(message))


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (b"\x08", "truncated or overlong varint at byte 1"),
        (b"\x12\x05ab", "field 2 runs past the message"),
        (b"\x29\x01\x02", "field 5 runs past the message"),
        (b"\x0b", "wire type 3 at byte 1"),
        (b"\x08" + b"\xff" * 11, "overlong varint"),
        (b"\x22\x02\xff\xfe", "invalid start byte"),
    ],
)
def test_malformed_messages_raise_value_errors_naming_where(message: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode(message)


@given(st.binary(max_size=200))
@settings(max_examples=500, deadline=None)
def test_garbage_decodes_or_raises_value_error_never_anything_else(message: bytes) -> None:
    try:
        chunk = decode(message)
    except ValueError:
        return
    assert len(bytes(chunk.data)) <= len(message)
