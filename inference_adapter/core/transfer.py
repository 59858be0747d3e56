"""Leased blocks into an engine's pages, one layer at a time, for every engine alike.

Both engines (ours, and vLLM's worker) describe an attention layer's pages as K and V views
``[num_pages, page_tokens, kv_heads, head_dim]`` (:class:`LayerKV`, any strides: token-major
like the stored layers, so pages that follow each other take one contiguous copy), and a load
as the blocks leased from the daemon (:class:`~kvstore.client.tensors.HostBlocks`: where they
lie in host memory) with, per block, the pages its parts go to (``pages``:
``[num_blocks, pages_per_block]`` int64, -1 where the engine computes the tokens itself; a
stored block is ``pages_per_block`` pages). :meth:`LayerWriter.write` puts layer ``i`` of
every block into its pages in one step:

- CUDA, blocks in registered host memory (the pinned arena, or a pinned download): one
  kernel launch reads them over the host link straight into the pages
  (:func:`~kvstore.kernels.transfer.load_layer`): no staging copy, no copy per block;
- CUDA, unregistered memory: the layer's slices are gathered on the host, sent in one copy,
  and the same kernel scatters them on the device;
- CPU: each run of consecutive pages is copied straight from the arena (one copy per byte),
  the copies of every layer planned once per load (one ``torch._foreach_copy_`` a layer).

On CUDA the work is queued on the current stream; the caller orders it and must not release
the lease before it is done. :class:`LayerSignals` is that ordering, the same for every
engine: made on the engine's thread, it gives the load a side stream that first waits for the
engine's stream (earlier users of the pages); after each layer the load records a CUDA event
there and sets the layer's flag, and the engine's wait for layer ``i`` makes its own stream
wait on event ``i`` (the host blocks only until the layer is queued, not done). It also says
who writes each layer: the load's thread in order, or, when the engine asks for a layer
nobody has begun (it got there first), the engine's own thread (``help``), so that waiting
for a layer never waits for another thread to wake up only to start it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.client import Namespace
from kvstore.client.tensors import HostBlocks
from kvstore.inference_adapter.core.timeline import DeviceEvent, HitTimeline
from kvstore.kernels.transfer import DeviceReadable, LayerCopies, load_layer

__all__ = [
    "WHOLE_LOAD_LAYER_BYTES",
    "LayerKV",
    "LayerSignals",
    "LayerWriter",
    "engine_layers",
    "staging_for",
]

# On the CPU, a load whose layer is smaller than this is written whole, every layer in one
# call by one thread: two threads taking turns per layer paid a GIL hand-off and a wake-up a
# layer (~30 us each here, against a ~40 us copy of a 256-token block's 512 KiB layer); from
# 2 MiB a layer the two threads copying side by side win (a 1K-token hit of a 1B-like
# model: 3.7-4.3 ms per layer, 4.9-5.4 ms whole).
WHOLE_LOAD_LAYER_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class LayerKV:
    """K and V views of one layer's pages: ``[num_pages, page_tokens, kv_heads, head_dim]``;
    ``pair`` is both at once, ``[2, num_pages, ...]`` (K at 0), when they are two equally
    strided halves of one tensor (a page run of K and V is then one copy)."""

    k: torch.Tensor
    v: torch.Tensor
    pair: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        """Tokens per page."""
        return self.k.size(1)


def engine_layers(kv_pool: torch.Tensor) -> list[LayerKV]:
    """Our engine's pool ``[num_layers, 2, num_pages, page_tokens, kv_heads, head_dim]`` as
    one :class:`LayerKV` per layer (views, no copy)."""
    return [LayerKV(layer[0], layer[1], layer) for layer in kv_pool]


@dataclass(frozen=True, slots=True)
class _Group:
    blocks: HostBlocks
    offsets: torch.Tensor  # [n] int64 byte offsets, on the pages' device
    pages: torch.Tensor  # [n, pages_per_block] int64, on the pages' device


class LayerWriter:
    """Writes layer after layer of leased blocks into their pages (see the module docstring).
    On the CPU each group's copies are planned once (:class:`~kvstore.kernels.transfer.
    LayerCopies`), so a layer costs one ``torch._foreach_copy_`` per group.

    Args:
        groups: ``(blocks, pages)`` per lease: the blocks and ``[len(blocks),
            pages_per_block]`` int64 pages for each (its leading rows when fewer blocks came).
        layers: The engine's layers, in model order.
        layer_bytes: Bytes of one layer of one block (the stored layout's).
    """

    def __init__(
        self,
        groups: Sequence[tuple[HostBlocks, torch.Tensor]],
        layers: Sequence[LayerKV],
        layer_bytes: int,
    ) -> None:
        self._layers = layers
        self._layer_bytes = layer_bytes
        device = layers[0].k.device
        chosen = [(blocks, pages[: len(blocks)]) for blocks, pages in groups if len(blocks)]
        self._copies = [] if device.type == "cuda" else [
            LayerCopies(blocks.source, list(blocks.offsets), layers[0].k, pages, layer_bytes)
            for blocks, pages in chosen
        ]  # fmt: skip
        self._groups = [] if device.type != "cuda" else [
            _Group(
                blocks,
                torch.tensor(blocks.offsets, dtype=torch.int64).to(device, non_blocking=True),
                pages.to(device, non_blocking=True),
            )
            for blocks, pages in chosen
        ]  # fmt: skip

    @property
    def whole(self) -> bool:
        """Whether the load is written whole (:meth:`write_many` of every layer at once):
        on the CPU, below ``WHOLE_LOAD_LAYER_BYTES`` a layer."""
        blocks = sum(copies.num_blocks for copies in self._copies)
        return bool(self._copies) and blocks * self._layer_bytes < WHOLE_LOAD_LAYER_BYTES

    def write_many(self, layers: Sequence[int]) -> None:
        """:meth:`write` of each of ``layers``; on the CPU in one call."""
        if not self._copies:
            for layer in layers:
                self.write(layer)
            return
        views = [(i, self._layers[i].k, self._layers[i].v, self._layers[i].pair) for i in layers]
        for copies in self._copies:
            copies.write_layers(views)

    def write(self, layer: int) -> None:
        """Layer ``layer`` of every block into its pages (queued on the current stream)."""
        target = self._layers[layer]
        for copies in self._copies:
            copies.write(layer, target.k, target.v, target.pair)
        start = layer * self._layer_bytes
        for group in self._groups:
            source, offsets = self._source(group, start, target.k.device)
            load_layer(source, offsets, target.k, target.v, group.pages)

    def _source(
        self, group: _Group, start: int, device: torch.device
    ) -> tuple[torch.Tensor | DeviceReadable, torch.Tensor]:
        """Where the kernel reads layer slices from, and their offsets."""
        blocks = group.blocks
        if blocks.mapped is not None:
            return blocks.mapped, group.offsets + start
        # Unregistered host memory: the layer's slices, gathered here, cross in one copy.
        size = self._layer_bytes
        slices = [blocks.source[at + start : at + start + size] for at in blocks.offsets]
        staged = torch.stack(slices).to(device).view(-1)
        offsets = torch.arange(len(slices), dtype=torch.int64, device=device) * size
        return staged, offsets


class LayerSignals:
    """Per layer of a load: who writes it, and "written" (a flag, and on CUDA the event the
    engine's stream waits on); see the module docstring.

    The load's thread writes every layer in order (:meth:`write_all`), once the blocks are in
    hand (:meth:`can_write`). With ``help``, an engine that waits for a layer no thread has
    begun writes it itself on its own thread, and, while the load's thread writes it, the
    next layer if nobody has begun it (:meth:`wait`): work that is due anyway, instead of
    waiting for a wake-up, so the hand-off costs no thread switch when the engine is ahead
    of the load. Each layer is written once, by whichever thread claims it first; a load
    given a ``whole`` writer (a small one on the CPU) is claimed and written all at once by
    whichever thread comes first (one hand-off a load, not one a layer). :meth:`stop` ends
    the writing: none begins after it, and it returns once those in flight are done (and,
    on CUDA, queued work has finished).

    Args:
        num_layers: Layers the load writes.
        help: Whether :meth:`wait` writes layers nobody has begun.
        timeline: Marked as each layer is written.
    """

    def __init__(
        self, num_layers: int, *, help: bool = False, timeline: HitTimeline | None = None
    ) -> None:
        self.num_layers = num_layers
        self.helped = 0  # layers the waiting thread wrote itself
        self._help = help
        self._timeline = timeline
        self._stream: torch.cuda.Stream | None = None
        self._events: list[torch.cuda.Event | None] = [None] * num_layers
        self._changed = threading.Condition()  # a layer was written, or writing stopped
        self._claimed = [False] * num_layers
        self._written = [False] * num_layers
        self._writing = 0  # writes in flight
        self._num_written = 0  # layers written (not only flagged)
        self._write: Callable[[int], None] | None = None
        self._whole: Callable[[Sequence[int]], None] | None = None
        self._stopped = False

    def after_engine(self, device: torch.device) -> None:
        """Call on the engine's thread before the first write, with the pages' device: on
        CUDA the writes then go on a side stream that first waits for what this thread's
        current stream queued so far (earlier users of the pages)."""
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._stream.wait_stream(torch.cuda.current_stream(device))
            if self._timeline is not None:  # the device's own times of each layer
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record(self._stream)
                events: Sequence[DeviceEvent | None] = self._events  # type: ignore[assignment]
                self._timeline.device_events = (start, events)  # type: ignore[assignment]

    def writing(self) -> contextlib.AbstractContextManager[object]:
        """The load's writes go on the side stream meanwhile (on the CPU: nothing)."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def can_write(
        self,
        write: Callable[[int], None],
        whole: Callable[[Sequence[int]], None] | None = None,
    ) -> None:
        """The blocks are in hand: ``write(layer)`` puts a layer into the pool, from now on
        on whichever thread claims it; with ``whole`` (``whole(layers)`` writes them all in
        one go), the first thread to write claims every layer and writes them at once."""
        with self._changed:
            self._write = write
            self._whole = whole

    def write(self, layer: int) -> bool:
        """Writes ``layer`` (every layer nobody claimed, with a ``whole`` writer) unless
        another thread claimed it, writing has stopped or cannot begin yet; then flags
        them. ``False`` when it did not write."""
        with self._changed:
            write, whole = self._write, self._whole
            if write is None or self._stopped or self._claimed[layer]:
                return False
            layers = [layer]
            if whole is not None:
                layers = [i for i in range(self.num_layers) if not self._claimed[i]]
            for i in layers:
                self._claimed[i] = True
            self._writing += 1
        written = False
        try:
            with self.writing():
                if whole is not None:
                    whole(layers)
                else:
                    write(layer)
                for i in layers:
                    self._record(i)
            if self._timeline is not None:  # before anyone may see them written
                for i in layers:
                    self._timeline.layer_ready(i)
            written = True
        finally:
            with self._changed:
                self._writing -= 1
                for i in layers:
                    self._written[i] = written or self._written[i]
                self._num_written += written * len(layers)
                self._changed.notify_all()
        return True

    def write_all(self) -> bool:
        """Writes, in order, every layer nobody has claimed; ``False`` once stopped."""
        for layer in range(self.num_layers):
            self.write(layer)
            if self._stopped:
                return False
        return True

    def _record(self, layer: int) -> None:
        if self._stream is not None:
            timed = self._timeline is not None
            event = torch.cuda.Event(enable_timing=timed)  # type: ignore[no-untyped-call]
            event.record(self._stream)
            self._events[layer] = event

    @property
    def complete(self) -> bool:
        """Whether every layer was written (nothing can write any more)."""
        return self._num_written == self.num_layers

    def release_all(self) -> None:
        """Flags every layer (the load failed or ended early): nobody waits any more."""
        with self._changed:
            self._written = [True] * self.num_layers
            self._changed.notify_all()

    def wait(self, layer: int, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for layer ``layer`` (with ``help``, writing what
        it can meanwhile: see the class docstring); once it is written, the caller's current
        stream waits for the layer's event. ``False`` on timeout.

        Raises:
            Exception: what a write raised, when this thread wrote it.
        """
        if self._help:
            self._write_or_next(layer)
        if not self._written[layer]:
            with self._changed:
                if not self._changed.wait_for(lambda: self._written[layer], timeout):
                    return False
        event = self._events[layer]
        if event is not None and self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(event)
        return True

    def _write_or_next(self, layer: int) -> None:
        """Writes ``layer`` if nobody has begun it; else, while the load's thread writes
        it, the next layer if nobody has begun that one (one at most: an engine with work
        of its own gets back to it)."""
        if self._written[layer]:
            return
        if self.write(layer) or (layer + 1 < self.num_layers and self.write(layer + 1)):
            self.helped += 1

    def stop(self) -> None:
        """No write begins after this; returns once those in flight are done and, on CUDA,
        the work they queued has finished (before a lease ends, or before the engine
        recomputes pages a cancelled load was writing)."""
        with self._changed:
            self._stopped = True
            self._changed.wait_for(lambda: not self._writing)
        self.synchronize()

    def synchronize(self) -> None:
        """Returns once every write queued so far is done."""
        if self._stream is not None:
            self._stream.synchronize()


def staging_for(
    namespace: Namespace, num_blocks: int, device: torch.device | str, *, pinned: bool = False
) -> torch.Tensor:
    """An empty staging buffer ``[num_blocks, num_layers, 2, block_tokens, kv_heads,
    head_dim]`` (the stored layout with a block axis); ``pinned``: page-locked host memory."""
    model = namespace.model
    shape = (num_blocks, *model.layout().shape)
    dtype = getattr(torch, model.dtype)
    return torch.empty(shape, dtype=dtype, device=device, pin_memory=pinned)
