"""The bounded save queue: new blocks go to the daemon without ever blocking the engine.

The connector gathers a request's new full blocks from the pool (K as the pool holds it) into
a staging tensor on the pool's device and offers it here as a :class:`SaveJob`. On CUDA the
gather is queued on the engine's stream and the job carries the event recorded after it
(:func:`ready_event`); the engine never waits for it. A background thread ``put``s jobs in
order; it waits for a job's event, then, for a job on CUDA, runs the put on a stream of its
own, so the device-to-host copy lands straight in the arena slots the daemon reserved (by DMA when
the client registered its shm session with CUDA: ``pin_arena``) while the engine's stream
goes on computing. No host bounce buffer: the bytes cross the link once, into the arena,
and the client sums them once there. Queued CUDA jobs hold device memory, at most
``capacity`` blocks of it.
The queue holds at most ``capacity`` blocks: an offer that does not fit is refused at once
(the connector counts the blocks as dropped) rather than waiting for room, so a slow or
absent daemon costs the engine nothing but cache misses later.

Primitives: ``has_room(n)`` -> bool, ``room()`` -> blocks, ``offer(job)`` -> bool (refused
when full), ``drain(timeout)`` -> bool (everything offered so far was handled), ``close()``;
counters in :class:`SaveCounts`; ``ready_event(blocks)`` -> the event to wait for, or None.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.client import Namespace, WriteStatus
from kvstore.inference_adapter.core.threads import torch_ops_alone

__all__ = ["Putter", "SaveCounts", "SaveJob", "SaveQueue", "ready_event"]

log = logging.getLogger(__name__)


class Putter(Protocol):
    """What the queue needs of a client: ``KVStoreClient.put``."""

    def put(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        blocks: Sequence[torch.Tensor],
        *,
        parent: bytes = ...,
    ) -> list[WriteStatus]: ...


@dataclass(frozen=True, slots=True)
class SaveJob:
    """A contiguous run of a key chain and its blocks."""

    keys: tuple[bytes, ...]
    parent: bytes  # the key before keys[0] (ROOT_KEY for block 0)
    blocks: torch.Tensor  # [len(keys), num_layers, 2, block_tokens, num_kv_heads, head_dim]
    ready: torch.cuda.Event | None = None  # recorded once ``blocks`` holds the KV (CUDA)


def ready_event(blocks: torch.Tensor) -> torch.cuda.Event | None:
    """On CUDA, an event recorded on the current stream once the work queued so far (what
    fills ``blocks``) is done; None on the CPU, where that work has already run."""
    if not blocks.is_cuda:
        return None
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record(torch.cuda.current_stream(blocks.device))
    return ready


@dataclass(frozen=True, slots=True)
class SaveCounts:
    """Blocks by what became of them once put."""

    stored: int
    dedup: int
    refused: int  # NO_SPACE or EXPIRED at the daemon
    failed: int  # the put raised (daemon down, ...)


class SaveQueue:
    """A bounded FIFO of save jobs served by one background thread.

    Args:
        client: The daemon's client.
        namespace: The model and tenant of every job.
        capacity: Most blocks waiting or being put at once (>= 1).
    """

    def __init__(self, client: Putter, namespace: Namespace, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"save queue capacity must be >= 1 block, got {capacity}")
        self._client = client
        self._namespace = namespace
        self.capacity = capacity
        self._jobs: collections.deque[SaveJob | None] = collections.deque()
        self._pending_blocks = 0  # queued + in the put now
        self._changed = threading.Condition()
        self._counts = collections.Counter[str]()
        self._failing = False  # the last put failed: the next failures are not logged again
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # the thread's own, per device
        self._thread = threading.Thread(target=self._serve, name="kvstore-save", daemon=True)
        self._thread.start()

    @property
    def counts(self) -> SaveCounts:
        with self._changed:
            c = self._counts
            return SaveCounts(c["stored"], c["dedup"], c["refused"], c["failed"])

    def has_room(self, num_blocks: int) -> bool:
        """Whether an offer of ``num_blocks`` would be taken now."""
        with self._changed:
            return self._fits(num_blocks)

    def room(self) -> int:
        """Blocks the queue takes beside what it holds now (``capacity`` when empty)."""
        with self._changed:
            return max(0, self.capacity - self._pending_blocks)

    def offer(self, job: SaveJob) -> bool:
        """Queues ``job`` if it fits (never waits); ``False`` when refused."""
        with self._changed:
            if not self._fits(len(job.keys)):
                return False
            self._pending_blocks += len(job.keys)
            self._jobs.append(job)
            self._changed.notify_all()
            return True

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until every job offered so far is handled; ``False`` on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending_blocks == 0, timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        """Puts what is queued (within ``timeout``), then stops the thread."""
        with self._changed:
            self._jobs.append(None)
            self._changed.notify_all()
        self._thread.join(timeout)

    def _fits(self, num_blocks: int) -> bool:
        # A job larger than the whole queue is still taken when the queue is empty.
        return self._pending_blocks == 0 or self._pending_blocks + num_blocks <= self.capacity

    def _serve(self) -> None:
        torch_ops_alone()
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._jobs))
                job = self._jobs.popleft()
            if job is None:
                return
            outcome = self._put(job)
            with self._changed:
                self._counts.update(outcome)
                self._pending_blocks -= len(job.keys)
                self._changed.notify_all()

    def _put(self, job: SaveJob) -> collections.Counter[str]:
        try:
            with self._device_work(job):
                statuses = self._client.put(
                    self._namespace, job.keys, list(job.blocks), parent=job.parent
                )
        except Exception as error:
            if not self._failing:  # one line per run of failures (a daemon away for a while)
                log.warning(
                    "saving %d blocks failed: %s (counted until a put succeeds)",
                    len(job.keys),
                    error,
                )
            self._failing = True
            return collections.Counter(failed=len(job.keys))
        self._failing = False
        names = {WriteStatus.STORED: "stored", WriteStatus.DEDUP: "dedup"}
        return collections.Counter(names.get(status, "refused") for status in statuses)

    def _device_work(self, job: SaveJob) -> contextlib.AbstractContextManager[object]:
        """Waits (this thread only) until ``job.ready`` fired; for blocks on CUDA, the put's
        copies then run on this thread's own stream, so that they neither queue behind the
        engine's next kernels nor hold them up."""
        if job.ready is not None:
            job.ready.synchronize()
        if not job.blocks.is_cuda:
            return contextlib.nullcontext()
        device = job.blocks.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        job.blocks.record_stream(stream)  # its memory is not reused before these copies end
        return torch.cuda.stream(stream)
