"""The Get and Put streams' chunks, encoded and decoded without copying their data.

A streamed get or put is mostly bytes: each chunk carries ``chunk_bytes`` (1 MiB by
default) of one block. Through protobuf's Python messages a chunk's data is copied twice
more on each side than on a raw bytes stream (into the message, out of it into the wire
bytes; on the receiver, out of the message again). These functions write and read the same
wire format (``kvstore.v1.GetChunk`` and ``PutChunk``: field numbers and types, proto3
defaults left out, fields in number order, so an encoding is the bytes protobuf would give)
with the data copied once, into the message, and read as a view of the received message:

- ``encode_get(chunk)`` / ``decode_get(message)``: the daemon's Get serializer (the data
  straight from the leased arena slot) and the client's deserializer;
- ``encode_put(chunk)`` / ``decode_put(message)``: the client's Put serializer and the
  daemon's deserializer.

Decoding skips unknown fields, as protobuf does; a truncated or malformed message raises
``ValueError`` naming where.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.wire.blocks import BlockSpec

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GetChunk:
    """One ``kvstore.v1.GetChunk``: ``data`` is a piece of block ``index``'s payload."""

    index: int
    data: bytes | memoryview
    last: bool = False
    tier: str = ""  # first chunk of a block
    checksum: int = 0  # first chunk of a block: xxh3-64 of its payload


@dataclass(frozen=True, slots=True)
class PutChunk:
    """One ``kvstore.v1.PutChunk``: ``block`` starts a block (None: the data goes on with
    the one before)."""

    data: bytes | memoryview
    namespace: bytes = b""  # first chunk of the stream
    block: BlockSpec | None = None
    checksum: int = 0  # optional, with ``block``: the payload's xxh3-64


# -- encoding --------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(field: int, value: bytes) -> bytes:
    return _varint(field << 3 | _LENGTH) + _varint(len(value)) + value if value else b""


def _block_spec(spec: BlockSpec) -> bytes:
    tokens = b"\x18" + _varint(spec.num_tokens) if spec.num_tokens else b""
    return _length_delimited(1, spec.key) + _length_delimited(2, spec.parent) + tokens


def encode_get(chunk: GetChunk) -> bytes:
    """The serialized ``GetChunk``; ``chunk.data`` is copied once, into it."""
    data = memoryview(chunk.data)
    head = b"\x08" + _varint(chunk.index) if chunk.index else b""
    if data.nbytes:
        head += b"\x12" + _varint(data.nbytes)
    tail = b"\x18\x01" if chunk.last else b""
    tail += _length_delimited(4, chunk.tier.encode())
    if chunk.checksum:
        tail += b"\x29" + _U64.pack(chunk.checksum)
    return b"".join((head, data, tail))


def encode_put(chunk: PutChunk) -> bytes:
    """The serialized ``PutChunk``; ``chunk.data`` is copied once, into it."""
    data = memoryview(chunk.data)
    head = _length_delimited(1, chunk.namespace)
    if chunk.block is not None:  # a present sub-message is written even when empty
        spec = _block_spec(chunk.block)
        head += b"\x12" + _varint(len(spec)) + spec
    if data.nbytes:
        head += b"\x1a" + _varint(data.nbytes)
    tail = b"\x21" + _U64.pack(chunk.checksum) if chunk.checksum else b""
    return b"".join((head, data, tail))


# -- decoding --------------------------------------------------------------------------------


def _fields(view: memoryview, what: str) -> list[tuple[int, int, int | memoryview]]:
    """``(field, wire type, value)`` of each field: ints for varints and fixed widths,
    views for length-delimited values."""
    found: list[tuple[int, int, int | memoryview]] = []
    at, end = 0, len(view)
    while at < end:
        tag, at = _read_varint(view, at, what)
        field, kind = tag >> 3, tag & 7
        value: int | memoryview
        if kind == _VARINT:
            value, at = _read_varint(view, at, what)
        elif kind == _LENGTH:
            length, at = _read_varint(view, at, what)
            if at + length > end:
                raise ValueError(f"{what} field {field} runs past the message at byte {at}")
            value, at = view[at : at + length], at + length
        elif kind in (_FIXED64, _FIXED32):
            width = 8 if kind == _FIXED64 else 4
            if at + width > end:
                raise ValueError(f"{what} field {field} runs past the message at byte {at}")
            value, at = int.from_bytes(view[at : at + width], "little"), at + width
        else:
            raise ValueError(f"{what} has wire type {kind} at byte {at}")
        found.append((field, kind, value))
    return found


def _read_varint(view: memoryview, at: int, what: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(view) or shift > 63:
            raise ValueError(f"{what} has a truncated or overlong varint at byte {at}")
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _number(kind: int, value: int | memoryview, want: int, what: str) -> int:
    if kind != want or not isinstance(value, int):
        raise ValueError(f"{what} has wire type {kind}, not {want}")
    return value


def _view(kind: int, value: int | memoryview, what: str) -> memoryview:
    if kind != _LENGTH or not isinstance(value, memoryview):
        raise ValueError(f"{what} has wire type {kind}, not {_LENGTH}")
    return value


def decode_get(message: bytes) -> GetChunk:
    """The ``GetChunk`` in ``message``; its ``data`` is a view of ``message`` (no copy)."""
    view = memoryview(message)
    index, data, last, tier, checksum = 0, view[:0], False, "", 0
    for field, kind, value in _fields(view, "GetChunk"):
        if field == 1:
            index = _number(kind, value, _VARINT, "GetChunk field 1") & 0xFFFFFFFF
        elif field == 2:
            data = _view(kind, value, "GetChunk field 2")
        elif field == 3:
            last = _number(kind, value, _VARINT, "GetChunk field 3") != 0
        elif field == 4:
            tier = bytes(_view(kind, value, "GetChunk field 4")).decode()
        elif field == 5:
            checksum = _number(kind, value, _FIXED64, "GetChunk field 5")
    return GetChunk(index, data, last, tier, checksum)


def decode_put(message: bytes) -> PutChunk:
    """The ``PutChunk`` in ``message``; its ``data`` is a view of ``message`` (no copy)."""
    view = memoryview(message)
    data, namespace, block, checksum = view[:0], b"", None, 0
    for field, kind, value in _fields(view, "PutChunk"):
        if field == 1:
            namespace = bytes(_view(kind, value, "PutChunk field 1"))
        elif field == 2:  # a repeated sub-message field merges, as protobuf's parser does
            block = _merge_spec(block, _view(kind, value, "PutChunk field 2"))
        elif field == 3:
            data = _view(kind, value, "PutChunk field 3")
        elif field == 4:
            checksum = _number(kind, value, _FIXED64, "PutChunk field 4")
    return PutChunk(data, namespace, block, checksum)


def _merge_spec(spec: BlockSpec | None, view: memoryview) -> BlockSpec:
    key, parent, tokens = (
        (b"", b"", 0) if spec is None else (spec.key, spec.parent, spec.num_tokens)
    )
    for field, kind, value in _fields(view, "BlockSpec"):
        if field == 1:
            key = bytes(_view(kind, value, "BlockSpec field 1"))
        elif field == 2:
            parent = bytes(_view(kind, value, "BlockSpec field 2"))
        elif field == 3:
            tokens = _number(kind, value, _VARINT, "BlockSpec field 3") & 0xFFFFFFFF
    return BlockSpec(key, parent, tokens)
