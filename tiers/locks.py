"""Exclusive locks on what one daemon owns: its SSD directory, its socket.

A :class:`FileLock` is an ``flock`` on a small file beside the thing it guards, held for as
long as the daemon runs. The kernel drops it when the process dies, however it dies
(SIGKILL included), so a file left behind never blocks a restart, and two daemons that
start at the same moment cannot both take it. The file holds the holder's pid, for the
message the second daemon gives. Primitives:

- ``FileLock(path, what).acquire()``: takes the lock or raises :class:`InUseError` naming
  ``what``, the path and the holder's pid, before the caller has touched anything else;
- ``release()``: lets it go (the file stays: removing it would race a daemon taking it).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

__all__ = ["FileLock", "InUseError"]


class InUseError(OSError):
    """Another live process holds the lock."""


class FileLock:
    """An exclusive, non-blocking ``flock`` on ``path`` (created if missing)."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        self.what = what
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> None:
        """Takes the lock; a second call while held does nothing.

        Raises:
            InUseError: Another process holds it (the message names its pid).
            OSError: The lock file cannot be created or opened (the message names it).
        """
        if self.held:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise OSError(
                error.errno, f"cannot open the lock file of {self.what}: {error.strerror}",
                str(self.path),
            ) from error  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise InUseError(
                errno.EBUSY,
                f"{self.what} is in use by another kvstore daemon (pid {holder}); "
                f"stop it first or configure another (lock file {self.path})",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Lets the lock go; nothing happens if it is not held."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
