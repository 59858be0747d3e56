"""The shared-memory data plane: a session with the daemon, its arena and its staging area.

A co-located client opens a session on the daemon's session socket
(``HandshakeResponse.shm_socket``; protocol in :mod:`kvstore.shm_wire`) and receives two
memory files:

- its tenant's **arena**, read-only (:class:`Arena`): leased blocks are read in place, by
  copy (:meth:`Arena.read`, :meth:`Arena.copy_out`) or zero-copy (:meth:`Arena.view`,
  :meth:`Arena.tensor`); the mapping cannot be written, so no bug in this process can damage
  a stored block;
- its own **staging area**, writable (:class:`Staging`): a put copies payloads into the slots
  ``Reserve`` names (:meth:`Staging.copy_in`); ``Commit`` has the daemon copy them into the
  arena and check them. :class:`StagingBudget` keeps concurrent puts within its size.

:meth:`ShmSession.open` runs the exchange; the session lasts until :meth:`ShmSession.aclose`
(or this process exits). Copies of ``COPY_IN_THREAD_BYTES`` or more run in a worker thread
(torch drops the GIL), and a cancelled caller still waits for that thread: a slot is
released or aborted only once nothing touches it any more. :func:`verify` checks bytes
against the checksum the daemon recorded when the block was committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import socket
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeAlias, TypeVar

import torch

from kvstore.blocks import payload_checksum
from kvstore.client.errors import CorruptBlockError
from kvstore.shm_wire import Hello, SessionError, SessionInfo, decode_reply, encode_hello, read_line
from kvstore.tiers.threads import pread_exactly, run_to_completion

__all__ = [
    "COPY_IN_THREAD_BYTES",
    "Arena",
    "Buffer",
    "Payload",
    "ShmSession",
    "Staging",
    "StagingBudget",
    "Target",
    "as_bytes",
    "check_payloads",
    "verify",
]

COPY_IN_THREAD_BYTES = 1 << 20
OPEN_SECONDS = 5.0

Buffer: TypeAlias = bytes | bytearray | memoryview
Payload: TypeAlias = Buffer | torch.Tensor  # what put takes: one block's raw KV
Target: TypeAlias = bytearray | memoryview | torch.Tensor  # where get may copy a block
Slots = Sequence[tuple[int, int]]

T = TypeVar("T")
log = logging.getLogger(__name__)

# torch.frombuffer warns once per process that a tensor over read-only bytes could write them;
# the client only ever reads through such tensors (the arena is mapped read-only).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class _Mapping:
    """One shared memory file mapped here; closed once the copies in flight are done."""

    def __init__(self, fd: int, size: int, *, writable: bool) -> None:
        self.size = size
        self._fd = fd
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._bytes: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def aclose(self) -> None:
        """Waits for copies in flight, then unmaps (views keep the mapping until released)."""
        await self._idle.wait()
        self.close()

    def close(self) -> None:
        self._bytes = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                log.warning("shared memory still viewed; unmapped when the views are released")
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def check(self, offset: int, length: int) -> None:
        """Raises ``ValueError`` unless ``[offset, offset + length)`` lies inside the file."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"slot ({offset}, {length}) lies outside the {self.size}-byte area")

    def tensor(self, offset: int, length: int) -> torch.Tensor:
        """A uint8 CPU tensor over a slot (no copy)."""
        self.check(offset, length)
        return self._open_bytes()[offset : offset + length]

    def view(self, offset: int, length: int) -> memoryview:
        """A read-only view of a slot."""
        self.check(offset, length)
        with memoryview(self._open_map()) as whole:
            return whole[offset : offset + length].toreadonly()

    async def _copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for each pair, in a worker thread when the bytes are many."""

        def copy_all() -> None:
            for src, dst in pairs:
                dst.copy_(src)

        if sum(src.numel() for src, _ in pairs) < COPY_IN_THREAD_BYTES:
            copy_all()
        else:
            await self.in_thread(copy_all)

    async def in_thread(self, call: Callable[[], T]) -> T:
        """Runs work on the mapping in a worker thread; ``aclose`` waits until it is done."""
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
            raise ValueError("the shared memory is closed")
        return self._mmap

    def _open_bytes(self) -> torch.Tensor:
        if self._bytes is None:
            raise ValueError("the shared memory is closed")
        return self._bytes


class Arena(_Mapping):
    """The tenant's arena, mapped read-only; ``arena_id`` names it in Acquire replies."""

    def __init__(self, fd: int, size: int, arena_id: bytes) -> None:
        super().__init__(fd, size, writable=False)
        self.arena_id = arena_id

    async def read(self, slots: Slots) -> list[bytes]:
        """New bytes objects holding the slots' contents."""
        for offset, length in slots:
            self.check(offset, length)
        arena, fd = self._open_map(), self._fd
        if sum(length for _, length in slots) < COPY_IN_THREAD_BYTES:
            return [arena[offset : offset + length] for offset, length in slots]
        return await self.in_thread(lambda: [pread_exactly(fd, *slot) for slot in slots])

    async def copy_out(self, slots: Slots, targets: Sequence[Target]) -> None:
        """Copies each slot into the target of the same index (exactly ``length`` bytes)."""
        await self._copy(
            [(self.tensor(*slot), as_bytes(dst)) for slot, dst in zip(slots, targets, strict=True)]
        )

    async def verify(self, slots: Slots, checksums: Sequence[int], what: str) -> None:
        """Checks each slot against the checksum the daemon recorded for its block.

        Raises:
            CorruptBlockError: naming the first block whose bytes do not match.
        """
        views = [self.view(*slot) for slot in slots]
        try:
            if sum(length for _, length in slots) < COPY_IN_THREAD_BYTES:
                verify(views, checksums, what)
            else:
                await self.in_thread(lambda: verify(views, checksums, what))
        finally:
            for view in views:
                view.release()


class Staging(_Mapping):
    """This session's staging area, mapped writable; the daemon only reads it."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__(fd, size, writable=True)

    async def copy_in(self, slots: Slots, sources: Sequence[Payload]) -> None:
        """Copies each source into the slot of the same index (exactly ``length`` bytes)."""
        await self._copy(
            [(as_bytes(src), self.tensor(*slot)) for slot, src in zip(slots, sources, strict=True)]
        )

    async def checksums(self, slots: Slots) -> list[int]:
        """The xxh3-64 of each slot's bytes, as the daemon will check them at Commit."""

        def sums() -> list[int]:
            return [payload_checksum(self.view(*slot)) for slot in slots]

        if sum(length for _, length in slots) < COPY_IN_THREAD_BYTES:
            return sums()
        return await self.in_thread(sums)


class StagingBudget:
    """Bytes of a staging area that concurrent puts may hold at once."""

    def __init__(self, total: int, page: int = mmap.PAGESIZE) -> None:
        self.total = total
        self._page = page
        self._free = total
        self._changed = asyncio.Condition()

    def slot_bytes(self, length: int) -> int:
        """The staging bytes a block of ``length`` takes (whole pages)."""
        return max(self._page, -(-length // self._page) * self._page)

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Waits until ``nbytes`` (at most ``total``) are free and holds them."""
        if nbytes > self.total:
            raise ValueError(f"{nbytes} bytes cannot fit a {self.total}-byte staging area")
        async with self._changed:
            await self._changed.wait_for(lambda: self._free >= nbytes)
            self._free -= nbytes
        try:
            yield
        finally:
            async with self._changed:
                self._free += nbytes
                self._changed.notify_all()


class ShmSession:
    """A session with the daemon: its socket, the tenant's arena and the staging area."""

    def __init__(
        self, sock: socket.socket, tenant: str, info: SessionInfo, arena: Arena, staging: Staging
    ) -> None:
        self.tenant = tenant
        self.info = info
        self.arena = arena
        self.staging = staging
        self.budget = StagingBudget(staging.size)
        self._socket: socket.socket | None = sock

    @property
    def session_id(self) -> bytes:
        return self.info.session

    @classmethod
    async def open(cls, path: str, hello: Hello) -> ShmSession:
        """Opens a session on the daemon's session socket ``path``.

        Raises:
            OSError: the socket cannot be reached.
            SessionError: the daemon refused (its gRPC status name in ``code``).
        """
        return await asyncio.to_thread(cls._open_blocking, path, hello)

    @classmethod
    def _open_blocking(cls, path: str, hello: Hello) -> ShmSession:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            sock.settimeout(OPEN_SECONDS)
            sock.connect(path)
            sock.sendall(encode_hello(hello))
            data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 2)
            while not data.endswith(b"\n"):
                data += read_line(sock)
            info = decode_reply(data)
            if len(fds) != 2:
                raise SessionError("INTERNAL", f"the daemon sent {len(fds)} descriptors, not 2")
            arena = Arena(fds[0], info.arena_bytes, info.arena_id)
            staging = Staging(fds[1], info.staging_bytes)
            fds = []
            sock.settimeout(None)
            return cls(sock, hello.tenant, info, arena, staging)
        except BaseException:
            for fd in fds:
                os.close(fd)
            sock.close()
            raise

    async def aclose(self) -> None:
        """Ends the session: the daemon aborts what it left reserved; unmaps both areas."""
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()
        await self.arena.aclose()
        await self.staging.aclose()


def verify(blocks: Sequence[Buffer], checksums: Sequence[int], what: str) -> None:
    """Raises :class:`CorruptBlockError` naming the first block whose xxh3-64 is not its
    checksum."""
    for index, (block, expected) in enumerate(zip(blocks, checksums, strict=True)):
        found = payload_checksum(block)
        if found != expected:
            raise CorruptBlockError(
                f"{what}: block {index} does not match its checksum "
                f"(expected {expected:#x}, found {found:#x})"
            )


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
