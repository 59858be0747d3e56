"""Block keys: the one function every engine and every node must compute alike.

A key names the KV of one full block of tokens together with everything before it, under one
model and tenant:

    h_i = SHA-256(h_{i-1} || namespace.digest() || tokens of block i as uint32 little-endian)

with h_{-1} = ``ROOT_KEY``. Equal keys mean equal prefixes, so "how much of this prompt is
cached" is "how many leading keys does the store hold". The hash is cryptographic on purpose
(one tenant must not be able to forge or probe another's keys) and never Python's ``hash()``.

Primitives:

- ``ModelFingerprint(...)`` -> ``.digest()``: everything about a model that changes its KV.
- ``Namespace(model, tenant)`` -> ``.digest()``: the fingerprint salted with a tenant.
- ``block_keys(tokens, namespace)`` -> one 32-byte key per full block; the tail is not keyed.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

from kvstore.blocks import DTYPE_BYTES, ROOT_KEY, BlockLayout

if TYPE_CHECKING:
    import torch

__all__ = ["ROOT_KEY", "ModelFingerprint", "Namespace", "TokenArray", "TokenIds", "block_keys"]

_FINGERPRINT_DOMAIN = b"kvstore/model-fingerprint/v1\0"
_NAMESPACE_DOMAIN = b"kvstore/namespace/v1\0"
_U32_CODE = next(code for code in "IL" if array(code).itemsize == 4)
_TOKEN_LIMIT = 1 << 32


class TokenArray(Protocol):
    """A 1-D integer array: a CPU torch tensor, a numpy array."""

    def tolist(self) -> object: ...


TokenIds: TypeAlias = Sequence[int] | TokenArray
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

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty str, got {self.model_name!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
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
        """The layout of one block of this model's KV.

        Raises:
            ValueError: The block exceeds the stored form's limits.
        """
        return BlockLayout(
            self.num_layers, self.num_kv_heads, self.block_tokens, self.head_dim, self.dtype
        )

    def digest(self) -> bytes:
        """SHA-256 of a canonical, versioned encoding of every field (32 bytes)."""
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
        scaling = config.get("rope_scaling") or {}
        if not isinstance(scaling, Mapping):
            raise ValueError(f"rope_scaling must be a mapping, got {scaling!r}")
        return cls(
            model_name=model_name,
            num_layers=_config_int(config, "num_hidden_layers"),
            num_kv_heads=_config_int(config, "num_key_value_heads", heads),
            head_dim=_config_int(config, "head_dim", _config_int(config, "hidden_size") // heads),
            dtype=dtype,
            block_tokens=block_tokens,
            rope_theta=_config_float(config, "rope_theta", 10000.0),
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
        """SHA-256 over the model digest and the length-prefixed tenant (32 bytes)."""
        tenant = self.tenant.encode("utf-8")
        return hashlib.sha256(
            _NAMESPACE_DOMAIN + self.model.digest() + struct.pack("<Q", len(tenant)) + tenant
        ).digest()


def block_keys(tokens: TokenIds, namespace: Namespace) -> list[bytes]:
    """Keys of the full blocks of a token sequence.

    Args:
        tokens: Token ids, each in [0, 2**32): a list, tuple, ``array.array``, or a 1-D
            integer CPU torch tensor or numpy array.
        namespace: The model and tenant the KV belongs to.

    Returns:
        ``len(tokens) // block_tokens`` keys of 32 bytes; key i covers tokens
        ``[0, (i + 1) * block_tokens)``. The partial tail gets no key.

    Raises:
        ValueError: A token is not an integer or lies outside [0, 2**32) (the message names
            its index and value), or a tensor is not 1-D.
    """
    words = _token_words(tokens)
    if sys.byteorder == "big":
        words.byteswap()
    data = memoryview(words).cast("B")
    ns_digest = namespace.digest()
    step = 4 * namespace.model.block_tokens
    keys: list[bytes] = []
    key = ROOT_KEY
    for start in range(0, len(data) - step + 1, step):
        hasher = hashlib.sha256(key)
        hasher.update(ns_digest)
        hasher.update(data[start : start + step])
        key = hasher.digest()
        keys.append(key)
    return keys


def _token_words(tokens: TokenIds) -> array[int]:
    """The token ids as a native-order uint32 array."""
    if "torch" in sys.modules:  # a tensor can only exist once torch is imported
        import torch

        if isinstance(tokens, torch.Tensor):
            return _tensor_words(tokens)
    if isinstance(tokens, bytes | bytearray | memoryview):
        tokens = memoryview(tokens).tolist()
    try:
        return array(_U32_CODE, tokens)  # type: ignore[arg-type]
    except (TypeError, OverflowError, ValueError) as exc:
        _raise_bad_token(tokens)
        raise ValueError(f"tokens must be a sequence of ints: {exc}") from exc


def _tensor_words(tokens: torch.Tensor) -> array[int]:
    import torch

    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    ids = tokens.detach().to("cpu", torch.int64)
    bad = ((ids < 0) | (ids >= _TOKEN_LIMIT)).nonzero()
    if bad.numel():
        index = int(bad[0])
        raise ValueError(f"token {index} is {int(ids[index])}, outside [0, 2**32)")
    words = array(_U32_CODE, bytes(4 * ids.numel()))
    if words:
        torch.frombuffer(words, dtype=torch.uint32).copy_(ids)  # [num_tokens]
    return words


def _raise_bad_token(tokens: object) -> None:
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    if not isinstance(tokens, Sequence):
        raise ValueError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    for index, value in enumerate(tokens):
        if not hasattr(value, "__index__"):
            raise ValueError(f"token {index} is {value!r}, not an integer")
        if not 0 <= value.__index__() < _TOKEN_LIMIT:
            raise ValueError(f"token {index} is {value!r}, outside [0, 2**32)")
