"""The ``kvstore`` command: run the daemon, or ask a running one for its statistics.

- ``kvstore serve [--config FILE] [--listen ADDR]... [--log-level LEVEL]`` runs the daemon
  on uvloop until SIGTERM or SIGINT. Without a config file the embedded defaults apply, with
  the host tier sized to the machine (:func:`kvstore.defaults.auto_host_capacity`) unless
  ``KVSTORE_HOST__CAPACITY`` names a size.
- ``kvstore stats [--address ADDR | --config FILE] [--token T] [--json]`` prints tier
  usage, hit rates and leases in flight (``--token`` defaults to ``$KVSTORE_TOKEN``);
  ``--json`` prints every field of the reply, zeros included, numbers as JSON numbers.
- ``kvstore health`` asks the gRPC health service (exit 0 when serving, a tier down
  included: the line says ``degraded`` and names it); ``kvstore
  namespaces [--json]`` lists namespaces with their blocks, bytes and tiers; ``kvstore evict
  --namespace HEX | --tenant NAME`` deletes their blocks from every tier; ``kvstore flush``
  copies what only the top tier holds to the tier below. These and ``stats`` take
  ``--address``/``--config``, ``--token``, ``--tls-ca``/``--tls-server-name`` and
  ``--timeout``. With tokens on, a tenant's token reaches its own namespaces; an operator
  token (``"token:*"`` in ``auth.tokens``) every tenant's, and only it may flush.
- ``kvstore chat [...]`` runs the multi-turn chat (SmolLM2)
  (:mod:`kvstore.inference_adapter.demo`), ``kvstore bench chat [...]`` the end-to-end
  benchmark (:mod:`kvstore.inference_adapter.bench`), ``kvstore bench vllm [...]`` the
  same through vLLM (:mod:`kvstore.inference_adapter.bench.vllm`) and ``kvstore bench gpu
  [...]`` store hits against recompute on one device
  (:mod:`kvstore.inference_adapter.bench.gpu`); their modules, and
  torch, load only when they run (without torch: a message naming the ``engine`` extra, exit
  status 2). The benchmarks run from a checkout (``make install``, an editable install): the
  wheel leaves them out, and there ``kvstore bench ...`` says so (exit status 2).

Exit statuses (every failure is one line on stderr, never a traceback or a secret):

- 0: done (``health``: the daemon serves);
- 1: the daemon cannot start: another one holds its socket or SSD directory (the line names
  that daemon's pid), an address cannot be bound, a tier's directory cannot be made; or a
  running daemon cannot be reached or refused the call (``health``: it does not serve);
- 2: a bad config (the key and the value are named; a token never is), a bad option, a host
  tier larger than the machine's memory, or a missing extra.

This is the entry point: the only place that installs uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from kvstore import __version__
from kvstore.config import LOG_LEVELS, TIER_SECTIONS, Config, ConfigError, load_config
from kvstore.protos.kvstore.v1 import kvstore_pb2
from kvstore.tiers.redis_url import without_secrets
from kvstore.wire.channels import open_sync_channel

__all__ = ["format_stats", "main"]

log = logging.getLogger("kvstore")
M = TypeVar("M", bound=Message)
# What the engine-side commands need beyond the daemon (the ``engine`` extra).
ENGINE_MODULES = ("torch", "triton", "gguf", "tokenizers", "jinja2")
# ``kvstore bench ...`` and ``kvstore dataset fetch``: in a checkout, not in the wheel.
BENCH_PACKAGE = "kvstore.inference_adapter.bench"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``kvstore`` command; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    delegated = {tuple(name.split()): module for name, module, _ in _DELEGATED}
    for words, module in delegated.items():
        if tuple(argv[: len(words)]) == words:  # its own parser takes every argument
            try:
                command: Callable[[list[str]], int] = importlib.import_module(module).main
            except ModuleNotFoundError as error:
                if f"{error.name}.".startswith(f"{BENCH_PACKAGE}."):  # it or a module in it
                    print(
                        f"kvstore {' '.join(words)}: the benchmarks are not in the installed "
                        "package; run it from a checkout installed with `make install`",
                        file=sys.stderr,
                    )
                    return 2
                if error.name not in ENGINE_MODULES:
                    raise
                print(
                    f"kvstore {' '.join(words)}: needs {error.name}, which is not installed: "
                    "pip install 'kvstore[engine]'",
                    file=sys.stderr,
                )
                return 2
            return command(argv[len(words) :])
    args = _parser().parse_args(argv)
    try:
        status: int = args.run(args)
        sys.stdout.flush()
    except ConfigError as error:
        print(f"kvstore: {error}", file=sys.stderr)
        return 2
    except _CallFailed as failed:  # the daemon is unreachable or refused: said in one line
        print(failed, file=sys.stderr)
        return 1
    except BrokenPipeError:  # `kvstore stats | head`: the reader left, which is no error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the flush at exit finds no pipe
        os.close(devnull)
        return 0
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Tiered KV-cache daemon.")
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", metavar="FILE", help="TOML file (default: embedded defaults)")
    serve.add_argument(
        "--listen",
        action="append",
        metavar="ADDR",
        help="'unix:/path' or 'host:port'; repeat for several (replaces server.listen)",
    )
    serve.add_argument("--log-level", choices=LOG_LEVELS,
                       help="replaces server.log_level (default info), also on SIGHUP")  # fmt: skip
    serve.set_defaults(run=_serve)
    stats = commands.add_parser("stats", help="print a running daemon's statistics")
    _client_options(stats)
    stats.add_argument("--json", action="store_true", help="print the StatsResponse as JSON")
    stats.add_argument(
        "--watch",
        nargs="?",
        const=1.0,
        type=_positive_seconds,
        metavar="SECONDS",
        help="a line of rates every SECONDS (default 1), like redis-cli --stat; Ctrl-C stops",
    )
    stats.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N lines")
    stats.set_defaults(run=_stats)
    health = commands.add_parser(
        "health", help="ask a running daemon's gRPC health service (exit 0 when serving)"
    )
    _client_options(health)
    health.set_defaults(run=_health)
    namespaces = commands.add_parser(
        "namespaces", help="list a running daemon's namespaces with their blocks and bytes"
    )
    _client_options(namespaces)
    namespaces.add_argument("--json", action="store_true", help="print the reply as JSON")
    namespaces.set_defaults(run=_namespaces)
    evict = commands.add_parser(
        "evict", help="delete a namespace's or a tenant's blocks from every tier"
    )
    _client_options(evict)
    which = evict.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="HEX",
                       help="the namespace digest, or a unique prefix (8+ digits)")  # fmt: skip
    which.add_argument("--tenant", metavar="NAME", help="every namespace of this tenant")
    evict.set_defaults(run=_evict)
    flush = commands.add_parser(
        "flush", help="copy blocks only the top tier holds to the tier below, now"
    )
    _client_options(flush)
    flush.set_defaults(run=_flush)
    # The engine-side commands load torch; ``main`` hands them their arguments untouched and
    # imports their modules only when they run. Listed here for ``kvstore --help``.
    summaries: dict[str, list[str]] = {}
    for name, _, summary in _DELEGATED:
        summaries.setdefault(name.split()[0], []).append(summary)
    for word, lines in summaries.items():
        group = commands.add_parser(
            word,
            help="; ".join(lines),
            description="\n".join(f"kvstore {line}" for line in lines)
            + f"\n\nRun 'kvstore {word} COMMAND --help' for a command's options.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        group.set_defaults(run=functools.partial(_group_usage, group))
    return parser


def message_fields(message: Message) -> dict[str, object]:
    """Every field of ``message`` with its own type, zeros included (protobuf's JSON drops
    zero fields and writes 64-bit numbers as strings): ``kvstore stats --json``."""
    fields: dict[str, object] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.type == field.TYPE_MESSAGE:
            value = (
                [message_fields(v) for v in value] if field.is_repeated else message_fields(value)
            )
        elif field.is_repeated:
            value = list(value)
        elif isinstance(value, bytes):
            value = value.hex()
        fields[field.name] = value
    return fields


def _group_usage(group: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``kvstore bench`` (a group's word alone): its commands, exit status 2."""
    group.print_help(sys.stderr)
    return 2


_DELEGATED = [
    (
        "chat",
        "kvstore.inference_adapter.demo",
        "multi-turn chat with SmolLM2 (or --random): TTFT with the store vs recompute",
    ),
    (
        "pd-proxy",
        "kvstore.inference_adapter.vllm.proxy",
        "pd-proxy: each request to a prefill vLLM, then to a decode vLLM with its KV hand-off",
    ),
    (
        "bench chat",
        "kvstore.inference_adapter.bench.chat",
        "bench chat: multi-turn workloads, recompute vs kvstore (TTFT, hit rates, plots)",
    ),
    (
        "bench vllm",
        "kvstore.inference_adapter.bench.vllm",
        "bench vllm: multi-turn chats through vLLM without and with the kvstore connector",
    ),
    (
        "bench truncation",
        "kvstore.inference_adapter.bench.truncation",
        "bench truncation: perplexity and TTFT past a chat truncation, recompute vs reuse",
    ),
    (
        "bench gpu",
        "kvstore.inference_adapter.bench.gpu",
        "bench gpu: TTFT of a store hit vs recompute, KV load and save rates vs the host link",
    ),
    (
        "bench blocks",
        "kvstore.inference_adapter.bench.blocks",
        "bench blocks: prefix hits on ShareGPT chats per store block size (the unsaved tail)",
    ),
    (
        "bench hit",
        "kvstore.inference_adapter.bench.hit",
        "bench hit: a store hit's time against a copy of its bytes, phase by phase",
    ),
    (
        "dataset fetch",
        "kvstore.inference_adapter.bench.sharegpt",
        "dataset fetch: download ShareGPT V3 for `kvstore bench chat --dataset sharegpt`",
    ),
    (
        "model",
        "kvstore.inference_adapter.models",
        "model fetch|path: download SmolLM2's GGUF file into the user cache, or print its path",
    ),
]


def serve_config(
    path: str | None, listen: Sequence[str] | None, server: Mapping[str, object] | None = None
) -> Config:
    """The daemon's configuration: file (or defaults), environment, then ``--listen`` and
    the other ``server`` keys the command line sets (``--log-level``).

    Raises:
        ConfigError: an invalid value anywhere.
    """
    flags: dict[str, object] = dict(server or {})
    if listen:
        flags["listen"] = list(listen)
    config = load_config(path, overrides={"server": flags} if flags else {})
    if path is None and config.host.enabled and "KVSTORE_HOST__CAPACITY" not in os.environ:
        from kvstore.defaults import host_default

        capacity, why = host_default()
        log.info("host tier %s by default: %s", format_size(capacity), why)
        config = dataclasses.replace(
            config, host=dataclasses.replace(config.host, capacity=capacity)
        )
    return config


def _serve(args: argparse.Namespace) -> int:
    import uvloop

    from kvstore.defaults import tune_allocator
    from kvstore.server import serve
    from kvstore.tiers.locks import InUseError

    tune_allocator()
    logging.basicConfig(
        level=(args.log_level or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    overrides = {"log_level": args.log_level} if args.log_level else {}
    config = serve_config(args.config, args.listen, overrides)
    logging.getLogger().setLevel(config.server.log_level.upper())
    check_host_fits(config)
    _log_layout(config, args.config)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    reread = (lambda: serve_config(args.config, args.listen, overrides)) if args.config else None
    try:
        asyncio.run(serve(config, reread))
    except OSError as error:  # a socket, directory or address the daemon cannot have
        log.debug("start-up failed", exc_info=True)
        message = error.strerror if isinstance(error, InUseError) else _os_error_line(error)
        print(f"kvstore serve: {message}", file=sys.stderr)
        return 1
    return 0


def _os_error_line(error: OSError) -> str:
    """``error`` in one line: its message, and the path it names when it names one."""
    text = error.strerror or str(error)
    if error.filename is not None and str(error.filename) not in text:
        text = f"{text}: {error.filename}"
    return text


def check_host_fits(config: Config) -> None:
    """Refuses a host tier larger than the memory this process may use (MemTotal, or the
    cgroup's memory.max): its arenas would be killed by the OOM killer, not refused.

    Raises:
        ConfigError: naming the capacity and the limit.
    """
    from kvstore.defaults import memory_limit

    limit, source = memory_limit()
    if config.host.enabled and limit is not None and config.host.capacity > limit:
        raise ConfigError(
            f"host.capacity {format_size(config.host.capacity)} is more than the memory this "
            f"process may use ({source}); set a smaller host.capacity"
        )


def _log_layout(config: Config, path: str | None) -> None:
    """Where everything lands and how big it may grow, with units, at start."""
    log.info("config: %s", path or "embedded defaults")
    for name in TIER_SECTIONS:
        tier = getattr(config, name)
        if not tier.enabled:
            log.info("%s tier: off", name)
            continue
        where = {"host": "memfd arenas (anonymous shared memory)",
                 "ssd": f"directory {getattr(tier, 'directory', '')}",
                 "redis": f"url {without_secrets(getattr(tier, 'url', ''))}"}[name]  # fmt: skip
        log.info("%s tier: up to %s, %s", name, format_size(tier.capacity), where)
    log.info("listening on %s", ", ".join(config.server.listen))
    if config.metrics.listen:
        log.info("metrics on http://%s/metrics", config.metrics.listen)


def format_size(size: int) -> str:
    """``size`` bytes in the largest binary unit that keeps one decimal (``4.0 GiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _client_options(parser: argparse.ArgumentParser) -> None:
    """The options of the commands that talk to a running daemon."""
    parser.add_argument("--address", help="'unix:/path' or 'host:port' (default: the first "
                        "server.listen address of --config or of the defaults)")  # fmt: skip
    parser.add_argument("--config", metavar="FILE", help="where to find server.listen")
    parser.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN"),
                        help="bearer token (default: $KVSTORE_TOKEN)")  # fmt: skip
    parser.add_argument("--tls-ca", metavar="PEM", help="CA certificate(s) of a TLS listener")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="the name in the certificate (default: the host's)")  # fmt: skip
    parser.add_argument("--timeout", type=_positive_seconds, default=5.0,
                        help="seconds per call (default 5)")  # fmt: skip


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


@contextlib.contextmanager
def _channel(args: argparse.Namespace) -> Iterator[tuple[str, grpc.Channel, list[tuple[str, str]]]]:
    """The address, a channel to it (TLS with ``--tls-ca``) and the call metadata.

    Raises:
        ConfigError: ``--tls-ca`` cannot be read, or names no certificate.
    """
    address = args.address or load_config(args.config).server.listen[0]
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else []
    root: bytes | None = None
    if args.tls_ca is not None:
        try:
            root = Path(args.tls_ca).read_bytes()
        except OSError as error:
            raise ConfigError(f"--tls-ca {args.tls_ca}: {error.strerror}") from error
        if b"-----BEGIN CERTIFICATE-----" not in root:
            raise ConfigError(f"--tls-ca {args.tls_ca}: no PEM certificate in it")
    with open_sync_channel(address, root_cert=root, server_name=args.tls_server_name) as channel:
        yield address, channel, metadata


def _stats(args: argparse.Namespace) -> int:
    if args.watch is not None:
        with _channel(args) as (address, channel, metadata):
            return _watch(lambda: _call(args, address, channel, metadata, "Stats",
                                        kvstore_pb2.StatsRequest(), kvstore_pb2.StatsResponse),
                          args.watch, args.count)  # fmt: skip
    response = _unary(args, "Stats", kvstore_pb2.StatsRequest(), kvstore_pb2.StatsResponse)
    if args.json:
        print(json.dumps(message_fields(response), indent=2))
    else:
        print(format_stats(response))
    return 0


class _CallFailed(Exception):
    """A call the daemon did not answer: the one line to print (exit status 1)."""

    def __init__(self, command: str, address: str, error: grpc.RpcError) -> None:
        super().__init__(f"kvstore {command}: {address}: {error.code().name}: {error.details()}")


WATCH_HEADER = (
    f"{'blocks':>10}{'host used':>12}{'ssd used':>12}{'gets/s':>9}{'hit':>7}{'puts/s':>9}"
    f"{'evict/s':>9}{'leases':>8}"
)


def _watch(read: Callable[[], kvstore_pb2.StatsResponse], every: float, count: int | None) -> int:
    """Prints a line of rates every ``every`` seconds (the header every 20 lines), ``count``
    lines or until interrupted (exit status 0 either way)."""
    previous, then = read(), time.monotonic()
    lines = 0
    try:
        while count is None or lines < count:
            time.sleep(max(0.0, then + every - time.monotonic()))
            current, now = read(), time.monotonic()
            if lines % 20 == 0:
                print(WATCH_HEADER)
            print(watch_line(previous, current, now - then), flush=True)
            previous, then, lines = current, now, lines + 1
    except KeyboardInterrupt:
        pass
    return 0


def watch_line(
    before: kvstore_pb2.StatsResponse, after: kvstore_pb2.StatsResponse, seconds: float
) -> str:
    """One ``--watch`` line: what ``after`` holds, and the rates since ``before``."""
    used = {tier.name: format_size(tier.usage_bytes) for tier in after.tiers}
    evictions = sum(t.evictions for t in after.tiers) - sum(t.evictions for t in before.tiers)
    gets, misses = after.gets - before.gets, after.misses - before.misses
    return (
        f"{after.blocks:>10}{used.get('host', '0 B'):>12}{used.get('ssd', '0 B'):>12}"
        f"{gets / seconds:>9.0f}{_rate(gets - misses, gets):>7}"
        f"{(after.puts - before.puts) / seconds:>9.0f}{evictions / seconds:>9.0f}"
        f"{after.active_leases:>8}"
    )


def _unary(args: argparse.Namespace, method: str, request: Message, reply: type[M]) -> M:
    """Calls ``method`` of the daemon on a channel of its own; its reply.

    Raises:
        _CallFailed: the daemon cannot be reached or refused the call.
    """
    with _channel(args) as (address, channel, metadata):
        return _call(args, address, channel, metadata, method, request, reply)


def _call(
    args: argparse.Namespace,
    address: str,
    channel: grpc.Channel,
    metadata: list[tuple[str, str]],
    method: str,
    request: Message,
    reply: type[M],
) -> M:
    """:func:`_unary` on an open channel (``stats --watch`` reuses one)."""
    from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc

    stub = kvstore_pb2_grpc.KVStoreStub(channel)  # type: ignore[no-untyped-call]
    try:
        answer = getattr(stub, method)(request, metadata=metadata, timeout=args.timeout)
    except grpc.RpcError as error:
        raise _CallFailed(method.lower(), address, error) from None
    assert isinstance(answer, reply)
    return answer


def _namespaces(args: argparse.Namespace) -> int:
    reply = _unary(
        args, "Namespaces", kvstore_pb2.NamespacesRequest(), kvstore_pb2.NamespacesResponse
    )
    if args.json:
        print(json.dumps(message_fields(reply)["namespaces"], indent=2))
    else:
        print(format_namespaces(reply))
    return 0


def format_namespaces(reply: kvstore_pb2.NamespacesResponse) -> str:
    """The namespaces as a table: a digest prefix (``kvstore evict --namespace`` takes it),
    tenant, model, blocks, bytes, and how many blocks each tier holds."""
    tiers = [tier.name for tier in reply.namespaces[0].tiers] if reply.namespaces else []
    lines = [f"{'namespace':<18}{'tenant':<16}{'model':<24}{'blocks':>9}{'size':>12}"
             + "".join(f"{name:>9}" for name in tiers)]  # fmt: skip
    for entry in reply.namespaces:
        lines.append(
            f"{entry.namespace.hex()[:16]:<18}{entry.tenant or '-':<16.15}"
            f"{entry.model_name or '-':<24.23}{entry.blocks:>9}{format_size(entry.bytes):>12}"
            + "".join(f"{tier.blocks:>9}" for tier in entry.tiers)
        )
    return "\n".join(lines)


def _evict(args: argparse.Namespace) -> int:
    namespace = b"" if args.namespace is None else _namespace_named(args, args.namespace)
    request = kvstore_pb2.EvictRequest(namespace=namespace, tenant=args.tenant or "")
    reply = _unary(args, "Evict", request, kvstore_pb2.EvictResponse)
    what = f"namespace {namespace.hex()}" if namespace else f"tenant {args.tenant!r}"
    print(f"evicted {reply.blocks} blocks ({reply.namespaces} namespaces) of {what}")
    return 0


def _namespace_named(args: argparse.Namespace, text: str) -> bytes:
    """The digest ``text`` names: 64 hex digits, or a prefix of 8+ that one listed
    namespace has.

    Raises:
        ConfigError: anything else (exit status 2).
    """
    digits = text.strip().lower()
    if len(digits) < 8 or any(c not in "0123456789abcdef" for c in digits):
        raise ConfigError(f"--namespace: expected 8 to 64 hex digits, got {text!r}")
    if len(digits) == 64:
        return bytes.fromhex(digits)
    reply = _unary(
        args, "Namespaces", kvstore_pb2.NamespacesRequest(), kvstore_pb2.NamespacesResponse
    )
    matches = [n.namespace for n in reply.namespaces if n.namespace.hex().startswith(digits)]
    if len(matches) != 1:
        raise ConfigError(f"--namespace {digits}: {len(matches)} namespaces start with it")
    return bytes(matches[0])


def _flush(args: argparse.Namespace) -> int:
    reply = _unary(args, "Flush", kvstore_pb2.FlushRequest(), kvstore_pb2.FlushResponse)
    print(f"flushed {reply.blocks} blocks to the tier below")
    return 0


def _health(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.server import TIER_HEALTH, TIERS_HEALTH

    serving = health_pb2.HealthCheckResponse.SERVING
    with _channel(args) as (address, channel, metadata):
        stub = health_pb2_grpc.HealthStub(channel)

        def check(service: str) -> int:
            request = health_pb2.HealthCheckRequest(service=service)
            try:
                status: int = stub.Check(request, metadata=metadata, timeout=args.timeout).status
            except grpc.RpcError as error:
                if service and error.code() == grpc.StatusCode.NOT_FOUND:
                    return int(serving)  # an older daemon, or a tier that is off
                raise _CallFailed("health", address, error) from None
            return status

        status = check("")
        down = []
        if status == serving and check(TIERS_HEALTH) != serving:
            down = [name for name in TIER_SECTIONS if check(TIER_HEALTH + name) != serving]
    line = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    if down:
        line += f", degraded: {', '.join(down)} tier down (hits come from the others)"
    print(f"{address}: {line}")
    return 0 if status == serving else 1


def format_stats(stats: kvstore_pb2.StatsResponse) -> str:
    """A ``StatsResponse`` as a short human-readable report."""
    lines = [f"{'tier':<8}{'usage':>24}{'blocks':>10}{'hits':>10}{'evictions':>11}  health"]
    for tier in stats.tiers:
        share = tier.usage_bytes / tier.capacity_bytes if tier.capacity_bytes else 0.0
        used, capacity = format_size(tier.usage_bytes), format_size(tier.capacity_bytes)
        usage = f"{used} / {capacity} {share:4.0%}"
        health = "ok" if tier.healthy else "DOWN"
        lines.append(
            f"{tier.name:<8}{usage:>24}{tier.blocks:>10}{tier.hits:>10}{tier.evictions:>11}"
            f"  {health}"
        )
    lines += [
        f"blocks {stats.blocks}; puts {stats.puts} (+{stats.dedup_puts} dedup), "
        f"dropped saves {stats.dropped_saves}, corrupt {stats.corrupt_blocks}",
        f"gets {stats.gets}, hit rate {_rate(stats.gets - stats.misses, stats.gets)}; "
        f"lookups {stats.lookups}, {stats.lookup_hit_blocks} blocks found",
        f"promotions {stats.promotions}, demotions {stats.demotions}",
        f"in flight: {stats.active_leases} leases, {stats.active_reservations} reservations; "
        f"expired: {stats.expired_leases} leases, {stats.expired_reservations} reservations",
    ]
    if stats.version:
        lines.append(f"kvstore {stats.version}, up {_duration(stats.uptime_seconds)}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    """``3d 4h 5m 6s``, largest unit first, zeros left out (``0s`` at the start)."""
    left, parts = int(seconds), list[str]()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size or (unit == "s" and not parts):
            parts.append(f"{left // size}{unit}")
            left %= size
    return " ".join(parts)


def _rate(hits: int, total: int) -> str:
    return f"{hits / total:.1%}" if total else "n/a"
