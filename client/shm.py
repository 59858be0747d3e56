"""The shared-memory data plane: a session with the daemon and its tenant's arena.

A co-located client opens a session on the daemon's session socket
(``HandshakeResponse.shm_socket``; protocol in :mod:`kvstore.wire.session`) and receives two
descriptors of its tenant's arena, which it maps twice:

- read-only (:class:`Arena`): leased blocks are read in place, by copy (:meth:`Arena.read`,
  :meth:`Arena.copy_out`) or zero-copy (:meth:`Arena.view`, :meth:`Arena.tensor`); that
  mapping cannot be written, so no bug in the code reading blocks can damage one;
- writable, for puts alone (:class:`Writer`): a put copies each payload into the arena slot
  ``Reserve`` held for it and sums it as it lands (:meth:`Writer.write`, one pass); ``Commit``
  sends the sums, which the daemon records as the blocks' checksums without reading the
  bytes again. :class:`WriteBudget` keeps concurrent puts within the session's window (the
  bytes it may hold reserved at once).

:meth:`ShmSession.open` runs the exchange; the session lasts until :meth:`ShmSession.aclose`
(or this process exits). Bytes in host memory are copied by address (``memmove``, after
checking each buffer's size, bounds and writability; numpy reads a buffer's address); a torch
tensor (possible only once torch is imported: :func:`is_tensor`) by its data pointer when it
is on the CPU, with no numpy array per block, and with torch's ``copy_`` when it is on a
device (:mod:`kvstore.client.tensors`).
Copies of ``THREAD_BYTES`` or more run in a worker thread (both drop the GIL), and a
cancelled caller still waits for that thread: a slot is released or aborted only once nothing
touches it any more. :func:`verify` checks bytes against the checksum the daemon recorded
when the block was committed.

Opened with ``pin_arena`` and CUDA usable in this process, both mappings are registered with
CUDA as page-locked memory (``cudaHostRegister``; the reader's read-only), so copies between
the arena and the GPU are DMA; when that fails, a warning is logged once and copies run
unpinned.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import mmap
import os
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias, TypeGuard, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvstore.client.calls import BlockingCalls, SessionCalls
from kvstore.client.errors import CorruptBlockError
from kvstore.wire.blocks import payload_checksum
from kvstore.wire.session import (
    Hello,
    SessionError,
    SessionInfo,
    decode_reply,
    encode_hello,
    read_line,
)
from kvstore.wire.threads import (
    THREAD_BYTES,
    Span,
    copy_and_sum_spans,
    copy_spans,
    pread_exactly,
    run_to_completion,
)

if TYPE_CHECKING:
    import torch

    from kvstore.client import tensors

__all__ = [
    "Arena",
    "Buffer",
    "Payload",
    "ShmSession",
    "Target",
    "TargetT",
    "WriteBudget",
    "Writer",
    "as_bytes",
    "buffer_bytes",
    "caller_stream",
    "check_payloads",
    "host_span",
    "is_tensor",
    "require_torch",
    "torch_imported",
    "verify",
]

OPEN_SECONDS = 5.0

Buffer: TypeAlias = bytes | bytearray | memoryview
Bytes: TypeAlias = npt.NDArray[np.uint8]  # flat
# What put takes (one block's raw KV), and where get may copy a block: buffers (numpy arrays
# too) or tensors.
Payload: TypeAlias = "Buffer | npt.NDArray[np.generic] | torch.Tensor"
Target: TypeAlias = "bytearray | memoryview | npt.NDArray[np.generic] | torch.Tensor"
TargetT = TypeVar("TargetT", bytearray, memoryview, "npt.NDArray[np.generic]", "torch.Tensor")
Slots = Sequence[tuple[int, int]]

T = TypeVar("T")
log = logging.getLogger(__name__)


def torch_imported() -> bool:
    """Whether torch has been imported here, so that a tensor may exist (none can before)."""
    return sys.modules.get("torch") is not None


def is_tensor(data: object) -> TypeGuard[torch.Tensor]:
    """Whether ``data`` is a torch tensor; ``False`` without importing torch when it is not
    imported (then no tensor exists)."""
    module = sys.modules.get("torch")
    return module is not None and isinstance(data, module.Tensor)


def caller_stream() -> torch.cuda.Stream | None:
    """The calling thread's current CUDA stream (on its current device) once this process has
    started CUDA; None otherwise. A call takes it where it is made and queues its copies to
    and from device tensors on it, wherever they then run: a current stream is per thread,
    and the client's loop and copy threads have only the default one."""
    module = sys.modules.get("torch")
    if module is None or not module.cuda.is_initialized():
        return None
    stream: torch.cuda.Stream = module.cuda.current_stream()
    return stream


def require_torch(what: str) -> None:
    """Imports torch for ``what``.

    Raises:
        ModuleNotFoundError: torch is not installed; the message says which extra brings it.
    """
    try:
        importlib.import_module("torch")
    except ImportError as error:
        raise ModuleNotFoundError(
            f"{what} needs torch, which is not installed here: install an engine that brings "
            "it, or pip install 'kvstore[engine]'",
            name="torch",
        ) from error


class _Mapping:
    """One shared memory file mapped here; closed once the copies in flight are done.

    With ``pin``, the mapping is registered with CUDA (page-locked, mapped into the device's
    address space; read-only when the mapping is) when torch is imported and CUDA is usable;
    ``close`` unregisters it.
    """

    _pin_failed = False  # a registration failed (and was logged) in this process

    def __init__(self, fd: int, size: int, *, writable: bool, pin: bool = False) -> None:
        self.size = size
        self._fd = fd
        self._writable = writable
        self._registered = 0  # the address registered with CUDA; 0: none
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        self._bytes: Bytes | None = np.frombuffer(self._mmap, dtype=np.uint8)
        self._address: int = self._bytes.ctypes.data  # where the mapping starts here
        self._tensor: torch.Tensor | None = None  # over _bytes, made on first use
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        if pin:
            self._pin()

    async def aclose(self) -> None:
        """Waits for copies in flight, then unmaps (views keep the mapping until released)."""
        await self._idle.wait()
        self.close()

    def close(self) -> None:
        self._unpin()
        self._bytes = self._tensor = None
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

    def array(self, offset: int, length: int) -> Bytes:
        """A uint8 numpy array over a slot (no copy; read-only in the arena)."""
        self.check(offset, length)
        return self._open_bytes()[offset : offset + length]

    def tensor(self, offset: int, length: int) -> torch.Tensor:
        """A uint8 CPU tensor over a slot (no copy). Needs torch.

        Raises:
            ModuleNotFoundError: torch is not installed.
        """
        self.check(offset, length)
        if self._tensor is None:
            require_torch("a tensor over shared memory")
            from kvstore.client import tensors

            self._tensor = tensors.over(self._open_bytes())
        if offset == 0 and length == self.size:
            return self._tensor
        return self._tensor[offset : offset + length]

    def view(self, offset: int, length: int) -> memoryview:
        """A read-only view of a slot."""
        self.check(offset, length)
        with memoryview(self._open_map()) as whole:
            return whole[offset : offset + length].toreadonly()

    async def _copy(
        self,
        slots: Slots,
        data: Sequence[Payload | Target],
        *,
        into_slots: bool,
        lanes: int | None = None,
        stream: torch.cuda.Stream | None = None,
        sums: bool = False,
    ) -> list[int]:
        """Copies ``data[i]`` into slot i (``into_slots``), or slot i into ``data[i]``, in a
        worker thread when the bytes are many: ``memmove`` between host buffers by address
        (a large copy split over ``lanes`` threads at most, default ``COPY_LANES``), torch's
        ``copy_`` for a tensor on a device (asynchronous from a pinned arena; on CUDA queued
        on ``stream``, see :func:`caller_stream`). With ``sums`` (into slots only), returns
        the xxh3-64 of each slot as it landed: from host memory taken during the copy
        (:func:`copy_and_sum_spans`), from a device once the copy is done; else ``[]``.

        Raises:
            ValueError: a slot outside the area, a buffer of another length than its slot,
                a target that cannot be written, or a tensor that is not contiguous.
        """
        whole = self._open_bytes()  # held until the copy ends: the mapping stays mapped
        base, size = self._address, self.size
        spans: list[Span] = []  # (source, target, length) addresses
        hosted: list[int] = []  # the index of each span's slot
        on_device_at: list[int] = []  # the index of each device tensor's slot
        buffers: list[object] = []  # what the spans point into, alive until the copy ends
        on_device: list[tuple[torch.Tensor, torch.Tensor]] = []  # (src, dst)
        for index, ((offset, length), item) in enumerate(zip(slots, data, strict=True)):
            if offset < 0 or length < 0 or offset + length > size:
                self.check(offset, length)  # raises, naming the slot
            host = host_span(item, writable=not into_slots)
            if host is None:  # a tensor on a device
                flat = cast("torch.Tensor", as_bytes(item))
                there = self.tensor(offset, length)
                on_device.append((flat, there) if into_slots else (there, flat))
                on_device_at.append(index)
                continue
            address, nbytes, owner = host
            if nbytes != length:
                raise ValueError(f"a {nbytes}-byte buffer cannot take a {length}-byte slot")
            here = base + offset
            spans.append((address, here, length) if into_slots else (here, address, length))
            hosted.append(index)
            buffers.append(owner)
        pinned = self.pinned

        def copy_all() -> list[int]:
            found = [0] * len(slots) if sums else []
            if sums:
                for index, total in zip(hosted, copy_and_sum_spans(spans, lanes), strict=True):
                    found[index] = total
            else:
                copy_spans(spans, lanes)
            if on_device:
                from kvstore.client import tensors

                tensors.copy_all(on_device, pinned=pinned, stream=stream)
                for index in on_device_at if sums else ():  # the host memory they landed in
                    offset, length = slots[index]
                    found[index] = payload_checksum(self.array(offset, length).data)
            return found

        if sum(length for _, length in slots) < THREAD_BYTES:
            found = copy_all()
        else:
            found = await self.in_thread(copy_all)
        del whole, buffers  # the copy has ended (also when this caller was cancelled)
        return found

    @property
    def pinned(self) -> bool:
        """Whether the mapping is registered with CUDA as page-locked memory."""
        return self._registered != 0

    def mapped(self) -> tensors.HostMapped | None:
        """The whole mapping as device kernels read it, when it is registered; else None."""
        if not self._registered:
            return None
        from kvstore.client import tensors

        return tensors.HostMapped(self._registered, self.size)

    def _pin(self) -> None:
        if not torch_imported() or self.size == 0:
            return
        from kvstore.client import tensors

        if not tensors.cuda_ready():
            return
        address = self._open_bytes().ctypes.data
        flags = tensors.CUDA_HOST_REGISTER_PORTABLE | tensors.CUDA_HOST_REGISTER_MAPPED
        if not self._writable:
            flags |= tensors.CUDA_HOST_REGISTER_READ_ONLY
        code = tensors.register_host(address, self.size, flags)
        if code == 0:
            self._registered = address
        elif not type(self)._pin_failed:  # once per process and kind: each session says the same
            type(self)._pin_failed = True
            log.warning(
                "cannot register %d bytes of shared memory with CUDA (cudaError %d); copies "
                "between it and the GPU run unpinned",
                self.size,
                code,
            )

    def _unpin(self) -> None:
        address, self._registered = self._registered, 0
        if address:
            from kvstore.client import tensors

            code = tensors.unregister_host(address)
            if code != 0:
                log.warning("cannot unregister shared memory from CUDA (cudaError %d)", code)

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

    def _open_bytes(self) -> Bytes:
        if self._bytes is None:
            raise ValueError("the shared memory is closed")
        return self._bytes


class Arena(_Mapping):
    """The tenant's arena, mapped read-only; ``arena_id`` names it in Acquire replies.

    With ``pin``, registered with CUDA, read-only (see :class:`_Mapping`): device kernels
    read leased blocks where they lie (:meth:`mapped`).
    """

    def __init__(self, fd: int, size: int, arena_id: bytes, *, pin: bool = False) -> None:
        super().__init__(fd, size, writable=False, pin=pin)
        self.arena_id = arena_id

    async def read(self, slots: Slots) -> list[bytes]:
        """New bytes objects holding the slots' contents."""
        for offset, length in slots:
            self.check(offset, length)
        arena, fd = self._open_map(), self._fd
        if sum(length for _, length in slots) < THREAD_BYTES:
            return [arena[offset : offset + length] for offset, length in slots]
        return await self.in_thread(lambda: [pread_exactly(fd, *slot) for slot in slots])

    async def copy_out(
        self, slots: Slots, targets: Sequence[Target], stream: torch.cuda.Stream | None = None
    ) -> None:
        """Copies each slot into the target of the same index (exactly ``length`` bytes); into
        a CUDA tensor on ``stream`` (:func:`caller_stream`)."""
        await self._copy(slots, targets, into_slots=False, stream=stream)

    async def verify(self, slots: Slots, checksums: Sequence[int], what: str) -> None:
        """Checks each slot against the checksum the daemon recorded for its block.

        Raises:
            CorruptBlockError: naming the first block whose bytes do not match.
        """
        views = [self.view(*slot) for slot in slots]
        try:
            if sum(length for _, length in slots) < THREAD_BYTES:
                verify(views, checksums, what)
            else:
                await self.in_thread(lambda: verify(views, checksums, what))
        finally:
            for view in views:
                view.release()


class Writer(_Mapping):
    """The tenant's arena mapped writable, for puts alone (reads go through :class:`Arena`,
    whose mapping cannot be written): each block is copied into the slot ``Reserve`` held for
    it and summed as it lands (:meth:`write`). With ``pin``, registered with CUDA: a save's
    device-to-host copy lands in the arena by DMA."""

    def __init__(self, fd: int, size: int, *, pin: bool = False) -> None:
        super().__init__(fd, size, writable=True, pin=pin)

    async def write(
        self, slots: Slots, sources: Sequence[Payload], stream: torch.cuda.Stream | None = None
    ) -> list[int]:
        """Copies each source into the slot of the same index (exactly ``length`` bytes) on
        every copy lane, and returns the xxh3-64 of each slot as written: what ``Commit``
        records as the block's checksum. A CUDA tensor is copied on ``stream``
        (:func:`caller_stream`)."""
        return await self._copy(slots, sources, into_slots=True, stream=stream, sums=True)


class WriteBudget:
    """Bytes of a session's window (what it may hold reserved at once) that concurrent puts
    hold."""

    def __init__(self, total: int, page: int = mmap.PAGESIZE) -> None:
        self.total = total
        self._page = page
        self._free = total
        self._changed = asyncio.Condition()

    def slot_bytes(self, length: int) -> int:
        """The bytes of the window a block of ``length`` takes (whole pages)."""
        return max(self._page, -(-length // self._page) * self._page)

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Waits until ``nbytes`` (at most ``total``) are free and holds them."""
        if nbytes > self.total:
            raise ValueError(f"{nbytes} bytes cannot fit a {self.total}-byte write window")
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
    """A session with the daemon: its socket and the tenant's arena, mapped twice."""

    def __init__(
        self, sock: socket.socket, tenant: str, info: SessionInfo, arena: Arena, writer: Writer
    ) -> None:
        self.tenant = tenant
        self.info = info
        self.arena = arena
        self.writer = writer
        self.budget = WriteBudget(info.staging_bytes)
        self.calls: SessionCalls | None = None  # the read path's calls, when the daemon serves them
        self._socket: socket.socket | None = sock
        self._attach: tuple[str, Hello] | None = None  # where, and as whom, to attach more
        self._blocking: BlockingCalls | None = None
        self._attaching = threading.Lock()

    @property
    def session_id(self) -> bytes:
        return self.info.session

    @classmethod
    async def open(
        cls,
        path: str,
        hello: Hello,
        on_closed: Callable[[], None] | None = None,
        *,
        calls: bool = True,
    ) -> ShmSession:
        """Opens a session on the daemon's session socket ``path``; with ``hello.pin`` the
        arena is registered with CUDA when it can be (:class:`Arena`), and the daemon keeps
        its pages for as long as the session lasts. When the daemon serves calls on the
        socket (and ``calls``), ``calls`` carries them (:mod:`kvstore.client.calls`), and
        ``on_closed`` runs once the daemon ends the session.

        Raises:
            OSError: the socket cannot be reached.
            SessionError: the daemon refused (its gRPC status name in ``code``).
        """
        session = await asyncio.to_thread(cls._open_blocking, path, hello)
        if calls and session.info.calls and session._socket is not None:
            lane = SessionCalls(session._socket, on_closed)
            try:
                await lane.start()
            except BaseException:
                await session.aclose()
                raise
            session.calls = lane
            attach = Hello(hello.token, hello.tenant, 0, session=session.info.session)
            session._attach = (path, attach)
        return session

    def blocking_calls(self, timeout: float) -> BlockingCalls | None:
        """The session's calls on a connection of their own, for the calling thread
        (:class:`~kvstore.client.calls.BlockingCalls`), attached on first use; None when the
        daemon serves no calls here, the session is closed, or attaching failed (not tried
        again: the async calls serve)."""
        with self._attaching:
            if self._blocking is None and self._attach is not None and self.calls is not None:
                path, hello = self._attach
                self._attach = None  # one try
                try:
                    self._blocking = BlockingCalls.attach(path, hello, timeout)
                except (OSError, SessionError) as error:
                    log.info("no calls connection of its own for the shm session: %s", error)
            blocking = self._blocking
        return blocking if blocking is not None and blocking.open else None

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
            writer = Writer(fds[1], info.arena_bytes, pin=hello.pin)
            arena = Arena(fds[0], info.arena_bytes, info.arena_id, pin=hello.pin)  # pins last
            fds = []
            sock.settimeout(None)
            return cls(sock, hello.tenant, info, arena, writer)
        except BaseException:
            for fd in fds:
                os.close(fd)
            sock.close()
            raise

    async def aclose(self) -> None:
        """Ends the session: the daemon aborts what it left reserved; unmaps both mappings,
        unregistered from CUDA first: the daemon keeps the arena's pages until the end."""
        await self.arena.aclose()
        await self.writer.aclose()
        calls, self.calls = self.calls, None
        if calls is not None:
            await calls.aclose()
        with self._attaching:
            self._attach = None
            blocking, self._blocking = self._blocking, None
        if blocking is not None:
            blocking.close()
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()


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


def as_bytes(data: Payload | Target) -> Bytes | torch.Tensor:
    """``data``'s bytes without a copy: a flat uint8 numpy array over host memory (a buffer,
    a CPU tensor), or a flat uint8 tensor for a tensor on a device. A tensor must be
    contiguous.

    Raises:
        ValueError: A non-contiguous tensor or buffer.
    """
    if is_tensor(data):
        from kvstore.client import tensors

        return tensors.flat_bytes(data)
    return buffer_bytes(data)


def host_span(data: Payload | Target, *, writable: bool) -> tuple[int, int, object] | None:
    """``(address, length, owner)`` of ``data``'s bytes in this process's memory, where
    ``owner`` keeps them alive; None for a tensor on a device. A CPU tensor costs no numpy
    array (a fraction of a microsecond against several).

    Raises:
        ValueError: A tensor or buffer that is not contiguous, or, with ``writable``, a
            buffer that cannot be written.
    """
    if is_tensor(data):
        from kvstore.client import tensors

        return tensors.host_span(data)
    array = buffer_bytes(data)
    if writable and not array.flags.writeable:
        raise ValueError("the target buffer is read-only")
    return array.ctypes.data, array.nbytes, array


def buffer_bytes(data: Payload | Target) -> Bytes:
    """A flat uint8 numpy array over a buffer's memory (``data`` is not a tensor).

    Raises:
        ValueError: A buffer that is not C-contiguous.
    """
    view = memoryview(cast(Buffer, data))  # numpy arrays are buffers too
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if view.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(view.cast("B") if view.format != "B" else view, dtype=np.uint8)


def check_payloads(
    blocks: Sequence[Payload | Target], size: int, *, what: str, writable: bool = False
) -> None:
    """Checks that every block is a contiguous buffer or tensor of exactly ``size`` bytes.

    Raises:
        ValueError: Naming the first bad block's index and its size, or why it cannot be used.
    """
    for index, block in enumerate(blocks):
        if is_tensor(block):
            nbytes, contiguous, readonly = block.nbytes, block.is_contiguous(), False
        else:
            try:
                view = memoryview(cast(Buffer, block))
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
