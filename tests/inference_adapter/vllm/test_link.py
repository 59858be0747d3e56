"""The connector's daemon link against a real daemon that is absent, killed and restarted."""

from __future__ import annotations

import hashlib
import itertools
import logging
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from kvstore.client import KVStoreClient, KVStoreError, ModelFingerprint, Namespace, block_keys
from kvstore.client.connection import StaleArenaError
from kvstore.inference_adapter.vllm.link import DaemonDown, Link
from tests.support.daemon import Daemon, running_daemon

NAMESPACE = Namespace(ModelFingerprint("tiny", 2, 2, 16, "float32", block_tokens=16), "")
KEYS = [bytes([n]) * 32 for n in range(1, 4)]
T = TypeVar("T")


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
    retry_s = 1.0  # 50 refusals take microseconds: far inside it even on a loaded machine
    link = Link(daemon.address, NAMESPACE, retry_s=retry_s, role="scheduler", call_timeout=0.5)
    caplog.set_level(logging.WARNING, logger="kvstore.inference_adapter.vllm.link")
    try:
        assert link.warm() is False  # nothing listens yet
        started = time.monotonic()
        for _ in range(50):  # within retry_s: refused at once, no connection attempt
            with pytest.raises(DaemonDown):
                link.call(lookup)
        # One failure and one line, not one per call; a stalled machine may have let the
        # retry window pass (a connection attempt each time it did).
        windows = 1 + int((time.monotonic() - started) / retry_s)
        assert 1 <= link.failures <= windows and downs(caplog) == 1

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


def payload(key: bytes) -> bytes:
    """A block's bytes, derived from its key (NAMESPACE's blocks are 4 KiB)."""
    return hashlib.sha256(key).digest() * (NAMESPACE.model.layout().payload_bytes // 32)


def test_links_shared_by_threads_through_restarts_read_only_right_bytes(tmp_path: Path) -> None:
    """Three worker links (each used by two threads, as vLLM's load and save threads share
    one) and three scheduler links to one daemon, all with a retry_s longer than the test,
    while the daemon is SIGKILLed and restarted three times. Every block read must be the
    bytes derived from its key; a call may only fail with the link's or the client's own
    errors; after each restart every scheduler link answers again through the workers'
    news alone; no connect thread is left behind."""
    before = set(threading.enumerate())
    daemon = Daemon(tmp_path, host_capacity="32MiB", ssd_capacity=None)
    daemon.start()
    workers = [
        Link(daemon.address, NAMESPACE, retry_s=600.0, role="worker", wait_for_connect=True)
        for _ in range(3)
    ]
    schedulers = [
        Link(daemon.address, NAMESPACE, retry_s=600.0, role="scheduler", call_timeout=5.0)
        for _ in range(3)
    ]
    stop = threading.Event()
    tally: Counter[str] = Counter()
    last_ok: dict[int, float] = {}
    lock = threading.Lock()

    def note(what: str, link: Link | None = None) -> None:
        with lock:
            tally[what] += 1
            if link is not None and what.endswith("ok"):
                last_ok[id(link)] = time.monotonic()

    def call(link: Link, fn: Callable[[KVStoreClient], T]) -> T | None:
        try:
            return link.call(fn)
        except (DaemonDown, KVStoreError, StaleArenaError) as error:
            note(f"refused {type(error).__name__}")
            return None

    def write_and_read(link: Link, seed: int) -> None:
        for round_ in itertools.count():
            if stop.is_set():
                return
            keys = block_keys(
                list(range(seed * 10**6 + round_ * 64, seed * 10**6 + round_ * 64 + 64)), NAMESPACE
            )
            blocks = [payload(key) for key in keys]
            if call(link, lambda c, k=keys, b=blocks: c.put(NAMESPACE, k, b)) is not None:
                note("put ok", link)
            got = call(link, lambda c, k=keys: c.get(NAMESPACE, k))
            if got is not None:
                note("get ok", link)
                for key, data in zip(keys, got, strict=False):  # a chain may come back short
                    note("verified" if bytes(data) == payload(key) else "WRONG")

    def look_up(link: Link) -> None:
        keys = block_keys(list(range(64)), NAMESPACE)
        while not stop.is_set():
            held = call(link, lambda c: c.lookup(NAMESPACE, keys))
            if held is not None:
                assert 0 <= held <= len(keys)
                note("lookup ok", link)
            time.sleep(0.01)

    runners = [
        threading.Thread(target=write_and_read, args=(link, n * 2 + k))
        for n, link in enumerate(workers)
        for k in range(2)
    ]
    runners += [threading.Thread(target=look_up, args=(link,)) for link in schedulers]
    for runner in runners:
        runner.start()
    try:
        for _ in range(3):
            time.sleep(1.0)
            daemon.kill()
            time.sleep(0.5)
            daemon.start()
            back = time.monotonic()
            deadline = back + 60.0  # long: a loaded machine reconnects late, not never
            while any(last_ok.get(id(link), 0.0) < back for link in schedulers + workers):
                assert time.monotonic() < deadline, f"a link did not come back: {tally}"
                time.sleep(0.05)
    finally:
        stop.set()
        for runner in runners:
            runner.join(30)
        for link in workers + schedulers:
            link.close()
        daemon.close()
    assert tally["WRONG"] == 0, tally
    # Floors far below what a run reads (1,600-1,900 here), so a slow machine passes: what
    # they catch is a run in which the links never read at all.
    assert tally["verified"] >= 100 and tally["lookup ok"] >= 9, tally
    stuck = [runner for runner in runners if runner.is_alive()]
    assert not stuck, "\n".join(
        "".join(traceback.format_stack(sys._current_frames()[t.ident])) for t in stuck if t.ident
    )
    time.sleep(0.5)  # the clients' loop threads end after close
    left = [t.name for t in set(threading.enumerate()) - before]
    ours = [
        name
        for name in left
        if name.startswith(("kvstore-client", "kvstore-worker", "kvstore-scheduler"))
    ]
    assert ours == [], ours  # no connect thread, no client loop left (gRPC's poller is its own)
