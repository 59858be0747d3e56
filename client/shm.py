"""The shared-memory data plane: the daemon's host arena mapped into this process.

The daemon owns one arena file (``HandshakeResponse.arena_path``); a co-located client maps it
read-write and moves KV bytes with memcpy instead of gRPC messages. :meth:`Arena.open` maps it
only when the file there is the one the daemon announced (same ``st_dev``, ``st_ino`` and
size), otherwise the client streams over gRPC instead.

Primitives, all on ``(offset, length)`` slots the daemon handed out under a lease or a
reservation:

- :meth:`Arena.read` -> new bytes; :meth:`Arena.copy_out` -> into caller-owned buffers or
  tensors (any device: ``copy_`` from a uint8 view of the arena);
- :meth:`Arena.copy_in` -> payloads (buffers or tensors) into reserved slots;
- :meth:`Arena.view` / :meth:`Arena.tensor` -> zero-copy read access to a slot.

Copies of ``COPY_IN_THREAD_BYTES`` or more run in a worker thread (torch drops the GIL), and a
cancelled caller still waits for that thread: a slot is released or aborted only once nothing
touches it any more.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import warnings
from collections.abc import Callable, Sequence
from typing import TypeAlias, TypeVar

import torch

__all__ = [
    "COPY_IN_THREAD_BYTES",
    "Arena",
    "Buffer",
    "Payload",
    "Target",
    "as_bytes",
    "check_payloads",
]

COPY_IN_THREAD_BYTES = 1 << 20

Buffer: TypeAlias = bytes | bytearray | memoryview
Payload: TypeAlias = Buffer | torch.Tensor  # what put takes: one block's raw KV
Target: TypeAlias = bytearray | memoryview | torch.Tensor  # where get may copy a block

T = TypeVar("T")
log = logging.getLogger(__name__)

# torch.frombuffer warns once per process that a tensor over read-only bytes could write them;
# the client only ever reads through such tensors.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class Arena:
    """The daemon's host arena, mapped shared and read-write."""

    def __init__(self, path: str, fd: int, size: int, device: int, inode: int) -> None:
        self.path = path
        self.size = size
        self.device = device
        self.inode = inode
        self._fd = fd
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED)
        self._bytes: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    def open(cls, path: str, size: int, device: int, inode: int) -> Arena | None:
        """Maps the arena if the file at ``path`` is the one the daemon announced.

        Args:
            path: The arena file.
            size: Its size in bytes.
            device: Its ``st_dev``.
            inode: Its ``st_ino``.

        Returns:
            The mapped arena, or ``None`` when the file is missing, another file, another size,
            or not readable and writable by this process (the caller streams instead).
        """
        if not path or size <= 0:
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as error:
            log.info("arena %s cannot be opened (%s); streaming instead", path, error)
            return None
        try:
            found = os.fstat(fd)
            if (found.st_dev, found.st_ino, found.st_size) != (device, inode, size):
                log.info("arena %s is not the daemon's (another host?); streaming instead", path)
                os.close(fd)
                return None
            return cls(path, fd, size, device, inode)
        except BaseException:
            os.close(fd)
            raise

    async def aclose(self) -> None:
        """Waits for copies in flight, then unmaps the arena (views keep it until released)."""
        await self._idle.wait()
        self.close()

    def close(self) -> None:
        """Unmaps the arena now; views still alive keep the mapping until they are released."""
        self._bytes = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                log.warning("arena %s: views still alive; unmapped when released", self.path)
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def check(self, offset: int, length: int) -> None:
        """Raises ``ValueError`` unless ``[offset, offset + length)`` lies inside the arena."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"slot ({offset}, {length}) lies outside the {self.size}-byte arena")

    def view(self, offset: int, length: int) -> memoryview:
        """A read-only view of a slot; release it before the slot's lease ends."""
        self.check(offset, length)
        with memoryview(self._open_map()) as whole:
            return whole[offset : offset + length].toreadonly()

    def tensor(self, offset: int, length: int) -> torch.Tensor:
        """A uint8 CPU tensor over a slot (no copy); valid while the slot's lease lasts."""
        self.check(offset, length)
        return self._open_bytes()[offset : offset + length]

    async def read(self, slots: Sequence[tuple[int, int]]) -> list[bytes]:
        """New bytes objects holding the slots' contents."""
        for offset, length in slots:
            self.check(offset, length)
        fd, arena = self._fd, self._open_map()
        if sum(length for _, length in slots) < COPY_IN_THREAD_BYTES:
            return [arena[offset : offset + length] for offset, length in slots]
        return await self._in_thread(lambda: [_pread(fd, *slot) for slot in slots])

    async def copy_out(self, slots: Sequence[tuple[int, int]], targets: Sequence[Target]) -> None:
        """Copies each slot into the target of the same index (exactly ``length`` bytes)."""
        await self._copy(
            [(self.tensor(*slot), as_bytes(dst)) for slot, dst in zip(slots, targets, strict=True)]
        )

    async def copy_in(self, slots: Sequence[tuple[int, int]], sources: Sequence[Payload]) -> None:
        """Copies each source into the slot of the same index (exactly ``length`` bytes)."""
        await self._copy(
            [(as_bytes(src), self.tensor(*slot)) for slot, src in zip(slots, sources, strict=True)]
        )

    async def _copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for each pair, in a worker thread when the bytes are many."""

        def copy_all() -> None:
            for src, dst in pairs:
                dst.copy_(src)

        if sum(src.numel() for src, _ in pairs) < COPY_IN_THREAD_BYTES:
            copy_all()
        else:
            await self._in_thread(copy_all)

    async def _in_thread(self, call: Callable[[], T]) -> T:
        """Runs a copy in a worker thread; ``aclose`` waits until every such copy is done."""
        self._inflight += 1
        self._idle.clear()
        try:
            return await run_to_completion(call)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def _open_map(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"arena {self.path} is closed")
        return self._mmap

    def _open_bytes(self) -> torch.Tensor:
        if self._bytes is None:
            raise ValueError(f"arena {self.path} is closed")
        return self._bytes


def as_bytes(data: Payload | Target) -> torch.Tensor:
    """A flat uint8 tensor sharing ``data``'s memory (a tensor must be contiguous).

    Raises:
        ValueError: A non-contiguous tensor or buffer.
    """
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise ValueError(f"tensor must be contiguous, got strides {data.stride()}")
        return data.detach().reshape(-1).view(torch.uint8)
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view.cast("B") if view.format != "B" else view, dtype=torch.uint8)


def check_payloads(
    blocks: Sequence[Payload | Target], size: int, *, what: str, writable: bool = False
) -> None:
    """Checks that every block is a contiguous buffer or tensor of exactly ``size`` bytes.

    Raises:
        ValueError: Naming the first bad block's index and its size, or why it cannot be used.
    """
    for index, block in enumerate(blocks):
        if isinstance(block, torch.Tensor):
            nbytes, contiguous, readonly = block.nbytes, block.is_contiguous(), False
        else:
            try:
                view = memoryview(block)
            except TypeError:
                kind = type(block).__name__
                raise ValueError(
                    f"{what}[{index}] must be a buffer or a tensor, got {kind}"
                ) from None
            nbytes, contiguous, readonly = view.nbytes, view.c_contiguous, view.readonly
        if not contiguous:
            raise ValueError(f"{what}[{index}] must be contiguous")
        if writable and readonly:
            raise ValueError(f"{what}[{index}] must be writable")
        if nbytes != size:
            raise ValueError(
                f"{what}[{index}] must be {size} bytes (the layout's payload_bytes), got {nbytes}"
            )


def _pread(fd: int, offset: int, length: int) -> bytes:
    parts = [os.pread(fd, length, offset)]
    done = len(parts[0])
    while done < length:  # one read stops at about 2 GiB
        parts.append(os.pread(fd, length - done, offset + done))
        if not parts[-1]:
            raise OSError(f"arena ended at byte {offset + done} of a {length}-byte read")
        done += len(parts[-1])
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def run_to_completion(call: Callable[[], T]) -> T:
    """Runs ``call`` in a worker thread; a cancelled caller still waits for it to finish, so
    the slots it touches are not released or aborted while the copy runs."""
    future = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait({future})
            except asyncio.CancelledError:
                continue
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what propagates
        raise
