"""Ports for the servers tests and benchmarks start: below the ephemeral range, never the
same twice, never one that is taken."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from kvstore.inference_adapter.bench import ports
from kvstore.inference_adapter.bench.ports import free_port


def ephemeral_start() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    given = [free_port() for _ in range(200)] + [free_port(10000) for _ in range(50)]
    assert len(set(given)) == len(given)
    assert all(1024 <= port < ephemeral_start() for port in given)
    assert all(port + 10000 < ephemeral_start() for port in given[200:])
    assert not {port + 10000 for port in given[200:]} & set(given)
    for port in given[:20]:
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_a_taken_port_is_never_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the range starting at 1030, the candidates are 1024-1029: all of them held by
    listeners, there is none (an error naming the range); one released, it is the one."""
    limits = tmp_path / "ip_local_port_range"
    limits.write_text("1030\t60999\n")
    monkeypatch.setattr(ports, "_RANGE", limits)
    monkeypatch.setattr(ports, "_given", set())
    held = {}
    for port in range(1024, 1030):
        with contextlib.suppress(OSError):  # taken by something else: no candidate either
            held[port] = socket.create_server(("127.0.0.1", port))
    assert held, "every port of 1024-1029 is taken on this machine"
    try:
        with pytest.raises(RuntimeError, match="from 1030"):
            free_port()
        released = min(held)
        held.pop(released).close()
        assert free_port() == released
        with pytest.raises(RuntimeError):
            free_port()  # never the same port twice
    finally:
        for listener in held.values():
            listener.close()
