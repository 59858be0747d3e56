"""The Redis tier: blobs shared between nodes, one Redis string per key.

Redis key = ``key_prefix`` + ``b":"`` + key; the value is the blob, written by one ``SET``
(atomic, with ``PX`` when a TTL is set). Every node using the same prefix sees every blob.

Primitives, in the order a tier's life uses them:

1. ``start()`` -- build the connection pool and ping; succeeds even when Redis is down.
2. ``put()`` / ``put_many()`` -- reserve bytes in this instance's accounting, then ``SET``
   (``put_many`` pipelines one ``SET`` per blob in one round trip).
3. ``get()`` / ``get_many()`` / ``get_range()`` (``EXISTS`` + ``GETRANGE`` in one
   ``MULTI``), ``contains()`` / ``contains_many()`` -- always asked of Redis live, since another
   node may have written the key; a key this instance wrote that Redis no longer has (TTL, an
   eviction, another node's delete) leaves the accounting when a read finds it gone.
4. ``delete()``, ``keys()``, ``usage()``, ``healthy()``, then ``aclose()``.

Accounting covers only what this instance wrote. A replace reserves the new blob while the
old one still counts, so near capacity it may be refused where it would have fitted; blocks
are content-addressed, so a key is rarely rewritten with another blob. With a TTL, a key
leaves the accounting once its TTL has passed, read or not.

Redis being down is an expected outcome, not an error: a connection error or timeout turns
into a miss (``None``, ``False``), ``healthy()`` turns ``False`` and for ``retry_interval_s``
every call answers a miss at once without touching the network; then one call probes again
and, if Redis answers, the tier is healthy and writes resume.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Self, TypeVar
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.tiers.base import (
    BlobTooLargeError,
    Buffer,
    TierClosedError,
    check_key,
    check_range,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
Op = Callable[[Redis], Awaitable[T]]

# Errors that mean "Redis is unreachable" (the builtin ones cover sockets and asyncio timeouts).
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
URL_SCHEMES = ("redis", "rediss", "unix")
MAX_OFFSET = 2**62  # GETRANGE takes signed 64-bit offsets


class _Failed(Exception):
    """Redis did not answer (down, skipped while degraded, or refused the command)."""


class RedisTier:
    """A :class:`~kvstore.tiers.base.Tier` over a Redis server shared by every node.

    Args:
        url: ``redis://host:port/db``, ``rediss://...`` or ``unix://path``.
        capacity_bytes: Most bytes (keys and blobs) this instance keeps in Redis.
        key_prefix: Namespace of the Redis keys; nodes sharing blobs use the same one.
        ttl_s: Expire every blob this long after it is written; ``None`` keeps them.
        pool_size: Most connections open at once; further calls wait for a free one.
        timeout_s: Connect and socket timeout of every command.
        retry_interval_s: How long to answer misses without trying, once Redis failed.
        name: Name used in logs and metrics.

    Raises:
        ValueError: A bad URL scheme, or a size, count or duration out of range.
    """

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        *,
        key_prefix: str = "kvstore",
        ttl_s: float | None = None,
        pool_size: int = 16,
        timeout_s: float = 1.0,
        retry_interval_s: float = 1.0,
        name: str = "redis",
    ) -> None:
        _check_args(url, capacity_bytes, key_prefix, ttl_s, pool_size, timeout_s, retry_interval_s)
        self.name = name
        self._url = url
        self._capacity = capacity_bytes
        self._prefix = key_prefix.encode() + b":"
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._pool_size = pool_size
        self._timeout_s = timeout_s
        self._retry_interval_s = retry_interval_s
        self._sizes: dict[bytes, int] = {}  # key -> bytes, for what this instance wrote
        self._used = 0  # sum of _sizes + bytes reserved by puts in flight
        self._deadlines: dict[bytes, float] = {}  # key -> monotonic time its TTL ends
        self._expiring: deque[tuple[float, bytes]] = deque()  # in deadline order
        self._client: Redis | None = None
        self._healthy = False
        self._retry_at = 0.0

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Builds the connection pool and pings Redis; a Redis that is down only degrades."""
        if self._client is not None:
            return
        pool = BlockingConnectionPool.from_url(
            self._url,
            max_connections=self._pool_size,
            timeout=None,  # wait for a free connection; each command has its own timeouts
            socket_timeout=self._timeout_s,
            socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 0),  # failing fast is the point: misses are cheap
        )
        self._client = Redis(connection_pool=pool)
        self._healthy, self._retry_at = True, 0.0
        try:
            await self._call(lambda client: client.ping())
        except _Failed:
            return
        logger.info("redis tier %s: connected, prefix %r", self.name, self._prefix)

    async def aclose(self) -> None:
        """Closes the connections."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
            await client.connection_pool.aclose()

    async def put(self, key: bytes, data: Buffer) -> bool:
        """Stores ``data`` under ``key``.

        Returns:
            ``True`` when stored; ``False`` when there is no room or Redis did not take it.

        Raises:
            BlobTooLargeError: The blob is larger than the whole tier.
        """
        return (await self.put_many([(key, data)]))[0]

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        """Stores several blobs in one round trip; one ``put`` answer per item, in order.

        Raises:
            BlobTooLargeError: One blob is larger than the whole tier (nothing is written).
        """
        batch = [(self._rkey(key), memoryview(data).cast("B")) for key, data in items]
        sizes = [self._record_size(rkey, view) for rkey, view in batch]
        self._reap()
        fits = [self._reserve(size) for size in sizes]
        accepted = [item for item, fit in zip(batch, fits, strict=True) if fit]
        results: list[object] = []
        try:
            if accepted:
                results = await self._call(lambda client: self._set_all(client, accepted))
        except _Failed:
            pass
        finally:
            stored = iter(results)
            done = [fit and next(stored, None) is True for fit in fits]
            for (rkey, _), size, fit, ok in zip(batch, sizes, fits, done, strict=True):
                self._settle(rkey[len(self._prefix) :], size, reserved=fit, stored=ok)
        return done

    async def get(self, key: bytes) -> bytes | None:
        """Returns the blob stored under ``key``, or ``None`` on a miss or when Redis is down."""
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Returns one ``get`` answer per key, in one round trip."""
        rkeys = [self._rkey(key) for key in keys]
        try:
            values = await self._call(lambda client: _pipelined(client, "get", rkeys))
        except _Failed:
            return [None] * len(rkeys)
        found = [value if isinstance(value, bytes) else None for value in values]
        self._observe(rkeys, [value is not None for value in found])
        return found

    async def get_range(self, key: bytes, offset: int, length: int) -> bytes | None:
        """Returns ``length`` bytes of the blob from ``offset`` (fewer at its end), or ``None``.

        Raises:
            InvalidRangeError: A negative ``offset`` or ``length``.
        """
        rkey = self._rkey(key)
        check_range(offset, length)
        start, end = min(offset, MAX_OFFSET), min(offset + length - 1, MAX_OFFSET)
        try:
            exists, data = await self._call(
                lambda client: _exists_and_range(client, rkey, start, end if length else None)
            )
        except _Failed:
            return None
        self._observe([rkey], [exists])
        return data if exists else None

    async def contains(self, key: bytes) -> bool:
        """Returns whether Redis holds ``key`` (``False`` when Redis is down)."""
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Returns one ``contains`` answer per key, in one round trip."""
        rkeys = [self._rkey(key) for key in keys]
        try:
            counts = await self._call(lambda client: _pipelined(client, "exists", rkeys))
        except _Failed:
            return [False] * len(rkeys)
        found = [count == 1 for count in counts]
        self._observe(rkeys, found)
        return found

    async def delete(self, key: bytes) -> bool:
        """Deletes ``key``; returns whether Redis held it (``False`` when Redis is down)."""
        rkey = self._rkey(key)
        try:
            removed = await self._call(lambda client: client.delete(rkey))
        except _Failed:
            return False
        self._forget(rkey[len(self._prefix) :])
        return removed == 1

    def keys(self) -> Iterable[bytes]:
        """Returns the keys this instance wrote and has not seen disappear."""
        self._reap()
        return list(self._sizes)

    def usage(self) -> int:
        """Returns the bytes this instance holds in Redis, counting puts in flight."""
        self._reap()
        return self._used

    def capacity(self) -> int:
        """Returns the capacity in bytes."""
        return self._capacity

    def healthy(self) -> bool:
        """Returns ``False`` from the moment Redis fails until it answers again."""
        return self._client is not None and self._healthy

    def _rkey(self, key: bytes) -> bytes:
        if self._client is None:
            raise TierClosedError(f"redis tier {self.name} is not started or already closed")
        checked: bytes = check_key(key)
        return self._prefix + checked

    def _record_size(self, rkey: bytes, view: memoryview) -> int:
        size = len(rkey) + view.nbytes
        if size > self._capacity:
            raise BlobTooLargeError(
                f"blob of {view.nbytes} bytes exceeds the capacity of tier {self.name} "
                f"({self._capacity} bytes)"
            )
        return size

    def _reserve(self, size: int) -> bool:
        if self._used + size > self._capacity:
            return False
        self._used += size
        return True

    def _settle(self, key: bytes, size: int, *, reserved: bool, stored: bool) -> None:
        if reserved:
            self._used -= size
        if not stored:
            return
        self._forget(key)
        self._sizes[key] = size
        self._used += size
        if self._ttl_ms is not None:
            deadline = time.monotonic() + self._ttl_ms / 1000
            self._deadlines[key] = deadline
            self._expiring.append((deadline, key))

    def _forget(self, key: bytes) -> None:
        self._used -= self._sizes.pop(key, 0)
        self._deadlines.pop(key, None)

    def _observe(self, rkeys: Sequence[bytes], present: Sequence[bool]) -> None:
        for rkey, here in zip(rkeys, present, strict=True):
            if not here:
                self._forget(rkey[len(self._prefix) :])

    def _reap(self) -> None:
        now = time.monotonic()
        while self._expiring and self._expiring[0][0] <= now:
            deadline, key = self._expiring.popleft()
            if self._deadlines.get(key) == deadline:
                self._forget(key)

    async def _set_all(self, client: Redis, batch: list[tuple[bytes, memoryview]]) -> list[object]:
        async with client.pipeline(transaction=False) as pipe:
            for rkey, view in batch:
                pipe.set(rkey, view, px=self._ttl_ms)
            return list(await pipe.execute(raise_on_error=False))

    async def _call(self, op: Op[T]) -> T:
        """Runs ``op`` on the client, or raises :class:`_Failed` without raising anything else."""
        if self._client is None:
            raise TierClosedError(f"redis tier {self.name} is not started or already closed")
        if not self._may_try():
            raise _Failed
        try:
            result = await op(self._client)
        except UNREACHABLE as exc:
            self._degrade(exc)
            raise _Failed from exc
        except RedisError as exc:
            logger.warning("redis tier %s: command failed: %s", self.name, exc)
            raise _Failed from exc
        if not self._healthy:
            self._healthy = True
            logger.info("redis tier %s: Redis answers again, resuming", self.name)
        return result

    def _may_try(self) -> bool:
        if self._healthy:
            return True
        now = time.monotonic()
        if now < self._retry_at:
            return False
        self._retry_at = now + self._retry_interval_s  # this call probes; the others miss
        return True

    def _degrade(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + self._retry_interval_s
        if self._healthy:
            self._healthy = False
            logger.warning(
                "redis tier %s: Redis unreachable (%s: %s); answering misses, retrying every %gs",
                self.name, type(exc).__name__, exc, self._retry_interval_s,
            )  # fmt: skip


async def _pipelined(client: Redis, command: str, rkeys: Sequence[bytes]) -> list[object]:
    async with client.pipeline(transaction=False) as pipe:
        for rkey in rkeys:
            pipe.execute_command(command.upper(), rkey)
        return list(await pipe.execute())


async def _exists_and_range(
    client: Redis, rkey: bytes, start: int, end: int | None
) -> tuple[bool, bytes]:
    """``EXISTS`` and ``GETRANGE`` in one ``MULTI``: a missing key and an empty range differ."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.exists(rkey)
        if end is not None:
            pipe.getrange(rkey, start, end)
        results = await pipe.execute()
    data = results[1] if end is not None else b""
    return results[0] == 1, bytes(data)


def _check_args(
    url: str,
    capacity_bytes: int,
    key_prefix: str,
    ttl_s: float | None,
    pool_size: int,
    timeout_s: float,
    retry_interval_s: float,
) -> None:
    if urlsplit(url).scheme not in URL_SCHEMES:
        raise ValueError(f"url must start with one of {URL_SCHEMES}, got {url!r}")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise ValueError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
    checks = [
        ("capacity_bytes", capacity_bytes, capacity_bytes > 0),
        ("key_prefix", key_prefix, bool(key_prefix)),
        ("ttl_s", ttl_s, ttl_s is None or ttl_s > 0),
        ("pool_size", pool_size, pool_size >= 1),
        ("timeout_s", timeout_s, timeout_s > 0),
        ("retry_interval_s", retry_interval_s, retry_interval_s >= 0),
    ]
    for what, value, ok in checks:
        if not ok:
            raise ValueError(f"{what} out of range, got {value!r}")
