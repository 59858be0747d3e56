"""Block layout and stored form: round trips, per-layer access, compression, corruption."""

from __future__ import annotations

import hashlib
import struct
import zlib

import pytest
import torch
import xxhash

from kvstore.wire.blocks import (
    HEADER_PREFIX_BYTES,
    ROOT_KEY,
    BadMagicError,
    BlockFormatError,
    BlockLayout,
    ChecksumMismatchError,
    Codec,
    HeaderCorruptError,
    TrailingBytesError,
    TruncatedBlockError,
    UnsupportedVersionError,
    decode_block,
    decode_header,
    decode_layer,
    encode_block,
    header_length,
    payload_checksum,
)

KEY = hashlib.sha256(b"key").digest()
NAMESPACE = hashlib.sha256(b"namespace").digest()
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def make_layout(dtype: str = "float16") -> BlockLayout:
    return BlockLayout(num_layers=3, num_kv_heads=2, block_tokens=16, head_dim=32, dtype=dtype)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().view(torch.uint8).reshape(-1)
    out = bytearray(flat.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(flat)
    return bytes(out)


def kv_like(layout: BlockLayout, seed: int = 0) -> torch.Tensor:
    """KV with per-channel structure: a channel mean per head plus small token noise."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, layout.num_kv_heads, layout.block_tokens, layout.head_dim)
    channel = torch.randn(*shape[:3], 1, shape[4], generator=gen)
    kv = channel + 0.05 * torch.randn(*shape, generator=gen)
    return kv.to(TORCH_DTYPES[layout.dtype])  # [layers, k|v, kv_heads, tokens, head_dim]


def encode(
    layout: BlockLayout, payload: bytes | memoryview, codec: Codec = Codec.RAW, **kw: int
) -> bytes:
    num_tokens = kw.get("num_tokens", layout.block_tokens)
    return encode_block(
        key=KEY,
        parent=ROOT_KEY,
        namespace=NAMESPACE,
        num_tokens=num_tokens,
        layout=layout,
        payload=payload,
        codec=codec,
    )


def flipped(blob: bytes, offset: int) -> bytes:
    damaged = bytearray(blob)
    damaged[offset] ^= 0xFF
    return bytes(damaged)


def resealed(blob: bytes, offset: int, value: bytes) -> bytes:
    """The blob with header bytes replaced and the header crc recomputed to match."""
    size = header_length(blob)
    damaged = bytearray(blob)
    damaged[offset : offset + len(value)] = value
    struct.pack_into("<I", damaged, size - 4, zlib.crc32(damaged[: size - 4]))
    return bytes(damaged)


def test_layout_sizes_and_layer_ranges_match_the_tensor_layout() -> None:
    layout = make_layout()
    kv = kv_like(layout)
    raw = tensor_bytes(kv)

    assert layout.itemsize == 2
    assert layout.layer_bytes == 2 * 2 * 16 * 32 * 2
    assert layout.payload_bytes == len(raw) == 3 * layout.layer_bytes
    for layer in range(3):
        offset, length = layout.layer_range(layer)
        assert raw[offset : offset + length] == tensor_bytes(kv[layer])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("codec", list(Codec))
def test_round_trip_is_bit_exact(dtype: str, codec: Codec) -> None:
    layout = make_layout(dtype)
    raw = tensor_bytes(kv_like(layout))

    blob = encode(layout, raw, codec, num_tokens=11)
    header, payload = decode_block(blob)

    assert payload == raw
    assert header.key == KEY
    assert header.parent == ROOT_KEY
    assert header.namespace == NAMESPACE
    assert header.num_tokens == 11
    assert header.layout == layout
    assert header.codec is codec
    assert header.stored_bytes == len(blob)
    assert header.header_bytes % 64 == 0


@pytest.mark.parametrize("codec", list(Codec))
def test_each_layer_decodes_alone_from_its_stored_range(codec: Codec) -> None:
    layout = make_layout("bfloat16")
    raw = tensor_bytes(kv_like(layout, seed=3))
    blob = encode(layout, raw, codec)

    header = decode_header(blob[: header_length(blob[:HEADER_PREFIX_BYTES])])
    for layer in range(layout.num_layers):
        offset, length = header.stored_range(layer)
        raw_offset, raw_length = layout.layer_range(layer)
        decoded = decode_layer(header, memoryview(blob)[offset : offset + length], layer)
        assert decoded == raw[raw_offset : raw_offset + raw_length]


def test_payload_may_be_any_contiguous_buffer() -> None:
    layout = make_layout("float32")
    raw = tensor_bytes(kv_like(layout))
    shaped = memoryview(bytearray(raw)).cast("B", (layout.num_layers, layout.layer_bytes))

    assert encode(layout, shaped) == encode(layout, raw)
    with pytest.raises(ValueError, match="payload must be a C-contiguous buffer"):
        encode(layout, memoryview(raw + raw)[::2])


def test_shuffle_compresses_kv_like_fp16_better_than_plain_lz4() -> None:
    layout = BlockLayout(
        num_layers=2, num_kv_heads=8, block_tokens=256, head_dim=128, dtype="float16"
    )
    raw = tensor_bytes(kv_like(layout))

    raw_size = len(encode(layout, raw, Codec.RAW))
    lz4_size = len(encode(layout, raw, Codec.LZ4))
    shuffle_size = len(encode(layout, raw, Codec.LZ4_SHUFFLE))

    assert shuffle_size < 0.95 * lz4_size
    assert shuffle_size < 0.95 * raw_size


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.LZ4_SHUFFLE])
def test_truncation_anywhere_raises_truncated(codec: Codec) -> None:
    layout = make_layout()
    blob = encode(layout, tensor_bytes(kv_like(layout)), codec)
    header = decode_header(blob)
    layer1, length1 = header.stored_range(1)
    cuts = [0, 2, 5, HEADER_PREFIX_BYTES - 1, header.header_bytes - 1, header.header_bytes]
    cuts += [layer1 + length1 // 2, len(blob) - 1]

    for cut in cuts:
        with pytest.raises(TruncatedBlockError, match=r"needs \d+ bytes, found \d+"):
            decode_block(blob[:cut])
    with pytest.raises(TruncatedBlockError, match=f"block header needs {header.header_bytes}"):
        decode_header(blob[: header.header_bytes - 1])
    with pytest.raises(TruncatedBlockError, match="stored layer 1 needs"):
        decode_layer(header, blob[layer1 : layer1 + length1 - 1], 1)


def test_trailing_bytes_raise() -> None:
    layout = make_layout()
    blob = encode(layout, tensor_bytes(kv_like(layout)), Codec.LZ4)
    header = decode_header(blob)
    offset, length = header.stored_range(0)

    with pytest.raises(TrailingBytesError, match=f"stored block has {len(blob)} bytes"):
        decode_block(blob + b"\0")
    with pytest.raises(TrailingBytesError, match="stored layer 0 has"):
        decode_layer(header, blob[offset : offset + length + 1], 0)


@pytest.mark.parametrize("codec", list(Codec))
def test_a_flipped_byte_in_a_layer_names_that_layer(codec: Codec) -> None:
    layout = make_layout()
    blob = encode(layout, tensor_bytes(kv_like(layout)), codec)
    header = decode_header(blob)

    for layer in range(layout.num_layers):
        offset, length = header.stored_range(layer)
        for position in (offset, offset + length // 2, offset + length - 1):
            with pytest.raises(ChecksumMismatchError, match=f"layer {layer} checksum") as info:
                decode_block(flipped(blob, position))
            assert info.value.layer == layer
            with pytest.raises(ChecksumMismatchError):
                decode_layer(header, flipped(blob, position)[offset : offset + length], layer)


def test_a_flipped_byte_anywhere_in_the_header_raises_the_specific_error() -> None:
    layout = make_layout()
    blob = encode(layout, tensor_bytes(kv_like(layout)), Codec.LZ4)
    header = decode_header(blob)
    expected: dict[range, type[BlockFormatError]] = {
        range(0, 4): BadMagicError,
        range(4, 6): UnsupportedVersionError,
        range(6, 10): HeaderCorruptError,  # header length no longer fits the layer count
        range(110, 114): HeaderCorruptError,  # layer count no longer fits the header length
    }

    for offset in range(header.header_bytes):
        error = next((err for span, err in expected.items() if offset in span), None)
        with pytest.raises(error or ChecksumMismatchError) as info:
            decode_block(flipped(blob, offset))
        if error is None:
            assert info.value.layer is None  # type: ignore[attr-defined]


def test_wrong_magic_and_unsupported_version_say_what_they_found() -> None:
    layout = make_layout()
    blob = encode(layout, tensor_bytes(kv_like(layout)))

    with pytest.raises(BadMagicError, match=r"magic must be b'KVB1', found b'GGUF'"):
        decode_block(b"GGUF" + blob[4:])
    with pytest.raises(UnsupportedVersionError, match="version must be 2, found 1"):
        decode_block(blob[:4] + struct.pack("<H", 1) + blob[6:])  # crc32 blocks of format 1
    with pytest.raises(BadMagicError):
        header_length(b"\0" * HEADER_PREFIX_BYTES)


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [
        (126, b"\x09", "dtype code must be one of"),
        (127, b"\x07", "codec must be one of"),
        (106, struct.pack("<I", 0), "num_tokens must be an int in 1..16, got 0"),
        (114, struct.pack("<I", 0), "num_kv_heads must be an int"),
        (180, b"\x01", "header padding must be zero bytes"),
    ],
)
def test_a_resealed_header_with_bad_fields_is_corrupt(
    offset: int, value: bytes, match: str
) -> None:
    layout = make_layout()
    blob = encode(layout, tensor_bytes(kv_like(layout)))

    with pytest.raises(HeaderCorruptError, match=match):
        decode_block(resealed(blob, offset, value))


def test_lz4_bytes_that_pass_the_checksum_but_do_not_decode_raise() -> None:
    layout = make_layout()
    blob = bytearray(encode(layout, tensor_bytes(kv_like(layout)), Codec.LZ4))
    header = decode_header(blob)
    offset, length = header.stored_range(0)
    blob[offset : offset + length] = b"\xff" * length
    struct.pack_into("<Q", blob, 140, xxhash.xxh3_64_intdigest(b"\xff" * length))  # layer 0
    struct.pack_into(
        "<I", blob, header.header_bytes - 4, zlib.crc32(blob[: header.header_bytes - 4])
    )

    with pytest.raises(BlockFormatError, match=r"layer 0 must decode|lz4 data does not decode"):
        decode_block(bytes(blob))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"payload": b"\0" * 10}, "payload must be 12288 bytes, got 10"),
        ({"key": b"\1" * 31}, "key must be 32 bytes, got 31 bytes"),
        ({"parent": "root"}, "parent must be 32 bytes, got str"),
        ({"namespace": b""}, "namespace must be 32 bytes, got 0 bytes"),
        ({"num_tokens": 0}, r"num_tokens must be an int in 1\.\.16, got 0"),
        ({"num_tokens": 17}, r"num_tokens must be an int in 1\.\.16, got 17"),
    ],
)
def test_encode_rejects_bad_arguments(changes: dict[str, object], match: str) -> None:
    layout = make_layout()
    args: dict[str, object] = {
        "key": KEY,
        "parent": ROOT_KEY,
        "namespace": NAMESPACE,
        "num_tokens": 16,
        "layout": layout,
        "payload": bytes(layout.payload_bytes),
    }

    with pytest.raises(ValueError, match=match):
        encode_block(**{**args, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_layers", 0, r"num_layers must be an int in 1\.\.4096, got 0"),
        ("num_kv_heads", -1, "num_kv_heads must be an int in .*, got -1"),
        ("block_tokens", True, "block_tokens must be an int in .*, got True"),
        ("head_dim", 1.5, "head_dim must be an int in .*, got 1.5"),
        ("dtype", "int8", r"dtype must be one of \['bfloat16', 'float16', 'float32'\], got 'int8'"),
        ("head_dim", 1 << 20, "layer_bytes must be at most"),
    ],
)
def test_layout_rejects_bad_fields(field: str, value: object, match: str) -> None:
    fields: dict[str, object] = {
        "num_layers": 2,
        "num_kv_heads": 8,
        "block_tokens": 256,
        "head_dim": 128,
        "dtype": "float16",
    }

    with pytest.raises(ValueError, match=match):
        BlockLayout(**{**fields, field: value})  # type: ignore[arg-type]


def test_layer_indices_out_of_range_raise() -> None:
    layout = make_layout()
    blob = encode(layout, bytes(layout.payload_bytes))
    header = decode_header(blob)

    with pytest.raises(ValueError, match=r"layer must be an int in 0\.\.2, got 3"):
        layout.layer_range(3)
    with pytest.raises(ValueError, match="got -1"):
        header.stored_range(-1)
    with pytest.raises(ValueError, match="got 3"):
        decode_layer(header, b"", 3)


def test_a_payload_whose_layers_check_out_but_not_the_whole_is_refused() -> None:
    layout = make_layout()
    payload = tensor_bytes(kv_like(layout))
    blob = encode(layout, payload)
    assert decode_header(blob).checksum == payload_checksum(payload)
    wrong = struct.pack("<Q", payload_checksum(payload) ^ 1)  # the payload checksum field
    with pytest.raises(ChecksumMismatchError, match="payload checksum mismatch") as info:
        decode_block(resealed(blob, 128, wrong))
    assert info.value.layer == -1
