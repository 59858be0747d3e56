"""A lock held across every process on the machine: for tests too heavy to run twice at once.

``machine_lock(name)`` takes an exclusive ``flock`` on ``<tempdir>/kvstore-tests-<name>.lock``
and holds it for the ``with`` block. Two suites running side by side (and the two workers of
one) then start such a test one after another: a pair of vLLM servers for a trained model
holds ~4.4 GB (each worker ~3.8 GB RSS), and four at once, with the rest of two suites,
left a 24 GiB machine under 1.5 GB available, where one engine died mid-run. The kernel
releases the lock when its holder dies, so a killed test never leaves it taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["machine_lock"]


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Holds the machine-wide lock ``name`` (waits for it; see the module docstring)."""
    path = Path(tempfile.gettempdir()) / f"kvstore-tests-{name}.lock"
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
