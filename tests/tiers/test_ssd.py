"""SSD tier scenarios beyond the contract: restart, bad files, crashes, capacity, arguments.

Everything runs on real files in a temp directory; mocks only inject faults.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import re
import stat
from pathlib import Path

import pytest

from kvstore.tiers import BlobTooLargeError
from kvstore.tiers.locks import InUseError
from kvstore.tiers.ssd import SsdTier
from kvstore.tiers.ssd_files import HEADER_BYTES, MAGIC, record_overhead

KIB = 1024
MIB = 1024 * KIB


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like a block key


def record_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("??/*.blk"))


def temp_files(directory: Path) -> list[Path]:
    return sorted((directory / "tmp").iterdir())


def prefixed_key(first: int, i: int) -> bytes:
    return bytes([first]) + key(i)[1:]  # a block key whose record sits in folder f"{first:02x}"


def quarantined(directory: Path) -> dict[str, Path]:
    """Returns what sits in ``quarantine/``, by the name it had (``ab-<name>`` inside ``ab/``)."""
    return {
        re.sub(r"(\.\d+){1,2}$", "", path.name): path
        for path in (directory / "quarantine").iterdir()
    }


async def test_restart_reads_every_blob_back(tmp_path: Path) -> None:
    rng = random.Random(1)
    sizes = [0, 1, 4095, 4096, 65_537, 300_000]
    blobs = {key(i): rng.randbytes(sizes[i % len(sizes)]) for i in range(120)}
    async with SsdTier(tmp_path, 64 * MIB) as tier:
        for k, blob in blobs.items():
            assert await tier.put(k, blob)
        used = tier.usage()
    assert used == sum(record_overhead(32) + len(b) for b in blobs.values())
    assert sum(path.stat().st_size for path in record_files(tmp_path)) == used

    async with SsdTier(tmp_path, 64 * MIB) as again:
        assert again.dropped_on_start == 0
        assert again.usage() == used
        assert sorted(again.keys()) == sorted(blobs)
        for k, blob in blobs.items():
            assert await again.get(k) == blob
            assert await again.get_range(k, 3, 100) == blob[3:103]


async def test_a_second_tier_on_the_same_directory_refuses_and_touches_nothing(
    tmp_path: Path,
) -> None:
    async with SsdTier(tmp_path, 64 * MIB) as first:
        for i in range(20):
            assert await first.put(key(i), bytes([i]) * 1000)
        files = sorted(record_files(tmp_path))
        # Room for one record only: a start would trim 19 of the first tier's files.
        second = SsdTier(tmp_path, record_overhead(32) + 1000)
        with pytest.raises(
            InUseError, match=rf"ssd directory {tmp_path} is in use .*pid {os.getpid()}"
        ):
            await second.start()
        assert sorted(record_files(tmp_path)) == files
        assert await first.get(key(3)) == bytes([3]) * 1000
    async with SsdTier(tmp_path, 64 * MIB) as after:  # closing let the directory go
        assert len(list(after.keys())) == 20


async def test_record_file_layout(tmp_path: Path) -> None:
    async with SsdTier(tmp_path, MIB) as tier:
        k = bytes(range(40))
        await tier.put(k, b"payload")
        path = tier.path_of(k)
        assert path == tmp_path / k.hex()[:2] / f"{k.hex()}.blk"
        raw = path.read_bytes()
        assert raw[:8] == MAGIC
        assert raw[HEADER_BYTES : HEADER_BYTES + 40] == k
        assert raw[HEADER_BYTES + 40 :] == b"payload"
        assert tier.usage() == len(raw) == tier.record_overhead(40) + 7


async def test_bad_files_are_deleted_and_counted_at_start(tmp_path: Path) -> None:
    async with SsdTier(tmp_path, MIB) as tier:
        for i in range(6):
            await tier.put(key(i), bytes([i]) * 5000)
        paths = {i: tier.path_of(key(i)) for i in range(6)}
        renamed_to = tier.path_of(key(77))

    # Step 1: damage four records and leave a temp file, as a crash or a bad disk would.
    with paths[0].open("r+b") as file:
        file.truncate(paths[0].stat().st_size - 1)
    raw = bytearray(paths[1].read_bytes())
    raw[13] ^= 0x01  # a blob-length byte: the header crc no longer matches
    paths[1].write_bytes(raw)
    paths[2].write_bytes(b"KVSSD0")  # shorter than a header
    paths[3].rename(renamed_to)
    (tmp_path / "tmp" / "half-written.tmp").write_bytes(b"x" * 100)

    # Step 2: a new tier drops exactly those five files and keeps the rest intact.
    async with SsdTier(tmp_path, MIB) as again:
        assert again.dropped_on_start == 5
        assert again.stats().dropped_on_start == 5
        assert sorted(again.keys()) == [key(4), key(5)]
        assert again.usage() == 2 * (record_overhead(32) + 5000)
        assert await again.get(key(4)) == bytes([4]) * 5000
        for i in range(4):
            assert await again.get(key(i)) is None
        assert await again.get(key(77)) is None
    assert not renamed_to.exists()
    assert not any(paths[i].exists() for i in range(4))
    assert temp_files(tmp_path) == []


async def test_bad_header_found_on_read_is_a_miss_and_dropped(tmp_path: Path) -> None:
    async with SsdTier(tmp_path, MIB) as tier:
        await tier.put(key(1), b"a" * 1000)
        await tier.put(key(2), b"b" * 1000)
        raw = bytearray(tier.path_of(key(1)).read_bytes())
        raw[0] ^= 0xFF  # magic
        tier.path_of(key(1)).write_bytes(raw)
        with tier.path_of(key(2)).open("r+b") as file:
            file.truncate(HEADER_BYTES + 32 + 500)

        assert await tier.get(key(1)) is None
        assert await tier.get_range(key(2), 900, 50) is None
        assert not await tier.contains(key(1))
        assert not await tier.contains(key(2))
        assert tier.usage() == 0
        assert tier.corrupt_reads == 2
        assert record_files(tmp_path) == []


async def test_missing_file_is_a_miss(tmp_path: Path) -> None:
    async with SsdTier(tmp_path, MIB) as tier:
        await tier.put(key(1), b"a" * 1000)
        tier.path_of(key(1)).unlink()
        assert await tier.get(key(1)) is None
        assert tier.usage() == 0
        assert list(tier.keys()) == []


async def test_failed_replace_leaves_no_blob_and_no_usage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with SsdTier(tmp_path, MIB) as tier:
        await tier.put(key(1), b"old" * 100)
        used = tier.usage()

        def no_space(src: object, dst: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", no_space)
        assert await tier.put(key(2), b"new" * 100) is False
        assert await tier.put(key(1), b"new" * 100) is False
        monkeypatch.undo()

        assert await tier.get(key(2)) is None
        assert await tier.get(key(1)) == b"old" * 100
        assert tier.usage() == used
        assert temp_files(tmp_path) == []


async def test_crash_during_write_leaves_nothing_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with SsdTier(tmp_path, MIB) as tier:

        def crash(fd: int) -> None:
            raise RuntimeError("power cut")

        monkeypatch.setattr(os, "fsync", crash)
        with pytest.raises(RuntimeError, match="power cut"):
            await tier.put(key(1), b"x" * 10_000)
        monkeypatch.undo()

        assert await tier.get(key(1)) is None
        assert not await tier.contains(key(1))
        assert tier.usage() == 0
        assert record_files(tmp_path) == []
        assert await tier.put(key(1), b"y" * 10_000)
        assert await tier.get(key(1)) == b"y" * 10_000


async def test_cancelled_put_finishes_and_keeps_usage_exact(tmp_path: Path) -> None:
    async with SsdTier(tmp_path, 64 * MIB) as tier:
        puts = [asyncio.create_task(tier.put(key(i), os.urandom(2 * MIB))) for i in range(8)]
        await asyncio.sleep(0)
        for task in puts:
            task.cancel()
        await asyncio.gather(*puts, return_exceptions=True)
    # aclose waited for the writes: what the index held is exactly what is on disk.
    async with SsdTier(tmp_path, 64 * MIB) as again:
        on_disk = sum(path.stat().st_size for path in record_files(tmp_path))
        assert again.usage() == on_disk
        assert again.dropped_on_start == 0


async def test_directory_over_capacity_is_trimmed_oldest_first(tmp_path: Path) -> None:
    record = record_overhead(32) + 100 * KIB
    async with SsdTier(tmp_path, 10 * record) as tier:
        for i in range(10):
            await tier.put(key(i), bytes([i]) * (100 * KIB))
            os.utime(tier.path_of(key(i)), ns=(i * 10**9, i * 10**9))

    async with SsdTier(tmp_path, 4 * record + 1) as smaller:
        assert smaller.trimmed_on_start == 6
        assert smaller.usage() == 4 * record <= smaller.capacity()
        assert sorted(smaller.keys()) == [key(i) for i in range(6, 10)]
        assert len(record_files(tmp_path)) == 4
        assert await smaller.get(key(9)) == bytes([9]) * (100 * KIB)


async def test_concurrent_puts_never_overshoot_capacity(tmp_path: Path) -> None:
    record = record_overhead(32) + 50 * KIB
    async with SsdTier(tmp_path, 7 * record + 100) as tier:
        peak = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, tier.usage())
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(tier.put(key(i), os.urandom(50 * KIB)) for i in range(40)))
        done.set()
        await watcher

        assert results.count(True) == 7
        assert peak <= tier.capacity()
        assert tier.usage() == 7 * record
        assert len(record_files(tmp_path)) == 7


async def test_concurrent_replaces_of_one_key_end_with_one_whole_blob(tmp_path: Path) -> None:
    async with SsdTier(tmp_path, 8 * MIB) as tier:
        blobs = [bytes([i]) * (64 * KIB + i) for i in range(20)]
        readers = [tier.get(key(1)) for _ in range(20)]
        writers = [tier.put(key(1), blob) for blob in blobs]
        results = await asyncio.gather(*writers, *readers)
        assert all(results[:20])
        for seen in results[20:]:
            assert seen is None or seen in blobs
        final = await tier.get(key(1))
        assert final in blobs
        assert final is not None
        assert tier.usage() == record_overhead(32) + len(final)
        assert len(record_files(tmp_path)) == 1


async def test_large_blob_round_trip_and_ranges(tmp_path: Path) -> None:
    blob = os.urandom(32 * MIB)
    async with SsdTier(tmp_path, 64 * MIB, fsync=False) as tier:
        assert await tier.put(key(1), memoryview(blob))
        assert await tier.get(key(1)) == blob
        layer = 32 * MIB // 40
        assert await tier.get_range(key(1), 17 * layer, layer) == blob[17 * layer : 18 * layer]


async def test_blob_larger_than_the_tier_raises(tmp_path: Path) -> None:
    async with SsdTier(tmp_path, 10 * KIB) as tier:
        with pytest.raises(BlobTooLargeError, match="exceeds the capacity"):
            await tier.put(key(1), b"x" * (10 * KIB))
        assert tier.usage() == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes must be positive, got 0"),
        ({"capacity_bytes": -5}, "capacity_bytes must be positive, got -5"),
        ({"capacity_bytes": 1.5}, "capacity_bytes must be an int, got 1.5"),
        ({"capacity_bytes": True}, "capacity_bytes must be an int, got True"),
        ({"directory": ""}, "directory must not be empty, got ''"),
        ({"name": ""}, "name must not be empty, got ''"),
    ],
)
def test_bad_constructor_args_name_the_value(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {"directory": tmp_path, "capacity_bytes": MIB, **kwargs}
    with pytest.raises(ValueError, match=message):
        SsdTier(**args)  # type: ignore[arg-type]


async def test_entries_in_the_way_of_the_layout_are_quarantined(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, outside = tmp_path / "tier", tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "theirs.txt").write_bytes(b"not the tier's")
    root.mkdir()
    (root / "00").write_bytes(b"a file where a prefix folder belongs")
    (root / "ab").symlink_to(outside, target_is_directory=True)
    (root / "tmp").write_bytes(b"a file where tmp/ belongs")
    os.mkfifo(root / "cd")
    blobs = {prefixed_key(first, 1): bytes([first]) * 3000 for first in (0x00, 0xAB, 0xCD)}

    with caplog.at_level(logging.WARNING):
        async with SsdTier(root, MIB) as tier:
            assert tier.stats().quarantined_on_start == 4
            assert list(tier.keys()) == []
            for k, blob in blobs.items():
                assert await tier.put(k, blob)
            for k, blob in blobs.items():
                assert await tier.get(k) == blob
            assert tier.usage() == 3 * (record_overhead(32) + 3000)

    moved = quarantined(root)
    assert sorted(moved) == ["00", "ab", "cd", "tmp"]
    assert moved["00"].read_bytes() == b"a file where a prefix folder belongs"
    assert moved["tmp"].read_bytes() == b"a file where tmp/ belongs"
    assert os.readlink(moved["ab"]) == str(outside)
    assert stat.S_ISFIFO(moved["cd"].lstat().st_mode)
    assert [path.name for path in outside.iterdir()] == ["theirs.txt"]  # nothing went through
    assert (outside / "theirs.txt").read_bytes() == b"not the tier's"
    for name in ("00", "ab", "cd", "tmp"):
        assert (root / name).is_dir() and not (root / name).is_symlink()
    assert f"{root / '00'} is a regular file in the way, moved it to {moved['00']}" in caplog.text
    assert f"{root / 'ab'} is a symlink in the way, moved it to {moved['ab']}" in caplog.text
    assert f"{root / 'cd'} is a fifo in the way, moved it to {moved['cd']}" in caplog.text

    # Quarantine is never read as records, even a valid record in a folder named like a prefix.
    hidden = prefixed_key(0xAB, 1)
    (root / "quarantine" / "ab").mkdir()
    record = SsdTier(root, MIB).path_of(hidden)
    raw = record.read_bytes()
    record.rename(root / "quarantine" / "ab" / record.name)
    async with SsdTier(root, MIB) as again:
        assert (again.dropped_on_start, again.quarantined_on_start) == (0, 0)
        assert sorted(again.keys()) == sorted(k for k in blobs if k != hidden)
        assert again.usage() == 2 * (record_overhead(32) + 3000)
    assert sorted(path.name for path in (root / "quarantine").iterdir()) == sorted(
        [path.name for path in moved.values()] + ["ab"]
    )
    assert (root / "quarantine" / "ab" / record.name).read_bytes() == raw


async def test_strangers_in_a_prefix_folder_are_never_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, outside = tmp_path / "tier", tmp_path / "elsewhere"
    outside.mkdir()
    kept, linked, nested, blocked = (prefixed_key(0x5A, i) for i in range(4))
    async with SsdTier(root, MIB) as tier:
        for k in (kept, linked, nested):
            assert await tier.put(k, k * 10)
        paths = {k: tier.path_of(k) for k in (kept, linked, nested, blocked)}
    folder = root / "5a"
    linked_raw, nested_raw = paths[linked].read_bytes(), paths[nested].read_bytes()
    # A valid record elsewhere, reached only through a symlink named like the record.
    target = outside / paths[linked].name
    paths[linked].rename(target)
    paths[linked].symlink_to(target)
    # A valid record inside a subdirectory named like the record's key.
    subdir = folder / nested.hex()
    subdir.mkdir()
    paths[nested].rename(subdir / paths[nested].name)
    # A directory where a record belongs, and a file that is not a record.
    paths[blocked].mkdir()
    (paths[blocked] / "inside").write_bytes(b"someone's data")
    notes = folder / "notes.txt"
    notes.write_bytes(b"operator notes")

    with caplog.at_level(logging.WARNING):
        async with SsdTier(root, MIB) as again:
            assert list(again.keys()) == [kept]
            assert again.usage() == record_overhead(32) + 320
            assert (again.dropped_on_start, again.quarantined_on_start) == (0, 2)
            assert await again.get(linked) is None
            assert await again.put(linked, b"new blob")
            assert await again.get(linked) == b"new blob"
            assert await again.put(blocked, b"fresh blob")
            assert await again.get(blocked) == b"fresh blob"

    assert paths[linked].is_file() and not paths[linked].is_symlink()
    assert target.read_bytes() == linked_raw  # the put replaced the link, not its target
    assert notes.read_bytes() == b"operator notes"
    assert [path.name for path in subdir.iterdir()] == [paths[nested].name]
    assert (subdir / paths[nested].name).read_bytes() == nested_raw
    moved = quarantined(root)
    assert sorted(moved) == sorted(f"5a-{paths[k].name}" for k in (linked, blocked))
    assert os.readlink(moved[f"5a-{paths[linked].name}"]) == str(target)
    assert (moved[f"5a-{paths[blocked].name}"] / "inside").read_bytes() == b"someone's data"
    assert caplog.text.count(f"leaving {notes} alone: a regular file that is not a record") == 1
    assert caplog.text.count(f"leaving {subdir} alone: a directory that is not a record") == 1


@pytest.mark.parametrize("error", [errno.EACCES, errno.EIO])
async def test_unreadable_record_is_skipped_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    async with SsdTier(tmp_path, MIB) as tier:
        await tier.put(key(1), b"a" * 1000)
        await tier.put(key(2), b"b" * 1000)
        bad = tier.path_of(key(2))
    raw = bad.read_bytes()
    if error == errno.EACCES:
        bad.chmod(0)
    if error != errno.EACCES or os.access(bad, os.R_OK):  # root reads through chmod 000
        real_open = os.open

        def failing_open(path: str, flags: int, *args: int, **kwargs: int) -> int:
            if os.fspath(path) == str(bad):
                raise OSError(error, os.strerror(error), str(bad))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", failing_open)

    async with SsdTier(tmp_path, MIB) as again:
        assert list(again.keys()) == [key(1)]
        assert again.usage() == record_overhead(32) + 1000
        assert again.dropped_on_start == 0
        assert not await again.contains(key(2))
        assert await again.get(key(2)) is None
    monkeypatch.undo()
    bad.chmod(0o644)
    assert bad.read_bytes() == raw  # skipped, not deleted: readable again, it is adopted again
    async with SsdTier(tmp_path, MIB) as healed:
        assert sorted(healed.keys()) == [key(1), key(2)]
        assert await healed.get(key(2)) == b"b" * 1000


async def test_folder_inside_tmp_is_quarantined_and_temp_files_deleted(tmp_path: Path) -> None:
    root, outside = tmp_path / "tier", tmp_path / "elsewhere.bin"
    outside.write_bytes(b"keep me")
    async with SsdTier(root, MIB) as tier:
        await tier.put(key(1), b"x" * 100)
    stuck = root / "tmp" / "stuck"
    stuck.mkdir()
    (stuck / "partial.tmp").write_bytes(b"half")
    (root / "tmp" / "leftover.tmp").write_bytes(b"y" * 10)
    (root / "tmp" / "link.tmp").symlink_to(outside)

    async with SsdTier(root, MIB) as again:
        assert (again.dropped_on_start, again.quarantined_on_start) == (2, 1)
        assert list(again.keys()) == [key(1)]
        assert temp_files(root) == []
        assert await again.put(key(2), b"z" * 50)
        assert await again.get(key(2)) == b"z" * 50
        assert again.usage() == 2 * record_overhead(32) + 150
    moved = quarantined(root)
    assert sorted(moved) == ["tmp-stuck"]
    assert (moved["tmp-stuck"] / "partial.tmp").read_bytes() == b"half"
    assert outside.read_bytes() == b"keep me"


async def test_file_named_quarantine_goes_into_quarantine(tmp_path: Path) -> None:
    (tmp_path / "quarantine").write_bytes(b"was here first")
    (tmp_path / "ef").write_bytes(b"in the way")
    async with SsdTier(tmp_path, MIB) as tier:
        assert tier.quarantined_on_start == 2
        assert await tier.put(prefixed_key(0xEF, 1), b"blob")
        assert await tier.get(prefixed_key(0xEF, 1)) == b"blob"
    moved = quarantined(tmp_path)
    assert sorted(moved) == ["ef", "quarantine"]
    assert moved["quarantine"].read_bytes() == b"was here first"
    assert moved["ef"].read_bytes() == b"in the way"


async def test_directory_that_is_a_file_fails_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    root.write_bytes(b"not a directory")
    tier = SsdTier(root, MIB)
    with pytest.raises(NotADirectoryError, match=re.escape(f"not a directory: '{root}'")):
        await tier.start()
    assert not tier.healthy()
    assert root.read_bytes() == b"not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod")
async def test_directory_it_cannot_write_fails_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(
            PermissionError, match=re.escape(f"not readable and writable: '{root}'")
        ):
            await SsdTier(root, MIB).start()
    finally:
        root.chmod(0o700)
    assert list(root.iterdir()) == []
