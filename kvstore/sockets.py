"""Unix socket paths the daemon listens on: parsing ``unix:`` addresses, claiming a path.

- ``unix_path("unix:/run/kvstore/kvstore.sock")`` -> the path (``unix:///abs`` and ``~``
  accepted);
- ``prepare_socket_path(path, socket_mode, gid)`` creates the directory (mode from the
  socket's: a group or others the socket admits may pass through it; group ``gid``, from
  ``server.socket_group``, when set) and removes a stale socket left by a
  daemon that died; it refuses a path a live daemon listens on, or that is not a socket;
- ``claim_sockets(listen)`` takes the lock of every unix socket the daemon will listen on
  (``<socket>.lock``, see :mod:`kvstore.tiers.locks`), first thing at start: a second daemon
  on a busy socket refuses before it allocates an arena or reads an SSD directory;
- ``check_tcp_addresses(listen)`` binds each ``host:port`` once and lets go, also before
  anything is allocated: a port in use or an address not of this host is refused with the
  kernel's reason. (gRPC's own bind says only "failed", and its ``SO_REUSEPORT`` would let two
  daemons share a port: the server turns that option off.)
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

__all__ = ["check_tcp_addresses", "claim_sockets", "prepare_socket_path", "set_access", "unix_path"]


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


def make_socket_directory(path: Path, socket_mode: int = 0o600, gid: int | None = None) -> None:
    """Creates ``path``'s directory with :func:`directory_mode` (and group ``gid``); one that
    exists is left as it is, with a warning when it keeps out whom ``socket_mode`` lets in."""
    directory, wanted = path.parent, directory_mode(socket_mode)
    if not directory.exists():
        directory.mkdir(parents=True, exist_ok=True)
        set_access(directory, wanted, gid)  # mkdir's mode is cut by the umask
        return
    missing = wanted & ~stat.S_IMODE(directory.stat().st_mode)
    if missing & 0o055:
        log.warning(
            "socket directory %s has mode %o: clients the socket mode %o admits cannot "
            "reach the socket (the directory needs %o)", directory,
            stat.S_IMODE(directory.stat().st_mode), socket_mode, wanted,
        )  # fmt: skip


def set_access(path: Path, mode: int, gid: int | None = None) -> None:
    """``chmod`` (and ``chown`` to group ``gid``) a socket or socket directory.

    Raises:
        PermissionError: the daemon's user may not give ``path`` to ``gid`` (it is not in that
            group); the message names both and the config key.
    """
    if gid is not None:
        try:
            os.chown(path, -1, gid)
        except PermissionError as error:
            raise PermissionError(
                error.errno,
                f"server.socket_group: cannot give {path} to group {gid} "
                "(the daemon's user is not in that group)",
            ) from error
    os.chmod(path, mode)


def prepare_socket_path(path: Path, socket_mode: int = 0o600, gid: int | None = None) -> None:
    """Creates the socket's directory; refuses a path held by a live daemon or a non-socket.

    Raises:
        OSError: EEXIST (not a socket) or EADDRINUSE (a live daemon listens there).
    """
    make_socket_directory(path, socket_mode, gid)
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


def claim_sockets(
    listen: Sequence[str], socket_mode: int = 0o600, gid: int | None = None
) -> list[FileLock]:
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
            make_socket_directory(path, socket_mode, gid)
            lock = FileLock(path.with_name(path.name + ".lock"), f"socket {path}")
            lock.acquire()
            locks.append(lock)
            prepare_socket_path(path, socket_mode, gid)  # one from before the locks may listen
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def check_tcp_addresses(listen: Sequence[str]) -> None:
    """Binds every ``host:port`` of ``listen`` (port 0 aside) once, then closes it.

    Raises:
        OSError: ``server.listen <address>: <the kernel's reason>`` for the first that cannot
            be bound (a name that does not resolve included).
    """
    for address in listen:
        if address.startswith("unix:"):
            continue
        host, _, port = address.rpartition(":")
        if port == "0":
            continue
        try:
            infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)  # fmt: skip
        except (socket.gaierror, ValueError) as error:
            raise OSError(errno.EADDRNOTAVAIL, f"server.listen {address}: {error}") from error
        bound, refusal = 0, None
        for family, kind, proto, _, where in infos:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
                try:
                    probe.bind(where)
                    bound += 1
                except OSError as error:
                    if error.errno == errno.EADDRINUSE or refusal is None:
                        refusal = error
        if refusal is not None and (refusal.errno == errno.EADDRINUSE or not bound):
            raise OSError(refusal.errno, f"server.listen {address}: {refusal.strerror}")
