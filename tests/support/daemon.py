"""A real kvstore daemon in a child process, for integration tests.

``Daemon(workdir)`` writes a small config (a few MiB of host arena and an SSD tier under
``workdir``, fsync off, a unix socket in a short temporary directory) and runs
``python -m kvstore serve --config`` on it. ``start()`` waits until the health service
answers SERVING; ``stop()`` sends SIGTERM (graceful: write-back blocks reach the SSD),
``kill()`` sends SIGKILL; ``start()`` again restarts on the same directories and socket.

    daemon = Daemon(tmp_path, tokens=["secret:tenant-a"])
    daemon.start()
    ... AsyncKVStoreClient(daemon.address, token="secret") ...
    daemon.stop()

``running_daemon(tmp_path)`` is the same as a context manager that always cleans up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.launch import kvstore_command

__all__ = ["Daemon", "rpcs", "running_daemon", "scrape"]


class Daemon:
    """One daemon process on fixed directories; see the module docstring.

    Args:
        workdir: Where the config, the arena, the SSD blocks and the log live.
        host_capacity: The host arena's size (TOML size string).
        ssd_capacity: The SSD tier's size; ``None`` disables the SSD tier.
        tokens: ``"token:tenant"`` pairs for ``[auth] tokens``.
        tcp: Also listen on these ``"host:port"`` addresses.
        settings: More config values, ``{"section": {"key": value}}``, merged over the rest.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        host_capacity: str = "8MiB",
        ssd_capacity: str | None = "64MiB",
        tokens: Sequence[str] = (),
        tcp: Sequence[str] = (),
        settings: Mapping[str, Mapping[str, object]] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A unix socket path must stay under ~107 bytes; pytest's tmp_path may be longer.
        self._socket_dir = Path(tempfile.mkdtemp(prefix="kvs-"))
        self.socket_path = self._socket_dir / "kvstore.sock"
        self.config_path = self.workdir / "kvstore.toml"
        self.log_path = self.workdir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        sections: dict[str, dict[str, object]] = {
            "host": {"capacity": host_capacity},
            "ssd": {
                "enabled": ssd_capacity is not None,
                "directory": str(self.workdir / "ssd"),
                "capacity": ssd_capacity or "64MiB",
                "fsync": False,
            },
            "server": {"listen": [self.address, *tcp], "lease_ttl": "10s", "shutdown_grace": "2s"},
            "auth": {"tokens": list(tokens)},
        }
        for section, values in (settings or {}).items():
            sections.setdefault(section, {}).update(values)
        self.config_path.write_text(_toml(sections))

    @property
    def address(self) -> str:
        """The client address: ``unix:/.../kvstore.sock``."""
        return f"unix:{self.socket_path}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0) -> None:
        """Starts the daemon and waits until it serves.

        Raises:
            RuntimeError: It exited, or did not serve within ``timeout`` (log tail included).
        """
        if self.running:
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        command = kvstore_command("serve", "--config", str(self.config_path))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket_path.exists() and self._serving():
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"the daemon did not serve within {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``; its exit status."""
        return self._end(signal.SIGTERM, timeout)

    def kill(self) -> int | None:
        """SIGKILL: the daemon dies without flushing or removing its files."""
        return self._end(signal.SIGKILL, 10.0)

    def restart(self, *, graceful: bool = True) -> None:
        """Stops (SIGTERM, or SIGKILL when not ``graceful``) and starts on the same dirs."""
        if graceful:
            self.stop()
        else:
            self.kill()
        self.start()

    def close(self) -> None:
        """Stops the daemon and removes the socket directory."""
        with contextlib.suppress(ProcessLookupError):
            self.stop()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    def log(self, tail: int = 4000) -> str:
        """The end of the daemon's output."""
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def _end(self, signum: signal.Signals, timeout: float) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signum)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10.0)
        return proc.returncode

    def _serving(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@contextlib.contextmanager
def running_daemon(workdir: Path, **options: object) -> Iterator[Daemon]:
    """A started :class:`Daemon` (keyword options as its constructor's), closed on exit."""
    daemon = Daemon(workdir, **options)  # type: ignore[arg-type]
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.close()


def _toml(sections: Mapping[str, Mapping[str, object]]) -> str:
    """The sections as TOML (JSON literals are valid TOML for strings, numbers, booleans)."""
    lines: list[str] = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def scrape(port: int) -> dict[str, float]:
    """A daemon's ``/metrics`` (``[metrics] listen`` on ``port``) as ``{'name{labels}': value}``."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def rpcs(metrics: dict[str, float]) -> Counter[str]:
    """Calls per method in a :func:`scrape` (over gRPC and shm session sockets alike), every
    status code together."""
    calls: Counter[str] = Counter()
    for name, value in metrics.items():
        if name.startswith("kvstore_rpcs_total{"):
            calls[name.split('method="')[1].split('"')[0]] += int(value)
    return calls
