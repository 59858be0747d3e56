"""SSD record files: the record format and the blocking file operations of the SSD tier.

A record file holds one blob under its key (format in :mod:`kvstore.tiers.ssd`). Everything
here blocks: the tier runs it in a worker thread, never on the event loop.

- ``encode_header`` / ``decode_header``: the 24-byte record header (+ key);
- ``lock_root(root)``: create the directory and take its lock (``kvstore.lock``, an
  ``flock`` held while the daemon runs) before anything else touches it: a second daemon
  on the same directory refuses to start instead of trimming the first one's records;
- ``recover(root, capacity)``: prepare a directory at start and scan it (headers only),
  dropping bad records and trimming the oldest beyond capacity. It never fails because of what
  the directory holds: whatever sits where a prefix folder or ``tmp/`` belongs, ``*.blk``
  entries that are not regular files and folders inside ``tmp/`` are moved into
  ``<root>/quarantine/`` (never scanned, never deleted); other entries in prefix folders are
  not ours and are left alone; records it cannot read are skipped. Symlinks are never followed;
- ``write_file`` (temp file, fsync, rename, directory fsync), ``read_file``,
  ``remove_if_same`` (never deletes a newer record that replaced a bad one).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import time
import zlib
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvstore.tiers.base import MAX_KEY_BYTES
from kvstore.tiers.locks import FileLock

logger = logging.getLogger(__name__)

MAGIC = b"KVSSD001"
_FIELDS = struct.Struct("<8sHHQ")  # magic, key length, reserved, blob length
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CRC.size  # 24
SUFFIX = ".blk"
TMP_DIR = "tmp"
QUARANTINE_DIR = "quarantine"
LOCK_FILE = "kvstore.lock"  # beside the prefix folders: recovery leaves it alone
PREFIXES = tuple(f"{prefix:02x}" for prefix in range(256))


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
    """What ``recover`` found: the index and what it deleted, trimmed and moved aside."""

    index: dict[bytes, int]
    dropped: int
    trimmed: int
    quarantined: int


@dataclass(frozen=True, slots=True)
class _Found:
    key: bytes
    size: int
    mtime_ns: int
    path: Path


def recover(root: Path, capacity: int) -> Recovery:
    """Prepares the tier's directory and rebuilds the index from its record headers.

    Nothing found inside ``root`` makes this fail: an entry where a prefix folder or ``tmp/``
    belongs (a file, a symlink, a fifo...) and a ``*.blk`` entry that is not a regular file are
    moved into ``quarantine/``; other strangers in prefix folders are left alone; a record that
    cannot be read is skipped and kept; bad records and temp files are deleted.

    Args:
        root: The tier's directory; created if missing. Symlinks inside it are never followed.
        capacity: Most record bytes to keep; the oldest records beyond it are deleted.

    Returns:
        The index (key -> record bytes) and the counts of files dropped, trimmed, quarantined.

    Raises:
        OSError: ``root`` cannot be created, is not a directory or is not readable and
            writable; the message names it.
    """
    _check_root(root)
    quarantine = _Quarantine(root)
    tmp_ok = _ensure_folder(root / TMP_DIR, quarantine)
    folders = [root / name for name in PREFIXES if _ensure_folder(root / name, quarantine)]
    _fsync_dir(root)
    dropped = _clear_tmp(root / TMP_DIR, quarantine) if tmp_ok else 0
    found, bad = _scan(folders, quarantine)
    kept = _trim(found, capacity)
    index = {record.key: record.size for record in kept}
    return Recovery(index, dropped + bad, len(found) - len(kept), quarantine.moved)


def lock_root(root: Path) -> FileLock:
    """Creates ``root`` if missing and takes its lock (``LOCK_FILE``), before anything in it
    is read: one daemon per SSD directory.

    Raises:
        InUseError: Another daemon holds it.
        OSError: As :func:`recover`.
    """
    _check_root(root)
    lock = FileLock(root / LOCK_FILE, f"ssd directory {root}")
    lock.acquire()
    return lock


def _check_root(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:  # exist_ok only lets an existing directory through
        raise NotADirectoryError(
            errno.ENOTDIR, "ssd: the tier directory is not a directory", str(root)
        ) from exc
    except OSError as exc:
        raise OSError(
            exc.errno, f"ssd: cannot create the tier directory: {exc.strerror}", str(root)
        ) from exc
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, "ssd: the tier directory is not readable and writable", str(root)
        )


def _ensure_folder(path: Path, quarantine: _Quarantine) -> bool:
    """Makes ``path`` a plain directory, first moving whatever else is there to quarantine;
    returns whether it is one (if not, the failure is logged and its records are unavailable)."""
    try:
        mode: int | None = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        logger.error("ssd: cannot inspect %s, not using it: %s", path, exc)
        return False
    if mode is not None and stat.S_ISDIR(mode):
        return True
    if mode is not None and not quarantine.move(path, _kind(mode)):
        return False
    try:
        os.mkdir(path)
    except OSError as exc:
        logger.error("ssd: cannot create directory %s, not using it: %s", path, exc)
        return False
    return True


def _clear_tmp(tmp: Path, quarantine: _Quarantine) -> int:
    """Deletes what a crash left in ``tmp/`` (a subdirectory goes to quarantine); returns how
    many files it deleted."""
    dropped = 0
    for entry in _list(tmp):
        path = Path(entry.path)
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError as exc:
            logger.warning("ssd: cannot inspect %s, leaving it: %s", path, exc)
            continue
        if is_dir:
            quarantine.move(path, "directory")
        elif _drop(path):
            dropped += 1
    return dropped


def _scan(folders: list[Path], quarantine: _Quarantine) -> tuple[list[_Found], int]:
    """Returns the good records in the prefix ``folders`` and how many bad ones it deleted."""
    found: list[_Found] = []
    dropped = 0
    for folder in folders:
        for path in _record_files(folder, quarantine):
            try:
                record = _check_file(path)
            except OSError as exc:
                logger.warning("ssd: skipping %s, cannot read it (left in place): %s", path, exc)
                continue
            if record is not None:
                found.append(record)
            elif _drop(path):
                dropped += 1
    return found, dropped


def _record_files(folder: Path, quarantine: _Quarantine) -> list[Path]:
    """Returns the regular ``*.blk`` files in a prefix folder. A ``*.blk`` entry that is not a
    regular file goes to quarantine; any other entry is not ours and is left alone."""
    paths: list[Path] = []
    for entry in _list(folder):
        path = Path(entry.path)
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
        except OSError as exc:
            logger.warning("ssd: cannot inspect %s, leaving it: %s", path, exc)
            continue
        if not entry.name.endswith(SUFFIX):
            logger.warning("ssd: leaving %s alone: a %s that is not a record", path, _kind(mode))
        elif stat.S_ISREG(mode):
            paths.append(path)
        else:
            quarantine.move(path, _kind(mode))
    return paths


def _list(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError as exc:
        logger.warning("ssd: cannot list %s, skipping what it holds: %s", folder, exc)
        return []


def _check_file(path: Path) -> _Found | None:
    """Returns the record in ``path``, or ``None`` (logged) when the file is not a whole record
    under its own name.

    Raises:
        OSError: The file cannot be opened or read (it may be fine: it is not deleted).
    """
    with open(path, "rb", opener=_open_no_follow) as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):  # swapped since the folder was listed
            raise OSError(f"it is now a {_kind(info.st_mode)}")
        try:
            key, blob_len = decode_header(file.read(HEADER_BYTES + MAX_KEY_BYTES))
        except CorruptRecordError as exc:
            logger.warning("ssd: dropping %s: %s", path, exc)
            return None
    size = record_overhead(len(key)) + blob_len
    if info.st_size != size:
        logger.warning("ssd: dropping %s: %d bytes, header says %d", path, info.st_size, size)
        return None
    if path.name != f"{key.hex()}{SUFFIX}" or path.parent.name != key.hex()[:2]:
        logger.warning("ssd: dropping %s: it holds key %s", path, key.hex())
        return None
    return _Found(key, size, info.st_mtime_ns, path)


def _open_no_follow(path: str, flags: int) -> int:
    # No symlinks out of the directory; O_NONBLOCK: a fifo swapped in cannot hang the open.
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _drop(path: Path) -> bool:
    """Deletes a bad record or temp file; returns ``False`` (logged) when it cannot."""
    try:
        remove_quietly(path)
    except OSError as exc:
        logger.warning("ssd: cannot delete %s: %s", path, exc)
        return False
    return True


def _trim(found: list[_Found], capacity: int) -> list[_Found]:
    """Deletes the oldest records until the rest fit in ``capacity``; returns the rest."""
    found.sort(key=lambda record: record.mtime_ns)
    excess = sum(record.size for record in found) - capacity
    cut = 0
    while excess > 0:
        _drop(found[cut].path)
        excess -= found[cut].size
        cut += 1
    if cut:
        logger.warning("ssd: over capacity at start, deleted the %d oldest records", cut)
    return found[cut:]


class _Quarantine:
    """Moves entries that are in the tier's way into ``<root>/quarantine/``, never deleting
    them; the folder is created on first use and is never scanned for records."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = root / QUARANTINE_DIR
        self.moved = 0
        self._ready = False

    def move(self, path: Path, kind: str) -> bool:
        """Moves ``path`` (a ``kind``, for the log) into quarantine under a name of its own.

        Returns:
            Whether it moved; a failure is logged and leaves ``path`` where it was.
        """
        try:
            self._prepare()
            target = _unused_name(self.folder, "-".join(path.relative_to(self.root).parts))
            os.rename(path, target)
        except OSError as exc:
            logger.error("ssd: %s is a %s in the way, cannot quarantine it: %s", path, kind, exc)
            return False
        self.moved += 1
        logger.warning("ssd: %s is a %s in the way, moved it to %s", path, kind, target)
        return True

    def _prepare(self) -> None:
        if self._ready:
            return
        try:
            mode: int | None = os.lstat(self.folder).st_mode
        except FileNotFoundError:
            mode = None
        if mode is None:
            os.mkdir(self.folder)
        elif not stat.S_ISDIR(mode):  # a stranger holds the name: it goes in there too
            aside = _unused_name(self.root, QUARANTINE_DIR)
            os.rename(self.folder, aside)
            os.mkdir(self.folder)
            target = _unused_name(self.folder, QUARANTINE_DIR)
            os.rename(aside, target)
            self.moved += 1
            logger.warning(
                "ssd: %s is a %s in the way, moved it to %s", self.folder, _kind(mode), target
            )
        self._ready = True


def _unused_name(folder: Path, name: str) -> Path:
    """Returns ``folder/<name>.<time ns>``, with a counter appended if that is taken."""
    base = f"{name}.{time.time_ns()}"
    candidate, count = folder / base, 0
    while os.path.lexists(candidate):
        count += 1
        candidate = folder / f"{base}.{count}"
    return candidate


_KINDS: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISLNK, "symlink"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISREG, "regular file"),
    (stat.S_ISFIFO, "fifo"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISCHR, "character device"),
)


def _kind(mode: int) -> str:
    return next((name for is_kind, name in _KINDS if is_kind(mode)), "special file")


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
