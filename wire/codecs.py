"""Per-layer codecs for stored blocks: raw, lz4, and lz4 after a byte shuffle.

``CODECS`` maps each :class:`Codec` to a (compress, decompress) pair working on one layer:
``compress(raw, itemsize) -> stored`` and ``decompress(stored, raw_bytes, itemsize) -> raw``.
The byte shuffle groups byte 0 of every element, then byte 1, ...: the exponent bytes of
fp16/bf16 KV are alike, so lz4 finds runs it would miss in the interleaved form.
Decompressing bytes that are not valid lz4 raises :class:`BlockFormatError`.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import NamedTuple

import lz4.block
import numpy as np


class BlockFormatError(ValueError):
    """Stored bytes that are not a valid block; decoding them would return wrong data."""


class Codec(IntEnum):
    """How each layer's bytes are stored."""

    RAW = 0
    LZ4 = 1
    LZ4_SHUFFLE = 2  # byte-shuffled (all byte 0s, then all byte 1s, ...) before lz4


Stored = bytes | bytearray | memoryview


def _raw_compress(raw: memoryview, itemsize: int) -> Stored:
    return raw


def _raw_decompress(stored: memoryview, raw_bytes: int, itemsize: int) -> Stored:
    return stored


def _lz4_compress(raw: memoryview | bytearray, itemsize: int = 1) -> Stored:
    return lz4.block.compress(raw, store_size=False)  # type: ignore[no-any-return]


def _lz4_decompress(stored: memoryview, raw_bytes: int, itemsize: int = 1) -> bytearray:
    try:
        out = lz4.block.decompress(stored, uncompressed_size=raw_bytes, return_bytearray=True)
    except lz4.block.LZ4BlockError as exc:
        raise BlockFormatError(f"lz4 data does not decode: {exc}") from exc
    return out  # type: ignore[no-any-return]


def _shuffle(raw: memoryview, itemsize: int) -> bytearray:
    out = bytearray(raw.nbytes)
    src = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize)  # [elements, itemsize]
    dst = np.frombuffer(out, dtype=np.uint8).reshape(itemsize, -1)  # [itemsize, elements]
    np.copyto(dst, src.T)
    return out


def _unshuffle(shuffled: bytearray, itemsize: int) -> bytearray:
    out = bytearray(len(shuffled))
    src = np.frombuffer(shuffled, dtype=np.uint8).reshape(itemsize, -1)  # [itemsize, elements]
    dst = np.frombuffer(out, dtype=np.uint8).reshape(-1, itemsize)  # [elements, itemsize]
    np.copyto(dst, src.T)
    return out


def _shuffle_compress(raw: memoryview, itemsize: int) -> Stored:
    return _lz4_compress(_shuffle(raw, itemsize))


def _shuffle_decompress(stored: memoryview, raw_bytes: int, itemsize: int) -> Stored:
    return _unshuffle(_lz4_decompress(stored, raw_bytes), itemsize)


class _CodecFns(NamedTuple):
    compress: Callable[[memoryview, int], Stored]  # (raw layer, itemsize) -> stored layer
    decompress: Callable[[memoryview, int, int], Stored]  # (stored, raw bytes, itemsize) -> raw


CODECS: dict[Codec, _CodecFns] = {
    Codec.RAW: _CodecFns(_raw_compress, _raw_decompress),
    Codec.LZ4: _CodecFns(_lz4_compress, _lz4_decompress),
    Codec.LZ4_SHUFFLE: _CodecFns(_shuffle_compress, _shuffle_decompress),
}
