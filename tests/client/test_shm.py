"""The client's shared memory, on memory files made here (no daemon needed): the arena mapped
read-only and writable, copies, views, checksums and the write window's budget."""

from __future__ import annotations

import asyncio
import mmap
import os

import numpy as np
import pytest
import torch

from kvstore.client.errors import CorruptBlockError
from kvstore.client.shm import (
    Arena,
    WriteBudget,
    Writer,
    as_bytes,
    check_payloads,
)
from kvstore.wire.blocks import payload_checksum
from kvstore.wire.threads import THREAD_BYTES

AREA_BYTES = 8 * THREAD_BYTES


def memfd(size: int = AREA_BYTES) -> int:
    fd = os.memfd_create("test-area", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def read_only(fd: int) -> int:
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


@pytest.fixture
async def areas() -> tuple[Arena, Writer, mmap.mmap]:
    """The arena mapped read-only and writable here, and as the daemon maps it."""
    arena_fd = memfd()
    daemon = mmap.mmap(arena_fd, AREA_BYTES)
    arena = Arena(read_only(arena_fd), AREA_BYTES, b"a" * 16)
    writer = Writer(os.dup(arena_fd), AREA_BYTES)
    os.close(arena_fd)
    yield arena, writer, daemon
    await arena.aclose()
    await writer.aclose()
    daemon.close()


@pytest.mark.parametrize("length", [4096, 3 * THREAD_BYTES])  # inline and threaded
async def test_copies_in_and_out_are_bit_exact_and_writes_are_summed(areas, length: int) -> None:
    arena, writer, daemon = areas
    data = os.urandom(length)
    tensor = torch.randint(-(2**15), 2**15, (length // 2,), dtype=torch.int16)
    sums = await writer.write([(0, length), (length, length)], [data, tensor])
    assert bytes(daemon[0:length]) == data  # written in place: the daemon copies nothing
    assert sums == [payload_checksum(data), payload_checksum(tensor.numpy().tobytes())]

    assert await arena.read([(0, length)]) == [data]
    out = bytearray(length)
    await arena.copy_out([(0, length)], [out])
    assert out == data
    received = torch.empty_like(tensor)
    await arena.copy_out([(length, length)], [received])
    assert torch.equal(received, tensor)


async def test_many_blocks_are_summed_each_on_the_lanes(areas) -> None:
    _, writer, daemon = areas
    length = THREAD_BYTES // 2
    blocks = [os.urandom(length) for _ in range(8)]  # 4 MiB: dealt to several lanes
    slots = [(i * length, length) for i in range(8)]
    assert await writer.write(slots, blocks) == [payload_checksum(b) for b in blocks]
    assert bytes(daemon[0 : 8 * length]) == b"".join(blocks)


async def test_copies_refuse_buffers_of_another_size_and_read_only_targets(areas) -> None:
    arena, writer, _ = areas
    with pytest.raises(ValueError, match="4095-byte buffer cannot take a 4096-byte slot"):
        await writer.write([(0, 4096)], [bytes(4095)])
    with pytest.raises(ValueError, match="8192-byte buffer"):
        await arena.copy_out([(0, 4096)], [torch.zeros(2048, dtype=torch.int32)])
    with pytest.raises(ValueError, match="read-only"):
        await arena.copy_out([(0, 4096)], [bytes(4096)])
    with pytest.raises(ValueError, match="contiguous"):
        await arena.copy_out([(0, 4096)], [torch.zeros(32, 32, dtype=torch.int32).t()])
    with pytest.raises(ValueError, match="outside"):
        await arena.copy_out([(AREA_BYTES - 4095, 4096)], [bytearray(4096)])


async def test_the_arena_cannot_be_written_from_here(areas) -> None:
    arena, _, daemon = areas
    daemon[8192:8196] = b"kvkv"
    view = arena.view(8192, 4)
    assert view.readonly and bytes(view) == b"kvkv"
    assert bytes(arena.tensor(8192, 4).numpy()) == b"kvkv"
    with pytest.raises(TypeError):
        view[0] = 0
    view.release()
    with pytest.raises(TypeError, match="readonly"):
        arena._open_map()[0:1] = b"x"  # the mapping itself is read-only
    fd = arena._fd
    with pytest.raises(PermissionError):
        mmap.mmap(fd, AREA_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.write(fd, b"x")


async def test_verify_names_the_block_that_does_not_match(areas) -> None:
    arena, _, daemon = areas
    daemon[0:4096] = b"\x01" * 4096
    good = payload_checksum(b"\x01" * 4096)
    await arena.verify([(0, 4096)], [good], "Acquire")
    with pytest.raises(CorruptBlockError, match="block 1 does not match"):
        await arena.verify([(0, 4096), (0, 4096)], [good, good ^ 1], "Acquire")


def test_slots_outside_the_areas_are_refused(areas) -> None:
    arena, writer, _ = areas
    for area in (arena, writer):
        for offset, length in [(-1, 4), (AREA_BYTES - 2, 4), (0, AREA_BYTES + 1)]:
            with pytest.raises(ValueError, match="outside"):
                area.view(offset, length)


async def test_closing_with_a_live_view_keeps_the_mapping_until_released() -> None:
    writer = Writer(memfd(), AREA_BYTES)
    await writer.write([(0, 3)], [b"abc"])
    view = writer.view(0, 3)

    writer.close()

    assert bytes(view) == b"abc"  # still mapped
    view.release()
    with pytest.raises(ValueError, match="closed"):
        writer.view(0, 3)


async def test_the_write_budget_holds_puts_back_until_bytes_are_free() -> None:
    budget = WriteBudget(4 * 4096, page=4096)
    assert budget.slot_bytes(1) == 4096 and budget.slot_bytes(4097) == 8192
    order: list[str] = []

    async def put(name: str, nbytes: int, hold: float) -> None:
        async with budget.hold(nbytes):
            order.append(f"{name}+")
            await asyncio.sleep(hold)
            order.append(f"{name}-")

    await asyncio.gather(put("a", 3 * 4096, 0.05), put("b", 2 * 4096, 0.0))
    assert order == ["a+", "a-", "b+", "b-"]  # b waited until a gave its bytes back
    with pytest.raises(ValueError, match="cannot fit"):
        async with budget.hold(5 * 4096):
            pass


def test_payload_checks_name_the_index_and_the_sizes() -> None:
    good = bytes(16)
    with pytest.raises(ValueError, match=r"blocks\[1\] must be 16 bytes .* got 15"):
        check_payloads([good, bytes(15)], 16, what="blocks")
    with pytest.raises(ValueError, match=r"blocks\[0\] must be contiguous"):
        check_payloads([torch.zeros(4, 8).t()], 64, what="blocks")
    with pytest.raises(ValueError, match=r"out\[0\] must be writable"):
        check_payloads([good], 16, what="out", writable=True)
    with pytest.raises(ValueError, match=r"blocks\[0\] must be a buffer or a tensor, got int"):
        check_payloads([3], 16, what="blocks")  # type: ignore[list-item]
    check_payloads([good, bytearray(16), torch.zeros(8, dtype=torch.float16)], 16, what="b")


def test_as_bytes_views_without_copying() -> None:
    tensor = torch.zeros(2, 3, dtype=torch.float32)
    flat = as_bytes(tensor)
    flat[0:4] = 255

    assert isinstance(flat, np.ndarray)  # host memory is copied with numpy
    assert flat.dtype == np.uint8 and flat.shape == (24,)
    assert tensor[0, 0].isnan()  # 0xFFFFFFFF is a NaN: the write landed in the tensor
    assert as_bytes(b"").shape == (0,)
    halves = np.zeros((2, 4), dtype=np.float16)
    as_bytes(halves)[0:2] = 255
    assert np.isnan(halves[0, 0])
    assert not as_bytes(b"abc").flags.writeable
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(tensor.t())
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(halves.T)


async def test_numpy_arrays_are_payloads_and_targets(areas) -> None:
    arena, writer, _ = areas
    length = 2 * THREAD_BYTES  # threaded
    sent = np.random.default_rng(0).integers(0, 2**16, length // 2, dtype=np.uint16)
    await writer.write([(0, length)], [sent])
    received = np.zeros((2, length // 4), dtype=np.uint16)
    check_payloads([received], length, what="out", writable=True)
    await arena.copy_out([(0, length)], [received])
    assert np.array_equal(received.reshape(-1), sent)


async def test_tensors_over_the_arena_share_its_memory(areas) -> None:
    arena, _, daemon = areas
    daemon[0:4] = b"kvkv"
    tensor = arena.tensor(0, 4)
    assert tensor.dtype == torch.uint8 and bytes(tensor.numpy()) == b"kvkv"
    daemon[0:4] = b"abcd"
    assert bytes(tensor.numpy()) == b"abcd"  # no copy
    del tensor


async def test_without_cuda_a_pinned_arena_is_mapped_unpinned(caplog) -> None:
    """``pin=True`` where CUDA is not usable: no registration, no warning, copies work."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is usable here: tests/client/test_client.py pins for real")
    fd = memfd()
    arena = Arena(read_only(fd), AREA_BYTES, b"a" * 16, pin=True)
    os.close(fd)
    assert not arena.pinned
    out = bytearray(4096)
    await arena.copy_out([(0, 4096)], [out])
    await arena.aclose()
    assert "CUDA" not in caplog.text


def pinned_arenas(count: int) -> list[Arena]:
    arenas = []
    for _ in range(count):
        fd = memfd()
        arenas.append(Arena(read_only(fd), AREA_BYTES, b"a" * 16, pin=True))
        os.close(fd)
    return arenas


async def test_a_registered_arena_is_unregistered_on_close(monkeypatch) -> None:
    """The CUDA calls stubbed: what the arena asks for, and that it undoes it."""
    from kvstore.client import tensors

    registered: list[tuple[int, int, int]] = []
    unregistered: list[int] = []
    monkeypatch.setattr(tensors, "cuda_ready", lambda: True)
    monkeypatch.setattr(tensors, "register_host", lambda *call: registered.append(call) or 0)
    monkeypatch.setattr(
        tensors, "unregister_host", lambda address: unregistered.append(address) or 0
    )
    (arena,) = pinned_arenas(1)
    address = arena.array(0, 1).ctypes.data
    assert arena.pinned
    assert registered == [(address, AREA_BYTES, 0x01 | 0x02 | 0x08)]  # portable, mapped, read-only
    mapped = arena.mapped()
    assert mapped is not None and (mapped.address, mapped.nbytes) == (address, AREA_BYTES)
    out = bytearray(4096)
    await arena.copy_out([(0, 4096)], [out])
    await arena.aclose()
    assert unregistered == [address] and not arena.pinned


async def test_a_failed_registration_warns_once_and_copies_unpinned(monkeypatch, caplog) -> None:
    from kvstore.client import tensors

    monkeypatch.setattr(tensors, "cuda_ready", lambda: True)
    monkeypatch.setattr(tensors, "register_host", lambda *call: 801)  # cudaErrorNotSupported
    monkeypatch.setattr(Arena, "_pin_failed", False)
    arenas = pinned_arenas(2)
    assert not any(arena.pinned for arena in arenas)
    assert caplog.text.count("cannot register") == 1
    out = bytearray(4096)
    await arenas[1].copy_out([(0, 4096)], [out])
    for arena in arenas:
        await arena.aclose()
