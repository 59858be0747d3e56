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
