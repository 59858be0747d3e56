"""Block keys: the one function every engine and every node must compute alike.

A key names the KV of one full block of tokens together with everything before it, under one
model and tenant:

    h_i = SHA-256(h_{i-1} || namespace.digest() || tokens of block i as uint32 little-endian)

with h_{-1} = ``ROOT_KEY``. Equal keys mean equal prefixes, so "how much of this prompt is
cached" is "how many leading keys does the store hold". The hash is cryptographic on purpose
(one tenant must not be able to forge or probe another's keys) and never Python's ``hash()``.

Equal keys must also mean equal KV. KV that is not what a plain prefill of its tokens computes
(a truncated chat's reused blocks, and everything computed on top of them) is keyed under a
``KeySalt``: from block ``from_block`` on, the chain also hashes the salt's digest once, at that
block,

    h_j = SHA-256(h_{j-1} || namespace.digest() || SHA-256(salt) || tokens of block j)

so every key from there on differs from the plain chain's, and only a lookup that names the
same salt (the session that made the KV) finds it.

Primitives:

- ``ModelFingerprint(...)`` -> ``.digest()``: everything about a model that changes its KV
  (defined in :mod:`kvstore.wire.namespace`, shared with the daemon).
- ``Namespace(model, tenant)`` -> ``.digest()``: the fingerprint salted with a tenant.
- ``KeySalt(salt, from_block)``: marks the approximate part of a chain.
- ``block_keys(tokens, namespace, salt=None)`` -> one 32-byte key per full block; the tail is
  not keyed.
- ``shard_keys(keys, rank)``: the keys of tensor-parallel rank ``rank``'s share of the same
  blocks (its KV heads): rank 0 keeps the chain's keys, every other rank gets keys of its own,
  ``SHA-256(domain || rank || key)``, so ranks never collide; ``ROOT_KEY`` stays the root.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

from kvstore.wire.blocks import ROOT_KEY
from kvstore.wire.namespace import ModelFingerprint, Namespace

if TYPE_CHECKING:
    import torch

__all__ = [
    "ROOT_KEY",
    "KeySalt",
    "ModelFingerprint",
    "Namespace",
    "TokenArray",
    "TokenIds",
    "block_keys",
    "shard_keys",
]

_U32_CODE = next(code for code in "IL" if array(code).itemsize == 4)
_TOKEN_LIMIT = 1 << 32


class TokenArray(Protocol):
    """A 1-D integer array: a CPU torch tensor, a numpy array."""

    def tolist(self) -> object: ...


TokenIds: TypeAlias = Sequence[int] | TokenArray

_SALT_DOMAIN = b"kvstore/key-salt/v1\0"
_SHARD_DOMAIN = b"kvstore/tp-shard/v1\0"


@dataclass(frozen=True, slots=True)
class KeySalt:
    """Keys the blocks of a chain from ``from_block`` on apart from the plain chain's.

    Args:
        salt: Names where the KV came from (e.g. a session and the truncation that made it
            approximate); any non-empty bytes.
        from_block: The first block whose KV is not a plain prefill's; the blocks before it
            keep their plain keys (and stay shared).
    """

    salt: bytes
    from_block: int

    def __post_init__(self) -> None:
        if not isinstance(self.salt, bytes) or not self.salt:
            raise ValueError(f"salt must be non-empty bytes, got {self.salt!r}")
        if isinstance(self.from_block, bool) or not isinstance(self.from_block, int):
            raise ValueError(f"from_block must be an int, got {self.from_block!r}")
        if self.from_block < 0:
            raise ValueError(f"from_block must be >= 0, got {self.from_block}")

    def digest(self) -> bytes:
        """SHA-256 of the salt (32 bytes), the value the chain hashes."""
        return hashlib.sha256(_SALT_DOMAIN + self.salt).digest()


def block_keys(tokens: TokenIds, namespace: Namespace, salt: KeySalt | None = None) -> list[bytes]:
    """Keys of the full blocks of a token sequence.

    Args:
        tokens: Token ids, each in [0, 2**32): a list, tuple, ``array.array``, or a 1-D
            integer CPU torch tensor or numpy array.
        namespace: The model and tenant the KV belongs to.
        salt: Keys blocks ``salt.from_block`` on as approximate KV of that origin; None:
            the plain chain.

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
    salted_at = -1 if salt is None else salt.from_block * step
    keys: list[bytes] = []
    key = ROOT_KEY
    for start in range(0, len(data) - step + 1, step):
        hasher = hashlib.sha256(key)
        hasher.update(ns_digest)
        if start == salted_at and salt is not None:
            hasher.update(salt.digest())
        hasher.update(data[start : start + step])
        key = hasher.digest()
        keys.append(key)
    return keys


def shard_keys(keys: Sequence[bytes], rank: int) -> list[bytes]:
    """The keys of tensor-parallel rank ``rank``'s share of the blocks ``keys`` name.

    Raises:
        ValueError: ``rank`` is negative.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if rank == 0:
        return list(keys)
    prefix = _SHARD_DOMAIN + rank.to_bytes(4, "little")
    return [key if key == ROOT_KEY else hashlib.sha256(prefix + key).digest() for key in keys]


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
