"""Argument checks shared by the kernel wrappers and their torch references.

Every public kernel entry point validates its tensors before launching anything: a wrong
rank, dtype, device or memory layout raises ``ValueError`` naming the argument, instead of a
kernel reading the wrong bytes. Values inside tensors (lengths, page ids, positions) are not
read here: that would synchronise with the device on every call.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MIN_HEAD_DIM = 2
MAX_HEAD_DIM = 256
MIN_DOT_DIM = 16  # tl.dot wants every operand dim >= 16


def check_tensor(
    name: str,
    value: object,
    *,
    shape: str,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    contiguous_dims: int = 0,
) -> torch.Tensor:
    """Check one tensor argument and return it.

    Args:
        name: The argument's name, used in the error message.
        value: What the caller passed.
        shape: The expected shape, written like ``[batch, num_heads, head_dim]``; its
            comma count gives the expected rank.
        dtypes: Accepted dtypes.
        device: The device it must live on, or None for any.
        contiguous_dims: How many trailing dims must be C-contiguous (the kernels index
            them with computed offsets; the leading dims may have any stride).

    Raises:
        ValueError: The argument is not such a tensor.
    """
    ndim = shape.count(",") + 1
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a tensor {shape}, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape}, got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"{name} dtype must be one of {names}, got {value.dtype}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device}, got {value.device}")
    expected = 1
    for dim in range(ndim - 1, ndim - 1 - contiguous_dims, -1):
        if value.size(dim) > 1 and value.stride(dim) != expected:
            raise ValueError(
                f"{name} must be contiguous in its last {contiguous_dims} dims {shape}, "
                f"got strides {value.stride()}"
            )
        expected *= value.size(dim)
    return value


def check_size(name: str, tensor: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Raise ValueError unless ``tensor.size(dim) == expected``."""
    if tensor.size(dim) != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} ({expected}), got {tensor.size(dim)}"
        )


def check_head_dim(name: str, head_dim: int) -> None:
    """Raise ValueError unless head_dim is even (RoPE pairs its halves) and in
    ``MIN_HEAD_DIM .. MAX_HEAD_DIM``. It need not be a power of two: the kernels tile it
    padded to ``head_dim_tile(head_dim)`` and mask the tail lanes."""
    if head_dim % 2 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"{name} head_dim must be even and in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {head_dim}"
        )


def head_dim_tile(head_dim: int) -> int:
    """The kernels' tile along head_dim: the next power of two, at least 16 (``tl.dot``'s
    smallest operand); lanes past head_dim are masked."""
    return max(MIN_DOT_DIM, 1 << (head_dim - 1).bit_length())


def check_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` unless given; must be a positive number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    return float(scale)
