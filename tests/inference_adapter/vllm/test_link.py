"""The connector's daemon link against a real daemon that is absent, killed and restarted."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient, ModelFingerprint, Namespace
from kvstore.inference_adapter.vllm.link import DaemonDown, Link
from tests.support.daemon import Daemon

NAMESPACE = Namespace(ModelFingerprint("tiny", 2, 2, 16, "float32", block_tokens=16), "")
KEYS = [bytes([n]) * 32 for n in range(1, 4)]


def lookup(client: KVStoreClient) -> int:
    return client.lookup(NAMESPACE, KEYS)


def test_down_at_start_then_up_then_killed_then_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = Daemon(tmp_path)
    link = Link(daemon.address, NAMESPACE, retry_s=0.3, role="scheduler", timeout=2.0, retries=0)
    caplog.set_level(logging.WARNING, logger="kvstore.inference_adapter.vllm.link")
    try:
        assert link.warm() is False  # nothing listens yet
        started = time.monotonic()
        for _ in range(50):  # within retry_s: refused at once, no connection attempt
            with pytest.raises(DaemonDown):
                link.call(lookup)
        assert time.monotonic() - started < 0.3
        assert link.failures == 1
        downs = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(downs) == 1  # one line, not one per call

        daemon.start()
        time.sleep(0.35)
        assert link.call(lookup) == 0
        assert any("answers again" in r.getMessage() for r in caplog.records)

        daemon.kill()
        with pytest.raises(Exception):  # noqa: B017 - the first call sees the dead socket
            link.call(lookup)
        with pytest.raises(DaemonDown):
            link.call(lookup)
        daemon.start()
        time.sleep(0.35)
        assert link.call(lookup) == 0
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 2
    finally:
        link.close()
        daemon.close()
