"""Unix socket paths the daemon listens on: parsing ``unix:`` addresses, claiming a path.

- ``unix_path("unix:/run/kvstore/kvstore.sock")`` -> the path (``unix:///abs`` and ``~``
  accepted);
- ``prepare_socket_path(path, socket_mode)`` creates the directory (mode from the socket's:
  a group or others the socket admits may pass through it) and removes a stale socket left by a
  daemon that died; it refuses a path a live daemon listens on, or that is not a socket;
- ``claim_sockets(listen)`` takes the lock of every unix socket the daemon will listen on
  (``<socket>.lock``, see :mod:`kvstore.tiers.locks`), first thing at start: a second daemon
  on a busy socket refuses before it allocates an arena or reads an SSD directory.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from collections.abc import Sequence
from pathlib import Path

from kvstore.tiers.locks import FileLock

log = logging.getLogger(__name__)

__all__ = ["claim_sockets", "prepare_socket_path", "unix_path"]


def unix_path(address: str) -> Path:
    """The filesystem path of a ``unix:`` address."""
    rest = address.removeprefix("unix:")
    return Path(rest.removeprefix("//") if rest.startswith("///") else rest).expanduser()


def directory_mode(socket_mode: int) -> int:
    """The mode of a socket directory the daemon creates: always ``rwx`` for its owner, and
    ``r-x`` for the group or for others when ``socket_mode`` lets them read or write the
    socket (they must pass through the directory to reach it)."""
    mode = 0o700
    if socket_mode & 0o060:
        mode |= 0o050
    if socket_mode & 0o006:
        mode |= 0o005
    return mode


def make_socket_directory(path: Path, socket_mode: int = 0o600) -> None:
    """Creates ``path``'s directory with :func:`directory_mode`; one that exists is left as
    it is, with a warning when it keeps out whom ``socket_mode`` lets in."""
    directory, wanted = path.parent, directory_mode(socket_mode)
    if not directory.exists():
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, wanted)  # mkdir's mode is cut by the umask
        return
    missing = wanted & ~stat.S_IMODE(directory.stat().st_mode)
    if missing & 0o055:
        log.warning(
            "socket directory %s has mode %o: clients the socket mode %o admits cannot "
            "reach the socket (the directory needs %o)", directory,
            stat.S_IMODE(directory.stat().st_mode), socket_mode, wanted,
        )  # fmt: skip


def prepare_socket_path(path: Path, socket_mode: int = 0o600) -> None:
    """Creates the socket's directory; refuses a path held by a live daemon or a non-socket.

    Raises:
        OSError: EEXIST (not a socket) or EADDRINUSE (a live daemon listens there).
    """
    make_socket_directory(path, socket_mode)
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


def claim_sockets(listen: Sequence[str], socket_mode: int = 0o600) -> list[FileLock]:
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
            make_socket_directory(path, socket_mode)
            lock = FileLock(path.with_name(path.name + ".lock"), f"socket {path}")
            lock.acquire()
            locks.append(lock)
            prepare_socket_path(path, socket_mode)  # one from before the locks may listen
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks
