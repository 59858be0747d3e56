"""Defaults that depend on the machine: the host tier's size when no config file names one.

``auto_host_capacity()`` = min(25% of the memory limit, 8 GiB), rounded down to 64 MiB (and
at least 64 MiB). The memory limit is ``MemTotal``, or the cgroup's ``memory.max`` when a
container sets a lower one: the same on every start of the same machine or container,
whatever is free at that moment (a share of ``MemAvailable`` gave 4.2-6.1 GB on one machine).
The arenas are memfds: their pages are taken as blocks arrive, not at start, so the size is a
ceiling, not a reservation. ``host_default()`` also says why, for the start-up log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

GRANULE: Final = 64 * 2**20
CAP: Final = 8 * 2**30
MEMORY_SHARE: Final = 0.25
MEMINFO: Final = "/proc/meminfo"
CGROUP_LIMIT: Final = "/sys/fs/cgroup/memory.max"


def host_capacity(memory_limit: int | None) -> int:
    """The host tier size for a machine (or container) with this much memory.

    Args:
        memory_limit: Bytes, or None when unknown (not Linux): the cap.
    """
    limits = [CAP]
    if memory_limit is not None:
        limits.append(int(memory_limit * MEMORY_SHARE))
    return max(GRANULE, min(limits) // GRANULE * GRANULE)


def meminfo_bytes(field: str, meminfo: str | Path = MEMINFO) -> int | None:
    """A ``/proc/meminfo`` field (``MemTotal``, ``MemAvailable``) in bytes, or None."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            number, _, unit = rest.strip().partition(" ")
            return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    return None


def cgroup_limit(path: str | Path = CGROUP_LIMIT) -> int | None:
    """The cgroup v2 memory limit in bytes; None when there is none ("max") or no file."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def memory_limit(
    meminfo: str | Path = MEMINFO, cgroup: str | Path = CGROUP_LIMIT
) -> tuple[int | None, str]:
    """The memory this process may use, and where that figure comes from."""
    total, limit = meminfo_bytes("MemTotal", meminfo), cgroup_limit(cgroup)
    if limit is not None and (total is None or limit < total):
        return limit, f"the cgroup's memory.max {limit / 2**30:.1f} GiB"
    if total is not None:
        return total, f"MemTotal {total / 2**30:.1f} GiB"
    return None, "memory unknown"


def host_default(
    meminfo: str | Path = MEMINFO, cgroup: str | Path = CGROUP_LIMIT
) -> tuple[int, str]:
    """The host tier size for this machine, and why (for the log)."""
    limit, source = memory_limit(meminfo, cgroup)
    capacity = host_capacity(limit)
    if limit is None:
        return capacity, f"{source}: the {CAP // 2**30} GiB cap"
    if capacity == CAP:
        return capacity, f"{MEMORY_SHARE:.0%} of {source}, capped at {CAP // 2**30} GiB"
    return capacity, f"{MEMORY_SHARE:.0%} of {source}, in {GRANULE // 2**20} MiB steps"


def auto_host_capacity() -> int:
    """The host tier size for this machine."""
    return host_default()[0]


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
