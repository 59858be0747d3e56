"""The ``kvstore`` command: machine-sized defaults, the stats report, and a real daemon process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.cli import format_stats, main, serve_config
from kvstore.client import KVStoreClient
from kvstore.client.keys import block_keys
from kvstore.config import Config, HostConfig, SsdConfig
from kvstore.defaults import auto_host_capacity, host_capacity, host_default, meminfo_bytes
from kvstore.launch import kvstore_command
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.store import BlockStore
from kvstore.wire.blocks import ROOT_KEY
from kvstore.wire.namespace import ModelFingerprint, Namespace
from tests.support.daemon import Daemon, running_daemon
from tests.support.net import free_port, self_signed

GiB, MiB = 2**30, 2**20


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("mem", "expected"),
    [
        (64 * GiB, 8 * GiB),  # the cap
        (8 * GiB, 2 * GiB),  # a quarter of the available memory
        (1000 * MiB, 192 * MiB),  # 250 MiB rounded down to 64 MiB
        (100 * MiB, 64 * MiB),  # never below one granule
        (None, 8 * GiB),  # memory unknown: the cap
    ],
)
def test_host_capacity(mem: int | None, expected: int) -> None:
    assert host_capacity(mem) == expected


def test_the_default_is_a_share_of_the_memory_limit_and_says_why(tmp_path: Path) -> None:
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "memory.max"
    meminfo.write_text("MemTotal:  16000000 kB\nMemAvailable:   3000000 kB\n")
    assert meminfo_bytes("MemTotal", meminfo) == 16_000_000 * 1024
    assert meminfo_bytes("MemTotal", tmp_path / "missing") is None
    capacity, why = host_default(meminfo, tmp_path / "no-cgroup")
    assert capacity == host_capacity(16_000_000 * 1024)  # MemTotal, not what is free now
    assert why == "25% of MemTotal 15.3 GiB, in 64 MiB steps"
    cgroup.write_text("2147483648\n")  # a container's 2 GiB limit wins over the machine's
    assert host_default(meminfo, cgroup) == (
        512 * MiB,
        "25% of the cgroup's memory.max 2.0 GiB, in 64 MiB steps",
    )
    cgroup.write_text("max\n")
    assert host_default(meminfo, cgroup)[0] == capacity
    meminfo.write_text("MemTotal:  64000000 kB\n")
    assert host_default(meminfo, cgroup) == (8 * GiB, "25% of MemTotal 61.0 GiB, capped at 8 GiB")
    assert host_default(tmp_path / "x", tmp_path / "y") == (
        8 * GiB,
        "memory unknown: the 8 GiB cap",
    )
    assert auto_host_capacity() == host_default()[0]  # the same on every call


def test_start_up_logs_sizes_with_units_and_no_secret(caplog: pytest.LogCaptureFixture) -> None:
    from kvstore.cli import _log_layout
    from kvstore.config import RedisConfig

    config = Config(
        host=HostConfig(capacity=3 * GiB // 2),
        ssd=SsdConfig(directory="/var/lib/kvstore/ssd", capacity=64 * GiB),
        redis=RedisConfig(enabled=True, url="redis://:s3cret@cache:6379/0", capacity=GiB),
    )
    with caplog.at_level("INFO", logger="kvstore"):
        _log_layout(config, "/etc/kvstore.toml")
    text = caplog.text
    assert "host tier: up to 1.5 GiB, memfd arenas" in text
    assert "ssd tier: up to 64.0 GiB, directory /var/lib/kvstore/ssd" in text
    assert "redis tier: up to 1.0 GiB, url redis://***@cache:6379/0" in text
    assert "s3cret" not in text


def test_serve_config_sizes_the_host_tier_only_without_a_file(
    tmp_path: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = serve_config(None, ["unix:/tmp/a.sock", "127.0.0.1:0"])
    assert config.server.listen == ("unix:/tmp/a.sock", "127.0.0.1:0")
    assert config.host.capacity == auto_host_capacity()
    monkeypatch.setenv("KVSTORE_HOST__CAPACITY", "128MiB")
    assert serve_config(None, None).host.capacity == 128 * MiB
    monkeypatch.delenv("KVSTORE_HOST__CAPACITY")
    file = tmp_path / "kvstore.toml"
    file.write_text('[host]\nttl = "0s"\n')
    assert serve_config(str(file), None).host.capacity == HostConfig().capacity


def test_a_bad_config_exits_2_naming_the_key(
    tmp_path: Path, clean_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "bad.toml"
    file.write_text("[server]\nlisten = ['nowhere']\n")
    assert main(["serve", "--config", str(file)]) == 2
    assert "server.listen" in capsys.readouterr().err


def test_format_stats() -> None:
    stats = pb.StatsResponse(
        tiers=[
            pb.TierStats(name="host", usage_bytes=3 * MiB, capacity_bytes=4 * MiB, blocks=10,
                         hits=7, healthy=True),
            pb.TierStats(name="redis", capacity_bytes=GiB, healthy=False),
        ],
        gets=8, misses=2, active_leases=3, active_reservations=1, lookups=4,
        expired_leases=5, expired_reservations=6, version="9.9", uptime_seconds=90061.5,
    )  # fmt: skip
    report = format_stats(stats)
    assert "3.0 MiB / 4.0 MiB  75%" in report
    assert "DOWN" in report.splitlines()[2]
    assert "hit rate 75.0%" in report
    assert "3 leases, 1 reservations; expired: 5 leases, 6 reservations" in report
    assert report.splitlines()[-1] == "kvstore 9.9, up 1d 1h 1m 1s"


# -- a real daemon process ------------------------------------------------------------------

MODEL = ModelFingerprint("cli-model", num_layers=2, num_kv_heads=2, head_dim=64,
                         dtype="float16", block_tokens=16)  # fmt: skip


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kv-") as name:  # short: socket paths are limited
        yield Path(name)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(kvstore_command(*args), capture_output=True, text=True, timeout=60)


def test_serve_stats_and_sigterm(tmp_path: Path, sock_dir: Path) -> None:
    sock = sock_dir / "kvstore.sock"
    config = tmp_path / "kvstore.toml"
    config.write_text(
        '[host]\ncapacity = "4MiB"\n'
        f'[ssd]\ndirectory = "{tmp_path / "ssd"}"\ncapacity = "64MiB"\nfsync = false\n'
        f'[server]\nlisten = ["unix:{sock}"]\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    daemon = subprocess.Popen(
        kvstore_command("serve", "--config", str(config)),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        address = f"unix:{sock}"
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            request = pb.RegisterNamespaceRequest(
                model=pb.ModelFingerprint(
                    model_name="cli-model",
                    layout=pb.Layout(num_layers=2, num_kv_heads=2, block_tokens=16, head_dim=64,
                                     dtype="float16"),
                    rope_theta=10000.0,
                )
            )  # fmt: skip
            ns = stub.RegisterNamespace(request).namespace
            (key,) = block_keys(list(range(16)), Namespace(MODEL, ""))
            payload = os.urandom(MODEL.layout().payload_bytes)
            spec = pb.BlockSpec(key=key, parent=ROOT_KEY, num_tokens=16)
            reply = stub.Put(iter([pb.PutChunk(namespace=ns, block=spec, data=payload)]))
            assert list(reply.statuses) == [pb.STORED]
        report = run_cli("stats", "--address", address)
        assert report.returncode == 0, report.stderr
        assert report.stdout.startswith("tier") and "host" in report.stdout
        as_json = json.loads(run_cli("stats", "--address", address, "--json").stdout)
        assert as_json["puts"] == 1 and as_json["tiers"][0]["name"] == "host"
        assert as_json["misses"] == 0  # zeros are printed too, numbers as numbers
        daemon.send_signal(signal.SIGTERM)
        output, _ = daemon.communicate(timeout=60)
        assert daemon.returncode == 0, output
        assert "flushed 1 blocks" in output
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert not sock.exists()
    refused = run_cli("stats", "--address", f"unix:{sock}", "--timeout", "1")
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    # The write-back block was flushed to SSD on the way out.
    ssd_config = Config(
        host=HostConfig(capacity=4 * MiB),
        ssd=SsdConfig(directory=str(tmp_path / "ssd"), capacity=64 * MiB, fsync=False),
    )

    async def reopen() -> bytes | None:
        async with BlockStore.from_config(ssd_config) as store:
            block = await store.get(key, namespace=ns)
            return None if block is None else block.payload

    assert asyncio.run(reopen()) == payload


def test_chat_command_is_delegated_lazily(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", "--help"])
    assert exit_info.value.code == 0
    assert "--address" in capsys.readouterr().out


COMMANDS = [[], ["serve"], ["stats"], ["health"], ["namespaces"], ["evict"], ["flush"],
            ["chat"], ["bench"], ["bench", "chat"], ["bench", "vllm"], ["bench", "truncation"],
            ["bench", "gpu"], ["dataset"], ["dataset", "fetch"], ["model"]]  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS, ids=lambda words: " ".join(words) or "kvstore")
def test_every_command_has_help_that_exits_0(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_version_and_a_group_word_alone(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore import __version__

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"kvstore {__version__}\n"
    assert main(["bench"]) == 2
    listed = capsys.readouterr().err
    words = ("chat", "vllm", "truncation", "gpu")
    assert all(f"kvstore bench {word}:" in listed for word in words)


def test_a_reader_that_leaves_early_is_no_error() -> None:
    """``kvstore stats | head``: the pipe closes under the command; no traceback."""
    code = (
        "import sys\nfrom kvstore import cli\n"
        "def talk(args):\n    for _ in range(100000):\n        print('x' * 100)\n    return 0\n"
        "cli._stats = talk\nsys.exit(cli.main(['stats']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-P", "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.read(10) == b"x" * 10
    proc.stdout.close()  # the reader leaves
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"Traceback" not in stderr, stderr.decode()


def test_stats_json_has_every_field_with_its_own_type() -> None:
    from kvstore.cli import message_fields

    response = pb.StatsResponse(
        tiers=[pb.TierStats(name="host", usage_bytes=2**40, hits=0, healthy=True)], gets=7
    )
    fields = message_fields(response)
    assert json.loads(json.dumps(fields)) == fields
    assert fields["gets"] == 7 and fields["puts"] == 0 and fields["misses"] == 0
    assert set(fields) == {f.name for f in pb.StatsResponse.DESCRIPTOR.fields}
    (tier,) = fields["tiers"]  # type: ignore[misc]
    assert tier["usage_bytes"] == 2**40 and tier["hits"] == 0 and tier["healthy"] is True


def serve_with(tmp_path: Path, toml: str) -> subprocess.CompletedProcess[str]:
    """``kvstore serve`` on a config that cannot start (it must exit on its own)."""
    config = tmp_path / "kvstore.toml"
    config.write_text(toml)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        kvstore_command("serve", "--config", str(config)),
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The command's last stderr line, after checking it is the only non-log line."""
    lines = [line for line in proc.stderr.splitlines() if " INFO " not in line]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_run_time_failures_are_one_line_with_a_documented_status(
    tmp_path: Path, sock_dir: Path
) -> None:
    listen = f'[server]\nlisten = ["unix:{sock_dir / "s.sock"}"]\n'
    too_big = serve_with(
        tmp_path, '[host]\ncapacity = "1000TiB"\n[ssd]\nenabled = false\n' + listen
    )
    assert too_big.returncode == 2
    assert "host.capacity 1000.0 TiB is more than the memory" in one_line_error(too_big)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    bad_dir = serve_with(
        tmp_path, f'[host]\ncapacity = "8MiB"\n[ssd]\ndirectory = "{blocked / "blocks"}"\n' + listen
    )
    assert bad_dir.returncode == 1
    assert str(blocked) in one_line_error(bad_dir)
    bad_url = serve_with(
        tmp_path,
        '[host]\ncapacity = "8MiB"\n[ssd]\nenabled = false\n'
        '[redis]\nenabled = true\nurl = "redis://admin:hunter2@localhost:sixthree/0"\n' + listen,
    )
    assert bad_url.returncode == 2
    line = one_line_error(bad_url)
    assert "redis.url" in line and "port must be a number" in line
    assert "hunter2" not in bad_url.stderr and "admin" not in bad_url.stderr
    for redis, expected in [
        ('url = "redis://localhost/0"\ntls_ca = "/etc/hostname"',
         "redis.tls_ca is set but the url does not use TLS"),
        (f'url = "rediss://localhost/0"\ntls_ca = "{tmp_path / "no-ca.pem"}"',
         f"redis.tls_ca '{tmp_path / 'no-ca.pem'}': no such file"),
        ('url = "rediss://localhost/0"\ntls_cert = "/etc/hostname"',
         "redis.tls_cert and tls_key go together"),
    ]:  # fmt: skip
        bad_tls = serve_with(
            tmp_path,
            '[host]\ncapacity = "8MiB"\n[ssd]\nenabled = false\n'
            f"[redis]\nenabled = true\n{redis}\n" + listen,
        )
        assert bad_tls.returncode == 2 and expected in one_line_error(bad_tls)
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        busy = serve_with(
            tmp_path,
            '[host]\ncapacity = "8MiB"\n[ssd]\nenabled = false\n'
            f'[server]\nlisten = ["unix:{sock_dir / "b.sock"}", "127.0.0.1:{port}"]\n',
        )
    assert busy.returncode == 1
    assert one_line_error(busy) == (
        f"kvstore serve: server.listen 127.0.0.1:{port}: Address already in use"
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_stats_and_health_over_tls_with_a_token(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    port = free_port()
    daemon = Daemon(tmp_path / "daemon", tokens=["s3cret:tenant-a"], tcp=[f"127.0.0.1:{port}"],
                    settings={"server": {"tls_cert": str(cert), "tls_key": str(key)}})  # fmt: skip
    daemon.start()
    try:
        tls = ("--address", f"localhost:{port}", "--tls-ca", str(cert))
        health = run_cli("health", *tls)
        assert health.returncode == 0 and health.stdout == f"localhost:{port}: SERVING\n"
        by_ip = run_cli("health", "--address", f"127.0.0.1:{port}", "--tls-ca", str(cert),
                        "--tls-server-name", "localhost")  # fmt: skip
        assert by_ip.returncode == 0, by_ip.stderr
        stats = run_cli("stats", *tls, "--token", "s3cret", "--json")
        assert stats.returncode == 0 and json.loads(stats.stdout)["tiers"][0]["name"] == "host"
        no_token = run_cli("stats", *tls)
        assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr
        wrong = run_cli("stats", *tls, "--token", "guess")
        assert wrong.returncode == 1 and "guess" not in wrong.stderr
        plain = run_cli("health", "--address", f"localhost:{port}", "--timeout", "2")
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
        garbage = tmp_path / "garbage.pem"
        garbage.write_bytes(os.urandom(64))
        not_pem = run_cli("health", "--address", f"localhost:{port}", "--tls-ca", str(garbage))
        assert not_pem.returncode == 2 and "no PEM certificate" in one_line_error(not_pem)
        unix = run_cli("health", "--address", daemon.address)
        assert unix.returncode == 0  # health stays open to probes without a token
    finally:
        daemon.close()
    gone = run_cli("health", "--address", daemon.address, "--timeout", "1")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def test_health_names_a_tier_that_is_down_and_stays_serving(tmp_path: Path) -> None:
    """A Redis tier whose server does not answer: the daemon serves (``""`` SERVING, exit
    0), ``kvstore.tiers`` and ``kvstore.tier.redis`` are NOT_SERVING, the others SERVING;
    ``kvstore health`` says degraded and names the tier."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    settings = {"redis": {"enabled": True, "url": f"redis://127.0.0.1:{free_port()}/0",
                          "timeout": "200ms"}}  # fmt: skip
    with running_daemon(tmp_path, ssd_capacity=None, settings=settings) as daemon:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> str:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

            names = ["", "kvstore.v1.KVStore", "kvstore.tiers", "kvstore.tier.host",
                     "kvstore.tier.redis"]  # fmt: skip
            assert [status(name) for name in names] == [
                "SERVING", "SERVING", "NOT_SERVING", "SERVING", "NOT_SERVING",
            ]  # fmt: skip
            with pytest.raises(grpc.RpcError) as off:
                status("kvstore.tier.ssd")  # no SSD tier here
            assert off.value.code() == grpc.StatusCode.NOT_FOUND
        health = run_cli("health", "--address", daemon.address)
        assert (health.returncode, health.stdout) == (
            0, f"{daemon.address}: SERVING, degraded: redis tier down (hits come from the others)\n"
        )  # fmt: skip


def test_stats_watch_prints_rates_of_what_happens_meanwhile(tmp_path: Path) -> None:
    namespace = Namespace(MODEL, "")
    size = MODEL.layout().payload_bytes
    with running_daemon(tmp_path, host_capacity="64MiB") as daemon:
        watch = subprocess.Popen(
            kvstore_command("stats", "--address", daemon.address, "--watch", "0.5", "--count", "4"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        with KVStoreClient(daemon.address) as client:
            for turn in range(6):
                keys = block_keys(list(range(turn * 1000, turn * 1000 + 16 * 8)), namespace)
                blocks = [bytes([turn, i]) * (size // 2) for i in range(len(keys))]
                client.put(namespace, keys, blocks)
                assert client.get(namespace, keys) == blocks
                time.sleep(0.2)
        out, err = watch.communicate(timeout=60)
    assert watch.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["blocks", "host", "used", "ssd", "used", "gets/s", "hit",
                                "puts/s", "evict/s", "leases"]  # fmt: skip
    rows = [line.split() for line in lines[1:]]
    assert len(rows) == 4
    assert int(rows[-1][0]) == 48  # 6 turns of 8 blocks, all held
    assert sum(float(row[7]) for row in rows) > 0  # puts/s in some interval
    assert any(row[6] == "100.0%" for row in rows)  # gets of what was just put: all hits


@pytest.mark.parametrize("seconds", ["0", "-1", "soon"])
def test_watch_and_timeout_take_positive_seconds(
    seconds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["stats", "--watch", seconds])
    assert exited.value.code == 2
    assert f"expected seconds > 0, got {seconds!r}" in capsys.readouterr().err
