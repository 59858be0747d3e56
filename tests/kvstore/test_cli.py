"""The ``kvstore`` command: machine-sized defaults, the stats report, and a real daemon process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.blocks import ROOT_KEY
from kvstore.cli import format_stats, main, serve_config
from kvstore.client.keys import block_keys
from kvstore.config import Config, HostConfig, SsdConfig
from kvstore.defaults import auto_host_capacity, host_capacity, host_default, meminfo_bytes
from kvstore.namespace import ModelFingerprint, Namespace
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.store import BlockStore

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
    )  # fmt: skip
    report = format_stats(stats)
    assert "3.0 MiB / 4.0 MiB  75%" in report
    assert "DOWN" in report.splitlines()[2]
    assert "hit rate 75.0%" in report
    assert "3 leases, 1 reservations" in report


# -- a real daemon process ------------------------------------------------------------------

MODEL = ModelFingerprint("cli-model", num_layers=2, num_kv_heads=2, head_dim=64,
                         dtype="float16", block_tokens=16)  # fmt: skip


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kv-") as name:  # short: socket paths are limited
        yield Path(name)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=60
    )


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
        [sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
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


COMMANDS = [[], ["serve"], ["stats"], ["chat"], ["bench"], ["bench", "chat"], ["bench", "vllm"],
            ["bench", "truncation"], ["dataset"], ["dataset", "fetch"], ["model"]]  # fmt: skip


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
    assert all(f"kvstore bench {word}:" in listed for word in ("chat", "vllm", "truncation"))


def test_a_reader_that_leaves_early_is_no_error() -> None:
    """``kvstore stats | head``: the pipe closes under the command; no traceback."""
    code = (
        "import sys\nfrom kvstore import cli\n"
        "def talk(args):\n    for _ in range(100000):\n        print('x' * 100)\n    return 0\n"
        "cli._stats = talk\nsys.exit(cli.main(['stats']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
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
