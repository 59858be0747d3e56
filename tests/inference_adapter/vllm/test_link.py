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


def until_connected(link: Link, timeout: float = 20.0) -> float:
    """Calls until one succeeds; the longest a failing call took."""
    deadline, longest = time.monotonic() + timeout, 0.0
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            assert link.call(lookup) == 0
            return longest
        except DaemonDown:
            longest = max(longest, time.monotonic() - started)
            time.sleep(0.02)
    raise AssertionError("the link did not reconnect")


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

        daemon.start()  # no call needed: the link retries in the background
        # No call waited past its deadline (0.5 s, plus slack for a loaded machine) for the
        # connect's own timeout (10 s).
        assert until_connected(link) < 0.5 + 1.0
        assert link.call(lambda client: client.timeout) == 0.5  # calls keep the short deadline
        assert any("answers again" in r.getMessage() for r in caplog.records)

        daemon.kill()
        with pytest.raises(Exception):  # noqa: B017 - the first call sees the dead socket
            link.call(lookup)
        with pytest.raises(DaemonDown):
            link.call(lookup)
        daemon.start()
        until_connected(link)
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
            with pytest.raises(DaemonDown):  # it tries to connect, and is refused
                link.call(lookup)
            daemon.start()
            time.sleep(0.15)
            assert link.call(lookup) == 0  # the first call after the outage goes through
            link.close()
            with pytest.raises(DaemonDown):  # a closed link never connects again
                link.call(lookup)
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


def test_a_link_that_connects_wakes_the_others_to_its_daemon(tmp_path: Path) -> None:
    """vLLM's engine in one process: the worker's first save after an outage connects in its
    call; the scheduler, held off for ``retry_s`` (a minute here), looks up again at once
    instead of answering "miss" for the rest of its minute. A link to another daemon stays
    held off."""
    daemon, other = Daemon(tmp_path / "a"), Daemon(tmp_path / "b")
    scheduler = Link(daemon.address, NAMESPACE, retry_s=60.0, role="scheduler", call_timeout=5.0)
    elsewhere = Link(other.address, NAMESPACE, retry_s=60.0, role="scheduler", call_timeout=5.0)
    worker = Link(daemon.address, NAMESPACE, retry_s=60.0, role="worker", wait_for_connect=True)
    try:
        assert not scheduler.warm() and not elsewhere.warm() and not worker.warm()
        daemon.start()
        other.start()
        with pytest.raises(DaemonDown):  # held off: no attempt for a minute
            scheduler.call(lookup)
        assert worker.call(lookup) == 0  # connects in the call, and tells the scheduler
        assert scheduler.call(lookup) == 0  # waits for the connect it was woken into
        with pytest.raises(DaemonDown):
            elsewhere.call(lookup)
        assert scheduler.failures == 1 and elsewhere.failures == 1
    finally:
        for link in (scheduler, elsewhere, worker):
            link.close()
        daemon.close()
        other.close()
