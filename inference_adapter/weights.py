"""A Llama checkpoint on disk: its ``config.json`` and its safetensors weights.

Reads the Hugging Face layout from a local folder, nothing from the network:

- ``LlamaConfig.from_dict`` / ``read_config(folder)``: the sizes the model and the KV pool
  need, from a ``config.json`` in the transformers 4 or 5 spelling. RoPE parameters go
  through ``kvstore.kernels.rope.RopeConfig``, so a scaling type the kernels do not compute
  (anything but default and llama3) is refused with ``UnsupportedRopeScalingError``.
- ``weight_files(folder)``: the ``*.safetensors`` files, following
  ``model.safetensors.index.json`` when the checkpoint is sharded.
- ``read_weights(folder, dtype=..., device=...)``: every tensor by its Hugging Face name.

Building the model from these lives in ``model.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open

from kvstore.client import ModelFingerprint, Namespace
from kvstore.kernels.rope import RopeConfig

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SUPPORTED_MODEL_TYPES = ("llama",)
_T = TypeVar("_T", int, float, bool)
_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false"}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The architecture of one Llama-family checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope: RopeConfig
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        sizes = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for key, value in sizes.items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope.head_dim != self.head_dim:
            raise ValueError(f"rope head_dim {self.rope.head_dim} != head_dim {self.head_dim}")

    @classmethod
    def from_dict(cls, config: Mapping[str, object]) -> LlamaConfig:
        """Build from a ``config.json`` dict.

        Raises:
            ValueError: A required key is missing, a value has the wrong type, or the model
                type or activation is not Llama's.
            UnsupportedRopeScalingError: A rope scaling other than default or llama3.
        """
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported: {SUPPORTED_MODEL_TYPES}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be silu, got {config['hidden_act']!r}")
        heads = _field(config, "num_attention_heads", int)
        hidden = _field(config, "hidden_size", int)
        head_dim = _field(config, "head_dim", int, hidden // max(heads, 1))
        return cls(
            hidden_size=hidden,
            intermediate_size=_field(config, "intermediate_size", int),
            num_hidden_layers=_field(config, "num_hidden_layers", int),
            num_attention_heads=heads,
            num_key_value_heads=_field(config, "num_key_value_heads", int, heads),
            head_dim=head_dim,
            vocab_size=_field(config, "vocab_size", int),
            rope=RopeConfig.from_hf_config({**config, "head_dim": head_dim}),
            max_position_embeddings=_field(config, "max_position_embeddings", int, 2048),
            rms_norm_eps=_field(config, "rms_norm_eps", float, 1e-6),
            tie_word_embeddings=_field(config, "tie_word_embeddings", bool, False),
            attention_bias=_field(config, "attention_bias", bool, False),
            mlp_bias=_field(config, "mlp_bias", bool, False),
            dtype=_dtype(config),
        )


def read_config(folder: str | Path) -> LlamaConfig:
    """The ``LlamaConfig`` of the checkpoint in ``folder``.

    Raises:
        FileNotFoundError: No ``config.json`` there.
        ValueError, UnsupportedRopeScalingError: As ``LlamaConfig.from_dict``.
    """
    config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} in {folder} must hold a JSON object")
    return LlamaConfig.from_dict(config)


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of the checkpoint in ``folder``, sharded or not.

    Raises:
        FileNotFoundError: No safetensors file there, or the index names a missing shard.
    """
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{INDEX_FILE} names {path.name}, which is missing")
    return files


def read_weights(
    folder: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``folder`` by its Hugging Face name, cast to
    ``dtype`` on ``device``."""
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt", device=str(device)) as shard:
            for name in shard.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                weights[name] = shard.get_tensor(name).to(dtype)
    return weights


def _field(config: Mapping[str, object], key: str, kind: type[_T], default: _T | None = None) -> _T:
    """``config[key]`` as ``kind`` (an int is a fine float, a bool is no number)."""
    value = config.get(key)
    if value is None:  # absent, or null: Hugging Face writes null for "the default"
        value = default
    if value is None:
        raise ValueError(f"config needs {key}")
    accepted = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
        raise ValueError(f"{key} must be {_KIND_NAMES[kind]}, got {value!r}")
    return kind(value)


def _dtype(config: Mapping[str, object]) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[str(name)]


def namespace_for(
    config: LlamaConfig,
    *,
    model_name: str,
    block_tokens: int,
    dtype: torch.dtype | None = None,
    tenant: str = "",
) -> Namespace:
    """The namespace of a Llama model's KV: one fingerprint for the engine and the HF bridge.

    Args:
        config: The architecture (``engine.config``, or ``LlamaConfig.from_dict`` of a
            transformers config).
        model_name: Names the weights alike on every node (a hub id, not a local path).
        block_tokens: Tokens per block (the engine's ``page_tokens``).
        dtype: The KV dtype; ``config.dtype`` when None.
        tenant: The tenant salt.
    """
    fingerprint = ModelFingerprint(
        model_name=model_name,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=str(dtype or config.dtype).removeprefix("torch."),
        block_tokens=block_tokens,
        rope_theta=config.rope.theta,
        rope_scaling=_scaling_pairs(config.rope),
    )
    return Namespace(fingerprint, tenant)


RopeIdentity = tuple[float, tuple[tuple[str, str | float], ...]]


def rope_identity(config: Mapping[str, object], head_dim: int) -> RopeIdentity:
    """``(rope_theta, rope_scaling pairs)`` of any model's ``config.json`` dict, for a
    fingerprint: what makes K after RoPE differ between two otherwise equal models.

    default and llama3 scaling read as :func:`namespace_for` reads them (so a Llama gets the
    same namespace either way); any other type is kept as its parameters, unread: a store
    that copies K as the engine rotated it need not compute it, only tell it apart.

    Raises:
        ValueError: The RoPE parameters are not a mapping, or theta is not a number.
    """
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_scaling must be a mapping, got {params!r}")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise ValueError(f"rope_theta must be a number, got {theta!r}")
    kind = str(params.get("rope_type", params.get("type", "default")))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if kind in ("default", "llama3") and partial in (1, 1.0, None):
        return float(theta), _scaling_pairs(RopeConfig.from_scaling(head_dim, theta, params))
    named = {str(k): v for k, v in params.items() if k not in ("rope_theta", "type")}
    named |= {"rope_type": kind, "partial_rotary_factor": partial if partial is not None else 1}
    return float(theta), tuple((key, _plain(value)) for key, value in sorted(named.items()))


def _scaling_pairs(rope: RopeConfig) -> tuple[tuple[str, str | float], ...]:
    scaling = rope.scaling
    if scaling is None:
        return ()
    return (
        ("rope_type", "llama3"),
        ("factor", scaling.factor),
        ("low_freq_factor", scaling.low_freq_factor),
        ("high_freq_factor", scaling.high_freq_factor),
        ("original_max_position_embeddings", float(scaling.original_max_position_embeddings)),
    )


def _plain(value: object) -> str | float:
    """A number as a float, a string as it is, anything else as its sorted JSON."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
