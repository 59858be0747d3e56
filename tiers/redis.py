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
into a miss (``None``, ``False``), ``healthy()`` turns ``False`` and from then on every call
answers a miss at once without touching the network. No request ever probes: a background
task pings the failed node every ``retry_interval_s`` (under ``timeout_s``), and once it
answers the tier is healthy and writes resume. Each node's outage is a
:class:`~kvstore.wire.outage.Outage`, the breaker the vLLM connector's link keeps too.

Time is bounded per call, whatever the network does: every call (a batch, across all the
nodes it touches) has one deadline, ``timeout_s`` from its start, and a node that misses it
counts as failed. A connection that fails at once (a pooled connection the server closed
when it restarted) is retried once on a fresh one within that deadline before the node
counts as down, so a restart costs no writes.

On a Redis Cluster this holds per node. A batch is split by the node that serves each key's
slot (the client's slot map) and sent as one pipeline per node, concurrently: a node that
fails costs the misses of its own keys, for ``retry_interval_s``, while the keys of the other
nodes are served. Each failure of a node also reloads the slot map (``CLUSTER SLOTS``) in the
background (under its own timeout; the probe reloads it too), and the keys of the failed
call that it now maps to another node are tried there once if the reload ends within the
call's deadline: once a replica is promoted, its slots are served by the first call that
finds the old primary gone (with a slot map from before the failover, as a node that had no
reason to look has).
``down_nodes()`` names the nodes that failed and have not answered since; ``healthy()`` is
``False`` while there is one (the tier is degraded, not off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Self, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterDownError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.tiers.base import (
    BlobTooLargeError,
    Buffer,
    TierClosedError,
    check_key,
    check_range,
)
from kvstore.tiers.redis_url import (
    CLUSTER_SCHEMES,
    SENTINEL_SCHEMES,
    check_tls,
    check_url,
    cluster_credentials,
    cluster_seeds,
    sentinel_service,
)
from kvstore.wire.outage import Outage

logger = logging.getLogger(__name__)

T = TypeVar("T")
Client = Redis | RedisCluster
Op = Callable[[Client], Awaitable[T]]
Batch = Callable[[Client, Sequence[int]], Awaitable[list[object]]]  # answers, one per position

# Errors that mean "Redis is unreachable" (the builtin ones cover sockets and asyncio timeouts;
# a cluster none of whose nodes answers, or whose slot no node serves, raises
# RedisClusterException, which is no RedisError; a live node answers CLUSTERDOWN while a
# failed primary's slots have no owner yet, until its replica is promoted).
UNREACHABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    RedisClusterException,
    ClusterDownError,
    OSError,
)
RELOAD_TIMEOUTS = 3  # a slot-map reload may take this many timeout_s (it asks nodes in turn)
MAX_OFFSET = 2**62  # GETRANGE takes signed 64-bit offsets
WHOLE = ""  # the target of a call no single node answers for: the one server (or Sentinel
# primary), or a cluster whose slot map is not known yet
_FAILED = object()  # the answer for a key whose node did not answer


class _Failed(Exception):
    """Redis did not answer (down, skipped while degraded, or refused the command)."""


class _Unreachable(_Failed):
    """The node was tried and did not answer."""


class RedisTier:
    """A :class:`~kvstore.tiers.base.Tier` over a Redis server shared by every node.

    Args:
        url: ``redis://host:port/db``, ``rediss://...``, ``unix://path``, or a Redis Cluster's
            seed nodes: ``redis+cluster://host:port,host:port`` (``rediss+cluster://``).
        capacity_bytes: Most bytes (keys and blobs) this instance keeps in Redis.
        key_prefix: Namespace of the Redis keys; nodes sharing blobs use the same one.
        ttl_s: Expire every blob this long after it is written; ``None`` keeps them.
        pool_size: Most connections open at once; further calls wait for a free one.
        timeout_s: Connect and socket timeout of every command.
        retry_interval_s: How often a failed node is probed (in the background) until it
            answers; meanwhile its calls answer misses without trying.
        name: Name used in logs and metrics.
        tls_ca: With a ``rediss`` URL, the PEM file of the CA that signed the servers'
            certificates (``None``: the system's CAs). Certificates are always verified.
        tls_cert, tls_key: A client certificate and its key, for servers that ask for one.

    Raises:
        ValueError: A bad URL scheme, a size, count or duration out of range, or TLS files
            that do not fit the URL or do not exist.
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
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        _check_args(url, capacity_bytes, key_prefix, ttl_s, pool_size, timeout_s, retry_interval_s)
        check_tls(url, tls_ca or "", tls_cert or "", tls_key or "")
        self._tls: dict[str, Any] = {}
        if url.startswith("rediss"):
            self._tls = {"ssl_ca_certs": tls_ca or None, "ssl_certfile": tls_cert or None,
                         "ssl_keyfile": tls_key or None, "ssl_cert_reqs": "required"}  # fmt: skip
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
        self._client: Client | None = None
        # Calls in flight at once. The one-server pool blocks by itself; redis-py's cluster
        # client would raise on a node's full pool instead, so it waits here.
        self._slots: contextlib.AbstractAsyncContextManager[object] = contextlib.nullcontext()
        # Targets that failed and have not answered since, each with its outage.
        self._down: dict[str, Outage] = {}
        self._probes: dict[str, asyncio.Task[None]] = {}  # target -> its background probe
        self._refresh: asyncio.Task[None] | None = None  # a cluster slot map being reloaded

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Builds the connection pool and pings Redis; a Redis that is down only degrades."""
        if self._client is not None:
            return
        self._client = self._connect()
        self._down.clear()
        try:
            await self._call(lambda client: client.ping(), WHOLE, self._deadline())
        except _Failed:
            return
        logger.info("redis tier %s: connected, prefix %r", self.name, self._prefix)

    def _connect(self) -> Client:
        """A client for one server (a blocking pool of ``pool_size``) or for a Redis Cluster
        (``redis+cluster://`` seeds: redis-py's cluster client, which maps slots to nodes,
        splits pipelines by node and follows MOVED/ASK; ``pool_size`` connections per node).
        Connecting waits for nothing: the first command does, within ``timeout_s``."""
        scheme = self._url.partition("://")[0]
        if scheme in SENTINEL_SCHEMES:
            # The sentinels name the primary (again after a failover); its pool is not a
            # blocking one, so calls in flight are bounded here too.
            self._slots = asyncio.Semaphore(self._pool_size)
            user, password = cluster_credentials(self._url)
            service, database = sentinel_service(self._url)
            # With rediss+sentinel, TLS to the sentinels and to the primary alike.
            connection: dict[str, Any] = {"socket_timeout": self._timeout_s,
                                          "socket_connect_timeout": self._timeout_s}  # fmt: skip
            if self._tls:
                connection.update(ssl=True, **self._tls)
            sentinel = Sentinel(cluster_seeds(self._url), sentinel_kwargs=connection)
            primary: Redis = sentinel.master_for(
                service,
                db=database,
                username=user,
                password=password,
                retry=Retry(NoBackoff(), 0),
                **connection,
            )
            return primary
        if scheme in CLUSTER_SCHEMES:
            self._slots = asyncio.Semaphore(self._pool_size)
            user, password = cluster_credentials(self._url)
            return RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in cluster_seeds(self._url)],
                username=user,
                password=password,
                ssl=bool(self._tls),
                **self._tls,
                max_connections=self._pool_size,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                # No retry: redis-py retries a failed pipeline after closing every node's
                # connections, the other nodes' calls in flight too. A failed node is
                # skipped here instead, and the slot map reloaded (MOVED/ASK are followed
                # whatever the retries).
                retry=Retry(NoBackoff(), 0),
                require_full_coverage=False,  # a shard down costs its slots' misses only
            )
        pool = BlockingConnectionPool.from_url(
            self._url,
            max_connections=self._pool_size,
            timeout=None,  # wait for a free connection; each command has its own timeouts
            socket_timeout=self._timeout_s,
            socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 0),  # failing fast is the point: misses are cheap
            **self._tls,
        )
        return Redis(connection_pool=pool)

    async def aclose(self) -> None:
        """Closes the connections."""
        client, self._client = self._client, None
        if client is None:
            return
        tasks = [*self._probes.values(), *([self._refresh] if self._refresh else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._refresh = None
        self._probes.clear()
        self._down.clear()
        await client.aclose()
        if isinstance(client, Redis):
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
                results = await self._per_node(
                    [rkey for rkey, _ in accepted],
                    lambda client, part: self._set_all(client, [accepted[i] for i in part]),
                )
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
        values = await self._per_node(rkeys, _pipelined("GET", rkeys))
        self._observe(rkeys, [value is None if value is not _FAILED else None for value in values])
        return [value if isinstance(value, bytes) else None for value in values]

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
                lambda client: _exists_and_range(client, rkey, start, end if length else None),
                self._target(rkey),
                self._deadline(),
            )
        except _Failed:
            return None
        self._observe([rkey], [not exists])
        return data if exists else None

    async def contains(self, key: bytes) -> bool:
        """Returns whether Redis holds ``key`` (``False`` when Redis is down)."""
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Returns one ``contains`` answer per key, in one round trip."""
        rkeys = [self._rkey(key) for key in keys]
        counts = await self._per_node(rkeys, _pipelined("EXISTS", rkeys))
        self._observe(rkeys, [count == 0 if count is not _FAILED else None for count in counts])
        return [count == 1 for count in counts]

    async def delete(self, key: bytes) -> bool:
        """Deletes ``key``; returns whether Redis held it (``False`` when Redis is down)."""
        rkey = self._rkey(key)
        try:
            removed = await self._call(
                lambda client: client.delete(rkey), self._target(rkey), self._deadline()
            )
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
        """Returns ``False`` from the moment Redis (one of a cluster's nodes) fails until it
        answers again."""
        return self._client is not None and not self.down_nodes()

    def down_nodes(self) -> list[str]:
        """The nodes (``host:port``; ``""`` for the one server, or a cluster not reached yet)
        that failed and have not answered since. A cluster node that serves no slot any more
        (its replica took over) is left out."""
        client = self._client
        if isinstance(client, RedisCluster) and self._down:
            serving = {node.name for node in client.get_primaries()}
            for gone in [name for name in self._down if name != WHOLE and name not in serving]:
                del self._down[gone]
        return sorted(self._down)

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

    def _observe(self, rkeys: Sequence[bytes], absent: Sequence[bool | None]) -> None:
        """Forgets the keys a read found absent (``None``: their node did not answer)."""
        for rkey, gone in zip(rkeys, absent, strict=True):
            if gone:
                self._forget(rkey[len(self._prefix) :])

    def _reap(self) -> None:
        now = time.monotonic()
        while self._expiring and self._expiring[0][0] <= now:
            deadline, key = self._expiring.popleft()
            if self._deadlines.get(key) == deadline:
                self._forget(key)

    async def _set_all(self, client: Client, batch: list[tuple[bytes, memoryview]]) -> list[object]:
        async with client.pipeline(transaction=False) as pipe:
            for rkey, view in batch:
                pipe.set(rkey, view, px=self._ttl_ms)
            results = list(await pipe.execute(raise_on_error=False))
        # A key's own error (OOM under maxmemory) is that key's answer, but a cluster
        # pipeline hands back its node's failure as every key's answer too: raised, so that
        # the node counts as down (a write is often the first call after a node died). Some
        # keys stored and others not: the node answered (the rest were redirected elsewhere).
        if results and all(isinstance(result, UNREACHABLE) for result in results):
            raise results[0]
        return results

    def _target(self, rkey: bytes) -> str:
        """The node serving ``rkey``'s slot (``WHOLE`` for one server, or while a cluster's
        slot map is not known)."""
        client = self._client
        if not isinstance(client, RedisCluster) or not client.nodes_manager.slots_cache:
            return WHOLE
        try:
            return str(client.nodes_manager.get_node_from_slot(client.keyslot(rkey)).name)
        except SlotNotCoveredError:
            return WHOLE

    async def _per_node(self, rkeys: Sequence[bytes], run: Batch) -> list[object]:
        """``run(client, positions)`` once per node serving some of ``rkeys`` (concurrently),
        with the positions of that node's keys; returns its answers in the order of
        ``rkeys``, ``_FAILED`` for the keys of a node that failed or is skipped."""
        answers: list[object] = [_FAILED] * len(rkeys)
        deadline = self._deadline()  # one for the whole batch, across its nodes

        async def on(target: str, part: list[int], *, again: bool = True) -> None:
            try:
                values = await self._call(lambda client: run(client, part), target, deadline)
            except _Unreachable:
                if again and self._refresh is not None:
                    # The slot map this failure reloads may send these keys elsewhere now
                    # (this node's replica took over): one more try there, none here, if
                    # the reload ends within the batch's deadline.
                    try:
                        async with asyncio.timeout_at(deadline):
                            await asyncio.shield(self._refresh)
                    except TimeoutError:
                        return
                    moved = self._split(rkeys, part)
                    moved.pop(target, None)
                    await asyncio.gather(*(on(*item, again=False) for item in moved.items()))
                return
            except _Failed:
                return
            for position, value in zip(part, values, strict=True):
                answers[position] = value

        parts = self._split(rkeys, range(len(rkeys)))
        if len(parts) == 1:
            await on(*parts.popitem())
        else:
            await asyncio.gather(*(on(target, part) for target, part in parts.items()))
        return answers

    def _split(self, rkeys: Sequence[bytes], positions: Iterable[int]) -> dict[str, list[int]]:
        """The ``positions`` of ``rkeys`` by the node serving each key's slot."""
        parts: dict[str, list[int]] = {}
        for position in positions:
            parts.setdefault(self._target(rkeys[position]), []).append(position)
        return parts

    def _deadline(self) -> float:
        """The event loop's time by which a call starting now must be answered."""
        return asyncio.get_running_loop().time() + self._timeout_s

    async def _call(self, op: Op[T], target: str, deadline: float) -> T:
        """Runs ``op`` on the client for ``target`` by ``deadline`` (the loop's clock), or
        raises :class:`_Failed` without raising anything else. A connection that fails at
        once is tried once more on a fresh one (the server may have closed the pooled one)."""
        client = self._client
        if client is None:
            raise TierClosedError(f"redis tier {self.name} is not started or already closed")
        if target in self._down:
            raise _Failed  # its probe, not a request, finds out when it answers again
        async with self._slots:  # waiting for a free connection is no failure of the node
            for attempt in (1, 2):
                try:
                    async with asyncio.timeout_at(deadline):
                        result = await op(client)
                    break
                except RedisConnectionError as exc:
                    if attempt == 1 and asyncio.get_running_loop().time() < deadline:
                        logger.debug("redis tier %s: retrying on a fresh connection", self.name)
                        continue
                    self._degrade(target, exc)
                    raise _Unreachable from exc
                except UNREACHABLE as exc:
                    self._degrade(target, exc)
                    raise _Unreachable from exc
                except RedisError as exc:
                    logger.warning("redis tier %s: command failed: %s", self.name, _reason(exc))
                    raise _Failed from exc
        for answered in {target, WHOLE} & self._down.keys():  # a node answers: the cluster is up
            self._answered(answered)
        return result

    def _answered(self, target: str) -> None:
        outage = self._down.pop(target, None)
        lasted = None if outage is None else outage.answered(time.monotonic())
        if lasted is not None:
            logger.info(
                "redis tier %s: %s answers again (down %.1f s), resuming",
                self.name, _node(target), lasted,
            )  # fmt: skip

    def _degrade(self, target: str, exc: BaseException) -> None:
        outage = self._down.setdefault(target, Outage(self._retry_interval_s))
        if outage.fail(time.monotonic()):
            logger.warning(
                "redis tier %s: %s unreachable (%s: %s); answering misses, probing every %gs",
                self.name, _node(target), type(exc).__name__, _reason(exc),
                self._retry_interval_s,
            )  # fmt: skip
        if target not in self._probes:
            self._probes[target] = asyncio.get_running_loop().create_task(self._probe(target))
        self._start_reload()

    def _start_reload(self) -> asyncio.Task[None] | None:
        """The cluster's slot-map reload in flight, started if none is."""
        client = self._client
        if not isinstance(client, RedisCluster):
            return None
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._reload_slots(client))
        return self._refresh

    async def _reload_slots(self, client: RedisCluster) -> None:
        """Reloads the cluster's slot map (a replica promoted serves its slots from now on)."""
        try:
            async with asyncio.timeout(RELOAD_TIMEOUTS * self._timeout_s):
                await client.nodes_manager.initialize()
        except (*UNREACHABLE, RedisError) as exc:
            logger.debug("redis tier %s: slot map not reloaded: %s", self.name, exc)

    async def _probe(self, target: str) -> None:
        """Pings ``target`` every ``retry_interval_s`` until it answers (or, on a cluster,
        until it serves no slot any more); requests meanwhile answer misses."""
        try:
            while target in self._down and self._client is not None:
                await asyncio.sleep(self._retry_interval_s)
                client = self._client
                if client is None:
                    return
                if isinstance(client, RedisCluster):
                    reload = self._start_reload()
                    if reload is not None:
                        await asyncio.shield(reload)
                    if target != WHOLE and target not in self.down_nodes():
                        return  # its replica took over its slots: nothing to wait for
                try:
                    async with asyncio.timeout(self._timeout_s):
                        await _ping(client, target)
                except (*UNREACHABLE, RedisError) as exc:
                    logger.debug("redis tier %s: %s still down: %s", self.name, target, exc)
                    continue
                if target in self._down:
                    self._answered(target)
        finally:
            self._probes.pop(target, None)


async def _ping(client: Client, target: str) -> None:
    """PING ``target``: the one server (``WHOLE``: a cluster's default node) or a node."""
    if target == WHOLE or not isinstance(client, RedisCluster):
        await client.ping()
        return
    node = client.get_node(node_name=target)
    if node is None:
        raise RedisClusterException(f"{target} is not a node of the cluster any more")
    await client.execute_command("PING", target_nodes=node)


def _reason(exc: BaseException) -> str:
    """What went wrong, without the command redis-py puts before it (a key in raw bytes)."""
    return str(exc).rpartition(" caused error: ")[2]


def _node(target: str) -> str:
    return "Redis" if target == WHOLE else f"node {target}"


def _pipelined(command: str, rkeys: Sequence[bytes]) -> Batch:
    """A :data:`Batch` sending ``command`` for the keys at the positions it is given."""

    async def run(client: Client, part: Sequence[int]) -> list[object]:
        async with client.pipeline(transaction=False) as pipe:
            for position in part:
                pipe.execute_command(command, rkeys[position])
            return list(await pipe.execute())

    return run


async def _exists_and_range(
    client: Client, rkey: bytes, start: int, end: int | None
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
    check_url(url)
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
