"""Defaults that depend on the machine: the host tier's size when no config file names one.

``auto_host_capacity()`` = min(25% of ``MemAvailable``, 8 GiB), rounded down to 64 MiB (and at
least 64 MiB). A daemon started without a config file then fits the machine it lands on
instead of asking for a fixed 4 GiB that a laptop or a container may not have. (The arenas
are memfds: their pages are taken as blocks arrive, not at start.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

GRANULE: Final = 64 * 2**20
CAP: Final = 8 * 2**30
MEMORY_SHARE: Final = 0.25


def host_capacity(mem_available: int | None) -> int:
    """The host tier size for a machine with this much free memory (see the module doc).

    Args:
        mem_available: ``MemAvailable`` in bytes, or None when unknown (not Linux): the cap.
    """
    limits = [CAP]
    if mem_available is not None:
        limits.append(int(mem_available * MEMORY_SHARE))
    return max(GRANULE, min(limits) // GRANULE * GRANULE)


def mem_available(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or None when it cannot be read."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            number, _, unit = rest.strip().partition(" ")
            return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    return None


def auto_host_capacity() -> int:
    """The host tier size for this machine."""
    return host_capacity(mem_available())


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
ALLOCATOR_REUSE_BYTES: Final = 256 * 2**20


def tune_allocator(reuse_bytes: int = ALLOCATOR_REUSE_BYTES) -> bool:
    """Lets glibc reuse freed buffers up to ``reuse_bytes`` instead of unmapping them.

    Blocks are 2-32 MiB; by default glibc maps each such buffer afresh and unmaps it on
    free, so every block read pays a page fault per 4 KiB (measured: a 32 MiB read at
    ~1.3 GB/s instead of ~5 GB/s). Called once by the daemon's entry point. Returns False
    where there is no glibc (the setting is an optimisation, never required).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, reuse_bytes) and mallopt(_M_TRIM_THRESHOLD, 4 * reuse_bytes)
    )
