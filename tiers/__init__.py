"""Byte stores with a capacity: host shared memory, local SSD, Redis.

Tiers know nothing of KV semantics (see :mod:`kvstore.tiers.base` for the contract).
"""

from kvstore.tiers.base import (
    BlobTooLargeError,
    Buffer,
    InvalidKeyError,
    InvalidRangeError,
    Tier,
    TierClosedError,
    TierError,
)

__all__ = [
    "BlobTooLargeError",
    "Buffer",
    "InvalidKeyError",
    "InvalidRangeError",
    "Tier",
    "TierClosedError",
    "TierError",
]
