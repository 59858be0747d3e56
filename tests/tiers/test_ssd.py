"""SSD tier scenarios beyond the contract: restart, bad files, crashes, capacity, arguments.

Everything runs on real files in a temp directory; mocks only inject faults.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from kvstore.tiers import BlobTooLargeError
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
