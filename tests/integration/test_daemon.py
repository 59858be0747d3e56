"""The daemon as engines meet it: a real `kvstore serve` process, real clients in other processes.

Each scenario starts the daemon on a unix socket in a temporary directory (small host arena,
SSD tier) and drives it with the client library, from this process and from worker processes
(``tests/support/worker.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvstore.client import (
    ROOT_KEY,
    AsyncKVStoreClient,
    CorruptBlockError,
    InvalidArgumentError,
    KVStoreClient,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    WriteStatus,
    block_keys,
)
from kvstore.launch import kvstore_command
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from tests.support.daemon import Daemon, running_daemon, scrape
from tests.support.net import free_port
from tests.support.waiting import wait_for
from tests.support.worker import BLOCK, NAMESPACE, SHARED_TOKENS, own_tokens, payload

WORKER = Path(__file__).resolve().parents[1] / "support" / "worker.py"


def worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-P", str(WORKER), *args], stdout=subprocess.PIPE, text=True
    )


def test_two_planes_from_concurrent_processes_store_shared_blocks_once(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon:
        plan = [("alice", "shm"), ("bob", "shm"), ("carol", "stream"), ("dave", "stream")]
        procs = [worker("roundtrip", daemon.address, name, plane) for name, plane in plan]
        reports = [json.loads(proc.communicate(timeout=120)[0]) for proc in procs]
        assert all(proc.returncode == 0 for proc in procs)
        assert [r["plane"] for r in reports] == [plane for _, plane in plan]
        for report in reports:
            assert report["held"] == 12 and report["exact"] == [True] * 12
        # Every shared block was stored by exactly one process; the others were told DEDUP.
        for index in range(8):
            column = sorted(r["statuses"][index] for r in reports)
            assert column == ["DEDUP", "DEDUP", "DEDUP", "STORED"]
        with KVStoreClient(daemon.address) as client:
            stats = client.stats()
            assert stats.blocks == 8 + 4 * 4
            host = next(t for t in stats.tiers if t.name == "host")
            assert host.usage_bytes == stats.blocks * BLOCK
            # Another client finds the shared chain by key alone.
            shared = block_keys(SHARED_TOKENS, NAMESPACE)
            assert client.lookup(NAMESPACE, shared) == 8


def test_killed_client_leases_and_reservations_expire(tmp_path: Path) -> None:
    """The holder sets everything up under a 10-minute lease_ttl (nothing it holds can
    expire before it reports, however loaded the machine), then holds a lease of 1 s, whose
    end the test waits for: nothing here races the clock."""
    settings = {"server": {"lease_ttl": "10m"}}
    with running_daemon(tmp_path, settings=settings) as daemon:
        holder = worker("hold", daemon.address, "1")
        assert holder.stdout is not None
        report = json.loads(holder.stdout.readline())
        assert report == {"lease_slots": 2, "reserved": 2, "active": [1, 2],
                          "host_bytes": 4 * BLOCK}  # fmt: skip
        assert json.loads(holder.stdout.readline()) == {"lease_slots": 2}  # the 1 s lease
        keys = block_keys(own_tokens("holder", 4), NAMESPACE)[8:]
        with KVStoreClient(daemon.address) as client:
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            # The daemon takes everything back by itself: the reservations when the dead
            # client's session closes, the lease when its second is up.
            wait_for(lambda: client.stats().active_reservations == 0, timeout=120)
            wait_for(lambda: client.stats().active_leases == 0, timeout=120)
            stats = client.stats()
            assert (stats.expired_leases, stats.expired_reservations) == (1, 2)  # counted
            host = next(t for t in stats.tiers if t.name == "host")
            assert host.usage_bytes == 2 * BLOCK
            # The half-written reservation never became a block.
            assert client.get(NAMESPACE, keys[2:]) == []
            assert [bytes(b) for b in client.get(NAMESPACE, keys[:2])] == [
                payload(k) for k in keys[:2]
            ]


def test_a_hung_writer_holds_no_more_than_its_window_and_its_late_writes_land_nowhere(
    tmp_path: Path,
) -> None:
    """A writer SIGSTOPped with its window full of reserved slots (a hung peer): its Reserve
    got no more than ``server.max_staging_bytes``; its reservations expire; another client's
    puts turn a tiny arena over and over around the held slots; the writer, continued, writes
    every byte of its slots and commits: EXPIRED, and not a byte of another block changed."""
    window_blocks, capacity_blocks = 4, 16
    settings = {
        "host": {"capacity": f"{capacity_blocks * BLOCK // 1024}KiB"},
        "server": {"lease_ttl": "1s", "max_staging_bytes": f"{window_blocks * BLOCK // 1024}KiB"},
    }
    with running_daemon(tmp_path, settings=settings) as daemon:
        stalled = subprocess.Popen(
            [sys.executable, "-P", str(WORKER), "stall", daemon.address, "6"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert stalled.stdin is not None and stalled.stdout is not None
        try:
            report = json.loads(stalled.stdout.readline())
            assert report["reserved"] == ["RESERVED"] * window_blocks + ["NO_SPACE"] * 2
            stalled.send_signal(signal.SIGSTOP)
            keys = block_keys(own_tokens("busy", 3 * capacity_blocks), NAMESPACE)
            with KVStoreClient(daemon.address) as busy:
                wait_for(lambda: busy.stats().expired_reservations == window_blocks, timeout=60)
                for start in range(0, len(keys), 4):  # 60 blocks through 12 free slots
                    part = keys[start : start + 4]
                    stored = busy.put(NAMESPACE, part, [payload(k) for k in part])
                    assert WriteStatus.NO_SPACE not in stored, stored

                def still_exact() -> int:
                    held = 0
                    for key in keys:
                        found = busy.get(NAMESPACE, [key])  # a chain's get stops at a miss
                        if found:
                            assert bytes(found[0]) == payload(key)
                            held += 1
                    return held

                before = still_exact()
                assert before > 0
                stalled.send_signal(signal.SIGCONT)
                stalled.stdin.write("go\n")
                stalled.stdin.flush()
                late = json.loads(stalled.stdout.readline())
                assert late["committed"] == ["EXPIRED"] * window_blocks
                assert still_exact() == before  # the late bytes landed in none of them
        finally:
            stalled.send_signal(signal.SIGCONT)
            stalled.kill()
            stalled.wait(10)


def test_a_block_written_again_after_its_commit_is_never_served(tmp_path: Path) -> None:
    """A put writes its tenant's arena in place, through a writable mapping the kernel cannot
    limit to the slots reserved: a process of that tenant can write a block again after its
    commit. The checksum its writer took as it wrote catches it: a client made with
    ``verify=True`` finds the block corrupt, and the daemon, flushing it to SSD, counts it and
    drops it. A miss from then on, never data."""
    with running_daemon(tmp_path, settings={"ssd": {"write_policy": "write_back"}}) as daemon:
        keys = block_keys(own_tokens("rewritten", 4), NAMESPACE)  # 12 blocks
        with KVStoreClient(daemon.address) as writer:
            stored = writer.put(NAMESPACE, keys, [payload(k) for k in keys])
            assert stored == [WriteStatus.STORED] * len(keys)
            session = writer._client._conn.sessions[NAMESPACE.tenant]
            session.writer._open_bytes()[:] = 0x5A  # every byte of the tenant's arena
            with (
                KVStoreClient(daemon.address, verify=True) as checker,
                pytest.raises(CorruptBlockError, match="does not match its checksum"),
            ):
                checker.get(NAMESPACE, keys)
            with grpc.insecure_channel(daemon.address) as channel:
                kvstore_pb2_grpc.KVStoreStub(channel).Flush(pb.FlushRequest())
            stats = writer.stats()
            assert stats.corrupt_blocks == len(keys), stats
            assert writer.lookup(NAMESPACE, keys) == 0
            assert writer.get(NAMESPACE, keys) == []


def test_sigterm_flushes_write_back_blocks_to_ssd(tmp_path: Path) -> None:
    with running_daemon(tmp_path, settings={"ssd": {"write_policy": "write_back"}}) as daemon:
        keys = block_keys(own_tokens("flush", 6), NAMESPACE)
        with KVStoreClient(daemon.address) as client:
            client.put(NAMESPACE, keys, [payload(k) for k in keys])
            assert set(client.lookup_tiers(NAMESPACE, keys).tiers) == {"host"}
        assert daemon.stop() == 0
        assert not daemon.socket_path.exists()
        daemon.start()
        with KVStoreClient(daemon.address) as client:
            held = client.lookup_tiers(NAMESPACE, keys)
            assert held.num_blocks == len(keys) and set(held.tiers) == {"ssd"}
            blocks = client.get(NAMESPACE, keys)
            assert [bytes(b) for b in blocks] == [payload(k) for k in keys]


def serve(config: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``kvstore serve`` on ``config`` until it exits (it must refuse: it never serves)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    command = kvstore_command("serve", "--config", str(config))
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def test_a_second_daemon_on_the_same_ssd_directory_refuses_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    settings = {"ssd": {"write_policy": "write_through"}}
    with running_daemon(tmp_path / "a", settings=settings) as first:
        keys = block_keys(own_tokens("ssd-lock", 8), NAMESPACE)
        with KVStoreClient(first.address) as client:
            client.put(NAMESPACE, keys, [payload(k) for k in keys])
        ssd = tmp_path / "a" / "ssd"
        files = sorted(ssd.glob("*/*.blk"))
        assert len(files) == len(keys)
        # Another socket, the same SSD directory, room for one block: it would trim 7.
        second = Daemon(
            tmp_path / "b", ssd_capacity="40KiB", settings={"ssd": {"directory": str(ssd)}}
        )
        try:
            refused = serve(second.config_path)
        finally:
            second.close()
        assert refused.returncode == 1
        assert refused.stderr.strip().splitlines()[-1] == (
            f"kvstore serve: ssd directory {ssd} is in use by another kvstore daemon "
            f"(pid {first.proc.pid}); stop it first or configure another "
            f"(lock file {ssd / 'kvstore.lock'})"
        )
        assert "Traceback" not in refused.stderr
        assert sorted(ssd.glob("*/*.blk")) == files
        with KVStoreClient(first.address) as client:
            assert client.lookup(NAMESPACE, keys) == len(keys)
        # A SIGKILLed daemon's lock goes with it: the restart takes the directory back.
        first.kill()
        first.start()
        with KVStoreClient(first.address) as client:
            assert [bytes(b) for b in client.get(NAMESPACE, keys)] == [payload(k) for k in keys]


def test_a_second_serve_on_a_busy_socket_refuses_before_allocating(tmp_path: Path) -> None:
    with running_daemon(tmp_path / "a") as first:
        second = Daemon(tmp_path / "b", host_capacity="2GiB")
        config = second.config_path.read_text().replace(second.address, first.address)
        second.config_path.write_text(config)
        try:
            began = time.monotonic()
            refused = serve(second.config_path)
            took = time.monotonic() - began
        finally:
            second.close()
        assert refused.returncode == 1, refused.stderr
        assert (
            refused.stderr.strip()
            .splitlines()[-1]
            .startswith(
                f"kvstore serve: socket {first.socket_path} is in use by another kvstore daemon "
                f"(pid {first.proc.pid})"
            )
        )
        assert not (tmp_path / "b" / "ssd").exists()  # refused before any tier started
        assert first.running and first._serving()
        print(f"refused in {took:.1f} s")


def test_sighup_reloads_tokens_and_watermarks_and_leaves_the_daemon_serving(
    tmp_path: Path,
) -> None:
    with running_daemon(tmp_path, tokens=["old-token:tests"]) as daemon:
        keys = block_keys(own_tokens("hup", 2), NAMESPACE)
        with KVStoreClient(daemon.address, token="old-token") as client:
            client.put(NAMESPACE, keys, [payload(k) for k in keys])
        assert "opened for tenant" not in daemon.log(tail=1 << 20)  # a DEBUG line: not at info
        config = daemon.config_path.read_text()
        config = config.replace('"old-token:tests"', '"new-token:tests"')
        config = config.replace('capacity = "8MiB"', 'capacity = "16MiB"')  # needs a restart
        config = config.replace(
            'shutdown_grace = "2s"', 'shutdown_grace = "2s"\nlog_level = "debug"'
        )
        daemon.config_path.write_text(config + "[eviction]\nhigh_watermark = 0.9\n")
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: applied" in daemon.log(tail=1 << 20))
        assert daemon.running and daemon._serving()
        log = daemon.log(tail=1 << 20)
        assert (
            "SIGHUP: applied auth.tokens (1), eviction watermarks 0.85-0.9, server.log_level debug"
            in log
        )
        assert "these need a restart: host.capacity" in log
        assert "opened for tenant" not in log
        with KVStoreClient(daemon.address, token="new-token") as client:
            assert [bytes(b) for b in client.get(NAMESPACE, keys)] == [payload(k) for k in keys]
        assert "DEBUG kvstore.sessions: shm session" in daemon.log(tail=1 << 20)  # now at debug
        with (
            pytest.raises(UnauthenticatedError),
            KVStoreClient(daemon.address, token="old-token") as client,
        ):
            client.lookup(NAMESPACE, keys)
        # A config that no longer parses is refused; the daemon runs on as it was.
        daemon.config_path.write_text("[host]\ncapacity = -1\n")
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "the config was not reloaded" in daemon.log(tail=1 << 20))
        with KVStoreClient(daemon.address, token="new-token") as client:
            assert client.lookup(NAMESPACE, keys) == len(keys)
        assert daemon.stop() == 0


def test_sigterm_during_start_up_closes_what_it_opened(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, settings={"ssd": {"write_policy": "write_through"}})
    try:
        daemon.start()
        keys = block_keys(own_tokens("early", 4), NAMESPACE)
        with KVStoreClient(daemon.address) as client:
            client.put(NAMESPACE, keys, [payload(k) for k in keys])
        assert daemon.stop() == 0
        files = sorted((tmp_path / "ssd").glob("*/*.blk"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        command = kvstore_command("serve", "--config", str(daemon.config_path))
        proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        lock = daemon.socket_path.with_name("kvstore.sock.lock")
        wait_for(lambda: lock.exists() and lock.read_text().strip() == str(proc.pid))
        proc.send_signal(signal.SIGTERM)  # the sockets are claimed: the start is under way
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        assert "stopped during start-up" in stderr or "kvstore stopped" in stderr
        assert not daemon.socket_path.exists()
        assert sorted((tmp_path / "ssd").glob("*/*.blk")) == files
        daemon.start()  # nothing left behind blocks the next start
        with KVStoreClient(daemon.address) as client:
            assert client.lookup(NAMESPACE, keys) == len(keys)
    finally:
        daemon.close()


def test_a_scrape_after_a_chat_shows_the_gets_and_hits_kvstore_stats_shows(
    tmp_path: Path,
) -> None:
    port = free_port()
    settings = {"metrics": {"listen": f"127.0.0.1:{port}"}}
    with running_daemon(tmp_path, settings=settings) as daemon:
        # A chat's traffic: each turn looks up its prompt, reads the held prefix (over shm,
        # then over the stream), and saves the blocks of its new tokens.
        tokens = own_tokens("metrics-chat", 1)
        with (
            KVStoreClient(daemon.address) as shm,
            KVStoreClient(daemon.address, use_shm=False) as stream,
        ):
            for turn in range(4):
                keys = block_keys(tokens, NAMESPACE)
                held = (shm if turn % 2 else stream).lookup(NAMESPACE, keys)
                got = (shm if turn % 2 else stream).get(NAMESPACE, keys[:held])
                assert [bytes(b) for b in got] == [payload(k) for k in keys[:held]]
                shm.put(NAMESPACE, keys[held:], [payload(k) for k in keys[held:]])
                tokens += own_tokens(f"turn {turn}", 2)[-32:]
        with (
            grpc.insecure_channel(daemon.address) as channel,
            pytest.raises(grpc.RpcError) as failed,
        ):
            kvstore_pb2_grpc.KVStoreStub(channel).Release(pb.ReleaseRequest(lease_id=987654))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        printed = subprocess.run(
            kvstore_command("stats", "--address", daemon.address, "--json"),
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
        stats = json.loads(printed.stdout)
        metrics = scrape(port)
    assert int(stats["gets"]) > 0 and metrics["kvstore_gets_total"] == int(stats["gets"])
    assert metrics["kvstore_misses_total"] == int(stats.get("misses", 0))
    for tier in stats["tiers"]:
        assert metrics[f'kvstore_tier_hits_total{{tier="{tier["name"]}"}}'] == int(
            tier.get("hits", 0)
        )
    hits = sum(int(tier.get("hits", 0)) for tier in stats["tiers"])
    assert hits + int(stats.get("misses", 0)) == int(stats["gets"])  # each read counted once
    assert metrics["kvstore_lookups_total"] == 4 and metrics["kvstore_leases_active"] == 0
    assert metrics['kvstore_build_info{version="0.1.0"}'] == 1
    # Bytes per tier: every block put was written into the host tier once, and reads that
    # hit served their payloads.
    host = next(tier for tier in stats["tiers"] if tier["name"] == "host")
    assert host["written_bytes"] == stats["puts"] * BLOCK
    assert host["read_bytes"] == host["hits"] * BLOCK > 0
    for tier in stats["tiers"]:
        for field in ("read_bytes", "written_bytes"):
            name = f'kvstore_tier_{field}_total{{tier="{tier["name"]}"}}'
            assert metrics[name] == tier[field]
    # Per-method calls and latencies: the 4 lookups, and the failed Release by its code.
    assert metrics['kvstore_rpcs_total{code="OK",method="Lookup"}'] == 4
    assert metrics['kvstore_rpc_duration_seconds_count{method="Lookup"}'] == 4
    assert metrics['kvstore_rpc_duration_seconds_bucket{le="10.0",method="Lookup"}'] == 4
    code = failed.value.code().name
    assert metrics[f'kvstore_rpcs_total{{code="{code}",method="Release"}}'] == 1
    assert metrics["kvstore_event_loop_lag_seconds_count"] > 0  # the loop's lag, measured
    assert stats["version"] == "0.1.0" and 0 < stats["uptime_seconds"] < 600


def arena_fds(pid: int) -> list[str]:
    """What the process's descriptors of host arenas point at (a descriptor the daemon
    closes while they are listed, a socket or a file of its own, is skipped)."""
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            links.append(os.readlink(fd))
    return [link for link in links if "kvstore-arena" in link]


def test_sigkill_then_restart_leaves_no_arena_behind(tmp_path: Path) -> None:
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    settings = {"ssd": {"write_policy": "write_through"}}  # what survives the SIGKILL
    with running_daemon(tmp_path, settings=settings) as daemon:
        keys = block_keys(own_tokens("arena", 2), NAMESPACE)
        with KVStoreClient(daemon.address) as client:
            client.put(NAMESPACE, keys, [payload(k) for k in keys])
        assert daemon.proc is not None
        first = daemon.proc.pid
        # Arenas are memfds: memory that is no file's, freed with the last descriptor.
        assert arena_fds(first) and all(link.startswith("/memfd:") for link in arena_fds(first))
        daemon.kill()
        assert not Path(f"/proc/{first}").exists()
        daemon.start()
        with KVStoreClient(daemon.address) as client:  # from the SSD tier, into a new arena
            assert [bytes(b) for b in client.get(NAMESPACE, keys)] == [payload(k) for k in keys]
        assert daemon.proc is not None and arena_fds(daemon.proc.pid)
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {name for name in shm_after - shm_before if "kvstore" in name}


def test_sigkill_mid_write_never_serves_a_corrupt_block(tmp_path: Path) -> None:
    settings = {"ssd": {"write_policy": "write_through", "fsync": True}}
    with running_daemon(tmp_path, settings=settings) as daemon:
        chains = [block_keys(own_tokens(f"writer{i}", 8), NAMESPACE) for i in range(4)]

        async def writer(keys: list[bytes]) -> None:
            async with AsyncKVStoreClient(daemon.address, retries=0) as client:
                for start in range(0, len(keys), 2):
                    part = keys[start : start + 2]
                    parent = keys[start - 1] if start else ROOT_KEY
                    await client.put(NAMESPACE, part, [payload(k) for k in part], parent=parent)

        async def write_then_kill() -> None:
            tasks = [asyncio.create_task(writer(keys)) for keys in chains]
            await asyncio.sleep(0.5)
            daemon.kill()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(write_then_kill())
        # Damage one block file on disk too: a flipped byte must read as a miss, never as data.
        files = sorted((tmp_path / "ssd").rglob("*.blk"))
        if files:
            data = bytearray(files[0].read_bytes())
            data[-50] ^= 0xFF
            files[0].write_bytes(bytes(data))
        daemon.start()
        served = 0
        with KVStoreClient(daemon.address) as client:
            for keys in chains:
                for key in keys:
                    blocks = client.get(NAMESPACE, [key])
                    if blocks:
                        assert bytes(blocks[0]) == payload(key)
                        served += 1
        assert served > 0


def test_bad_requests_get_status_codes_and_the_daemon_keeps_serving(tmp_path: Path) -> None:
    with running_daemon(tmp_path, tokens=["good:tests", "other:intruder"]) as daemon:
        keys = block_keys(own_tokens("bad", 2), NAMESPACE)
        with KVStoreClient(daemon.address, token="good") as client:
            with pytest.raises(ValueError, match=r"keys\[1\] must be 32 bytes"):
                client.lookup(NAMESPACE, [keys[0], b"short"])
            with pytest.raises(ValueError, match="blocks"):
                client.put(NAMESPACE, keys[:1], [b"x" * 10])
            assert client.put(NAMESPACE, keys, [payload(k) for k in keys]) == [
                WriteStatus.STORED
            ] * len(keys)
        with (
            pytest.raises(UnauthenticatedError, match="bearer token"),
            KVStoreClient(daemon.address, token="wrong") as client,
        ):
            client.lookup(NAMESPACE, keys)
        with pytest.raises(UnauthenticatedError), KVStoreClient(daemon.address) as client:
            client.stats()
        with (
            KVStoreClient(daemon.address, token="other") as client,
            pytest.raises(PermissionDeniedError, match="tenant"),
        ):
            client.lookup(NAMESPACE, keys)
        # Malformed requests that bypass the client's own checks are refused by the daemon.
        with grpc.insecure_channel(daemon.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            auth = (("authorization", "Bearer good"),)
            with pytest.raises(grpc.RpcError) as error:
                stub.Lookup(pb.LookupRequest(namespace=b"n" * 32, keys=[b"k" * 32]), metadata=auth)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND
            assert "namespace" in error.value.details()
            with pytest.raises(grpc.RpcError) as error:
                stub.Lookup(pb.LookupRequest(namespace=b"n" * 5), metadata=auth)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            huge = pb.LookupRequest(namespace=b"n" * 32, keys=[b"k" * 32] * 400_000)
            with pytest.raises(grpc.RpcError) as error:
                stub.Lookup(huge, metadata=auth)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with KVStoreClient(daemon.address, token="good") as client:
            assert client.lookup(NAMESPACE, keys) == len(keys)  # still serving
            assert issubclass(ResourceExhaustedError, Exception)
            assert issubclass(InvalidArgumentError, Exception)


def test_32_concurrent_clients_mixed_operations_leave_no_leaks(tmp_path: Path) -> None:
    with running_daemon(tmp_path, host_capacity="16MiB") as daemon:

        async def client_loop(index: int, deadline: float) -> int:
            rng = random.Random(index)
            operations = 0
            async with AsyncKVStoreClient(daemon.address, use_shm=index % 4 != 0) as client:
                while time.monotonic() < deadline:
                    keys = block_keys(own_tokens(f"c{index}-{rng.randrange(3)}", 2), NAMESPACE)
                    action = rng.choice(["put", "get", "lookup", "view"])
                    if action == "put":
                        await client.put(NAMESPACE, keys, [payload(k) for k in keys])
                    elif action == "get":
                        for key, block in zip(
                            keys, await client.get(NAMESPACE, keys), strict=False
                        ):
                            assert bytes(block) == payload(key)
                    elif action == "view":
                        async with client.view(NAMESPACE, keys) as views:
                            for key, view in zip(keys, views, strict=False):
                                assert bytes(view) == payload(key)
                    else:
                        await client.lookup(NAMESPACE, keys)
                    operations += 1
            return operations

        async def run() -> list[int]:
            deadline = time.monotonic() + 8.0
            return await asyncio.gather(*(client_loop(i, deadline) for i in range(32)))

        counts = asyncio.run(run())
        assert min(counts) > 0
        with KVStoreClient(daemon.address) as client:
            stats = client.stats()
            assert stats.active_leases == 0 and stats.active_reservations == 0
            host = next(t for t in stats.tiers if t.name == "host")
            assert host.usage_bytes == host.blocks * BLOCK
            assert stats.puts + stats.dedup_puts >= stats.blocks
            # Delete everything: the arena returns to its baseline (empty).
            shared = block_keys(SHARED_TOKENS, NAMESPACE)
            deleted = client.delete(NAMESPACE, shared[:1])
            assert deleted == stats.blocks  # every chain hangs off the shared first block
            host = next(t for t in client.stats().tiers if t.name == "host")
            assert host.usage_bytes == 0 and client.stats().blocks == 0


def test_a_put_stream_refused_early_tells_an_asyncio_client_why(tmp_path: Path) -> None:
    """A Put stream refused at its first chunk (here: a namespace the daemon does not know, as
    after a restart) must reach a grpc.aio client as that status, not as INTERNAL: the daemon
    lets the client finish writing before it answers (grpc/grpc#36066)."""
    settings = {"server": {"max_message_bytes": "1MiB", "chunk_bytes": "64KiB"}}
    with running_daemon(tmp_path, settings=settings) as daemon:

        async def puts() -> list[grpc.StatusCode]:
            codes = []
            async with grpc.aio.insecure_channel(daemon.address) as channel:
                stub = kvstore_pb2_grpc.KVStoreStub(channel)
                for _ in range(60):
                    spec = pb.BlockSpec(key=os.urandom(32), parent=os.urandom(32), num_tokens=16)
                    first = pb.PutChunk(namespace=b"\1" * 32, block=spec, data=bytes(65536))
                    rest = [pb.PutChunk(data=bytes(65536)) for _ in range(63)]
                    try:
                        await stub.Put(iter([first, *rest]))
                    except grpc.aio.AioRpcError as error:
                        codes.append(error.code())
            return codes

        codes = asyncio.run(puts())
        assert codes == [grpc.StatusCode.NOT_FOUND] * 60
