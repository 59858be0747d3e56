"""Block layout and stored form: the bytes of one KV block as tiers keep them.

A block holds ``block_tokens`` tokens of KV for every layer of one model, layer-major, so the
KV of one layer is one contiguous byte range of the raw payload (``BlockLayout.layer_range``).
The stored form is a header followed by the stored layers back to back; each layer is
compressed and checksummed on its own, so a reader can fetch, verify and decode one layer
without touching the others.

Primitives, in the order a reader uses them:

- ``encode_block(key=..., parent=..., namespace=..., num_tokens=..., layout=..., payload=...)``
  -> stored bytes (header + layers).
- ``header_length(first HEADER_PREFIX_BYTES bytes)`` -> how many bytes the header takes.
- ``decode_header(header bytes)`` -> ``BlockHeader`` (header checksum verified).
- ``BlockHeader.stored_range(layer)`` -> (offset, length) of that layer in the stored bytes;
  ``decode_layer(header, those bytes, layer)`` -> raw KV of that layer.
- ``decode_block(stored bytes)`` -> (``BlockHeader``, raw payload), every layer and the
  whole payload verified.
- ``BlockSpec(key, parent, num_tokens)``: a block a client writes (``Spec``: anything with
  those three fields, a wire message included).
- ``payload_checksum(raw payload)`` -> the block's xxh3-64, computed once when a block is
  committed; it travels with the block through every tier (the index keeps it for the host
  tier, the header for the others) and is checked whenever the block moves.

Header (little-endian; ``header_bytes`` is a multiple of 64 so RAW layers stay aligned)::

    offset size field
    0      4    magic b"KVB1"
    4      2    format version (u16, FORMAT_VERSION)
    6      4    header length in bytes (u32), padding and trailing crc included
    10     32   key
    42     32   parent key (ROOT_KEY for block 0)
    74     32   namespace digest
    106    4    num_tokens (u32, 1..block_tokens)
    110    16   num_layers, num_kv_heads, block_tokens, head_dim (u32 each)
    126    1    dtype code (1 float16, 2 bfloat16, 3 float32)
    127    1    codec id (Codec)
    128    8    xxh3-64 of the raw payload (u64)
    136    12*L per layer: stored length (u32), xxh3-64 of the stored bytes (u64)
    ...         zero padding
    end-4  4    crc32 of every header byte before it

Version 1 (crc32 per layer, no payload checksum) is not read: such blocks are dropped as
``UnsupportedVersionError`` and recomputed by the engines that need them.

A decoder never returns wrong bytes: a short buffer, a wrong magic or version, a checksum
mismatch or an inconsistent header raise a ``BlockFormatError`` subclass that says what was
expected and what was found.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import xxhash

from kvstore.wire.codecs import CODECS, Stored
from kvstore.wire.codecs import BlockFormatError as BlockFormatError
from kvstore.wire.codecs import Codec as Codec

if TYPE_CHECKING:
    from typing_extensions import Buffer

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
KEY_BYTES = 32
ROOT_KEY: bytes = hashlib.sha256(b"kvstore/block-key-root/v1").digest()
MAGIC = b"KVB1"
FORMAT_VERSION = 2
MAX_LAYERS = 4096
MAX_LAYER_BYTES = 1 << 30

_DTYPE_CODES: dict[str, int] = {"float16": 1, "bfloat16": 2, "float32": 3}
_DTYPE_NAMES: dict[int, str] = {code: name for name, code in _DTYPE_CODES.items()}
_FIXED = struct.Struct("<4sHI32s32s32sIIIIIBBQ")
_VERSION = struct.Struct("<H")
_U32 = struct.Struct("<I")
_LAYER_ENTRY_BYTES = 12  # u32 stored length, u64 xxh3
_HEADER_ALIGN = 64
HEADER_PREFIX_BYTES: int = _FIXED.size


def payload_checksum(payload: Buffer) -> int:
    """The xxh3-64 of a block's raw payload (runs near memcpy speed, without the GIL)."""
    return xxhash.xxh3_64_intdigest(payload)


class BadMagicError(BlockFormatError):
    """The bytes do not start with the block magic."""


class UnsupportedVersionError(BlockFormatError):
    """The block was written in a format version this code does not read."""


class TruncatedBlockError(BlockFormatError):
    """Fewer bytes than the header (or the header's layer table) says the block has."""


class TrailingBytesError(BlockFormatError):
    """More bytes than the header says the block (or layer) has."""


class HeaderCorruptError(BlockFormatError):
    """A header whose fields contradict each other or name unknown values."""


class ChecksumMismatchError(BlockFormatError):
    """Bytes whose checksum differs from the one recorded for them.

    Attributes:
        layer: The layer whose stored bytes are damaged, None for the header itself, or -1
            for the whole decoded payload.
        expected: The checksum recorded in the block.
        found: The checksum of the bytes as read.
    """

    def __init__(self, layer: int | None, expected: int, found: int) -> None:
        what = {None: "header", -1: "payload"}.get(layer, f"layer {layer}")
        super().__init__(f"{what} checksum mismatch: expected {expected:#x}, found {found:#x}")
        self.layer = layer
        self.expected = expected
        self.found = found


def _check_count(name: str, value: int, limit: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
        raise ValueError(f"{name} must be an int in 1..{limit}, got {value!r}")


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Shape of the raw KV payload of one block.

    Raw payload, C order: ``[num_layers, 2 (k|v), block_tokens, num_kv_heads, head_dim]``
    elements of ``dtype`` (``shape``); layer i is bytes ``layer_range(i)``. Tokens outside
    heads, as the engines' paged caches lay them out, so that the tokens of one engine page
    are one contiguous range of a layer's K (and of its V).
    """

    num_layers: int
    num_kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        _check_count("num_layers", self.num_layers, MAX_LAYERS)
        for name in ("num_kv_heads", "block_tokens", "head_dim"):
            _check_count(name, getattr(self, name), MAX_LAYER_BYTES)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.layer_bytes > MAX_LAYER_BYTES:
            raise ValueError(
                f"layer_bytes must be at most {MAX_LAYER_BYTES}, got {self.layer_bytes}"
            )

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, block_tokens, num_kv_heads, head_dim)``: the payload's C order."""
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def layer_bytes(self) -> int:
        """Bytes of K then V of one layer."""
        return 2 * self.num_kv_heads * self.block_tokens * self.head_dim * self.itemsize

    @property
    def payload_bytes(self) -> int:
        """Bytes of the raw payload of one block, all layers."""
        return self.num_layers * self.layer_bytes

    def layer_range(self, layer: int) -> tuple[int, int]:
        """Where one layer lies in the raw payload.

        Args:
            layer: Layer index, 0-based.

        Returns:
            (offset, length) in bytes.

        Raises:
            ValueError: The layer index is outside 0..num_layers-1.
        """
        _check_layer(layer, self.num_layers)
        return layer * self.layer_bytes, self.layer_bytes


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """A block a client writes: its key, its parent's key and how many tokens it holds."""

    key: bytes
    parent: bytes
    num_tokens: int


class Spec(Protocol):
    """What a block's spec is read for: a :class:`BlockSpec`, or the wire's message with the
    same three fields (a 512-block Reserve does not build 512 objects to read them once)."""

    @property
    def key(self) -> bytes: ...

    @property
    def parent(self) -> bytes: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The decoded header of a stored block."""

    key: bytes
    parent: bytes
    namespace: bytes
    num_tokens: int
    layout: BlockLayout
    codec: Codec
    layer_lengths: tuple[int, ...]
    layer_checksums: tuple[int, ...]  # xxh3-64 of each stored layer
    checksum: int = 0  # xxh3-64 of the raw payload

    def __post_init__(self) -> None:
        num_layers = self.layout.num_layers
        if len(self.layer_lengths) != num_layers or len(self.layer_checksums) != num_layers:
            raise ValueError(
                f"layer_lengths and layer_checksums need {num_layers} entries, got "
                f"{len(self.layer_lengths)} and {len(self.layer_checksums)}"
            )

    @property
    def header_bytes(self) -> int:
        """Bytes of the encoded header, padding and crc included."""
        return _header_size(self.layout.num_layers)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the whole stored block: header plus all stored layers."""
        return self.header_bytes + sum(self.layer_lengths)

    def stored_range(self, layer: int) -> tuple[int, int]:
        """Where one stored (possibly compressed) layer lies in the encoded block.

        Args:
            layer: Layer index, 0-based.

        Returns:
            (offset, length) in bytes from the start of the block.

        Raises:
            ValueError: The layer index is outside 0..num_layers-1.
        """
        _check_layer(layer, self.layout.num_layers)
        return self.header_bytes + sum(self.layer_lengths[:layer]), self.layer_lengths[layer]


def _check_layer(layer: int, num_layers: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an int in 0..{num_layers - 1}, got {layer!r}")


def _header_size(num_layers: int) -> int:
    unpadded = _FIXED.size + _LAYER_ENTRY_BYTES * num_layers + _U32.size
    return -(-unpadded // _HEADER_ALIGN) * _HEADER_ALIGN


def _byte_view(buf: Buffer, what: str) -> memoryview:
    try:
        return memoryview(buf).cast("B")
    except TypeError as exc:
        raise ValueError(f"{what} must be a C-contiguous buffer: {exc}") from exc


# --- encode -------------------------------------------------------------------------------


def _check_key(name: str, value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        found = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise ValueError(f"{name} must be {KEY_BYTES} bytes, got {found}")


def encode_block(
    *,
    key: bytes,
    parent: bytes,
    namespace: bytes,
    num_tokens: int,
    layout: BlockLayout,
    payload: Buffer,
    codec: Codec = Codec.RAW,
    checksum: int | None = None,
) -> bytes:
    """Build the stored form of one block.

    Args:
        key: The block's key (32 bytes).
        parent: The previous block's key, ``ROOT_KEY`` for block 0 (32 bytes).
        namespace: The namespace digest the key was computed under (32 bytes).
        num_tokens: Tokens of KV the block holds, 1..layout.block_tokens.
        layout: Shape and dtype of the payload.
        payload: Raw KV, ``layout.payload_bytes`` bytes, C order
            ``[num_layers, 2, block_tokens, num_kv_heads, head_dim]``.
        codec: How each layer is stored.
        checksum: The payload's ``payload_checksum``, when the caller knows it already.

    Returns:
        Header followed by the stored layers.

    Raises:
        ValueError: A key is not 32 bytes, num_tokens is out of range, the payload size
            differs from the layout's or the codec is unknown.
    """
    for name, value in (("key", key), ("parent", parent), ("namespace", namespace)):
        _check_key(name, value)
    _check_count("num_tokens", num_tokens, layout.block_tokens)
    raw = _byte_view(payload, "payload")
    if raw.nbytes != layout.payload_bytes:
        raise ValueError(f"payload must be {layout.payload_bytes} bytes, got {raw.nbytes}")
    compress = CODECS[Codec(codec)].compress
    step = layout.layer_bytes
    layers = [
        compress(raw[start : start + step], layout.itemsize) for start in range(0, raw.nbytes, step)
    ]
    header = BlockHeader(
        key=key,
        parent=parent,
        namespace=namespace,
        num_tokens=num_tokens,
        layout=layout,
        codec=Codec(codec),
        layer_lengths=tuple(len(memoryview(layer)) for layer in layers),
        layer_checksums=tuple(xxhash.xxh3_64_intdigest(layer) for layer in layers),
        checksum=payload_checksum(raw) if checksum is None else checksum,
    )
    return b"".join([_pack_header(header), *layers])


def _pack_header(header: BlockHeader) -> bytes:
    layout = header.layout
    size = header.header_bytes
    body = bytearray(size - _U32.size)
    ids = (MAGIC, FORMAT_VERSION, size, header.key, header.parent, header.namespace)
    dims = (layout.num_layers, layout.num_kv_heads, layout.block_tokens, layout.head_dim)
    codes = (_DTYPE_CODES[layout.dtype], header.codec, header.checksum)
    _FIXED.pack_into(body, 0, *ids, header.num_tokens, *dims, *codes)
    table = [0] * (2 * layout.num_layers)
    table[0::2], table[1::2] = header.layer_lengths, header.layer_checksums
    struct.pack_into(_table_format(layout.num_layers), body, _FIXED.size, *table)
    return bytes(body) + _U32.pack(zlib.crc32(body))


def _table_format(num_layers: int) -> str:
    return "<" + "IQ" * num_layers


# --- decode -------------------------------------------------------------------------------


def _check_size(found: int, expected: int, what: str, *, exact: bool = True) -> None:
    if found < expected:
        raise TruncatedBlockError(f"{what} needs {expected} bytes, found {found}")
    if exact and found > expected:
        raise TrailingBytesError(f"{what} has {expected} bytes, found {found}")


def _check_magic_and_version(view: memoryview) -> None:
    magic = bytes(view[: len(MAGIC)])
    if len(magic) == len(MAGIC) and magic != MAGIC:
        raise BadMagicError(f"block magic must be {MAGIC!r}, found {magic!r}")
    if len(view) >= len(MAGIC) + _VERSION.size:
        (version,) = _VERSION.unpack_from(view, len(MAGIC))
        if version != FORMAT_VERSION:
            raise UnsupportedVersionError(
                f"block format version must be {FORMAT_VERSION}, found {version}"
            )


def header_length(prefix: Buffer) -> int:
    """Read the header length from the start of a stored block.

    Args:
        prefix: At least the first ``HEADER_PREFIX_BYTES`` bytes of the block.

    Returns:
        The number of bytes ``decode_header`` needs.

    Raises:
        BadMagicError, UnsupportedVersionError: Not a block this code reads.
        TruncatedBlockError: Fewer than ``HEADER_PREFIX_BYTES`` bytes.
        HeaderCorruptError: The header length contradicts the layer count.
    """
    view = _byte_view(prefix, "prefix")
    _check_magic_and_version(view)
    _check_size(len(view), HEADER_PREFIX_BYTES, "block header prefix", exact=False)
    size, num_layers = _U32.unpack_from(view, 6)[0], _U32.unpack_from(view, 110)[0]
    if not 0 < num_layers <= MAX_LAYERS:
        raise HeaderCorruptError(f"num_layers must be in 1..{MAX_LAYERS}, found {num_layers}")
    if size != _header_size(num_layers):
        raise HeaderCorruptError(
            f"header length must be {_header_size(num_layers)} for {num_layers} layers, "
            f"found {size}"
        )
    return int(size)


def decode_header(buf: Buffer) -> BlockHeader:
    """Parse and verify the header of a stored block.

    Args:
        buf: The block, or at least its first ``header_length(...)`` bytes.

    Returns:
        The header, its crc32 verified.

    Raises:
        BlockFormatError: A subclass saying what is wrong (see ``header_length``), or
            ``ChecksumMismatchError`` with ``layer=None`` when the header bytes are damaged.
    """
    view = _byte_view(buf, "buf")
    size = header_length(view)
    _check_size(len(view), size, "block header", exact=False)
    (expected,) = _U32.unpack_from(view, size - _U32.size)
    found = zlib.crc32(view[: size - _U32.size])
    if found != expected:
        raise ChecksumMismatchError(None, expected, found)
    return _parse_header(view[:size])


def _parse_header(view: memoryview) -> BlockHeader:
    fields = _FIXED.unpack_from(view)
    key, parent, namespace, num_tokens = fields[3:7]
    num_layers, num_kv_heads, block_tokens, head_dim, dtype_code, codec_id, checksum = fields[7:]
    table_end = _FIXED.size + _LAYER_ENTRY_BYTES * num_layers
    if any(view[table_end : len(view) - _U32.size]):
        raise HeaderCorruptError("header padding must be zero bytes")
    if dtype_code not in _DTYPE_NAMES:
        raise HeaderCorruptError(
            f"dtype code must be one of {sorted(_DTYPE_NAMES)}, found {dtype_code}"
        )
    if codec_id not in {int(codec) for codec in Codec}:
        raise HeaderCorruptError(
            f"codec must be one of {[int(c) for c in Codec]}, found {codec_id}"
        )
    table = struct.unpack_from(_table_format(num_layers), view, _FIXED.size)
    try:
        layout = BlockLayout(
            num_layers, num_kv_heads, block_tokens, head_dim, _DTYPE_NAMES[dtype_code]
        )
        _check_count("num_tokens", num_tokens, layout.block_tokens)
    except ValueError as exc:
        raise HeaderCorruptError(f"header fields are inconsistent: {exc}") from exc
    return BlockHeader(
        key=key,
        parent=parent,
        namespace=namespace,
        num_tokens=num_tokens,
        layout=layout,
        codec=Codec(codec_id),
        layer_lengths=table[0::2],
        layer_checksums=table[1::2],
        checksum=checksum,
    )


def _decode_layer_view(header: BlockHeader, stored: memoryview, layer: int) -> Stored:
    _check_size(len(stored), header.layer_lengths[layer], f"stored layer {layer}")
    found = xxhash.xxh3_64_intdigest(stored)
    if found != header.layer_checksums[layer]:
        raise ChecksumMismatchError(layer, header.layer_checksums[layer], found)
    layout = header.layout
    raw = CODECS[header.codec].decompress(stored, layout.layer_bytes, layout.itemsize)
    if len(raw) != layout.layer_bytes:
        raise BlockFormatError(
            f"layer {layer} must decode to {layout.layer_bytes} bytes, found {len(raw)}"
        )
    return raw


def decode_layer(header: BlockHeader, stored_layer: Buffer, layer: int) -> bytes:
    """Verify and decode one stored layer.

    Args:
        header: The block's header, from ``decode_header``.
        stored_layer: The bytes at ``header.stored_range(layer)`` of the block.
        layer: Layer index, 0-based.

    Returns:
        The layer's raw KV, ``header.layout.layer_bytes`` bytes, C order
        ``[2, block_tokens, num_kv_heads, head_dim]``.

    Raises:
        ValueError: The layer index is out of range.
        BlockFormatError: The bytes are short, long, damaged or do not decode.
    """
    _check_layer(layer, header.layout.num_layers)
    return bytes(_decode_layer_view(header, _byte_view(stored_layer, "stored_layer"), layer))


def decode_block(buf: Buffer) -> tuple[BlockHeader, bytes]:
    """Verify and decode a whole stored block.

    Args:
        buf: Exactly the stored block, as ``encode_block`` returned it.

    Returns:
        (header, raw payload of ``header.layout.payload_bytes`` bytes).

    Raises:
        BlockFormatError: A subclass saying what is wrong; no bytes are returned unless
            the header, every layer and the whole payload match their checksums.
    """
    view = _byte_view(buf, "buf")
    header = decode_header(view)
    _check_size(len(view), header.stored_bytes, "stored block")
    layers = []
    offset = header.header_bytes
    for layer, length in enumerate(header.layer_lengths):
        layers.append(_decode_layer_view(header, view[offset : offset + length], layer))
        offset += length
    payload = b"".join(layers)
    found = payload_checksum(payload)
    if found != header.checksum:
        raise ChecksumMismatchError(-1, header.checksum, found)
    return header, payload
