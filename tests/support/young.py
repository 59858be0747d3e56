"""What the cyclic garbage collector finds in its youngest generation, watched.

``biggest_young_dict()`` is a context manager: within it the collector runs a young
collection at every allocation (threshold 1), and before each one the largest tracked dict in
that generation is noted; ``.largest`` after the block. A per-block map left tracked for even
one allocation shows as a dict the size of the store.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any


class Watch:
    largest = 0


@contextlib.contextmanager
def biggest_young_dict() -> Iterator[Watch]:
    watch = Watch()

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 0:
            for obj in gc.get_objects(0):
                if type(obj) is dict and len(obj) > watch.largest:
                    watch.largest = len(obj)

    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1, threshold[1], threshold[2])
    gc.callbacks.append(seen)
    try:
        yield watch
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
