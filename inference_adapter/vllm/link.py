"""A daemon connection that fails soft: vLLM keeps serving while the daemon is away.

``Link.call(fn)`` runs ``fn(client)`` on a connected :class:`~kvstore.client.KVStoreClient`,
connecting first when there is none. When the daemon cannot be reached (at start or later),
the failure is logged once, the client is dropped, and for ``retry_s`` every call fails at
once with :class:`DaemonDown` instead of waiting on a dead socket: the caller answers "miss"
and vLLM recomputes. The first call after that tries again; the first success logs one line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvstore.client import KVStoreClient, Namespace

__all__ = ["DaemonDown", "Link"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class DaemonDown(ConnectionError):
    """The daemon did not answer; the connector waits ``retry_s`` before trying again."""


class Link:
    """A lazily (re)connected client; see the module docstring.

    Args:
        address: The daemon's address.
        namespace: Registered on every new connection.
        retry_s: How long to answer ``DaemonDown`` after a failure.
        role: Names this side in log lines ("scheduler", "worker").
        client_options: Passed to :class:`KVStoreClient` (token, timeout, retries, use_shm).
    """

    def __init__(
        self,
        address: str,
        namespace: Namespace,
        *,
        retry_s: float,
        role: str,
        **client_options: object,
    ) -> None:
        self.address = address
        self.namespace = namespace
        self.retry_s = retry_s
        self.role = role
        self._options = client_options
        self._client: KVStoreClient | None = None
        self._down_until = 0.0
        self._was_down = False
        self._lock = threading.Lock()
        self.failures = 0

    def call(self, fn: Callable[[KVStoreClient], T]) -> T:
        """``fn(client)``; ``DaemonDown`` when the daemon cannot be reached now.

        Any other error passes through; the client is dropped (and the daemon counted down)
        unless the error is about the call's own arguments or answer (``ValueError``,
        ``LookupError``), which a new connection would not change.
        """
        client = self._connected()
        try:
            return fn(client)
        except (ValueError, LookupError):
            raise
        except Exception as error:
            self._failed(client, error)
            raise

    def warm(self) -> bool:
        """Connects now (at start, off the first request's path); ``False`` when the daemon
        is down, which is logged and retried later like any failure."""
        try:
            self._connected()
        except DaemonDown:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _connected(self) -> KVStoreClient:
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until:
                raise DaemonDown(f"kvstore daemon at {self.address} is down")
            client = KVStoreClient(self.address, **self._options)  # type: ignore[arg-type]
            try:
                client.connect()
                client.register(self.namespace)
            except Exception as error:
                client.close()
                self._mark_down(error)
                raise DaemonDown(f"kvstore daemon at {self.address}: {error}") from error
            if self._was_down:
                log.warning("kvstore %s: daemon at %s answers again", self.role, self.address)
            self._was_down = False
            self._client = client
            return client

    def _failed(self, client: KVStoreClient, error: Exception) -> None:
        with self._lock:
            if self._client is not client:
                return  # another thread already dropped it
            self._client = None
            self._mark_down(error)
        client.close()

    def _mark_down(self, error: Exception) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.retry_s
        if not self._was_down:
            log.warning(
                "kvstore %s: daemon at %s unreachable (%s); vLLM recomputes until it answers",
                self.role,
                self.address,
                error,
            )
        self._was_down = True
