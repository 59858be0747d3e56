"""SSD record files: the record format and the blocking file operations of the SSD tier.

A record file holds one blob under its key (format in :mod:`kvstore.tiers.ssd`). Everything
here blocks: the tier runs it in a worker thread, never on the event loop.

- ``encode_header`` / ``decode_header``: the 24-byte record header (+ key);
- ``recover(root, capacity)``: scan a directory at start (headers only), dropping bad records
  and trimming the oldest beyond capacity;
- ``write_file`` (temp file, fsync, rename, directory fsync), ``read_file``,
  ``remove_if_same`` (never deletes a newer record that replaced a bad one).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvstore.tiers.base import MAX_KEY_BYTES

logger = logging.getLogger(__name__)

MAGIC = b"KVSSD001"
_FIELDS = struct.Struct("<8sHHQ")  # magic, key length, reserved, blob length
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CRC.size  # 24
SUFFIX = ".blk"
TMP_DIR = "tmp"


class CorruptRecordError(Exception):
    """A record whose header does not describe the file it sits in."""


def record_overhead(key_len: int) -> int:
    """Returns the bytes a record spends on top of its blob: the header and the key."""
    return HEADER_BYTES + key_len


def encode_header(key: bytes, blob_len: int) -> bytes:
    """Returns the header and key bytes that start the record of ``key``."""
    fields = _FIELDS.pack(MAGIC, len(key), 0, blob_len)
    return fields + _CRC.pack(zlib.crc32(key, zlib.crc32(fields))) + key


def decode_header(head: bytes) -> tuple[bytes, int]:
    """Returns ``(key, blob_len)`` from the first bytes of a record.

    Raises:
        CorruptRecordError: short read, bad magic, key length or crc.
    """
    if len(head) < HEADER_BYTES:
        raise CorruptRecordError(f"header is {len(head)} bytes, want {HEADER_BYTES}")
    magic, key_len, _, blob_len = _FIELDS.unpack_from(head)
    if magic != MAGIC:
        raise CorruptRecordError(f"bad magic {magic!r}")
    if not 0 < key_len <= MAX_KEY_BYTES or len(head) < HEADER_BYTES + key_len:
        raise CorruptRecordError(f"bad key length {key_len}")
    key = head[HEADER_BYTES : HEADER_BYTES + key_len]
    (crc,) = _CRC.unpack_from(head, _FIELDS.size)
    if crc != zlib.crc32(key, zlib.crc32(head[: _FIELDS.size])):
        raise CorruptRecordError("header crc mismatch")
    return key, blob_len


@dataclass(frozen=True, slots=True)
class Recovery:
    index: dict[bytes, int]
    dropped: int
    trimmed: int


@dataclass(frozen=True, slots=True)
class _Found:
    key: bytes
    size: int
    mtime_ns: int
    path: Path


def recover(root: Path, capacity: int) -> Recovery:
    tmp = root / TMP_DIR
    tmp.mkdir(parents=True, exist_ok=True)
    for prefix in range(256):
        (root / f"{prefix:02x}").mkdir(exist_ok=True)
    _fsync_dir(root)
    dropped = 0
    for leftover in tmp.iterdir():
        remove_quietly(leftover)
        dropped += 1
    found: list[_Found] = []
    for path in _record_files(root):
        record = _check_file(path)
        if record is None:
            remove_quietly(path)
            dropped += 1
        else:
            found.append(record)
    kept = _trim(found, capacity)
    return Recovery({r.key: r.size for r in kept}, dropped, len(found) - len(kept))


def _record_files(root: Path) -> Iterable[Path]:
    # Only the 256 prefix folders: other entries (lost+found on a mount point) are not ours.
    for prefix in range(256):
        for path in (root / f"{prefix:02x}").iterdir():
            if path.name.endswith(SUFFIX):
                yield path


def _check_file(path: Path) -> _Found | None:
    try:
        with path.open("rb") as file:
            key, blob_len = decode_header(file.read(HEADER_BYTES + MAX_KEY_BYTES))
            stat = os.fstat(file.fileno())
    except (OSError, CorruptRecordError) as exc:
        logger.warning("ssd: dropping %s: %s", path, exc)
        return None
    size = record_overhead(len(key)) + blob_len
    if stat.st_size != size:
        logger.warning("ssd: dropping %s: %d bytes, header says %d", path, stat.st_size, size)
        return None
    if path.name != f"{key.hex()}{SUFFIX}" or path.parent.name != key.hex()[:2]:
        logger.warning("ssd: dropping %s: it holds key %s", path, key.hex())
        return None
    return _Found(key, size, stat.st_mtime_ns, path)


def _trim(found: list[_Found], capacity: int) -> list[_Found]:
    """Deletes the oldest records until the rest fit in ``capacity``; returns the rest."""
    found.sort(key=lambda record: record.mtime_ns)
    excess = sum(record.size for record in found) - capacity
    cut = 0
    while excess > 0:
        remove_quietly(found[cut].path)
        excess -= found[cut].size
        cut += 1
    if cut:
        logger.warning("ssd: over capacity at start, deleted the %d oldest records", cut)
    return found[cut:]


def write_file(tmp: Path, path: Path, header: bytes, view: memoryview, fsync: bool) -> None:
    """Writes the record to ``tmp``, then moves it to ``path``; a failed write leaves neither
    a temp file nor a changed ``path``."""
    try:
        with tmp.open("wb") as file:
            file.write(header)
            file.write(view)
            file.flush()
            if fsync:
                os.fsync(file.fileno())
        _install(tmp, path, fsync)
    except BaseException:
        remove_quietly(tmp)
        raise


@dataclass(frozen=True, slots=True)
class Corrupt:
    """A record file that does not check out (``inode`` None: the file is missing)."""

    inode: int | None
    reason: str


def _read_record(file: BinaryIO, key: bytes, offset: int, length: int | None) -> bytes:
    start = record_overhead(len(key))
    stored_key, blob_len = decode_header(file.read(start))
    if stored_key != key:
        raise CorruptRecordError(f"record holds key {stored_key.hex()}")
    offset = min(offset, blob_len)
    count = blob_len - offset if length is None else min(length, blob_len - offset)
    if count == 0:
        return b""
    if offset:
        file.seek(start + offset)
    data = file.read(count)
    if len(data) != count:
        raise CorruptRecordError(f"record truncated: read {len(data)} of {count} bytes")
    return data


def read_file(path: Path, key: bytes, offset: int, length: int | None) -> bytes | Corrupt:
    with path.open("rb") as file:
        try:
            return _read_record(file, key, offset, length)
        except CorruptRecordError as exc:
            return Corrupt(os.fstat(file.fileno()).st_ino, str(exc))


def _install(tmp: Path, path: Path, fsync: bool) -> None:
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_if_same(path: Path, inode: int | None) -> bool:
    """Removes ``path`` if it is still the file ``inode``; ``True`` when that file is gone."""
    try:
        if os.stat(path).st_ino != inode:
            return False  # a newer record took its place (or it was missing and came back)
        os.remove(path)
    except FileNotFoundError:
        pass
    return True


def remove_quietly(path: Path) -> None:
    with suppress(FileNotFoundError):
        os.remove(path)
