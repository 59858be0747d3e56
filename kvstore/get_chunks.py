"""The Get stream's ``GetChunk`` messages, encoded and decoded without copying their data.

A streamed get is mostly bytes: each chunk is ``chunk_bytes`` (1 MiB by default) of one
block. Through protobuf's Python messages a chunk's data is copied four times (into
``bytes`` from the arena, into the message, into the serialized message; and on the client
out of the received message), against one for a raw bytes stream. These functions write
and read the same wire format (``kvstore.v1.GetChunk``: field numbers, types, proto3
defaults left out, fields in number order, so ``encode`` gives the bytes protobuf would)
with one copy each way:

- ``encode(chunk)`` -> the serialized message: the data copied once, straight from the
  arena view the daemon leased, into the message (the daemon's Get serializer);
- ``decode(message)`` -> a :class:`GetChunk` whose ``data`` is a view into ``message``, no
  copy (the client's Get deserializer). Unknown fields are skipped, as protobuf does; a
  truncated or malformed message raises ``ValueError`` naming the offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_INDEX, _DATA, _LAST, _TIER, _CHECKSUM = 0x08, 0x12, 0x18, 0x22, 0x29  # field << 3 | type
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


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(chunk: GetChunk) -> bytes:
    """The serialized message; ``chunk.data`` is copied once, into it."""
    data = memoryview(chunk.data)
    head = bytearray()
    if chunk.index:
        head += b"\x08" + _varint(chunk.index)
    if data.nbytes:
        head += b"\x12" + _varint(data.nbytes)
    tail = bytearray()
    if chunk.last:
        tail += b"\x18\x01"
    if chunk.tier:
        tier = chunk.tier.encode()
        tail += b"\x22" + _varint(len(tier)) + tier
    if chunk.checksum:
        tail += b"\x29" + _U64.pack(chunk.checksum)
    return b"".join((head, data, tail))


def decode(message: bytes) -> GetChunk:
    """The chunk in ``message``; its ``data`` is a view of ``message`` (no copy)."""
    view = memoryview(message)
    index, data, last, tier, checksum = 0, view[:0], False, "", 0
    at, end = 0, len(view)
    while at < end:
        tag, at = _read_varint(view, at)
        kind = tag & 7
        if kind == _VARINT:
            value, at = _read_varint(view, at)
            if tag == _INDEX:
                index = value & 0xFFFFFFFF
            elif tag == _LAST:
                last = value != 0
        elif kind == _LENGTH:
            length, at = _read_varint(view, at)
            if at + length > end:
                raise ValueError(f"GetChunk field {tag >> 3} runs past the message at {at}")
            if tag == _DATA:
                data = view[at : at + length]
            elif tag == _TIER:
                tier = bytes(view[at : at + length]).decode()
            at += length
        elif kind in (_FIXED64, _FIXED32):
            width = 8 if kind == _FIXED64 else 4
            if at + width > end:
                raise ValueError(f"GetChunk field {tag >> 3} runs past the message at {at}")
            if tag == _CHECKSUM:
                (checksum,) = _U64.unpack_from(view, at)
            at += width
        else:
            raise ValueError(f"GetChunk has wire type {kind} at byte {at}")
    return GetChunk(index, data, last, tier, checksum)


def _read_varint(view: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(view) or shift > 63:
            raise ValueError(f"GetChunk has a truncated or overlong varint at byte {at}")
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
