"""The blocking client: :class:`AsyncKVStoreClient` driven from a private event-loop thread.

Each method of :class:`KVStoreClient` is the async client's method of the same name, run on
one event loop that lives in a daemon thread (``asyncio.run_coroutine_threadsafe``); nothing
is implemented twice. ``view`` and ``view_tensors`` become ordinary context managers.

    with KVStoreClient("unix:/run/kvstore/kvstore.sock") as client:
        n = client.lookup(namespace, keys)
        payloads = client.get(namespace, keys)

A method must not be called from the client's own loop thread (it would wait on itself).
``close()`` may come from any thread while others are in calls: those calls end at once with
``NotConnectedError`` (their work on the loop is cancelled), never waiting on a stopped loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Concatenate, Literal, ParamSpec, Self, TypeVar

from kvstore.client.client import AsyncKVStoreClient
from kvstore.client.connection import StaleArenaError
from kvstore.client.errors import DeadlineExceededError, KVStoreError, NotConnectedError
from kvstore.client.shm import caller_stream
from kvstore.client.transfer import Found, new_lease_id
from kvstore.client.wire import ServerInfo
from kvstore.wire.namespace import Namespace

__all__ = ["KVStoreClient"]

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")


def _blocking(
    method: Callable[Concatenate[AsyncKVStoreClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[KVStoreClient, P], T]:
    """The async client's ``method``, waited for on the client's loop."""

    def call(self: KVStoreClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(method(self._client, *args, **kwargs))

    functools.update_wrapper(call, method)
    return call


def _blocking_copies(
    method: Callable[Concatenate[AsyncKVStoreClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[KVStoreClient, P], T]:
    """Like :func:`_blocking`, for a method that copies to or from CUDA tensors on its
    ``stream``: unless the caller names one, it is the caller's current stream, taken here on
    the caller's thread (the client's loop thread has only the default stream)."""

    def call(self: KVStoreClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        if kwargs.get("stream") is None:
            kwargs["stream"] = caller_stream()
        return self._run(method(self._client, *args, **kwargs))

    functools.update_wrapper(call, method)
    return call


def _blocking_context(
    method: Callable[Concatenate[AsyncKVStoreClient, P], AbstractAsyncContextManager[T]],
) -> Callable[Concatenate[KVStoreClient, P], contextlib.AbstractContextManager[T]]:
    """The async client's context-manager ``method`` as an ordinary context manager."""

    @contextlib.contextmanager
    def call(self: KVStoreClient, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        manager = method(self._client, *args, **kwargs)
        value = self._run(manager.__aenter__())
        try:
            yield value
        except BaseException:
            if not self._run(manager.__aexit__(*sys.exc_info())):
                raise
        else:
            self._run(manager.__aexit__(None, None, None))

    functools.update_wrapper(call, method)
    return call


class KVStoreClient:
    """The blocking twin of :class:`AsyncKVStoreClient`; same arguments, same methods."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        use_shm: bool = True,
        tls_root_cert: bytes | None = None,
        timeout: float = 10.0,
        retries: int = 3,
        verify: bool = False,
        staging_bytes: int = 256 << 20,
        pin_arena: bool = False,
        session_calls: bool = True,
    ) -> None:
        self._client = AsyncKVStoreClient(
            address,
            token=token,
            use_shm=use_shm,
            tls_root_cert=tls_root_cert,
            timeout=timeout,
            retries=retries,
            verify=verify,
            staging_bytes=staging_bytes,
            pin_arena=pin_arena,
            session_calls=session_calls,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"kvstore-client {address}", daemon=True
        )
        self._thread.start()
        self._calls_lock = threading.Lock()
        self._calls: set[concurrent.futures.Future[Any]] = set()  # in flight, any thread
        self._closing = False

    def _refuse_on_loop(self, coro: Coroutine[Any, Any, object]) -> None:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a KVStoreClient method was called from its own event loop")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        self._refuse_on_loop(coro)
        with self._calls_lock:
            if self._closing:
                coro.close()
                raise NotConnectedError(f"the KVStoreClient of {self.address} is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._calls.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self._closing:
                raise NotConnectedError(
                    f"the KVStoreClient of {self.address} was closed during the call"
                ) from None
            raise
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt while waiting: stop the call too
            raise
        finally:
            with self._calls_lock:
                self._calls.discard(future)

    def open_session(self, namespace: Namespace) -> bool:
        """:meth:`AsyncKVStoreClient.open_session`, and the session's calls connection of
        this client's own (what :meth:`find` uses) attached now too."""
        mapped = self._run(self._client.open_session(namespace))
        session = self._client._conn.sessions.get(namespace.tenant)
        if session is not None:
            session.blocking_calls(self.timeout)
        return mapped

    def find(self, namespace: Namespace, keys: Sequence[bytes]) -> Found:
        """:meth:`AsyncKVStoreClient.find`: from this thread on a calls connection of its own
        to the shm session when it can (``find_here``: no crossing to the client's loop and
        back), else on the loop, which also shakes hands again when the daemon restarted or
        forgot the namespace. A daemon that does not answer in time is not asked twice.

        Raises:
            DeadlineExceededError: no answer within the client's timeout.
        """
        lease_id = new_lease_id()
        try:
            found = self._client.find_here(namespace, keys, lease_id)
        except (KVStoreError, StaleArenaError) as error:
            self._run(self._client.release_lease(lease_id))  # it may have been granted
            if isinstance(error, DeadlineExceededError):
                raise
            log.debug("find on the calls connection failed (%s); on the loop instead", error)
            found = None
        if found is not None:
            return found
        return self._run(self._client.find(namespace, keys))

    def close(self) -> None:
        """Ends the calls other threads have in flight (``NotConnectedError``), closes the
        async client, then stops and closes the loop; again: no-op."""
        closing = self._client.aclose()
        self._refuse_on_loop(closing)  # it would wait on itself
        with self._calls_lock:
            if self._closing:
                closing.close()
                return
            self._closing = True
            in_flight = list(self._calls)
        for future in in_flight:
            future.cancel()  # its caller returns at once; its task is cancelled on the loop
        try:
            asyncio.run_coroutine_threadsafe(closing, self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> Self:
        try:
            self.connect()
        except BaseException:
            self.close()  # the loop thread would outlive a client no one can close
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVStoreClient({self.address!r}, data_plane={self.data_plane!r})"

    @property
    def address(self) -> str:
        return self._client.address

    @property
    def timeout(self) -> float:
        """Seconds per call attempt (see :attr:`AsyncKVStoreClient.timeout`)."""
        return self._client.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._client.timeout = seconds

    @property
    def data_plane(self) -> Literal["shm", "stream"]:
        """``"shm"`` when KV bytes move through the mapped arena, else ``"stream"``."""
        return self._client.data_plane

    @property
    def server_info(self) -> ServerInfo:
        """The daemon's last handshake (``NotConnectedError`` before ``connect()``)."""
        return self._client.server_info

    connect = _blocking(AsyncKVStoreClient.connect)
    register = _blocking(AsyncKVStoreClient.register)
    lookup = _blocking(AsyncKVStoreClient.lookup)
    lookup_tiers = _blocking(AsyncKVStoreClient.lookup_tiers)
    release = _blocking(AsyncKVStoreClient.release)
    release_lease = _blocking(AsyncKVStoreClient.release_lease)
    shared_blocks = _blocking(AsyncKVStoreClient.shared_blocks)
    get = _blocking_copies(AsyncKVStoreClient.get)
    put = _blocking_copies(AsyncKVStoreClient.put)
    prefetch = _blocking(AsyncKVStoreClient.prefetch)
    delete = _blocking(AsyncKVStoreClient.delete)
    stats = _blocking(AsyncKVStoreClient.stats)
    health = _blocking(AsyncKVStoreClient.health)
    view = _blocking_context(AsyncKVStoreClient.view)
    view_tensors = _blocking_context(AsyncKVStoreClient.view_tensors)
    host_blocks = _blocking_context(AsyncKVStoreClient.host_blocks)
