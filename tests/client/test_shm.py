"""Mapping the daemon's arena, checked against files made here (no daemon needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvstore.client.shm import COPY_IN_THREAD_BYTES, Arena, as_bytes, check_payloads

ARENA_BYTES = 8 * COPY_IN_THREAD_BYTES


def make_file(path: Path, size: int = ARENA_BYTES) -> tuple[str, int, int, int]:
    path.write_bytes(b"\0" * size)
    found = path.stat()
    return str(path), size, found.st_dev, found.st_ino


@pytest.fixture
async def arena(tmp_path: Path) -> Arena:
    mapped = Arena.open(*make_file(tmp_path / "arena"))
    assert mapped is not None
    yield mapped
    await mapped.aclose()


def test_the_arena_is_mapped_only_when_it_is_the_announced_file(tmp_path: Path) -> None:
    path, size, device, inode = make_file(tmp_path / "arena")
    other = make_file(tmp_path / "other")

    assert Arena.open(path, size, device, other[3]) is None  # another inode
    assert Arena.open(path, size + 4096, device, inode) is None  # another size
    assert Arena.open(path, size, device + 1, inode) is None  # another device
    assert Arena.open(str(tmp_path / "missing"), size, device, inode) is None
    assert Arena.open("", 0, 0, 0) is None  # the daemon has no host tier
    os.chmod(path, 0o400)
    if os.geteuid() != 0:  # root opens read-only files for writing anyway
        assert Arena.open(path, size, device, inode) is None
    os.chmod(path, 0o600)
    mapped = Arena.open(path, size, device, inode)
    assert mapped is not None
    mapped.close()


@pytest.mark.parametrize("length", [4096, 3 * COPY_IN_THREAD_BYTES])  # inline and threaded
async def test_copies_in_and_out_are_bit_exact(arena: Arena, length: int) -> None:
    data = os.urandom(length)
    tensor = torch.randint(-(2**15), 2**15, (length // 2,), dtype=torch.int16)

    await arena.copy_in([(0, length)], [data])
    assert await arena.read([(0, length)]) == [data]
    out = bytearray(length)
    await arena.copy_out([(0, length)], [out])
    assert out == data

    await arena.copy_in([(length, length)], [tensor])
    received = torch.empty_like(tensor)
    await arena.copy_out([(length, length)], [received])
    assert torch.equal(received, tensor)


async def test_views_are_read_only_and_tensors_share_memory(arena: Arena) -> None:
    await arena.copy_in([(8192, 4)], [b"kvkv"])

    view = arena.view(8192, 4)
    assert view.readonly and bytes(view) == b"kvkv"
    assert bytes(arena.tensor(8192, 4).numpy()) == b"kvkv"
    with pytest.raises(TypeError):
        view[0] = 0
    view.release()


def test_slots_outside_the_arena_are_refused(arena: Arena) -> None:
    for offset, length in [(-1, 4), (ARENA_BYTES - 2, 4), (0, ARENA_BYTES + 1)]:
        with pytest.raises(ValueError, match="outside"):
            arena.view(offset, length)


async def test_closing_with_a_live_view_keeps_the_mapping_until_released(tmp_path: Path) -> None:
    mapped = Arena.open(*make_file(tmp_path / "arena"))
    assert mapped is not None
    await mapped.copy_in([(0, 3)], [b"abc"])
    view = mapped.view(0, 3)

    mapped.close()

    assert bytes(view) == b"abc"  # still mapped
    view.release()
    with pytest.raises(ValueError, match="closed"):
        mapped.view(0, 3)


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

    assert flat.dtype == torch.uint8 and flat.numel() == 24
    assert tensor[0, 0].isnan()  # 0xFFFFFFFF is a NaN: the write landed in the tensor
    assert as_bytes(b"").numel() == 0
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(tensor.t())
