"""HostTier beyond the contract: the arenas (memfds, one per partition, read-only for
clients), the reserve/commit data plane, another process reading slots in place, memory
given back when a range changes partition, and copies in flight racing deletes and closes.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import random
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import xxhash

from kvstore.tiers import BlobTooLargeError, InvalidRangeError, TierClosedError
from kvstore.tiers import host as host_module
from kvstore.tiers.host import (
    HostTier,
    InvalidBufferError,
    InvalidSlotError,
    ReservationExistsError,
    ReservationNotFoundError,
    Slot,
    SlotExistsError,
)
from kvstore.wire.threads import COPY_THREAD_BYTES, SUM_CHUNK_BYTES
from tests.support.prefault import StalledPrefault

PAGE = 4096
MIB = 1024 * 1024
BIG = 32 * MIB  # well past COPY_THREAD_BYTES: copies run in a worker thread


@pytest.fixture
async def tier(tmp_path: Path) -> AsyncIterator[HostTier]:
    async with HostTier(16 * MIB) as host:
        yield host


def run_child(code: str, fd: int, *args: object) -> subprocess.CompletedProcess[bytes]:
    """Runs ``code`` in a fresh interpreter that inherits ``fd`` (``sys.argv[1]``)."""
    return subprocess.run(
        [sys.executable, "-P", "-c", code, str(fd), *map(str, args)],
        capture_output=True,
        timeout=60,
        pass_fds=(fd,),
    )


READ_SLOT = """
import mmap, sys
fd, offset, length = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ) as arena:
    sys.stdout.buffer.write(arena[offset : offset + length])
"""

# Every way a client holding the read-only descriptor could try to write or resize the arena.
TAMPER = """
import mmap, os, sys
fd = int(sys.argv[1])
attempts = {
    "map writable": lambda: mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
    "write": lambda: os.write(fd, b"x"),
    "truncate": lambda: os.ftruncate(fd, 0),
    "reopen writable": lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDWR),
}
if len(sys.argv) > 2:
    os.setgid(65534)
    os.setuid(65534)  # another user, as a containerised engine would be
for name, attempt in attempts.items():
    try:
        attempt()
    except OSError as error:
        print(name, "refused", error.errno)
    else:
        print(name, "ALLOWED")
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


async def test_an_arena_is_a_sealed_memfd_that_lives_until_aclose() -> None:
    host = HostTier(MIB + PAGE)
    with pytest.raises(TierClosedError, match="not started"):
        host.arena("")
    async with host:
        arena = host.arena("")
        assert arena.size == MIB + PAGE and len(arena.arena_id) == 16
        assert host.arena("") == arena  # one arena per partition, made once
        assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:kvstore-arena")
        assert fcntl.fcntl(arena.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        seals = fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        assert stat.S_IMODE(os.fstat(arena.fd).st_mode) == 0o400
        fd = arena.fd
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the tier: nothing is left behind
    with pytest.raises(TierClosedError, match="closed"):
        host.reserve(b"k", 1)
    with pytest.raises(TierClosedError, match="cannot be restarted"):
        await host.start()


async def test_two_tiers_get_two_arenas() -> None:
    async with HostTier(MIB) as a, HostTier(MIB) as b:
        assert a.arena("").arena_id != b.arena("").arena_id
        await a.put(b"k", b"a")
        assert await b.get(b"k") is None


async def test_partitions_get_their_own_arena_and_nothing_else() -> None:
    async with HostTier(MIB, partition_of=lambda key: key[:1].decode()) as host:
        await host.put(b"a1", b"A" * PAGE)
        await host.put(b"b1", b"B" * PAGE)
        a, b = host.arena("a"), host.arena("b")
        assert a.arena_id != b.arena_id
        slot_a, slot_b = host.locate(b"a1"), host.locate(b"b1")
        with mmap.mmap(a.fd, a.size, mmap.MAP_SHARED, mmap.PROT_READ) as seen_by_a:
            assert seen_by_a[slot_a.offset : slot_a.end] == b"A" * PAGE
            assert seen_by_a[slot_b.offset : slot_b.end] == bytes(PAGE)  # B's bytes: not here
        assert host.usage() == 2 * PAGE  # one capacity for every partition


async def test_a_range_that_changes_partition_is_given_back_by_the_old_one() -> None:
    async with HostTier(4 * PAGE, partition_of=lambda key: key[:1].decode()) as host:
        await host.put(b"a", b"A" * 4 * PAGE)
        slot = host.locate(b"a")
        a = host.arena("a")
        await host.delete(b"a")
        with mmap.mmap(a.fd, a.size, mmap.MAP_SHARED, mmap.PROT_READ) as seen_by_a:
            assert seen_by_a[0 : 4 * PAGE] == b"A" * 4 * PAGE  # kept: A may reuse it, no faults
            await host.put(b"b", b"B" * 4 * PAGE)  # the same range, now partition b's
            assert host.locate(b"b") == slot
            assert seen_by_a[0 : 4 * PAGE] == bytes(4 * PAGE)  # A's pages were released
        assert await host.get(b"b") == b"B" * 4 * PAGE


async def test_a_kept_partition_keeps_its_pages_until_released() -> None:
    """A client registered A's arena with CUDA: the device reads the pages the registration
    found, so a range A gives up keeps its pages (a refill would put new pages behind the
    registration's back). Once released, the old rule holds again."""
    async with HostTier(4 * PAGE, partition_of=lambda key: key[:1].decode()) as host:
        a = host.arena("a")
        host.keep_pages("a")
        host.keep_pages("a")  # two clients
        with mmap.mmap(a.fd, a.size, mmap.MAP_SHARED, mmap.PROT_READ) as seen_by_a:
            for owner in [b"b", b"c"]:
                await host.put(b"a", b"A" * 4 * PAGE)
                await host.delete(b"a")
                await host.put(owner, owner.upper() * 4 * PAGE)  # the range moves on
                assert seen_by_a[0 : 4 * PAGE] == b"A" * 4 * PAGE  # the same pages, kept
                await host.delete(owner)
                host.release_pages("a")  # one client left; then none
            await host.put(b"a", b"A" * 4 * PAGE)
            await host.delete(b"a")
            await host.put(b"b", b"B" * 4 * PAGE)
            assert seen_by_a[0 : 4 * PAGE] == bytes(4 * PAGE)  # released: given back again


def held_bytes(host: HostTier, partition: str) -> int:
    """Memory an arena's file holds (the kernel's count of its allocated pages)."""
    return os.fstat(host.arena(partition).fd).st_blocks * 512


async def test_prefault_fills_a_new_arena_and_the_partitions_stay_within_capacity() -> None:
    """The first arena is faulted in whole, in the background, while puts go on; a second
    partition's puts take pages from it (released there), so the memory the arenas hold
    together never exceeds the capacity; a closed tier stops pre-faulting."""
    capacity = 48 * MIB  # sixteen pre-fault chunks of 3 MiB
    async with HostTier(capacity, partition_of=lambda key: key[:1].decode(), prefault=True) as host:
        await host.put(b"a0", b"A" * PAGE)  # creates arena a: its pre-faulting starts
        await host.prefaulted()
        # All but the slab a0's put carved before pre-faulting began (3 MiB here).
        assert capacity - 3 * MIB + PAGE == held_bytes(host, "a")
        assert await host.get(b"a0") == b"A" * PAGE  # a put during it kept its bytes
        await host.put(b"b0", b"B" * 8 * MIB)  # arena b: nothing left to pre-fault
        await host.prefaulted()
        assert held_bytes(host, "b") == 8 * MIB
        assert held_bytes(host, "a") + held_bytes(host, "b") <= capacity
        assert await host.get(b"b0") == b"B" * 8 * MIB
    async with HostTier(capacity, prefault=True) as host:
        await host.put(b"k", b"x")
    assert not host._prefaults  # aclose cancelled and awaited it


async def test_prefaulting_leaves_the_event_loop_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk faults in a worker thread that lets go of the GIL: the loop turns while it
    faults (``mmap.madvise`` held it, ~7 ms a 16 MiB chunk, so the daemon answered nothing
    while a fresh arena faulted in). Not timed: held, no chunk would see the loop turn in
    the middle half of its faulting; free, most do (a loaded machine may deschedule it)."""
    faulting: list[tuple[float, float]] = []
    populate = host_module._Arena.populate

    def timed(arena: host_module._Arena, *args: int) -> None:
        start = time.perf_counter()
        populate(arena, *args)
        faulting.append((start, time.perf_counter()))

    monkeypatch.setattr(host_module._Arena, "populate", timed)
    monkeypatch.setattr(host_module, "PREFAULT_CHUNK_BYTES", 64 * MIB)  # tens of ms each
    async with HostTier(1024 * MIB, prefault=True) as host:  # 8 chunks fault in
        turns: list[float] = []
        await host.put(b"k", b"x")  # creates the arena: its pre-faulting starts
        done = asyncio.ensure_future(host.prefaulted())
        while not done.done():
            await asyncio.sleep(0)
            turns.append(time.perf_counter())
    middles = [(start + (end - start) / 4, end - (end - start) / 4) for start, end in faulting]
    turned = [any(low < at < high for at in turns) for low, high in middles]
    assert len(turned) >= 4 and sum(turned) >= len(turned) / 2, turned


async def test_puts_racing_the_prefault_all_land_while_the_tier_has_room() -> None:
    """Chunks held out of the allocator while they fault in never make a put into a tier
    with room fail: 384 puts (24 MiB of 64) race the pre-faulting of their arena."""
    async with HostTier(64 * MIB, prefault=True) as host:
        host.arena("")  # pre-faulting starts
        blobs = {f"k{i}".encode(): bytes([i % 251]) * 16 * PAGE for i in range(384)}
        stored = []
        for key, blob in blobs.items():
            stored.append(await host.put(key, blob))
            await asyncio.sleep(0)  # let the pre-faulting take turns
        await host.prefaulted()
        assert all(stored)
        assert [await host.get(key) for key in blobs] == list(blobs.values())
        assert held_bytes(host, "") <= 64 * MIB


async def test_a_put_that_finds_only_a_faulting_chunk_free_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tier fills while a pre-fault chunk (1 MiB of 16) is held: the put that needs the
    chunk's space waits for its faulting to end and lands; it does not fail."""
    blob = 64 * PAGE
    stall = StalledPrefault(monkeypatch)
    async with HostTier(16 * MIB, prefault=True) as host:
        host.arena("")
        await stall.started()
        for i in range(15 * MIB // blob):
            assert await host.put(f"k{i}".encode(), bytes([i]) * blob)
        assert host.reserve(b"r", blob) is None  # only the held chunk is free
        last = asyncio.create_task(host.put(b"last", b"L" * blob))
        waiter = asyncio.create_task(host.wait_unheld())
        for _ in range(3):
            await asyncio.sleep(0)
        assert not last.done() and not waiter.done()
        stall.release()
        assert await last and await waiter
        assert not await host.wait_unheld()  # nothing held now
        assert await host.get(b"last") == b"L" * blob
        assert host.usage() == 15 * MIB + blob  # the rest of the chunk is free again


async def test_without_prefault_an_arena_holds_only_what_was_written() -> None:
    async with HostTier(48 * MIB) as host:
        await host.put(b"k", b"x" * 2 * PAGE)
        assert held_bytes(host, "") == 2 * PAGE


@pytest.mark.parametrize("other_user", [False, True])
async def test_a_client_cannot_write_resize_or_reopen_the_arena(other_user: bool) -> None:
    if other_user and os.geteuid() != 0:
        pytest.skip("switching to another user needs root")
    async with HostTier(MIB) as host:
        await host.put(b"k", b"kv" * PAGE)
        arena = host.arena("")
        done = run_child(TAMPER, arena.fd, *(["other-user"] if other_user else []))
        assert done.returncode == 0, done.stderr.decode()
        lines = done.stdout.decode().splitlines()
        refused = {line.split(" refused")[0] for line in lines if " refused " in line}
        expected = {"map writable", "write", "truncate"}
        if other_user or os.geteuid() != 0:  # root may reopen anything; another user may not
            expected.add("reopen writable")
        assert expected <= refused, lines
        assert await host.get(b"k") == b"kv" * PAGE


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


async def test_a_commit_never_lands_over_a_committed_blob(tier: HostTier) -> None:
    await tier.put(b"k", b"old" * 2000)
    old = tier.locate(b"k")
    slot = tier.reserve(b"k", 6000)
    assert slot is not None and slot != old
    with tier.view(slot) as view:
        view[:] = b"new" * 2000
    with pytest.raises(SlotExistsError, match=b"k".hex()):
        tier.commit(b"k")
    assert await tier.get(b"k") == b"old" * 2000 and tier.locate(b"k") == old
    assert tier.abort(b"k") is True  # the reservation stayed pending; abort frees it


async def test_reserve_refuses_when_full_and_raises_when_never_fits(tmp_path: Path) -> None:
    async with HostTier(4 * PAGE) as host:
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
        tier.view(Slot(tier.capacity() - PAGE, PAGE + 1))
    with pytest.raises(InvalidSlotError, match="not pinned"):
        tier.unpin(Slot(0, 1))


async def test_another_process_reads_slots_in_place(tier: HostTier) -> None:
    blob = random.Random(2).randbytes(3 * MIB + 7)
    assert await tier.put(b"written-here", blob)
    slot = tier.locate(b"written-here")
    assert slot is not None
    done = run_child(READ_SLOT, tier.arena("").fd, slot.offset, slot.length)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == blob


async def test_large_copies_are_bit_exact_for_any_buffer(tier: HostTier) -> None:
    blob = bytearray(random.Random(3).randbytes(4 * MIB))
    assert len(blob) >= COPY_THREAD_BYTES
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
    async with HostTier(BIG) as host:  # room for exactly one blob
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


@pytest.mark.parametrize("length", [0, 100, SUM_CHUNK_BYTES + 1, 5 * MIB + 3])
async def test_get_hashed_copies_and_hashes_in_one_pass(tier: HostTier, length: int) -> None:
    blob = random.Random(length).randbytes(length)
    assert await tier.get_hashed(b"k") is None
    assert await tier.put(b"k", blob)
    got = await tier.get_hashed(b"k")
    assert got is not None
    copy, digest = got
    assert bytes(copy) == blob and digest == xxhash.xxh3_64_intdigest(blob)
    if length >= COPY_THREAD_BYTES:  # a view of its own buffer: no write reaches it
        assert isinstance(copy, memoryview) and copy.readonly
        assert await tier.put(b"k", bytes(length))
        assert bytes(copy) == blob


async def test_delete_during_a_large_hashed_get_keeps_its_bytes() -> None:
    async with HostTier(BIG) as host:  # room for exactly one blob
        first, second = os.urandom(BIG), os.urandom(BIG)
        assert await host.put(b"a", first)
        reading = asyncio.create_task(host.get_hashed(b"a"))
        await asyncio.sleep(0)  # the copy has pinned its slot and runs in a thread
        assert await host.delete(b"a")
        assert await host.put(b"b", second) is False  # the slot is still being read
        copy, digest = await reading
        assert bytes(copy) == first and digest == xxhash.xxh3_64_intdigest(first)
        assert await host.put(b"b", second)


async def test_replace_during_large_gets_keeps_each_result_whole(tmp_path: Path) -> None:
    async with HostTier(3 * BIG) as host:
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
    async with HostTier(4 * PAGE) as host:
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
    async with HostTier(BIG) as host:
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
    host = HostTier(BIG)
    await host.start()
    writing = asyncio.create_task(host.put(b"a", os.urandom(BIG)))
    await asyncio.sleep(0)
    await host.aclose()
    with pytest.raises(TierClosedError):
        await writing
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
    assert tier.usage() == 2 * PAGE
    assert await tier.get(b"k") == b"put"
    assert tier.abort(b"k") is True
    assert tier.usage() == PAGE


async def test_aclose_with_a_view_still_alive_keeps_it_usable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = HostTier(MIB)
    await host.start()
    slot = host.reserve(b"k", 3)
    assert slot is not None
    view = host.view(slot)
    await host.aclose()
    assert "views still alive" in caplog.text
    view[:] = b"abc"  # the mapping outlives the tier until the view goes
    view.release()


@pytest.mark.parametrize("length", [5000, 5 * MIB + 7])  # below and past COPY_THREAD_BYTES
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
    async with HostTier(BIG) as host:  # room for exactly one blob
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
