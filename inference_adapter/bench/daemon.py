"""The daemons the bench talks to: a tier configuration, its TOML, and its processes.

:class:`TierSetup` names one configuration of the store (host, SSD and Redis capacities,
the Redis tier's write policy, eviction policy, and how many queued sessions the chat server
names in prefetch hints). :func:`running_store` starts ``python -m kvstore serve`` on it in
a scratch directory (the SSD tier under the given parent, the socket in a short temporary
directory, a private ``redis-server`` on a free port when Redis is on, unless it is given
the URL of a Redis tier to share), waits until it answers, and yields a
:class:`StoreProcess`; on exit it stops both and removes their files. ``peak_rss_bytes``
reads the daemon's high-water resident set (arena pages it touched included).
:func:`redis_server` is that private ``redis-server`` on its own, for daemons to share.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstore.client import KVStoreClient, KVStoreError
from kvstore.config import load_config
from kvstore.inference_adapter.bench.ports import free_port
from kvstore.launch import kvstore_command

__all__ = ["StoreProcess", "TierSetup", "redis_server", "running_store"]

MIB = 1 << 20
START_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class TierSetup:
    """One store configuration; a capacity of ``None`` turns that tier off."""

    name: str
    host_bytes: int
    ssd_bytes: int | None = None
    redis_bytes: int | None = None
    redis_policy: str = "write_back"  # write_through: every put reaches Redis at once
    policy: str = "lru"
    lookahead: int = 0  # queued sessions named in each prefetch hint (0: no hints)
    hint_ttl_s: float = 60.0  # how long a hint protects its blocks (scheduler-aware policy)

    @property
    def tiers(self) -> str:
        """``host``, ``host+ssd``, ``host+ssd+redis``..."""
        names = ["host", "ssd" if self.ssd_bytes else "", "redis" if self.redis_bytes else ""]
        return "+".join(name for name in names if name)

    def describe(self) -> str:
        """The capacities, e.g. ``host 32 MiB, SSD 512 MiB``."""
        sizes = {"host": self.host_bytes, "SSD": self.ssd_bytes, "Redis": self.redis_bytes}
        return ", ".join(f"{tier} {_size(size)}" for tier, size in sizes.items() if size)

    def sections(
        self, scratch: Path, socket_path: Path, redis_url: str | None
    ) -> dict[str, dict[str, object]]:
        """The daemon's configuration as TOML sections."""
        return {
            "host": {"capacity": self.host_bytes},
            "ssd": {
                "enabled": self.ssd_bytes is not None,
                "capacity": self.ssd_bytes or 64 * MIB,
                "directory": str(scratch / "ssd"),
            },
            "redis": {
                "enabled": redis_url is not None,
                "url": redis_url or "redis://127.0.0.1:6379/0",
                "capacity": self.redis_bytes or 64 * MIB,
                "key_prefix": "kvstore-bench",
                "write_policy": self.redis_policy,
            },
            "eviction": {"policy": self.policy, "hint_ttl": self.hint_ttl_s},
            "server": {"listen": [f"unix:{socket_path}"]},
        }


@dataclass(frozen=True, slots=True)
class StoreProcess:
    """A running daemon."""

    address: str
    pid: int

    def peak_rss_bytes(self) -> int | None:
        """The daemon's peak resident set (``VmHWM``), or None where /proc does not say."""
        with contextlib.suppress(OSError), open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return None


@contextlib.contextmanager
def running_store(
    setup: TierSetup, scratch_parent: Path | None = None, *, redis_url: str | None = None
) -> Iterator[StoreProcess]:
    """A daemon on ``setup`` in a fresh scratch directory; see the module docstring.

    ``redis_url``, when ``setup.redis_bytes`` is set, is a Redis the daemon shares with
    others (its tier's capacity is still ``redis_bytes``); without it the daemon gets a
    private ``redis-server``.

    Raises:
        RuntimeError: The daemon or redis-server did not start (the log tail is included).
        ConfigError: ``setup`` is not a valid configuration (checked before starting).
    """
    with contextlib.ExitStack() as cleanup:
        scratch = Path(tempfile.mkdtemp(prefix="kvs-chat-", dir=scratch_parent))
        cleanup.callback(shutil.rmtree, scratch, ignore_errors=True)
        sockets = Path(tempfile.mkdtemp(prefix="kvs-"))  # a socket path must stay short
        cleanup.callback(shutil.rmtree, sockets, ignore_errors=True)
        if not setup.redis_bytes:
            redis_url = None
        elif redis_url is None:
            redis_url = cleanup.enter_context(redis_server(scratch, setup.redis_bytes))
        config = scratch / "kvstore.toml"
        socket_path = sockets / "kvstore.sock"
        config.write_text(_toml(setup.sections(scratch, socket_path, redis_url)))
        load_config(config)  # a bad setup fails here, with the key named
        command = kvstore_command("serve", "--config", str(config))
        proc = cleanup.enter_context(_child([*command, "--log-level", "warning"], scratch))
        address = f"unix:{socket_path}"
        _wait_for("the daemon", lambda: _answers(address), proc, scratch / "child.log")
        yield StoreProcess(address, proc.pid)


@contextlib.contextmanager
def redis_server(scratch: Path, maxmemory: int) -> Iterator[str]:
    """A private redis-server without persistence (its files under ``scratch/redis``);
    yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (make redis-server)")
    workdir = scratch / "redis"
    workdir.mkdir()
    port = free_port()
    # Room for the values plus Redis's own bookkeeping; the tier enforces its capacity.
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    args += ["no", "--maxmemory", str(2 * maxmemory + 64 * MIB), "--dir", str(workdir)]
    with _child(args, workdir) as proc:
        _wait_for("redis-server", lambda: _redis_answers(port), proc, workdir / "child.log")
        yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def _child(command: list[str], workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process logging to ``workdir/child.log``; SIGTERM (then SIGKILL) on exit."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVSTORE_")}
    with open(workdir / "child.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for(
    name: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{tail}")
        if ready():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{name} did not answer within {START_TIMEOUT_S:.0f} s")


def _answers(address: str) -> bool:
    if not Path(address.removeprefix("unix:")).exists():
        return False
    with contextlib.suppress(KVStoreError), KVStoreClient(address, retries=0) as client:
        return client.health()
    return False


def _redis_answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as conn:
        conn.sendall(b"PING\r\n")
        return conn.recv(16).startswith(b"+PONG")
    return False


def _size(count: int) -> str:
    return f"{count / MIB:.0f} MiB" if count >= 8 * MIB else f"{count / 1024:.0f} KiB"


def _toml(sections: Mapping[str, Mapping[str, object]]) -> str:
    """JSON literals are TOML literals for strings, numbers, booleans and string lists."""
    lines: list[str] = []
    for section, values in sections.items():
        lines += [
            f"[{section}]",
            *(f"{key} = {json.dumps(value)}" for key, value in values.items()),
        ]
    return "\n".join(lines) + "\n"
