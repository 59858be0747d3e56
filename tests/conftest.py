"""Session-wide fixtures: a real redis-server process on a free port.

Without CUDA, Triton kernels run on the CPU through the Triton interpreter, which must be
chosen before anything imports triton: this file is loaded first, so it sets it here.

torch's OpenMP workers spin while they wait for work (the default wait policy); with
another test run, a daemon or a vLLM engine on the same cores they take the CPU from the
threads doing the work: a bf16 chat test took 356 s beside a second copy of itself, against
60 s with the workers sleeping while they wait (40 s alone). The policy is read when torch
loads OpenMP, so it is set before the import; processes the tests start inherit it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.inference_adapter.bench.redis_cluster import LocalCluster
from tests.support.net import free_port


class RedisServer:
    """A redis-server child process that tests may stop and start again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed; `make test` installs it")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        pytest.fail(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def flushall(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as conn:
            conn.sendall(b"FLUSHALL\r\n")
            conn.recv(16)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A Redis Cluster of 3 primaries and 3 replicas, shared by the session."""
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A running, empty Redis; restarted if an earlier test left it stopped."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis_server.flushall()
    yield redis_server.url
