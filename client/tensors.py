"""Torch tensors as the client's payloads and targets; imported only once torch is.

The client moves bytes with numpy (its copies release the GIL), so neither the client nor the
daemon needs torch. A tensor can only exist once torch has been imported, so the client looks
for tensors only then (:func:`kvstore.client.shm.is_tensor`) and comes here for them:

- :func:`flat_bytes`: a contiguous tensor's bytes without a copy: a uint8 numpy view for a CPU
  tensor, a flat uint8 tensor for a tensor on another device;
- :func:`host_bytes`: a tensor's bytes as a uint8 numpy array in host memory (a device
  tensor is copied to the host);
- :func:`over`: a uint8 CPU tensor sharing a numpy array's memory (read-only arrays too);
- :func:`copy_all`: copies between host and device tensors, finished when it returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "copy_all",
    "empty",
    "flat_bytes",
    "host_bytes",
    "over",
]

Bytes = npt.NDArray[np.uint8]

# torch warns once per process that a tensor over read-only memory could write it; the
# client only ever reads through such tensors (over the arena, mapped read-only, and over
# received chunks), so the warnings are spent here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)
    torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


def flat_bytes(tensor: torch.Tensor) -> Bytes | torch.Tensor:
    """The bytes of a contiguous tensor, no copy: a uint8 numpy view of a CPU tensor, a flat
    uint8 tensor on the tensor's device otherwise.

    Raises:
        ValueError: The tensor is not contiguous.
    """
    if not tensor.is_contiguous():
        raise ValueError(f"tensor must be contiguous, got strides {tensor.stride()}")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        return flat
    array: Bytes = flat.numpy()
    return array


def host_bytes(tensor: torch.Tensor) -> Bytes:
    """A contiguous tensor's bytes in host memory: a view of a CPU tensor, a copy of another."""
    flat = flat_bytes(tensor)
    if isinstance(flat, torch.Tensor):
        array: Bytes = flat.cpu().numpy()
        return array
    return flat


def over(array: Bytes) -> torch.Tensor:
    """A uint8 CPU tensor sharing ``array``'s memory (read-only arrays too), keeping it alive."""
    return torch.from_numpy(array)


def empty(nbytes: int) -> torch.Tensor:
    """A new uint8 CPU tensor of ``nbytes``."""
    return torch.empty(nbytes, dtype=torch.uint8)


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each ``(src, dst)`` pair of flat uint8 tensors, one of them on a
    device."""
    for src, dst in pairs:
        dst.copy_(src)
