"""Ports for the servers that tests and benchmarks start themselves (redis-server, Redis
Cluster nodes and their bus ports, a daemon on TCP).

A port that ``bind(0)`` hands out comes from the kernel's ephemeral range, the range it also
takes the local ports of outgoing connections from. Between such a probe and the server's
own bind, any connection this machine opens may take the port, and the server exits with
"Address already in use" (a cluster test saw it once in a full run). ``free_port()`` picks
below that range instead, where no outgoing connection lands: at random, never the same port
twice in one process, and only a port that binds now (with ``port + bus_offset`` too, for a
Redis Cluster node's bus).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FIRST = 10000  # above the ports that services usually own
_given: set[int] = set()


def free_port(bus_offset: int = 0) -> int:
    """A port on 127.0.0.1 below the ephemeral range that binds now, never given before in
    this process; with ``bus_offset``, ``port + bus_offset`` binds too and stays below the
    range (Redis Cluster's bus port is ``port + 10000``).

    Raises:
        RuntimeError: No such port (the ephemeral range starts too low, or all are taken).
    """
    ephemeral = _ephemeral_start()
    first = _FIRST if ephemeral - bus_offset > _FIRST + 1000 else 1024
    candidates = range(first, ephemeral - bus_offset)
    for port in random.sample(candidates, min(2000, len(candidates))):
        if port in _given or port + bus_offset in _given:
            continue
        if _binds(port) and (not bus_offset or _binds(port + bus_offset)):
            _given.update({port, port + bus_offset})
            return port
    raise RuntimeError(
        f"no free port below the ephemeral range (from {ephemeral}) with its +{bus_offset}"
    )


def _ephemeral_start() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _binds(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
