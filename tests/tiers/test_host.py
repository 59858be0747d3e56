"""HostTier beyond the contract: the arena file, the reserve/commit data plane, another
process reading and writing slots in place, and copies in flight racing deletes and closes.
"""

from __future__ import annotations

import asyncio
import os
import random
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvstore.tiers import BlobTooLargeError, InvalidRangeError, TierClosedError
from kvstore.tiers.host import (
    COPY_IN_THREAD_BYTES,
    HostTier,
    InvalidBufferError,
    InvalidSlotError,
    ReservationExistsError,
    ReservationNotFoundError,
    Slot,
)

PAGE = 4096
MIB = 1024 * 1024
BIG = 32 * MIB  # well past COPY_IN_THREAD_BYTES: copies run in a worker thread


@pytest.fixture
async def tier(tmp_path: Path) -> AsyncIterator[HostTier]:
    async with HostTier(16 * MIB, directory=tmp_path) as host:
        yield host


def run_child(code: str, *args: object) -> bytes:
    """Runs ``code`` in a fresh interpreter with ``args`` in ``sys.argv[1:]``."""
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


READ_SLOT = """
import mmap, sys
path, offset, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as arena:
    sys.stdout.buffer.write(arena[offset : offset + length])
"""

WRITE_SLOT = """
import mmap, random, sys
path, offset, length, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as arena:
    arena[offset : offset + length] = random.Random(seed).randbytes(length)
"""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes must be positive, got 0"),
        ({"capacity_bytes": -5}, "capacity_bytes must be positive, got -5"),
        ({"capacity_bytes": 100}, "capacity_bytes must be at least page_bytes .4096., got 100"),
        ({"capacity_bytes": MIB, "page_bytes": 1000}, "page_bytes .* got 1000"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HostTier(**kwargs)


async def test_arena_file_lives_from_start_to_aclose(tmp_path: Path) -> None:
    host = HostTier(MIB + PAGE, directory=tmp_path)
    with pytest.raises(TierClosedError, match="not started"):
        _ = host.arena_path
    async with host:
        path = host.arena_path
        assert path.parent == tmp_path
        assert path.name.startswith(f"kvstore-{os.getpid()}-") and path.suffix == ".arena"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.stat().st_size == host.arena_bytes == MIB + PAGE
    assert not path.exists()
    assert os.listdir(tmp_path) == []
    with pytest.raises(TierClosedError, match="closed"):
        host.reserve(b"k", 1)
    with pytest.raises(TierClosedError, match="cannot be restarted"):
        await host.start()


async def test_two_tiers_get_two_arenas(tmp_path: Path) -> None:
    async with HostTier(MIB, directory=tmp_path) as a, HostTier(MIB, directory=tmp_path) as b:
        assert a.arena_path != b.arena_path
        await a.put(b"k", b"a")
        assert await b.get(b"k") is None


async def test_reservation_is_invisible_until_commit(tier: HostTier) -> None:
    slot = tier.reserve(b"k", 10_000)
    assert slot is not None and slot.length == 10_000 and slot.offset % PAGE == 0
    assert tier.usage() == 3 * PAGE
    assert await tier.get(b"k") is None
    assert not await tier.contains(b"k")
    assert list(tier.keys()) == []
    assert tier.locate(b"k") is None
    blob = random.Random(1).randbytes(10_000)
    with tier.view(slot) as view:
        view[:] = blob
    assert tier.commit(b"k") == slot
    assert tier.locate(b"k") == slot
    assert await tier.get(b"k") == blob
    assert list(tier.keys()) == [b"k"]


async def test_abort_frees_and_a_second_reserve_raises(tier: HostTier) -> None:
    assert tier.reserve(b"k", 5000) is not None
    with pytest.raises(ReservationExistsError, match=b"k".hex()):
        tier.reserve(b"k", 5000)
    assert tier.abort(b"k") is True
    assert tier.abort(b"k") is False
    assert tier.usage() == 0
    with pytest.raises(ReservationNotFoundError):
        tier.commit(b"k")


async def test_commit_replaces_the_old_blob_and_frees_it(tier: HostTier) -> None:
    await tier.put(b"k", b"old" * 2000)
    old = tier.locate(b"k")
    used = tier.usage()
    slot = tier.reserve(b"k", 6000)
    assert slot is not None and slot != old
    assert await tier.get(b"k") == b"old" * 2000  # the committed blob stays visible meanwhile
    with tier.view(slot) as view:
        view[:] = b"new" * 2000
    tier.commit(b"k")
    assert await tier.get(b"k") == b"new" * 2000
    assert tier.usage() == used


async def test_reserve_refuses_when_full_and_raises_when_never_fits(tmp_path: Path) -> None:
    async with HostTier(4 * PAGE, directory=tmp_path) as host:
        assert host.reserve(b"a", 3 * PAGE) is not None
        assert host.reserve(b"b", 2 * PAGE) is None
        with pytest.raises(BlobTooLargeError, match="16384"):
            host.reserve(b"c", 4 * PAGE + 1)
        with pytest.raises(BlobTooLargeError):
            await host.put(b"c", bytes(4 * PAGE + 1))
        with pytest.raises(InvalidRangeError, match="got -1"):
            host.reserve(b"c", -1)


async def test_view_outside_the_arena_and_unpin_of_unpinned_raise(tier: HostTier) -> None:
    with pytest.raises(InvalidSlotError):
        tier.view(Slot(tier.arena_bytes - PAGE, PAGE + 1))
    with pytest.raises(InvalidSlotError, match="not pinned"):
        tier.unpin(Slot(0, 1))


async def test_another_process_reads_and_writes_slots_in_place(tier: HostTier) -> None:
    blob = random.Random(2).randbytes(3 * MIB + 7)
    assert await tier.put(b"written-here", blob)
    slot = tier.locate(b"written-here")
    assert slot is not None
    assert run_child(READ_SLOT, tier.arena_path, slot.offset, slot.length) == blob

    length, seed = 2 * MIB + 12_345, 99
    reserved = tier.reserve(b"written-there", length)
    assert reserved is not None
    run_child(WRITE_SLOT, tier.arena_path, reserved.offset, length, seed)
    tier.commit(b"written-there")
    expected = random.Random(seed).randbytes(length)
    assert await tier.get(b"written-there") == expected
    assert await tier.get_range(b"written-there", MIB, 100) == expected[MIB : MIB + 100]
    assert await tier.get(b"written-here") == blob


async def test_large_copies_are_bit_exact_for_any_buffer(tier: HostTier) -> None:
    blob = bytearray(random.Random(3).randbytes(4 * MIB))
    assert len(blob) >= COPY_IN_THREAD_BYTES
    words = memoryview(blob).cast("I", shape=[1024, 1024])  # 2-D, 4-byte items
    sources = [bytes(blob), blob, memoryview(blob), words, memoryview(blob)[::2]]
    for i, (data, expected) in enumerate(zip(sources, [blob] * 4 + [blob[::2]], strict=True)):
        key = i.to_bytes(1, "big")
        assert await tier.put(key, data)
        assert await tier.get(key) == expected
        if i == 0:
            assert await tier.get_range(key, 5, 9 * MIB) == blob[5:]
            assert await tier.get_range(key, 100, MIB + 1) == blob[100 : MIB + 101]
        assert await tier.delete(key)


async def test_delete_during_a_large_get_keeps_its_bytes(tmp_path: Path) -> None:
    async with HostTier(BIG, directory=tmp_path) as host:  # room for exactly one blob
        first, second = os.urandom(BIG), os.urandom(BIG)
        assert await host.put(b"a", first)
        reading = asyncio.create_task(host.get(b"a"))
        await asyncio.sleep(0)  # the get has pinned its slot and is copying in a thread
        assert await host.delete(b"a")
        assert await host.put(b"b", second) is False  # the slot is still being read
        assert host.usage() == BIG
        assert await reading == first
        assert host.usage() == 0
        assert await host.put(b"b", second)
        assert await host.get(b"b") == second


async def test_replace_during_large_gets_keeps_each_result_whole(tmp_path: Path) -> None:
    async with HostTier(3 * BIG, directory=tmp_path) as host:
        old, new = os.urandom(BIG), os.urandom(BIG)
        assert await host.put(b"k", old)
        reads = [asyncio.create_task(host.get(b"k")) for _ in range(2)]
        await asyncio.sleep(0)
        assert await host.put(b"k", new)
        assert await host.put(b"other", new)
        assert await asyncio.gather(*reads) == [old, old]
        assert await host.get(b"k") == new
        assert host.usage() == 2 * BIG


async def test_pin_defers_the_free_until_unpin(tmp_path: Path) -> None:
    async with HostTier(4 * PAGE, directory=tmp_path) as host:
        await host.put(b"a", b"x" * 3 * PAGE)
        slot = host.pin(b"a")
        assert slot is not None
        assert await host.delete(b"a")
        assert await host.put(b"b", b"y" * 3 * PAGE) is False
        with host.view(slot) as view:
            assert bytes(view) == b"x" * 3 * PAGE
        host.unpin(slot)
        assert host.usage() == 0
        assert await host.put(b"b", b"y" * 3 * PAGE)
        assert host.pin(b"missing") is None


async def test_cancelled_get_holds_its_slot_until_the_copy_ends(tmp_path: Path) -> None:
    async with HostTier(BIG, directory=tmp_path) as host:
        await host.put(b"a", os.urandom(BIG))
        reading = asyncio.create_task(host.get(b"a"))
        await asyncio.sleep(0)
        reading.cancel()
        await host.delete(b"a")
        assert host.reserve(b"b", BIG) is None
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert host.reserve(b"b", BIG) is not None


async def test_aclose_waits_for_a_put_in_flight(tmp_path: Path) -> None:
    host = HostTier(BIG, directory=tmp_path)
    await host.start()
    path = host.arena_path
    writing = asyncio.create_task(host.put(b"a", os.urandom(BIG)))
    await asyncio.sleep(0)
    await host.aclose()
    with pytest.raises(TierClosedError):
        await writing
    assert not path.exists()
    assert host.usage() == 0
    assert list(host.keys()) == []


async def test_zero_length_blob_round_trips(tier: HostTier) -> None:
    assert await tier.put(b"empty", b"")
    assert await tier.get(b"empty") == b""
    assert tier.usage() == PAGE


async def test_put_leaves_a_pending_reservation_of_the_key_alone(tier: HostTier) -> None:
    slot = tier.reserve(b"k", 5)
    assert slot is not None
    assert await tier.put(b"k", b"put")
    with tier.view(slot) as view:
        view[:] = b"later"
    tier.commit(b"k")
    assert await tier.get(b"k") == b"later"
    assert tier.usage() == PAGE


async def test_aclose_with_a_view_still_alive_removes_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = HostTier(MIB, directory=tmp_path)
    await host.start()
    path = host.arena_path
    slot = host.reserve(b"k", 3)
    assert slot is not None
    view = host.view(slot)
    await host.aclose()
    assert not path.exists()
    assert "views still alive" in caplog.text
    view[:] = b"abc"  # the mapping outlives the tier until the view goes
    view.release()


@pytest.mark.parametrize("length", [5000, 5 * MIB + 7])  # below and past COPY_IN_THREAD_BYTES
async def test_get_into_fills_the_head_of_the_buffer(tier: HostTier, length: int) -> None:
    blob = random.Random(length).randbytes(length)
    assert await tier.put(b"k", blob)
    out = bytearray(b"\xff" * (length + 10))
    assert await tier.get_into(b"k", out) == length
    assert out == blob + b"\xff" * 10
    words = memoryview(bytearray(length + 3)).cast("B").cast("B", shape=[1, length + 3])
    assert await tier.get_into(b"k", words) == length  # any contiguous layout is bytes
    assert words.tobytes()[:length] == blob
    assert await tier.get_into(b"missing", out) is None


async def test_get_into_refuses_buffers_it_cannot_fill(tier: HostTier) -> None:
    assert await tier.put(b"k", b"abcdef")
    short = bytearray(5)
    with pytest.raises(InvalidBufferError, match="5-byte buffer cannot hold 6 bytes"):
        await tier.get_into(b"k", short)
    assert short == bytes(5)
    with pytest.raises(InvalidBufferError, match="writable"):
        await tier.get_into(b"k", memoryview(bytes(10)))
    with pytest.raises(InvalidBufferError, match="contiguous"):
        await tier.get_into(b"k", memoryview(bytearray(20))[::2])


async def test_delete_during_a_large_get_into_keeps_its_bytes(tmp_path: Path) -> None:
    async with HostTier(BIG, directory=tmp_path) as host:  # room for exactly one blob
        first = os.urandom(BIG)
        assert await host.put(b"a", first)
        out = bytearray(BIG)
        reading = asyncio.create_task(host.get_into(b"a", out))
        await asyncio.sleep(0)  # the copy has pinned its slot and runs in a thread
        assert await host.delete(b"a")
        assert host.reserve(b"b", BIG) is None  # the slot is still being read
        assert await reading == BIG
        assert out == first
        assert host.reserve(b"b", BIG) is not None
