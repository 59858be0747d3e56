"""Client side of kvstore: block keys, and the gRPC + shared-memory client of the daemon.

Keys are computed here, never in the daemon, so every engine and every node agrees on them:
``block_keys(tokens, Namespace(ModelFingerprint(...), tenant))`` -> one key per full block.

``AsyncKVStoreClient`` (asyncio) and ``KVStoreClient`` (blocking, the same methods) talk to the
daemon: lookup, get/view, put, prefetch, delete, stats, health. Errors are the classes of
:mod:`kvstore.client.errors`; a miss is a value (a count, a shorter list).
"""

from kvstore.client.client import AsyncKVStoreClient
from kvstore.client.errors import (
    CorruptBlockError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVStoreError,
    NotConnectedError,
    NotFoundError,
    PermissionDeniedError,
    ProtocolError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnknownLeaseError,
    UnknownNamespaceError,
)
from kvstore.client.keys import (
    ROOT_KEY,
    KeySalt,
    ModelFingerprint,
    Namespace,
    block_keys,
    shard_keys,
)
from kvstore.client.sync import KVStoreClient
from kvstore.client.transfer import Found, SharedLease
from kvstore.client.wire import LookupResult, ServerInfo, Stats, TierStats, WriteStatus

__all__ = [
    "ROOT_KEY",
    "AsyncKVStoreClient",
    "CorruptBlockError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "Found",
    "InvalidArgumentError",
    "KVStoreClient",
    "KVStoreError",
    "KeySalt",
    "LookupResult",
    "ModelFingerprint",
    "Namespace",
    "NotConnectedError",
    "NotFoundError",
    "PermissionDeniedError",
    "ProtocolError",
    "ResourceExhaustedError",
    "ServerInfo",
    "SharedLease",
    "Stats",
    "TierStats",
    "UnauthenticatedError",
    "UnavailableError",
    "UnknownLeaseError",
    "UnknownNamespaceError",
    "WriteStatus",
    "block_keys",
    "shard_keys",
]
