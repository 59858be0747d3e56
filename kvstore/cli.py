"""The ``kvstore`` command: run the daemon, or ask a running one for its statistics.

- ``kvstore serve [--config FILE] [--listen ADDR]... [--log-level LEVEL]`` runs the daemon
  on uvloop until SIGTERM or SIGINT. Without a config file the embedded defaults apply, with
  the host tier sized to the machine (:func:`kvstore.defaults.auto_host_capacity`) unless
  ``KVSTORE_HOST__CAPACITY`` names a size.
- ``kvstore stats [--address ADDR | --config FILE] [--token T] [--json]`` prints tier
  usage, hit rates and leases in flight (``--token`` defaults to ``$KVSTORE_TOKEN``);
  ``--json`` prints every field of the reply, zeros included, numbers as JSON numbers.
- ``kvstore chat [...]`` runs the multi-turn chat (SmolLM2)
  (:mod:`kvstore.inference_adapter.demo`), ``kvstore bench chat [...]`` the end-to-end
  benchmark (:mod:`kvstore.inference_adapter.bench`) and ``kvstore bench vllm [...]`` the
  same through vLLM (:mod:`kvstore.inference_adapter.bench.vllm`); their modules, and
  torch, load only when they run (without torch: a message naming the ``engine`` extra, exit
  status 2).

Exit statuses: 0 done; 1 the daemon cannot start because another one holds its socket or SSD
directory (one line on stderr, naming that daemon's pid); 2 a bad config or missing extra.

This is the entry point: the only place that installs uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import functools
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence

from google.protobuf.message import Message

from kvstore import __version__
from kvstore.config import Config, ConfigError, load_config
from kvstore.protos.kvstore.v1 import kvstore_pb2

__all__ = ["format_stats", "main"]

log = logging.getLogger("kvstore")
# What the engine-side commands need beyond the daemon (the ``engine`` extra).
ENGINE_MODULES = ("torch", "triton", "gguf", "tokenizers", "jinja2")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``kvstore`` command; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    delegated = {tuple(name.split()): module for name, module, _ in _DELEGATED}
    for words, module in delegated.items():
        if tuple(argv[: len(words)]) == words:  # its own parser takes every argument
            try:
                command: Callable[[list[str]], int] = importlib.import_module(module).main
            except ModuleNotFoundError as error:
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
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    serve.set_defaults(run=_serve)
    stats = commands.add_parser("stats", help="print a running daemon's statistics")
    stats.add_argument("--address", help="default: the first server.listen address")
    stats.add_argument("--config", metavar="FILE", help="where to find server.listen")
    stats.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN"), help="bearer token")
    stats.add_argument("--json", action="store_true", help="print the StatsResponse as JSON")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    stats.set_defaults(run=_stats)
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


def serve_config(path: str | None, listen: Sequence[str] | None) -> Config:
    """The daemon's configuration: file (or defaults), environment, then ``--listen``.

    Raises:
        ConfigError: an invalid value anywhere.
    """
    overrides = {"server": {"listen": list(listen)}} if listen else {}
    config = load_config(path, overrides=overrides)
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
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = serve_config(args.config, args.listen)
    _log_layout(config, args.config)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    reread = (lambda: serve_config(args.config, args.listen)) if args.config else None
    try:
        asyncio.run(serve(config, reread))
    except OSError as error:
        if not isinstance(error, InUseError) and error.errno != errno.EADDRINUSE:
            raise
        print(f"kvstore serve: {error.strerror or error}", file=sys.stderr)
        return 1
    return 0


def _log_layout(config: Config, path: str | None) -> None:
    """Where everything lands and how big it may grow, with units, at start."""
    log.info("config: %s", path or "embedded defaults")
    for name in ("host", "ssd", "redis"):
        tier = getattr(config, name)
        if not tier.enabled:
            log.info("%s tier: off", name)
            continue
        where = {"host": "memfd arenas (anonymous shared memory)",
                 "ssd": f"directory {getattr(tier, 'directory', '')}",
                 "redis": f"url {_without_secrets(getattr(tier, 'url', ''))}"}[name]  # fmt: skip
        log.info("%s tier: up to %s, %s", name, format_size(tier.capacity), where)
    log.info("listening on %s", ", ".join(config.server.listen))
    if config.metrics.listen:
        log.info("metrics on http://%s/metrics", config.metrics.listen)


def _without_secrets(url: str) -> str:
    """``url`` with any user and password taken out (``redis://:***@host:6379/0``)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    return urlunsplit(parts._replace(netloc=f"***@{parts.hostname}:{parts.port or ''}".rstrip(":")))


def format_size(size: int) -> str:
    """``size`` bytes in the largest binary unit that keeps one decimal (``4.0 GiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _stats(args: argparse.Namespace) -> int:
    import grpc

    from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc

    address = args.address or load_config(args.config).server.listen[0]
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    with grpc.insecure_channel(address) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)  # type: ignore[no-untyped-call]
        try:
            response = stub.Stats(
                kvstore_pb2.StatsRequest(), metadata=metadata, timeout=args.timeout
            )
        except grpc.RpcError as error:
            print(
                f"kvstore stats: {address}: {error.code().name}: {error.details()}", file=sys.stderr
            )
            return 1
    if args.json:
        print(json.dumps(message_fields(response), indent=2))
    else:
        print(format_stats(response))
    return 0


def format_stats(stats: kvstore_pb2.StatsResponse) -> str:
    """A ``StatsResponse`` as a short human-readable report."""
    lines = [f"{'tier':<8}{'usage':>24}{'blocks':>10}{'hits':>10}{'evictions':>11}  health"]
    for tier in stats.tiers:
        share = tier.usage_bytes / tier.capacity_bytes if tier.capacity_bytes else 0.0
        usage = f"{_size(tier.usage_bytes)} / {_size(tier.capacity_bytes)} {share:4.0%}"
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
        f"in flight: {stats.active_leases} leases, {stats.active_reservations} reservations",
    ]
    return "\n".join(lines)


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _rate(hits: int, total: int) -> str:
    return f"{hits / total:.1%}" if total else "n/a"
