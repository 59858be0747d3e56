"""The connectors' own threads run their torch work alone: no OpenMP team beside the engine's.

A thread that runs a parallel torch op on the CPU gets an OpenMP team of its own, and its
worker threads stay for the life of the thread. libgomp lets a thread waiting at a barrier
spin only while the process's OpenMP threads fit its cores; past that every team sleeps and
is woken at each barrier. vLLM on the CPU binds one thread per core, so one copy on a
connector thread (a save's copy out, a load's layer writes) made every later decode step
pay: measured on 2 cores, vLLM's decode fell from ~46 to ~34 tokens/s for good, with no
more CPU work done (the engine's threads slept at barriers instead of spinning).

:func:`torch_ops_alone` is every such thread's first call (``initializer=`` of its
executor): the thread's own OpenMP thread count becomes 1, so its ops run on it and start
no team. The count is per thread (the OpenMP ICV of the calling thread); the engine's
threads and torch's process-wide setting are left as they are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

__all__ = ["torch_ops_alone"]

log = logging.getLogger(__name__)

_RUNTIMES = ("libgomp", "libiomp", "libomp")


def torch_ops_alone() -> None:
    """Makes the calling thread's torch CPU ops run on it alone (see the module docstring).

    A no-op where no OpenMP runtime is loaded (torch built without one).
    """
    torch.get_num_threads()  # torch's set-up of a new thread sets its count: let it run first
    runtime = _openmp()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs on, from this process's mappings: the one in torch's
    own folders (other wheels bundle theirs too), else the only one; ``None``: none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:
        return None
    loaded = sorted(p for p in paths if any(name in p.rsplit("/", 1)[-1] for name in _RUNTIMES))
    home = os.path.dirname(torch.__file__)
    torchs = [p for p in loaded if p.startswith((home + os.sep, home + ".libs" + os.sep))]
    chosen = torchs or (loaded if len(loaded) == 1 else [])
    if not chosen:
        log.debug("no OpenMP runtime of torch's among %s", loaded)
        return None
    try:
        runtime = ctypes.CDLL(chosen[0])
        runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        log.debug("no omp_set_num_threads in %s", chosen[0], exc_info=True)
        return None
    return runtime
