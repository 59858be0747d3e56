"""The gRPC daemon: a thin servicer over :class:`~kvstore.service.KVStoreService`.

- ``KVStoreServicer`` (:mod:`kvstore.servicer`) turns protos into plain values and back;
  ``STATUS_CODES`` there is the one table from the :mod:`kvstore.errors` tree to gRPC status
  codes (an error outside it is a bug: the servicer logs it and answers INTERNAL).
- ``AuthInterceptor`` checks ``authorization: Bearer <token>`` on every call when
  ``auth.tokens`` is set (the health service stays open to probes).
- ``create_server(config, store)`` binds every listen address (unix sockets get
  ``server.socket_mode``; TCP port 0 gets a free port, reported in ``addresses``; TLS on TCP
  when ``tls_cert``/``tls_key`` are set), opens the shm-session socket beside the first unix
  socket when there is a host tier (:mod:`kvstore.sessions`), starts serving and marks
  health SERVING. Health names: ``""`` and ``kvstore.v1.KVStore`` (the daemon serves: they
  stay SERVING while a tier is down, since host and SSD still serve), ``kvstore.tiers``
  (NOT_SERVING while any tier is down: degraded) and ``kvstore.tier.<name>`` per tier
  (``TierHealthServicer``: brought up to date by every ``Check``, so a probe right after a
  tier failed sees it, and every ``HEALTH_POLL_S`` for ``Watch`` streams).
- ``serve(config)`` runs the daemon until SIGTERM or SIGINT: start the store and server; on a
  signal stop accepting, let calls in flight finish within ``shutdown_grace``, cancel
  prefetches, close the store (write-back blocks are flushed to SSD), remove the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hmac
import logging
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.budget import THREAD_SWITCH_S
from kvstore.config import (
    TIER_SECTIONS,
    AuthConfig,
    Config,
    ConfigError,
    ServerConfig,
    socket_gid,
)
from kvstore.errors import StoreError, UnauthenticatedError
from kvstore.metrics import LoopLag, RpcMetrics, serve_metrics
from kvstore.service import KVStoreService
from kvstore.servicer import (
    STATUS_CODES,
    KVStoreServicer,
    Metadata,
    SessionCalls,
    add_to_server,
    status_of,
)
from kvstore.sessions import SessionServer
from kvstore.sockets import (
    check_tcp_addresses,
    claim_sockets,
    prepare_socket_path,
    set_access,
    unix_path,
)
from kvstore.store import BlockStore
from kvstore.tiers import collector
from kvstore.wire.session import session_path

__all__ = ["STATUS_CODES", "Authenticator", "RunningServer", "create_server", "serve"]

log = logging.getLogger(__name__)

SERVICE_NAME = "kvstore.v1.KVStore"
TIERS_HEALTH = "kvstore.tiers"  # NOT_SERVING while any tier is down: the daemon is degraded
TIER_HEALTH = "kvstore.tier."  # + a tier's name: that tier
HEALTH_POLL_S = 0.5
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Authenticator:
    """Maps the bearer token of a call to its tenant (``None``: authentication is off)."""

    def __init__(self, config: AuthConfig) -> None:
        self.replace(config)

    def replace(self, config: AuthConfig) -> None:
        """Takes the tokens of ``config`` from the next call on (a SIGHUP reload)."""
        self._tenants = [
            (token.encode(), tenant) for token, tenant in config.tenants_by_token().items()
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def tenant_of(self, metadata: Metadata) -> str | None:
        """The tenant of the call's token; ``None`` when no tokens are configured.

        Raises:
            UnauthenticatedError: the token is missing, malformed or unknown.
        """
        if not self._tenants:
            return None
        values = [value for key, value in metadata or () if key == "authorization"]
        if not values:
            raise UnauthenticatedError("missing 'authorization: Bearer <token>' metadata")
        scheme, _, token = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise UnauthenticatedError("authorization metadata must be 'Bearer <token>'")
        return self.tenant_of_token(token)

    def tenant_of_token(self, token: str) -> str | None:
        """The tenant of a bare token; ``None`` when no tokens are configured.

        Raises:
            UnauthenticatedError: the token is empty or unknown.
        """
        if not self._tenants:
            return None
        offered, found = token.strip().encode(), None
        if not offered:
            raise UnauthenticatedError("missing bearer token")
        for known, tenant in self._tenants:  # compare every token: no timing hint
            if hmac.compare_digest(known, offered):
                found = tenant
        if found is None:
            raise UnauthenticatedError("unknown bearer token")
        return found


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Rejects calls without a known bearer token before they reach the servicer."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._auth = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self._auth.enabled or details.method.startswith(_HEALTH_PREFIX):
            return handler
        try:
            self._auth.tenant_of(details.invocation_metadata)
        except UnauthenticatedError as error:
            return _refusal(handler, error)
        return handler


def _refusal(handler: grpc.RpcMethodHandler, error: StoreError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails the call with ``error``."""

    async def refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(status_of(error), str(error))

    kinds = [
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
    ]
    build = next(make for behaviour, make in kinds if behaviour is not None)
    return build(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


@dataclass(slots=True)
class RunningServer:
    """A started server; ``stop()`` ends it (the store stays open: its owner closes it)."""

    server: grpc.aio.Server
    service: KVStoreService
    health: TierHealthServicer
    addresses: tuple[str, ...]  # as bound: "unix:/path", "127.0.0.1:41234" (port 0 resolved)
    socket_paths: tuple[Path, ...]
    grace: float
    sessions: SessionServer | None = None
    authenticator: Authenticator | None = None
    rpcs: RpcMetrics | None = None  # per-call metrics, when [metrics] listen is set
    tier_health: asyncio.Task[None] | None = None  # keeps the tiers' health names current
    loop_lag: asyncio.Task[None] | None = None  # measures the loop's lag, with the metrics

    async def stop(self, grace: float | None = None) -> None:
        """Marks health NOT_SERVING, stops accepting, lets calls in flight finish within
        ``grace`` seconds (default ``server.shutdown_grace``), cancels prefetches and removes
        the unix sockets."""
        for task in (self.tier_health, self.loop_lag):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace if grace is None else grace)
        if self.sessions is not None:
            await self.sessions.aclose()
        await self.service.aclose()
        for path in self.socket_paths:
            path.unlink(missing_ok=True)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def create_server(config: Config, store: BlockStore) -> RunningServer:
    """Builds, binds and starts the daemon's gRPC server over a started ``store``.

    Raises:
        OSError: a unix socket path is in use by a live daemon, or is not a socket.
        RuntimeError: gRPC could not bind an address.
    """
    limits = config.server.max_message_bytes
    options = [
        ("grpc.max_receive_message_length", limits),
        ("grpc.max_send_message_length", limits),
        ("grpc.so_reuseport", 0),  # a second daemon on this port fails to bind, not shares it
    ]
    authenticator = Authenticator(config.auth)
    rpcs = RpcMetrics() if config.metrics.listen else None
    interceptors = [AuthInterceptor(authenticator)]
    server = grpc.aio.server(
        interceptors=interceptors if rpcs is None else [rpcs, *interceptors], options=options
    )
    service = KVStoreService(store, config, secrets.token_bytes(16))
    servicer = KVStoreServicer(service, authenticator.tenant_of, config.server.chunk_bytes)
    add_to_server(servicer, server)
    health_servicer = TierHealthServicer(store)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    addresses, paths = _bind_all(server, config.server)
    calls = SessionCalls(servicer, None if rpcs is None else rpcs.timed)
    sessions = _sessions(config, store, service, authenticator, paths, calls)
    if sessions is not None:
        await sessions.start()
        service.sessions = sessions
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.refresh()
    log.info("kvstore listening on %s", ", ".join(addresses))
    loop = asyncio.get_running_loop()
    return RunningServer(
        server,
        service,
        health_servicer,
        addresses,
        paths,
        config.server.shutdown_grace,
        sessions,
        authenticator,
        rpcs,
        loop.create_task(health_servicer.watch_tiers()),
        None if rpcs is None else loop.create_task(LoopLag(rpcs.registry).run(), name="loop-lag"),
    )


class TierHealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # untyped
    """The standard health service, whose ``kvstore.tiers`` and ``kvstore.tier.<name>``
    follow ``store``'s tiers: ``refresh()`` sets the names whose tier changed."""

    def __init__(self, store: BlockStore) -> None:
        super().__init__()
        self._store = store
        self._shown: dict[str, bool] = {}

    async def refresh(self) -> None:
        states = {TIER_HEALTH + level.name: level.tier.healthy() for level in self._store.tiers}
        states[TIERS_HEALTH] = all(states.values())
        for name, up in states.items():
            if self._shown.get(name) != up:
                status = health_pb2.HealthCheckResponse.SERVING if up else _NOT_SERVING
                await self.set(name, status)
                self._shown[name] = up

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()
        return await super().Check(request, context)

    async def watch_tiers(self) -> None:
        """Refreshes every ``HEALTH_POLL_S`` (for ``Watch`` streams), until cancelled."""
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self.refresh()


def _sessions(
    config: Config,
    store: BlockStore,
    service: KVStoreService,
    authenticator: Authenticator,
    paths: tuple[Path, ...],
    calls: SessionCalls,
) -> SessionServer | None:
    """The shm-session server beside the first unix socket, when there is a host tier."""
    if not paths or not store.has_arena:
        return None
    return SessionServer(
        Path(session_path(str(paths[0]))),
        socket_mode=int(config.server.socket_mode, 8),
        socket_gid=socket_gid(config.server),
        store=store,
        tenant_of=authenticator.tenant_of_token,
        on_close=service.close_session,
        instance_id=service.instance_id,
        max_staging_bytes=config.server.max_staging_bytes,
        max_sessions=config.server.max_sessions,
        calls=calls,
    )


def _bind_all(
    server: grpc.aio.Server, config: ServerConfig
) -> tuple[tuple[str, ...], tuple[Path, ...]]:
    # Sockets are bound here but listen only at start(): chmod now leaves no window.
    credentials = _tls_credentials(config)
    addresses: list[str] = []
    paths: list[Path] = []
    for address in config.listen:
        if address.startswith("unix:"):
            path = unix_path(address)
            mode, gid = int(config.socket_mode, 8), socket_gid(config)
            prepare_socket_path(path, mode, gid)
            server.add_insecure_port(f"unix:{path}")
            set_access(path, mode, gid)
            addresses.append(f"unix:{path}")
            paths.append(path)
        else:
            host = address.rpartition(":")[0]
            try:
                if credentials is None:
                    port = server.add_insecure_port(address)
                else:
                    port = server.add_secure_port(address, credentials)
            except RuntimeError as error:  # gRPC says no more than "failed to bind"
                raise OSError(
                    errno.EADDRNOTAVAIL,
                    f"server.listen {address}: cannot bind (in use, or not this host's address)",
                ) from error
            addresses.append(f"{host}:{port}")
    return tuple(addresses), tuple(paths)


def _tls_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    key, cert = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])


async def serve(config: Config, reread: Callable[[], Config] | None = None) -> None:
    """Runs the daemon until SIGTERM or SIGINT, then shuts it down gracefully.

    The signals are handled from the first line: a SIGTERM during start-up lets the start
    finish, closes what it opened and returns. SIGHUP never stops the daemon: it calls
    ``reread`` for the config again and applies what can change while it runs (see
    :func:`reload`); without ``reread`` it is logged and ignored.

    Raises:
        InUseError: Another daemon holds a socket or the SSD directory; nothing was allocated
            (the sockets are claimed first) or read.
    """
    loop = asyncio.get_running_loop()
    stop, hangups = asyncio.Event(), asyncio.Queue[None]()
    handled: dict[signal.Signals, Callable[[], None]] = {
        signal.SIGTERM: stop.set,
        signal.SIGINT: stop.set,
        signal.SIGHUP: lambda: hangups.put_nowait(None),
    }
    for signum, handler in handled.items():
        loop.add_signal_handler(signum, handler)
    try:
        claimed = claim_sockets(
            config.server.listen, int(config.server.socket_mode, 8), socket_gid(config.server)
        )
        try:
            check_tcp_addresses(config.server.listen)
            await _serve_claimed(config, stop, hangups, reread)
        finally:
            for lock in claimed:
                lock.release()
    finally:
        for signum in handled:
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(signum)


async def _serve_claimed(
    config: Config,
    stop: asyncio.Event,
    hangups: asyncio.Queue[None],
    reread: Callable[[], Config] | None,
) -> None:
    store = BlockStore.from_config(config)
    await store.start()  # a SIGTERM meanwhile is seen once it is done
    try:
        if stop.is_set():
            log.info("stopped during start-up")
            return
        running = await create_server(config, store)
        stop_metrics = None
        if config.metrics.listen:
            stop_metrics, _ = serve_metrics(
                config.metrics.listen,
                running.service.stats,
                asyncio.get_running_loop(),
                running.rpcs,
            )
        sys.setswitchinterval(THREAD_SWITCH_S)  # a worker thread hands the loop the GIL soon
        frozen = collector.freeze()
        log.info("garbage collector: %d start-up objects frozen out of full collections", frozen)
        try:
            current = config
            while await _first_of(stop.wait(), hangups.get()) == 1:
                current = _on_hangup(current, reread, running, store)
            log.info("shutting down (grace %.1fs)", config.server.shutdown_grace)
        finally:
            if stop_metrics is not None:
                await asyncio.to_thread(stop_metrics)
            await running.stop()
    finally:
        await store.aclose(flush=True)
    log.info("kvstore stopped")


async def _first_of(*awaitables: Awaitable[object]) -> int:
    """The index of the first awaitable to finish; the others are cancelled."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    return next(i for i, task in enumerate(tasks) if task in done)


def _on_hangup(
    current: Config, reread: Callable[[], Config] | None, running: RunningServer, store: BlockStore
) -> Config:
    if reread is None:
        log.info("SIGHUP: no config file to read again; nothing changed")
        return current
    try:
        new = reread()
    except (ConfigError, OSError) as error:
        log.error("SIGHUP: the config was not reloaded, the daemon runs on: %s", error)
        return current
    applied, restart = reload(current, new, running, store)
    log.info("SIGHUP: applied %s", ", ".join(applied) or "nothing (no change)")
    if restart:
        log.warning("SIGHUP: left as they were, these need a restart: %s", ", ".join(restart))
    return new


def reload(
    old: Config, new: Config, running: RunningServer, store: BlockStore
) -> tuple[list[str], list[str]]:
    """Applies what changed from ``old`` to ``new`` that a running daemon can take: the
    tokens, the eviction watermarks, the log level, the tiers' TTLs. Returns those changes,
    and the changed keys that need a restart (left as they were)."""
    applied: list[str] = []
    if new.auth != old.auth and running.authenticator is not None:
        running.authenticator.replace(new.auth)
        applied.append(f"auth.tokens ({len(new.auth.tokens)})")
    high, low = new.eviction.high_watermark, new.eviction.low_watermark
    if (high, low) != (old.eviction.high_watermark, old.eviction.low_watermark):
        store.set_watermarks(high, low)
        applied.append(f"eviction watermarks {low:g}-{high:g}")
    if new.server.log_level != old.server.log_level:
        logging.getLogger().setLevel(new.server.log_level.upper())
        applied.append(f"server.log_level {new.server.log_level}")
    names = {level.name for level in store.tiers}
    for section in TIER_SECTIONS:
        ttl = getattr(new, section).ttl
        if ttl != getattr(old, section).ttl and section in names:
            store.tier(section).ttl = ttl
            applied.append(f"{section}.ttl {ttl:g}s")
    # Everything else must be as it was: what differs needs a restart.
    kept = dataclasses.replace(
        new,
        auth=old.auth,
        server=dataclasses.replace(new.server, log_level=old.server.log_level),
        eviction=dataclasses.replace(
            new.eviction,
            high_watermark=old.eviction.high_watermark,
            low_watermark=old.eviction.low_watermark,
        ),
        host=dataclasses.replace(new.host, ttl=old.host.ttl),
        ssd=dataclasses.replace(new.ssd, ttl=old.ssd.ttl),
        redis=dataclasses.replace(new.redis, ttl=old.redis.ttl),
    )
    restart = [
        f"{section.name}.{key}"
        for section in dataclasses.fields(old)
        for key, value in dataclasses.asdict(getattr(old, section.name)).items()
        if dataclasses.asdict(getattr(kept, section.name))[key] != value
    ]
    return applied, restart
