"""Block keys: the one function every engine and every node must compute alike.

A key names the KV of one full block of tokens together with everything before it, under one
model and tenant:

    h_i = SHA-256(h_{i-1} || namespace.digest() || tokens of block i as uint32 little-endian)

with h_{-1} = ``ROOT_KEY``. Equal keys mean equal prefixes, so "how much of this prompt is
cached" is "how many leading keys does the store hold". The hash is cryptographic on purpose
(one tenant must not be able to forge or probe another's keys) and never Python's ``hash()``.

Primitives:

- ``ModelFingerprint(...)`` -> ``.digest()``: everything about a model that changes its KV
  (defined in :mod:`kvstore.namespace`, shared with the daemon).
- ``Namespace(model, tenant)`` -> ``.digest()``: the fingerprint salted with a tenant.
- ``block_keys(tokens, namespace)`` -> one 32-byte key per full block; the tail is not keyed.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias

from kvstore.blocks import ROOT_KEY
from kvstore.namespace import ModelFingerprint, Namespace

if TYPE_CHECKING:
    import torch

__all__ = ["ROOT_KEY", "ModelFingerprint", "Namespace", "TokenArray", "TokenIds", "block_keys"]

_U32_CODE = next(code for code in "IL" if array(code).itemsize == 4)
_TOKEN_LIMIT = 1 << 32


class TokenArray(Protocol):
    """A 1-D integer array: a CPU torch tensor, a numpy array."""

    def tolist(self) -> object: ...


TokenIds: TypeAlias = Sequence[int] | TokenArray


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
    if sys.modules.get("torch") is not None:  # a tensor can only exist once torch is imported
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
