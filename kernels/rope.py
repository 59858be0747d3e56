"""Rotary position embedding as Llama and Hugging Face compute it, with llama3 scaling.

The convention is Hugging Face's ``rotate_half``: dims ``[0, head_dim/2)`` pair with dims
``[head_dim/2, head_dim)`` (not interleaved pairs). For position p and frequency i::

    out[i]        = x[i] * cos(p * inv_freq[i]) - x[i + half] * sin(p * inv_freq[i])
    out[i + half] = x[i + half] * cos(p * inv_freq[i]) + x[i] * sin(p * inv_freq[i])

computed in float32 and cast back. Un-rotating (``inverse=True``) negates the sine.

Primitives, in order of use:

- ``RopeConfig`` (``from_hf_config`` / ``from_scaling``): head_dim, ``rope_theta`` and the
  scaling. Only ``default`` and ``llama3`` scaling are computed; any other ``rope_type``
  raises ``UnsupportedRopeScalingError`` rather than silently computing plain RoPE.
- ``inv_freq(config)`` -> ``[head_dim / 2]`` float32, bit-for-bit what transformers computes.
- ``rope_tables(config, max_positions, device)`` -> ``RopeTables``: cos and sin
  ``[max_positions, head_dim / 2]`` float32. The Triton copy kernels and the torch
  references read the same tables, so both round identically.
- ``apply_rope(x, positions, tables, inverse=...)``: rotate (or un-rotate) any
  ``[..., head_dim]`` tensor; the torch reference of the rotation inside the copy kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvstore.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_head_dim, check_tensor

TABLE_SHAPE = "[max_positions, head_dim // 2]"
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class UnsupportedRopeScalingError(ValueError):
    """A rope-scaling type these kernels do not compute."""


@dataclass(frozen=True, slots=True)
class Llama3Scaling:
    """Llama 3.1 frequency scaling (``rope_type: llama3`` in a Hugging Face config)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(
                "llama3 scaling needs factor > 0 and 0 < low_freq_factor < high_freq_factor, "
                f"got {self.factor}, {self.low_freq_factor}, {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "original_max_position_embeddings must be positive, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Everything that fixes the rotation of one model's K and Q."""

    head_dim: int
    theta: float = 10000.0
    scaling: Llama3Scaling | None = None

    def __post_init__(self) -> None:
        check_head_dim("RopeConfig", self.head_dim)
        if not (math.isfinite(self.theta) and self.theta > 0):
            raise ValueError(f"rope theta must be a positive number, got {self.theta!r}")

    @classmethod
    def from_scaling(
        cls, head_dim: int, theta: float, rope_scaling: Mapping[str, object] | None
    ) -> RopeConfig:
        """Build from a Hugging Face ``rope_scaling`` (or ``rope_parameters``) mapping.

        Args:
            head_dim: Dims per head.
            theta: ``rope_theta``.
            rope_scaling: The mapping, or None / empty for plain RoPE. The type is read from
                ``rope_type`` (or the legacy ``type``).

        Raises:
            UnsupportedRopeScalingError: A type other than ``default`` or ``llama3``, or a
                ``partial_rotary_factor`` other than 1.
            ValueError: A llama3 parameter is missing or out of range.
        """
        params = dict(rope_scaling or {})
        kind = params.get("rope_type", params.get("type", "default"))
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedRopeScalingError(
                f"partial_rotary_factor {params['partial_rotary_factor']!r} is not supported"
            )
        if kind == "default":
            return cls(head_dim, float(theta))
        if kind != "llama3":
            raise UnsupportedRopeScalingError(
                f"rope scaling type {kind!r} is not supported (supported: default, llama3)"
            )
        values = [params.get(key) for key in _LLAMA3_KEYS]
        numbers = [
            float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if len(numbers) != len(values):
            raise ValueError(f"llama3 rope scaling needs numbers for {', '.join(_LLAMA3_KEYS)}")
        scaling = Llama3Scaling(numbers[0], numbers[1], numbers[2], int(numbers[3]))
        return cls(head_dim, float(theta), scaling)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object]) -> RopeConfig:
        """Build from a Llama-family ``config.json`` dict (transformers 4 or 5 spelling).

        Raises:
            UnsupportedRopeScalingError, ValueError: As ``from_scaling``, or a size is missing.
        """
        heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
        head_dim = config.get("head_dim")
        if not isinstance(head_dim, int):
            if not (isinstance(heads, int) and isinstance(hidden, int) and heads > 0):
                raise ValueError("config needs head_dim, or hidden_size and num_attention_heads")
            head_dim = hidden // heads
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"rope_scaling must be a mapping, got {params!r}")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        if not isinstance(theta, int | float):
            raise ValueError(f"rope_theta must be a number, got {theta!r}")
        return cls.from_scaling(head_dim, float(theta), params)


def inv_freq(config: RopeConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32, computed as transformers does."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=device).float()
    inv = 1.0 / (config.theta ** (exponents / config.head_dim))
    scaling = config.scaling
    if scaling is None:
        return inv
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_freq_wavelen, inv / scaling.factor, inv)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True, slots=True)
class RopeTables:
    """cos and sin of ``position * inv_freq``, ``[max_positions, head_dim // 2]`` float32."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor("cos", self.cos, shape=TABLE_SHAPE, dtypes=(torch.float32,), contiguous_dims=2)
        check_tensor(
            "sin",
            self.sin,
            shape=TABLE_SHAPE,
            dtypes=(torch.float32,),
            device=self.cos.device,
            contiguous_dims=2,
        )
        if self.sin.shape != self.cos.shape:
            raise ValueError(f"sin shape {tuple(self.sin.shape)} must equal cos shape")

    @property
    def head_dim(self) -> int:
        """Dims per head the tables rotate."""
        return 2 * self.cos.size(1)

    @property
    def max_positions(self) -> int:
        """Positions 0 .. max_positions - 1 are covered."""
        return self.cos.size(0)


def rope_tables(
    config: RopeConfig, max_positions: int, device: torch.device | str = "cpu"
) -> RopeTables:
    """cos/sin tables for positions ``0 .. max_positions - 1`` on ``device``."""
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    positions = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    freqs = positions[:, None] * inv_freq(config, device)[None, :]
    return RopeTables(freqs.cos().contiguous(), freqs.sin().contiguous())


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, tables: RopeTables, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate ``x`` to ``positions`` (or, with ``inverse``, rotate it back from them).

    Args:
        x: ``[..., head_dim]`` float16, bfloat16 or float32.
        positions: Integer positions broadcastable to ``x.shape[:-1]``, each in
            ``0 .. tables.max_positions - 1``.
        tables: From ``rope_tables``, on x's device.
        inverse: Un-rotate instead.

    Returns:
        A new tensor shaped and typed like ``x``.

    Raises:
        ValueError: Mismatched head_dim, device or dtypes.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        raise ValueError("x must be a float16, bfloat16 or float32 tensor [..., head_dim]")
    if x.size(-1) != tables.head_dim or x.device != tables.cos.device:
        raise ValueError(
            f"x [..., {x.size(-1)}] on {x.device} does not match tables for head_dim "
            f"{tables.head_dim} on {tables.cos.device}"
        )
    if not isinstance(positions, torch.Tensor) or positions.dtype not in INDEX_DTYPES:
        raise ValueError("positions must be an int32 or int64 tensor")
    cos, sin = tables.cos[positions], tables.sin[positions]
    if inverse:
        sin = -sin
    x1, x2 = x.float().chunk(2, dim=-1)
    # Same operations in the same order as the copy kernels, so results match bit for bit.
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
