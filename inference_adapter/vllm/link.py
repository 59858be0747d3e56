"""A daemon connection that fails soft: vLLM keeps serving while the daemon is away.

``Link.call(fn)`` runs ``fn(client)`` on a connected :class:`~kvstore.client.KVStoreClient`
whose calls have the deadline ``call_timeout``. A connection is opened with the longer
``connect_timeout`` (a handshake and the shared-memory session take longer than a Lookup
should). Where there is none:

- ``wait_for_connect=False`` (the scheduler: admission must not wait long): a background
  thread opens one; the call waits for it at most ``call_timeout`` (the deadline it has
  anyway), then fails with :class:`DaemonDown`; the caller answers "miss" and vLLM
  recomputes;
- ``wait_for_connect=True`` (the worker's load and save threads): the call connects first
  (or waits for the connect in flight), whenever the last failure was.

After a failure (at start or later) the link answers ``DaemonDown`` and tries again in the
background every ``retry_s`` until the daemon answers, so it is connected again soon after
the daemon is back, whether or not calls come meanwhile. Links to one address in one
process share the news: when one connects, the others that are down try at once instead of
waiting out their ``retry_s`` (vLLM's engine in one process: the scheduler's lookups hit
again as soon as the worker's first save went through). A daemon going away is logged once,
and so is its return.

``warm()`` connects in the caller's thread, for the start of the process.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from kvstore.client import KVStoreClient, Namespace
from kvstore.wire.outage import Outage

__all__ = ["DaemonDown", "Link"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Every open link of this process (see the module docstring: a link that connects wakes the
# others to its address).
_LINKS: weakref.WeakSet[Link] = weakref.WeakSet()
_LINKS_LOCK = threading.Lock()


class DaemonDown(ConnectionError):
    """No connection to the daemon now; one is being opened, or tried after ``retry_s``."""


class Link:
    """A lazily (re)connected client; see the module docstring.

    Args:
        address: The daemon's address.
        namespace: Registered on every new connection.
        retry_s: How long to answer ``DaemonDown`` after a failure before trying again.
        role: Names this side in log lines ("scheduler", "worker").
        call_timeout: Seconds per call once connected.
        connect_timeout: Seconds per call while connecting.
        wait_for_connect: Whether a call without a connection opens one itself.
        client_options: Passed to :class:`KVStoreClient` (token, retries, use_shm, ...).
    """

    def __init__(
        self,
        address: str,
        namespace: Namespace,
        *,
        retry_s: float,
        role: str,
        call_timeout: float = 10.0,
        connect_timeout: float = 10.0,
        wait_for_connect: bool = False,
        **client_options: object,
    ) -> None:
        self.address = address
        self.namespace = namespace
        self.retry_s = retry_s
        self.role = role
        self.call_timeout = call_timeout
        self.connect_timeout = connect_timeout
        self.wait_for_connect = wait_for_connect
        self._options = client_options
        self._client: KVStoreClient | None = None
        self._connecting: threading.Thread | None = None
        self._retry: threading.Timer | None = None
        self._connect_lock = threading.Lock()
        self._outage = Outage(retry_s)  # under _lock
        self._closed = False
        self._lock = threading.Lock()
        with _LINKS_LOCK:
            _LINKS.add(self)

    @property
    def failures(self) -> int:
        """Failed connects and calls so far."""
        return self._outage.failures

    def call(self, fn: Callable[[KVStoreClient], T]) -> T:
        """``fn(client)``; ``DaemonDown`` at once when there is no connection now.

        Any other error passes through; the client is dropped (and the daemon counted down)
        unless the error is about the call's own arguments or answer (``ValueError``,
        ``LookupError``), which a new connection would not change.
        """
        client = self._client_or_connect()
        try:
            return fn(client)
        except (ValueError, LookupError):
            raise
        except Exception as error:
            self._failed(client, error)
            raise

    def warm(self) -> bool:
        """Connects in this thread (at start, off any request's path); ``False`` when the
        daemon is down, which is logged, and retried later like any failure."""
        return self._connect() is not None

    def close(self) -> None:
        with _LINKS_LOCK:
            _LINKS.discard(self)
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            retry, self._retry = self._retry, None
        if retry is not None:
            retry.cancel()
        if client is not None:
            client.close()

    def _client_or_connect(self) -> KVStoreClient:
        connecting: threading.Thread | None = None
        with self._lock:
            if self._client is not None:
                return self._client
            if self._closed:
                raise DaemonDown(f"kvstore daemon at {self.address}: the link is closed")
            if not self.wait_for_connect:
                if self._outage.due(time.monotonic()):
                    self._start_connecting()
                connecting = self._connecting
        if not self.wait_for_connect:
            if connecting is not None:
                connecting.join(self.call_timeout)
            with self._lock:
                if self._client is not None:
                    return self._client
            raise DaemonDown(f"kvstore daemon at {self.address}: not connected")
        client = self._connect()  # this caller may wait: it connects (or waits for whoever is)
        if client is None:
            raise DaemonDown(f"kvstore daemon at {self.address}: not connected")
        return client

    def _connect(self) -> KVStoreClient | None:
        """Opens a connection unless one exists; one attempt at a time (callers wait)."""
        with self._connect_lock:
            with self._lock:
                if self._client is not None or self._closed:
                    self._done_connecting()
                    return self._client
            client: KVStoreClient | None = None
            try:  # even the client's own thread may fail to start (a process at its limit)
                client = KVStoreClient(
                    self.address,
                    timeout=self.connect_timeout,
                    **self._options,  # type: ignore[arg-type]
                )
                client.connect()
                client.open_session(self.namespace)  # registers it; no request pays for these
                client.timeout = self.call_timeout
            except Exception as error:
                if client is not None:
                    client.close()
                with self._lock:
                    self._done_connecting()
                    self._mark_down(error)
                return None
            with self._lock:
                self._done_connecting()
                if self._closed:
                    client.close()
                    return None
                lasted = self._outage.answered(time.monotonic())
                if lasted is not None:
                    log.warning(
                        "kvstore %s: daemon at %s answers again (down %.1f s)",
                        self.role,
                        self.address,
                        lasted,
                    )
                self._client = client
            self._wake_others()
            return client

    def _wake_others(self) -> None:
        """The daemon answered this link: the other links to its address that are down
        connect now, in the background (a call meanwhile waits for that connect)."""
        with _LINKS_LOCK:
            others = [link for link in _LINKS if link is not self and link.address == self.address]
        for link in others:
            link._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._client is not None or self._closed:
                return
            self._outage.retry_now()
            self._start_connecting()

    def _start_connecting(self) -> None:
        """Under the lock: a background connect, unless one is on its way."""
        if self._connecting is None:
            self._connecting = threading.Thread(
                target=self._connect, name=f"kvstore-{self.role}-connect", daemon=True
            )
            self._connecting.start()

    def _done_connecting(self) -> None:
        """Under the lock: this thread's background connect (if it is one) is over; one
        started meanwhile for another thread stays registered, so calls wait for it."""
        if self._connecting is threading.current_thread():
            self._connecting = None

    def _failed(self, client: KVStoreClient, error: Exception) -> None:
        with self._lock:
            if self._client is not client:
                return  # another thread already dropped it
            self._client = None
            self._mark_down(error)
        client.close()

    def _retry_now(self) -> None:
        """The background retry: connects unless something else did."""
        with self._lock:
            self._retry = None
        self._connect()

    def _mark_down(self, error: Exception) -> None:
        """Under the lock: no new connection for ``retry_s``, then a background retry; one
        log line per outage."""
        began = self._outage.fail(time.monotonic())
        if not self._closed and self._retry is None:
            self._retry = threading.Timer(self.retry_s, self._retry_now)
            self._retry.daemon = True
            self._retry.start()
        if began:
            log.warning(
                "kvstore %s: daemon at %s unreachable (%s); vLLM recomputes until it answers",
                self.role,
                self.address,
                error,
            )
