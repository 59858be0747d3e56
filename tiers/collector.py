"""Keeping a million held blocks out of the cyclic garbage collector's full collections.

CPython's collector walks every object it tracks on a full collection, and every reference
in each. With a million blocks indexed (a node per block in the index, a slot per block in
the host tier, several dicts of a million entries) one collection stopped the event loop for
1.1 s, and one is due whenever the long-lived objects have grown by a quarter. Nothing per
block can be part of a reference cycle: a node refers to bytes, shared metadata and dicts of
atoms, a slot to two ints, and the containers that hold them hold nothing else. So the
collector has nothing to find there, and is kept from looking. Primitives:

- ``untrack(obj)``: takes a per-block record (an index node, a host slot) or a container
  of atoms (a policy's order, bytes to None) out of the collector's sight. Call it on a
  record that refers to no object that could refer back to it. Reference counting still
  frees them. CPython only (``PyObject_GC_UnTrack``, its public C call); a no-op elsewhere.
- ``insert(mapping, key, value)``: ``mapping[key] = value`` for a dict of such records (the
  index's nodes, the host tier's slots). CPython tracks a dict again when a value it could
  track goes in, even an untracked record, and puts it in the youngest generation; a
  collection of that generation, due every ~700 allocations, then walks every entry (10-20
  ms for 200K blocks: it was most of the event loop's lag at that size). ``insert`` untracks
  the dict again before anything can allocate, with collections held off for that one call;
  callers allocate nothing between two such inserts either.
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
from typing import TypeVar


def _untrack_call() -> Callable[[object], None] | None:
    if sys.implementation.name != "cpython":
        return None
    call = ctypes.pythonapi.PyObject_GC_UnTrack
    call.argtypes, call.restype = [ctypes.py_object], None
    return call


_UNTRACK = _untrack_call()
_is_tracked = gc.is_tracked
_gc_enabled, _gc_disable, _gc_enable = gc.isenabled, gc.disable, gc.enable
K = TypeVar("K")
V = TypeVar("V")


def untrack(obj: object) -> None:
    """Hides ``obj`` from the collector (see the module docstring for when that is safe).
    No collection runs between the call and the untracking: the C call allocates its
    argument tuple, which could start one while ``obj`` (a dict just added to) is tracked."""
    if _UNTRACK is None or not _is_tracked(obj):
        return
    if not _gc_enabled():
        _UNTRACK(obj)
        return
    _gc_disable()
    try:
        _UNTRACK(obj)
    finally:
        _gc_enable()


def insert(mapping: dict[K, V], key: K, value: V) -> None:
    """``mapping[key] = value``, ``mapping`` left untracked (see the module docstring)."""
    mapping[key] = value
    untrack(mapping)


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
