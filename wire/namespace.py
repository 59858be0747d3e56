"""Namespaces: a model fingerprint salted with a tenant, the scope of every block key.

``ModelFingerprint(...).digest()`` covers everything about a model that changes its KV
(name, layers, kv heads, head dim, dtype, block tokens, RoPE parameters);
``Namespace(model, tenant).digest()`` adds the tenant salt, so tenants' keys never collide.
The daemon computes the same digest when a client registers a namespace, and checks that a
token only uses its own tenant's namespaces. Block keys themselves are computed client side
(:func:`kvstore.client.block_keys`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

from kvstore.wire.blocks import DTYPE_BYTES, BlockLayout

__all__ = ["ModelFingerprint", "Namespace", "RopeScaling"]

# v2: stored K is after RoPE, at the positions its chain gives (v1 held it before RoPE), so
# blocks written under v1 are never read as v2. v3: a block's layer is token-major,
# [2, block_tokens, kv_heads, head_dim] (v2 had heads outside tokens), so v2 blocks are never
# read as v3.
_FINGERPRINT_DOMAIN = b"kvstore/model-fingerprint/v3\0"
_NAMESPACE_DOMAIN = b"kvstore/namespace/v1\0"

RopeScaling: TypeAlias = tuple[tuple[str, str | float], ...]


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_float(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _normalize_scaling(pairs: RopeScaling) -> RopeScaling:
    normalized: dict[str, str | float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"rope_scaling must hold (name, value) pairs, got {pair!r}")
        name, value = pair
        if not isinstance(name, str) or not name or name in normalized:
            raise ValueError(f"rope_scaling keys must be distinct non-empty str, got {name!r}")
        normalized[name] = (
            value if isinstance(value, str) else _check_float(f"rope_scaling[{name!r}]", value)
        )
    return tuple(sorted(normalized.items()))


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Everything about a model that changes the bytes of its KV cache.

    ``rope_scaling`` holds the rope-scaling config as (name, value) pairs; it is stored sorted,
    and int values are stored as floats so ``8192`` and ``8192.0`` agree.
    """

    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int = 256
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = ()
    # Tensor-parallel ranks the KV heads are split over; ``num_kv_heads`` is one rank's share.
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty str, got {self.model_name!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            _check_positive(name, getattr(self, name))
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        theta = _check_float("rope_theta", self.rope_theta)
        if theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        object.__setattr__(self, "rope_theta", theta)
        object.__setattr__(self, "rope_scaling", _normalize_scaling(tuple(self.rope_scaling)))
        self.layout()  # the block must also fit the stored form's limits

    def layout(self) -> BlockLayout:
        """The layout of one block of this model's KV (made once per fingerprint).

        Raises:
            ValueError: The block exceeds the stored form's limits.
        """
        return _layout(self)

    def _layout(self) -> BlockLayout:
        return BlockLayout(
            self.num_layers, self.num_kv_heads, self.block_tokens, self.head_dim, self.dtype
        )

    def digest(self) -> bytes:
        """SHA-256 of a canonical, versioned encoding of every field (32 bytes; computed once
        per fingerprint: every block key of every request hashes it in)."""
        return _model_digest(self)

    def _digest(self) -> bytes:
        fields = {
            "model_name": self.model_name,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
            "rope_theta": self.rope_theta.hex(),  # exact, unlike a decimal repr
            "rope_scaling": [[name, _tagged(value)] for name, value in self.rope_scaling],
        }
        if self.tp_size != 1:  # absent at 1: the digests of unsplit models stay as they were
            fields["tp_size"] = self.tp_size
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(_FINGERPRINT_DOMAIN + canonical.encode("ascii")).digest()

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, object], *, model_name: str, dtype: str, block_tokens: int = 256
    ) -> ModelFingerprint:
        """Build a fingerprint from a Hugging Face ``config.json`` dict (Llama family).

        Args:
            config: The parsed config.
            model_name: Names the weights, alike on every node (e.g. the hub id; not a local
                path, which would split the cache between nodes).
            dtype: The KV cache dtype.
            block_tokens: Tokens per block.

        Raises:
            ValueError: A needed field is missing or malformed.
        """
        heads = _config_int(config, "num_attention_heads")
        # Older configs: rope_theta + rope_scaling; transformers 5: both in rope_parameters.
        scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(scaling, Mapping):
            raise ValueError(f"rope_scaling must be a mapping, got {scaling!r}")
        scaling = dict(scaling)
        theta = scaling.pop("rope_theta", None)
        if set(scaling) <= {"rope_type", "type"} and scaling.get(
            "rope_type", scaling.get("type", "default")
        ) in ("default", None):
            scaling = {}  # plain RoPE, however the config spells it
        return cls(
            model_name=model_name,
            num_layers=_config_int(config, "num_hidden_layers"),
            num_kv_heads=_config_int(config, "num_key_value_heads", heads),
            head_dim=_config_int(config, "head_dim", _config_int(config, "hidden_size") // heads),
            dtype=dtype,
            block_tokens=block_tokens,
            rope_theta=float(theta)
            if isinstance(theta, int | float)
            else _config_float(config, "rope_theta", 10000.0),
            rope_scaling=tuple(
                (str(name), _scaling_value(value)) for name, value in scaling.items()
            ),
        )


def _tagged(value: str | float) -> dict[str, str]:
    return {"s": value} if isinstance(value, str) else {"f": value.hex()}


def _config_int(config: Mapping[str, object], name: str, default: int | None = None) -> int:
    value = config.get(name, default)
    if value is None:  # HF configs write null for "same as the default"
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config field {name} must be an int, got {value!r}")
    return value


def _config_float(config: Mapping[str, object], name: str, default: float) -> float:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"config field {name} must be a number, got {value!r}")
    return float(value)


def _scaling_value(value: object) -> str | float:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))  # lists, null, booleans


@dataclass(frozen=True, slots=True)
class Namespace:
    """A model fingerprint salted with a tenant; keys never collide across namespaces."""

    model: ModelFingerprint
    tenant: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelFingerprint):
            raise ValueError(f"model must be a ModelFingerprint, got {type(self.model).__name__}")
        if not isinstance(self.tenant, str):
            raise ValueError(f"tenant must be a str, got {self.tenant!r}")

    def digest(self) -> bytes:
        """SHA-256 over the model digest and the length-prefixed tenant (32 bytes; computed
        once per namespace)."""
        return _namespace_digest(self)

    def _digest(self) -> bytes:
        tenant = self.tenant.encode("utf-8")
        return hashlib.sha256(
            _NAMESPACE_DOMAIN + self.model.digest() + struct.pack("<Q", len(tenant)) + tenant
        ).digest()


# Values are frozen, so what they derive is derived once (a process sees few models).
_layout = functools.lru_cache(maxsize=256)(ModelFingerprint._layout)
_model_digest = functools.lru_cache(maxsize=256)(ModelFingerprint._digest)
_namespace_digest = functools.lru_cache(maxsize=1024)(Namespace._digest)
