"""Keeping a million held blocks out of the cyclic garbage collector's full collections.

CPython's collector walks every object it tracks on a full collection, and every reference
in each. With a million blocks indexed (a node per block in the index, a slot per block in
the host tier, several dicts of a million entries) one collection stopped the event loop for
1.1 s, and one is due whenever the long-lived objects have grown by a quarter. Nothing per
block can be part of a reference cycle: a node refers to bytes, shared metadata and dicts of
atoms, a slot to two ints, and the containers that hold them hold nothing else. So the
collector has nothing to find there, and is kept from looking. Primitives:

- ``untrack(obj)``: takes a per-block record (an index node, a host slot) or a container of
  per-block records (the index's dicts, a policy's order) out of the collector's sight.
  Call it on a record that refers to no object that could refer back to it, and on a
  container after each insertion of such records (CPython tracks a dict again when a value
  it could track goes in; a dict of atoms only, bytes to ints, it never tracks). Reference
  counting still frees them. CPython only (``PyObject_GC_UnTrack``, its public C call); a
  no-op elsewhere.
- ``freeze()``: collects once, then moves every object alive into the permanent generation
  (``gc.freeze``): the modules, the config, the tiers. Full collections walk only what was
  made after. The daemon calls it once its store has started, before it serves. An object
  alive then that later becomes garbage in a cycle is never collected, so it is called once,
  at start, never periodically.

``tracked_entries()`` (for tests and benchmarks) counts the references the collector would
walk: it must not grow with the blocks held.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable


def _untrack_call() -> Callable[[object], None] | None:
    if sys.implementation.name != "cpython":
        return None
    call = ctypes.pythonapi.PyObject_GC_UnTrack
    call.argtypes, call.restype = [ctypes.py_object], None
    return call


_UNTRACK = _untrack_call()
_is_tracked = gc.is_tracked


def untrack(obj: object) -> None:
    """Hides ``obj`` from the collector (see the module docstring for when that is safe)."""
    if _UNTRACK is not None and _is_tracked(obj):
        _UNTRACK(obj)


def freeze() -> int:
    """Collects, then freezes every object alive. Returns how many the permanent generation
    holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def tracked_entries() -> int:
    """Objects the collector tracks, plus the entries of every tracked container (outside
    the permanent generation): about what a full collection walks."""
    gc.collect()
    total = 0
    for obj in gc.get_objects():
        total += 1
        if issubclass(type(obj), dict | list | set | frozenset | tuple):
            total += len(obj)
    return total
