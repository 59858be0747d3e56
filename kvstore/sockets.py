"""Unix socket paths the daemon listens on: parsing ``unix:`` addresses, claiming a path.

- ``unix_path("unix:/run/kvstore/kvstore.sock")`` -> the path (``unix:///abs`` and ``~``
  accepted);
- ``prepare_socket_path(path)`` creates the directory and removes a stale socket left by a
  daemon that died; it refuses a path a live daemon listens on, or that is not a socket;
- ``claim_sockets(listen)`` takes the lock of every unix socket the daemon will listen on
  (``<socket>.lock``, see :mod:`kvstore.tiers.locks`), first thing at start: a second daemon
  on a busy socket refuses before it allocates an arena or reads an SSD directory.
"""

from __future__ import annotations

import errno
import socket
import stat
from collections.abc import Sequence
from pathlib import Path

from kvstore.tiers.locks import FileLock

__all__ = ["claim_sockets", "prepare_socket_path", "unix_path"]


def unix_path(address: str) -> Path:
    """The filesystem path of a ``unix:`` address."""
    rest = address.removeprefix("unix:")
    return Path(rest.removeprefix("//") if rest.startswith("///") else rest).expanduser()


def prepare_socket_path(path: Path) -> None:
    """Creates the socket's directory; refuses a path held by a live daemon or a non-socket.

    Raises:
        OSError: EEXIST (not a socket) or EADDRINUSE (a live daemon listens there).
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a unix socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # stale: left behind by a daemon that died
            return
    raise OSError(errno.EADDRINUSE, f"another daemon is listening on {path}")


def claim_sockets(listen: Sequence[str]) -> list[FileLock]:
    """The held locks of the ``unix:`` addresses in ``listen`` (their directories created).

    Raises:
        InUseError: Another daemon holds one (the locks taken so far are let go).
        OSError: As :func:`prepare_socket_path`.
    """
    locks: list[FileLock] = []
    try:
        for address in listen:
            if not address.startswith("unix:"):
                continue
            path = unix_path(address)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            lock = FileLock(path.with_name(path.name + ".lock"), f"socket {path}")
            lock.acquire()
            locks.append(lock)
            prepare_socket_path(path)  # a daemon from before the locks may still listen
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks
