"""The connector's daemon link against a real daemon that is absent, killed and restarted."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient, ModelFingerprint, Namespace
from kvstore.inference_adapter.vllm.link import DaemonDown, Link
from tests.support.daemon import Daemon, running_daemon

NAMESPACE = Namespace(ModelFingerprint("tiny", 2, 2, 16, "float32", block_tokens=16), "")
KEYS = [bytes([n]) * 32 for n in range(1, 4)]


def lookup(client: KVStoreClient) -> int:
    return client.lookup(NAMESPACE, KEYS)


def downs(caplog: pytest.LogCaptureFixture) -> int:
    return len([r for r in caplog.records if "unreachable" in r.getMessage()])


def test_down_at_start_then_up_then_killed_then_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = Daemon(tmp_path)
    link = Link(daemon.address, NAMESPACE, retry_s=0.3, role="scheduler", call_timeout=0.5)
    caplog.set_level(logging.WARNING, logger="kvstore.inference_adapter.vllm.link")
    try:
        assert link.warm() is False  # nothing listens yet
        started = time.monotonic()
        for _ in range(50):  # within retry_s: refused at once, no connection attempt
            with pytest.raises(DaemonDown):
                link.call(lookup)
        assert time.monotonic() - started < 0.3
        assert link.failures == 1 and downs(caplog) == 1  # one line, not one per call

        daemon.start()
        time.sleep(0.35)
        with pytest.raises(DaemonDown):  # the caller never waits: a connect starts behind it
            link.call(lookup)
        assert link.wait_connected(10.0)
        assert link.call(lookup) == 0
        assert link.call(lambda client: client.timeout) == 0.5  # calls keep the short deadline
        assert any("answers again" in r.getMessage() for r in caplog.records)

        daemon.kill()
        with pytest.raises(Exception):  # noqa: B017 - the first call sees the dead socket
            link.call(lookup)
        with pytest.raises(DaemonDown):
            link.call(lookup)
        daemon.start()
        time.sleep(0.35)
        with pytest.raises(DaemonDown):
            link.call(lookup)
        assert link.wait_connected(10.0) and link.call(lookup) == 0
        assert downs(caplog) == 2
    finally:
        link.close()
        daemon.close()


def test_a_waiting_link_connects_in_the_call(tmp_path: Path) -> None:
    """The worker's threads may wait: the first save after an outage is not lost."""
    with running_daemon(tmp_path) as daemon:
        link = Link(daemon.address, NAMESPACE, retry_s=0.1, role="worker", wait_for_connect=True)
        try:
            assert link.call(lookup) == 0  # no warm(): the call itself connected
            daemon.kill()
            with pytest.raises(Exception):  # noqa: B017 - the dead socket
                link.call(lookup)
            with pytest.raises(DaemonDown):  # within retry_s: at once
                link.call(lookup)
            daemon.start()
            time.sleep(0.15)
            assert link.call(lookup) == 0  # the first call after the outage goes through
        finally:
            link.close()


def test_a_slow_handshake_is_not_cut_by_the_call_deadline(tmp_path: Path) -> None:
    """Connecting takes longer than a Lookup may (the shm session, a busy daemon): it has
    its own timeout, so a short call deadline never keeps the link down."""
    with running_daemon(tmp_path) as daemon:
        link = Link(daemon.address, NAMESPACE, retry_s=0.1, role="scheduler", call_timeout=1e-4)
        try:
            assert link.warm()  # the handshake runs under connect_timeout
            assert link.call(lambda client: client.timeout) == 1e-4  # calls get the short one
        finally:
            link.close()
