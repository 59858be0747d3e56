"""A real Redis Cluster on this machine, for tests and benchmarks: ``primaries``
redis-server processes with ``replicas`` each, on free ports, joined by
``redis-cli --cluster create``.

    cluster = LocalCluster(tmp_path)   # 3 primaries + 3 replicas
    cluster.start()                    # returns once every node says cluster_state:ok
    ... RedisTier(cluster.url, ...) ...  # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...
    cluster.stop()

``LocalSentinel(tmp_path)`` is the same for a Sentinel setup: one primary, one replica and
three sentinels monitoring them as ``kvstore-primary``; ``url`` is a ``redis+sentinel://``
URL naming the three.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from kvstore.inference_adapter.bench.ports import free_port

__all__ = ["LocalCluster", "LocalSentinel", "RedisSetupError", "command", "dbsize"]

BUS_OFFSET = 10000  # a node's cluster bus port is its port + 10000


class RedisSetupError(RuntimeError):
    """redis-server or redis-cli is missing, or the nodes did not come up."""


class LocalCluster:
    """Redis Cluster processes under ``workdir``; see the module docstring."""

    def __init__(
        self, workdir: Path, primaries: int = 3, replicas: int = 1, *, full_coverage: bool = False
    ) -> None:
        self.workdir = workdir
        self.primaries, self.replicas = primaries, replicas
        # With full coverage (Redis's default) every node answers CLUSTERDOWN while one shard
        # has no primary; without it (as a cache should run) the other shards serve.
        self.full_coverage = full_coverage
        self.ports = [free_port(BUS_OFFSET) for _ in range(primaries * (1 + replicas))]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """Seed nodes: the first two primaries (the client learns the rest)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports[:2])

    def start(self, timeout: float = 60.0) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise RedisSetupError(
                "redis-server and redis-cli are not installed; `make test` installs them"
            )
        try:
            for port in self.ports:
                self.start_node(port)
        except RedisSetupError:
            self.stop()
            raise
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        created = subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas),
             "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if created.returncode != 0:
            self.stop()
            raise RedisSetupError(
                f"redis-cli --cluster create failed:\n{created.stdout}{created.stderr}"
            )
        deadline = time.monotonic() + timeout
        while not all(self.info(port).get("cluster_state") == "ok" for port in self.ports):
            if time.monotonic() > deadline:
                self.stop()
                raise RedisSetupError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def start_node(self, port: int) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        directory = self.workdir / str(port)
        directory.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(directory), "--protected-mode", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "1000", "--cluster-require-full-coverage",
                "yes" if self.full_coverage else "no"]  # fmt: skip
        log = directory / "redis.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        self.procs[port] = proc
        deadline = time.monotonic() + 10
        while self.command(port, "PING") != "+PONG":
            if proc.poll() is not None or time.monotonic() > deadline:
                said = log.read_text(errors="replace").strip().splitlines()[-3:]
                raise RedisSetupError(
                    f"redis-server on port {port} "
                    + ("exited" if proc.poll() is not None else "did not answer in 10 s")
                    + (": " + " / ".join(said) if said else "")
                )
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(timeout=10)
        self.procs.clear()

    def command(self, port: int, *words: str) -> str:
        return command(port, *words)

    def info(self, port: int) -> dict[str, str]:
        """``CLUSTER INFO`` of one node."""
        lines = self.command(port, "CLUSTER", "INFO").splitlines()[1:]
        return dict(line.split(":", 1) for line in lines if ":" in line)

    def dbsize(self, port: int) -> int:
        return dbsize(port)

    def flushall(self) -> None:
        for port in self.ports:
            if self.command(port, "ROLE").find("master") >= 0:
                self.command(port, "FLUSHALL")


class LocalSentinel:
    """A primary, its replica and three sentinels under ``workdir``."""

    SERVICE = "kvstore-primary"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.primary, self.replica = free_port(), free_port()
        self.sentinels = [free_port() for _ in range(3)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.SERVICE}/0"

    def start(self, timeout: float = 60.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisSetupError("redis-server is not installed; `make test` installs it")
        for port, extra in ((self.primary, []), (self.replica, ["--replicaof", "127.0.0.1",
                                                                 str(self.primary)])):  # fmt: skip
            directory = self.workdir / str(port)
            directory.mkdir(parents=True, exist_ok=True)
            self.procs[port] = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(directory), "--protected-mode", "no",
                 *extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            )  # fmt: skip
        for port in self.sentinels:
            config = self.workdir / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\n"
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary} 2\n"
                f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
                f"sentinel failover-timeout {self.SERVICE} 5000\n"
            )
            self.procs[port] = subprocess.Popen(
                [binary, str(config), "--sentinel"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not (
            "master_link_status:up" in self.command(self.replica, "INFO", "replication")
            and all(self.knows_everyone(port) for port in self.sentinels)
        ):
            if time.monotonic() > deadline:
                self.stop()
                raise RedisSetupError("the Sentinel setup did not come up")
            time.sleep(0.1)

    def knows_everyone(self, sentinel: int) -> bool:
        """Whether the sentinel on ``sentinel`` knows the replica and the other sentinels:
        until it does, a dead primary has no replica to promote and no quorum to elect a
        leader (sentinels learn replicas from the primary's INFO, about every 10 s, and
        each other from hello messages, every 2 s)."""
        fields = self.command(sentinel, "SENTINEL", "MASTER", self.SERVICE).split("\r\n")
        values = dict(zip(fields[2::4], fields[4::4], strict=False))
        others = len(self.sentinels) - 1
        return values.get("num-slaves") == "1" and values.get("num-other-sentinels") == str(others)

    def command(self, port: int, *words: str) -> str:
        return command(port, *words)

    def dbsize(self, port: int) -> int:
        return dbsize(port)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(timeout=10)
        self.procs.clear()


def command(port: int, *words: str) -> str:
    """One inline command's whole reply from the node on ``port``, as text ("" when it does
    not answer)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(" ".join(words).encode() + b"\r\n")
            reply = conn.recv(1 << 16)
            if reply.startswith(b"$"):  # a bulk string: read until it is all here
                size = int(reply[1 : reply.index(b"\r\n")])
                while len(reply) < reply.index(b"\r\n") + 2 + size:
                    reply += conn.recv(1 << 16)
            return reply.decode(errors="replace").strip()
    except OSError:
        return ""


def dbsize(port: int) -> int:
    """The keys the node on ``port`` holds (0 when it does not answer)."""
    reply = command(port, "DBSIZE")
    return int(reply[1:]) if reply.startswith(":") else 0
