"""Copies in worker threads that outlive a cancelled caller, and whole reads of a descriptor.

- ``run_to_completion(call)`` runs ``call`` in a worker thread; a caller cancelled meanwhile
  still waits for the thread to finish before the cancellation propagates, so the buffers
  the copy reads and writes stay valid (not freed, not unmapped) until it is done;
- ``pread_exactly(fd, offset, length)`` reads ``length`` bytes at ``offset`` (one ``pread``
  stops at about 2 GiB).

Shared by the host tier and the client's shared-memory mappings.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["pread_exactly", "run_to_completion"]

T = TypeVar("T")


def pread_exactly(fd: int, offset: int, length: int) -> bytes:
    """Reads ``length`` bytes at ``offset``.

    Raises:
        OSError: the file ends first.
    """
    parts = [os.pread(fd, length, offset)]
    done = len(parts[0])
    while done < length:
        parts.append(os.pread(fd, length - done, offset + done))
        if not parts[-1]:
            raise OSError(f"file ended at byte {offset + done} of a {length}-byte read")
        done += len(parts[-1])
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def run_to_completion(call: Callable[[], T]) -> T:
    """Runs ``call`` in a worker thread; see the module docstring."""
    future = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait({future})
            except asyncio.CancelledError:
                continue
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what propagates
        raise
