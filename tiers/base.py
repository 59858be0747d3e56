"""The tier contract: byte stores with a capacity, keyed by opaque bytes.

A tier knows nothing of KV caches, models or blocks: it stores a blob under a key and gives
it back. The tier manager (``kvstore.store``) decides what goes where; a tier only keeps its
promise of never holding more than ``capacity()`` bytes and never showing a half-written blob.

Primitives, in the order a tier's life uses them:

1. ``start()`` -- open files, connect, rebuild state (the SSD tier re-reads its directory).
2. ``put(key, data)`` -> ``True`` when stored, ``False`` when there is no room (a value,
   not an exception: the manager evicts and retries). Putting an existing key replaces it
   atomically; a reader sees the old blob or the new one, never a mix.
3. ``get(key)`` -> the blob, or ``None`` on a miss.
4. ``get_range(key, offset, length)`` -> ``length`` bytes from ``offset`` (fewer at the end of
   the blob), or ``None`` on a miss. Used for one layer of a block.
5. ``contains(key)``, ``delete(key)`` -> ``bool``; ``contains_many(keys)`` -> one ``bool`` per
   key in one round trip (the Redis tier pipelines it); ``keys()`` lists what is held (for
   Redis: what this instance wrote and has not seen disappear).
6. ``usage()`` / ``capacity()`` in bytes, ``healthy()`` for tiers that can be unreachable.
7. ``aclose()`` -- release files, mappings and connections. Every tier is an async context
   manager doing ``start()`` / ``aclose()``.

Errors that are the caller's fault (a key of the wrong type or length, a blob larger than the
whole tier, a negative range) raise :class:`TierError` subclasses. Expected outcomes (a miss,
a full tier, Redis being down) are values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, Self, runtime_checkable

Buffer = bytes | bytearray | memoryview

MAX_KEY_BYTES = 64


class TierError(Exception):
    """Base class of the errors raised by tiers."""


class InvalidKeyError(TierError, ValueError):
    """A key that is not bytes, is empty or is longer than :data:`MAX_KEY_BYTES`."""


class InvalidRangeError(TierError, ValueError):
    """A negative offset or length in ``get_range``."""


class BlobTooLargeError(TierError, ValueError):
    """A blob larger than the tier's whole capacity: no eviction can ever make room."""


class TierClosedError(TierError, RuntimeError):
    """The tier is not started, or already closed."""


def check_key(key: object) -> bytes:
    """Returns ``key`` as bytes, or raises :class:`InvalidKeyError` naming the problem."""
    if not isinstance(key, bytes | bytearray):
        raise InvalidKeyError(f"key must be bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidKeyError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)} bytes")
    return bytes(key)


def check_range(offset: int, length: int) -> None:
    """Raises :class:`InvalidRangeError` for a negative ``offset`` or ``length``."""
    if offset < 0 or length < 0:
        raise InvalidRangeError(f"range must be non-negative, got offset={offset} length={length}")


@runtime_checkable
class Tier(Protocol):
    """A byte store with a capacity. See the module docstring for the lifecycle."""

    name: str

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    async def put(self, key: bytes, data: Buffer) -> bool: ...

    async def get(self, key: bytes) -> bytes | None: ...

    async def get_range(self, key: bytes, offset: int, length: int) -> bytes | None: ...

    async def contains(self, key: bytes) -> bool: ...

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    async def delete(self, key: bytes) -> bool: ...

    def keys(self) -> Iterable[bytes]: ...

    def usage(self) -> int: ...

    def capacity(self) -> int: ...

    def healthy(self) -> bool: ...


@runtime_checkable
class HashedReads(Protocol):
    """A tier that can copy a raw blob and hash the copy (xxh3-64) in one pass."""

    async def get_hashed(self, key: bytes) -> tuple[bytes | memoryview, int] | None: ...
