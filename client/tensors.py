"""Torch tensors as the client's payloads and targets; imported only once torch is.

The client moves host bytes by address (``memmove`` through ctypes, which releases the GIL)
and reads them with numpy, so neither the client nor the daemon needs torch. A tensor can
only exist once torch has been imported, so the client looks for tensors only then
(:func:`kvstore.client.shm.is_tensor`) and comes here for them:

- :func:`flat_bytes`: a contiguous tensor's bytes without a copy: a uint8 numpy view for a CPU
  tensor, a flat uint8 tensor for a tensor on another device;
- :func:`host_bytes`: a tensor's bytes as a uint8 numpy array in host memory (a device
  tensor is copied to the host); :func:`host_span`: where a CPU tensor's bytes lie;
- :func:`over`: a uint8 CPU tensor sharing a numpy array's memory (read-only arrays too);
- :func:`copy_all`: copies between host and device tensors, asynchronous from pinned memory,
  all finished when it returns; on CUDA queued on the stream the caller names
  (:func:`kvstore.client.shm.caller_stream`: the stream current where the client's call was
  made, not on the client's loop or copy threads);
- :func:`register_host` / :func:`unregister_host`: ``cudaHostRegister`` of a host range so
  that copies from it to the GPU are DMA, and kernels can read it over the host link;
- :class:`HostMapped` names such a range as a kernel argument; :class:`HostBlocks` is where
  leased blocks lie in host memory (``AsyncKVStoreClient.host_blocks``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "CUDA_HOST_REGISTER_MAPPED",
    "CUDA_HOST_REGISTER_PORTABLE",
    "CUDA_HOST_REGISTER_READ_ONLY",
    "HostBlocks",
    "HostMapped",
    "copy_all",
    "cuda_ready",
    "empty",
    "flat_bytes",
    "host_bytes",
    "host_span",
    "on_stream",
    "over",
    "register_host",
    "unregister_host",
]

log = logging.getLogger(__name__)

Bytes = npt.NDArray[np.uint8]

# torch warns once per process that a tensor over read-only memory could write it; the
# client only ever reads through such tensors (over the arena, mapped read-only, and over
# received chunks), so the warnings are spent here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)
    torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))

# cudaHostRegister flags (cuda_runtime_api.h): usable from every CUDA context, mapped into
# the device's address space (kernels read it over the host link), and a range the process
# may only read (the arena is mapped read-only, so the driver must not ask for write access).
CUDA_HOST_REGISTER_PORTABLE = 0x01
CUDA_HOST_REGISTER_MAPPED = 0x02
CUDA_HOST_REGISTER_READ_ONLY = 0x08


@dataclass(frozen=True, slots=True)
class HostMapped:
    """Host memory registered with CUDA and mapped, as a kernel argument (Triton takes any
    object with ``data_ptr()`` and ``dtype``): ``address`` is its host address, which under
    unified addressing CUDA also resolves on the device. It must stay registered, and its
    bytes unchanged, until the kernels reading it have finished."""

    address: int
    nbytes: int
    dtype: torch.dtype = torch.int32  # what a kernel reads it as

    def data_ptr(self) -> int:
        return self.address


@dataclass(frozen=True, slots=True)
class HostBlocks:
    """Leased blocks where they lie in host memory: block ``i`` is
    ``source[offsets[i] : offsets[i] + payload_bytes]``.

    ``source`` is a flat uint8 CPU tensor (the arena, or a buffer the blocks were downloaded
    into); ``mapped`` is the same memory as a device kernel reads it, when it is registered
    with CUDA (a pinned arena, or a pinned download buffer), else None.
    """

    source: torch.Tensor
    offsets: tuple[int, ...]
    mapped: HostMapped | None = None

    def __len__(self) -> int:
        return len(self.offsets)


def flat_bytes(tensor: torch.Tensor) -> Bytes | torch.Tensor:
    """The bytes of a contiguous tensor, no copy: a uint8 numpy view of a CPU tensor, a flat
    uint8 tensor on the tensor's device otherwise.

    Raises:
        ValueError: The tensor is not contiguous.
    """
    if not tensor.is_contiguous():
        raise ValueError(f"tensor must be contiguous, got strides {tensor.stride()}")
    if tensor.requires_grad:
        tensor = tensor.detach()
    flat = tensor.view(-1).view(torch.uint8)  # ~1.5 us of the ~4 a block cost in all
    if not flat.is_cpu:
        return flat
    array: Bytes = flat.numpy()
    return array


def host_span(tensor: torch.Tensor) -> tuple[int, int, torch.Tensor] | None:
    """``(address, length, tensor)`` of a contiguous CPU tensor's bytes; None for a tensor
    on another device.

    Raises:
        ValueError: The tensor is not contiguous.
    """
    if not tensor.is_contiguous():
        raise ValueError(f"tensor must be contiguous, got strides {tensor.stride()}")
    if not tensor.is_cpu:
        return None
    return tensor.data_ptr(), tensor.nbytes, tensor


def host_bytes(tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Bytes:
    """A contiguous tensor's bytes in host memory: a view of a CPU tensor, a copy of another
    (from CUDA: queued on ``stream``, default this thread's current one, and waited for)."""
    flat = flat_bytes(tensor)
    if isinstance(flat, torch.Tensor):
        with on_stream(stream):
            array: Bytes = flat.cpu().numpy()
        return array
    return flat


def over(array: Bytes) -> torch.Tensor:
    """A uint8 CPU tensor sharing ``array``'s memory (read-only arrays too), keeping it alive."""
    return torch.from_numpy(array)


def empty(nbytes: int, *, pinned: bool = False) -> torch.Tensor:
    """A new uint8 CPU tensor of ``nbytes``; page-locked with ``pinned``."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def copy_all(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    pinned: bool,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """``dst.copy_(src)`` for each ``(src, dst)`` pair of flat uint8 tensors, one of them on a
    device; with ``pinned`` (the host side is page-locked) copies between it and CUDA, either
    way, are queued without waiting, and all are finished when this returns (the host memory
    holds the bytes, or may be reused).

    On CUDA the copies are queued on ``stream`` (for tensors on its device; default, and on
    other devices: this thread's current stream), after the work already queued there, and
    this waits for the copies alone (an event recorded after them), not for later work.
    """
    waiting: set[torch.device] = set()
    with on_stream(stream):
        for src, dst in pairs:
            device = dst.device if dst.is_cuda else src.device
            non_blocking = pinned and device.type == "cuda" and (src.is_cuda != dst.is_cuda)
            dst.copy_(src, non_blocking=non_blocking)
            if non_blocking:
                waiting.add(device)
        for device in waiting:
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(torch.cuda.current_stream(device))
            copied.synchronize()


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """Makes ``stream`` this thread's current stream on its device meanwhile; nothing for
    None."""
    if stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def cuda_ready() -> bool:
    """Whether this process can use CUDA (without initialising it when it cannot)."""
    return bool(torch.cuda.is_available())


def register_host(address: int, nbytes: int, flags: int) -> int:
    """``cudaHostRegister(address, nbytes, flags)``: its cudaError code, 0 when registered."""
    return _cuda_call(lambda cudart: cudart.cudaHostRegister(address, nbytes, flags))


def unregister_host(address: int) -> int:
    """``cudaHostUnregister(address)``: its cudaError code, 0 when done."""
    return _cuda_call(lambda cudart: cudart.cudaHostUnregister(address))


def _cuda_call(call: Callable[[Any], Any]) -> int:
    """``call(torch.cuda.cudart())``'s cudaError code, -1 when there is no CUDA runtime.

    Runs in a thread of its own that then ends: a failed CUDA runtime call leaves its error
    as the calling thread's "last error", which a later, unrelated check in that thread
    (torch checks it after kernel launches) would take for its own.
    """
    result: list[int] = []

    def run() -> None:
        try:
            result.append(int(call(torch.cuda.cudart())))  # type: ignore[no-untyped-call]
        except Exception as error:  # a build without CUDA, or CUDA cannot start
            log.debug("CUDA runtime call failed: %s", error)

    thread = threading.Thread(target=run, name="kvstore-cuda-host")
    thread.start()
    thread.join()
    return result[0] if result else -1
