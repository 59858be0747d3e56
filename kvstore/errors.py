"""The daemon's error tree. A miss is a value (``None`` or a count), never one of these.

The gRPC servicer maps each class to one status code in one table; the client maps them back.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of the errors raised by the block store."""


class InvalidBlockError(StoreError, ValueError):
    """A block with a malformed key, parent, layout or a payload of the wrong size."""


class UnknownLeaseError(StoreError, KeyError):
    """A lease id that was never issued, already released or expired."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown lease"


class StoreClosedError(StoreError, RuntimeError):
    """The store is not started, or already closed."""


class NoArenaError(StoreError, RuntimeError):
    """A shared-memory operation on a daemon without a host tier."""


class InvalidRequestError(StoreError, ValueError):
    """A request the daemon refuses as malformed: a bad key, count, size or fingerprint."""


class UnknownNamespaceError(StoreError, LookupError):
    """A namespace digest that was never registered with this daemon (since it started)."""


class PermissionDeniedError(StoreError, PermissionError):
    """A caller using a namespace or lease of another tenant, or registering for one."""


class UnauthenticatedError(StoreError, PermissionError):
    """A call without a bearer token, or with one the daemon does not know."""


class ResourceExhaustedError(StoreError):
    """A request past a configured limit: a block larger than ``server.max_block_bytes`` or
    the top tier, too many namespaces, leases or sessions, too many bytes buffered."""


class UnknownSessionError(StoreError, LookupError):
    """A shared-memory session that is not open (never was, closed, or another tenant's)."""
