"""The client's exception tree and the one table that maps gRPC status codes back to it.

The daemon's servicer maps its own errors to status codes; :func:`error_from_rpc` turns a
failed call back into one class of this tree, keeping the server's message. A miss is never
one of these: lookups return counts, gets return shorter lists.

``NOT_FOUND`` names one thing per call: a lease for ``Release``, the namespace for every call
that carries one (the daemon forgot it, e.g. it restarted). The client re-registers and
retries once on :class:`UnknownNamespaceError` before it ever reaches the caller.

Only :data:`TRANSIENT` errors are retried, and only by idempotent calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import grpc

__all__ = [
    "TRANSIENT",
    "CorruptBlockError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "KVStoreError",
    "NotConnectedError",
    "NotFoundError",
    "PermissionDeniedError",
    "ProtocolError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnknownLeaseError",
    "UnknownNamespaceError",
    "error_from_rpc",
    "error_from_status",
]


class KVStoreError(Exception):
    """Base class of every error the client raises about the daemon.

    Attributes:
        code: The gRPC status code of the failed call, ``None`` for client-side errors.
        method: The RPC that failed (``"Lookup"``), ``None`` for client-side errors.
    """

    def __init__(
        self, message: str, *, code: grpc.StatusCode | None = None, method: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.method = method


class InvalidArgumentError(KVStoreError):
    """The daemon refused the request's arguments (bad key, wrong payload size, ...)."""


class NotFoundError(KVStoreError):
    """Something the call names does not exist on the daemon."""


class UnknownNamespaceError(NotFoundError):
    """The daemon does not know the namespace (never registered, or it restarted)."""


class UnknownLeaseError(NotFoundError):
    """The lease was never issued, already released, or expired."""


class PermissionDeniedError(KVStoreError):
    """The token may not use this namespace (another tenant's)."""


class UnauthenticatedError(KVStoreError):
    """No token, or a token the daemon does not accept."""


class ResourceExhaustedError(KVStoreError):
    """A request over the daemon's message limit, or no resources left for it."""


class FailedPreconditionError(KVStoreError):
    """The daemon cannot serve the call in its state (e.g. a shm call without a host tier)."""


class UnavailableError(KVStoreError):
    """The daemon cannot be reached (not running, restarting, socket gone)."""


class DeadlineExceededError(KVStoreError):
    """The call did not finish within the client's timeout."""


class ProtocolError(KVStoreError):
    """The daemon answered something the client cannot use (slot outside the arena, ...)."""


class CorruptBlockError(KVStoreError):
    """A block read back does not match the checksum recorded when it was stored (only
    checked by a client created with ``verify=True``); nothing of it is returned."""


class NotConnectedError(KVStoreError):
    """The client is not connected: ``connect()`` was not called, or it is closed."""


# The one table: status code -> class. Codes not listed map to KVStoreError itself.
_BY_CODE: Final[Mapping[grpc.StatusCode, type[KVStoreError]]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}

# What NOT_FOUND means per call; calls not listed carry a namespace and mean that.
_NOT_FOUND_BY_METHOD: Final[Mapping[str, type[NotFoundError]]] = {
    "Release": UnknownLeaseError,
    "Handshake": NotFoundError,
    "RegisterNamespace": NotFoundError,
    "Stats": NotFoundError,
}

TRANSIENT: Final = (UnavailableError, DeadlineExceededError)


def error_from_rpc(error: grpc.RpcError, method: str) -> KVStoreError:
    """The client error for a failed call, with the server's message.

    Args:
        error: What grpc raised (an ``AioRpcError`` or any ``RpcError`` with ``code()``).
        method: The RPC's name, e.g. ``"Lookup"``.

    Returns:
        An instance of the class the status code maps to.
    """
    code = _call_attr(error, "code")
    details = _call_attr(error, "details")
    return error_from_status(
        code if isinstance(code, grpc.StatusCode) else None,
        details if isinstance(details, str) else "",
        method,
    )


def error_from_status(code: grpc.StatusCode | None, details: str, method: str) -> KVStoreError:
    """The client error for a call that ended with status ``code`` (None: unknown) and the
    server's message ``details``, over gRPC or a session socket."""
    cls = KVStoreError if code is None else _BY_CODE.get(code, KVStoreError)
    if cls is NotFoundError:
        cls = _NOT_FOUND_BY_METHOD.get(method, UnknownNamespaceError)
    name = "UNKNOWN" if code is None else code.name
    return cls(details or f"{method} failed: {name}", code=code, method=method)


def _call_attr(error: grpc.RpcError, name: str) -> object:
    attr = getattr(error, name, None)
    return attr() if callable(attr) else None
