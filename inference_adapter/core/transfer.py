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
- CPU: each run of consecutive pages is copied straight from the arena (one copy per byte).

On CUDA the work is queued on the current stream; the caller orders it and must not release
the lease before it is done. :class:`LayerSignals` is that ordering, the same for every
engine: made on the engine's thread, it gives the load a side stream that first waits for the
engine's stream (earlier users of the pages); after each layer the load records a CUDA event
there and sets the layer's flag, and the engine's wait for layer ``i`` makes its own stream
wait on event ``i`` (the host blocks only until the layer is queued, not done).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.client import Namespace
from kvstore.client.tensors import HostBlocks
from kvstore.kernels.transfer import DeviceReadable, load_layer

__all__ = ["LayerKV", "LayerSignals", "LayerWriter", "engine_layers", "staging_for"]


@dataclass(frozen=True, slots=True)
class LayerKV:
    """K and V views of one layer's pages: ``[num_pages, page_tokens, kv_heads, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        """Tokens per page."""
        return self.k.size(1)


def engine_layers(kv_pool: torch.Tensor) -> list[LayerKV]:
    """Our engine's pool ``[num_layers, 2, num_pages, page_tokens, kv_heads, head_dim]`` as
    one :class:`LayerKV` per layer (views, no copy)."""
    return [LayerKV(layer[0], layer[1]) for layer in kv_pool]


@dataclass(frozen=True, slots=True)
class _Group:
    blocks: HostBlocks
    offsets: torch.Tensor  # [n] int64 byte offsets, on the pages' device
    pages: torch.Tensor  # [n, pages_per_block] int64, on the pages' device


class LayerWriter:
    """Writes layer after layer of leased blocks into their pages (see the module docstring).

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
        self._groups = [
            _Group(
                blocks,
                torch.tensor(blocks.offsets, dtype=torch.int64).to(device, non_blocking=True),
                pages[: len(blocks)].to(device, non_blocking=True),
            )
            for blocks, pages in groups
            if len(blocks)
        ]

    @property
    def direct(self) -> bool:
        """Whether every block is read by the device where it lies (registered memory)."""
        on_cuda = self._layers[0].k.is_cuda
        return not on_cuda or all(g.blocks.mapped is not None for g in self._groups)

    def write(self, layer: int) -> None:
        """Layer ``layer`` of every block into its pages (queued on the current stream)."""
        target = self._layers[layer]
        start = layer * self._layer_bytes
        for group in self._groups:
            source, offsets = self._source(group, start, target.k.device)
            load_layer(source, offsets, target.k, target.v, group.pages)

    def _source(
        self, group: _Group, start: int, device: torch.device
    ) -> tuple[torch.Tensor | DeviceReadable, torch.Tensor]:
        """Where the kernel (or the reference) reads layer slices from, and their offsets."""
        blocks = group.blocks
        if device.type != "cuda":
            return blocks.source, group.offsets + start
        if blocks.mapped is not None:
            return blocks.mapped, group.offsets + start
        # Unregistered host memory: the layer's slices, gathered here, cross in one copy.
        size = self._layer_bytes
        slices = [blocks.source[at + start : at + start + size] for at in blocks.offsets]
        staged = torch.stack(slices).to(device).view(-1)
        offsets = torch.arange(len(slices), dtype=torch.int64, device=device) * size
        return staged, offsets


class LayerSignals:
    """Per layer, "written": a flag the load thread sets, and on CUDA the event the engine's
    stream waits on (see the module docstring).

    Args:
        num_layers: Layers the load writes.
    """

    def __init__(self, num_layers: int) -> None:
        self.ready = [threading.Event() for _ in range(num_layers)]
        self._stream: torch.cuda.Stream | None = None
        self._events: list[torch.cuda.Event | None] = [None] * num_layers

    def after_engine(self, device: torch.device) -> None:
        """Call on the engine's thread before the first write, with the pages' device: on
        CUDA the writes then go on a side stream that first waits for what this thread's
        current stream queued so far (earlier users of the pages)."""
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._stream.wait_stream(torch.cuda.current_stream(device))

    def writing(self) -> contextlib.AbstractContextManager[object]:
        """The load's writes go on the side stream meanwhile (on the CPU: nothing)."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def written(self, layer: int) -> None:
        """Layer ``layer`` is queued: its event is recorded after it, then its flag set."""
        if self._stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
            self._events[layer] = event
        self.ready[layer].set()

    def release_all(self) -> None:
        """Sets every flag (the load failed or ended early): nobody waits any more."""
        for flag in self.ready:
            flag.set()

    def wait(self, layer: int, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for layer ``layer``'s flag; once it is set and the
        layer was written, the caller's current stream waits for the layer's event. ``False``
        on timeout."""
        if not self.ready[layer].wait(timeout):
            return False
        event = self._events[layer]
        if event is not None and self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(event)
        return True

    def synchronize(self) -> None:
        """Returns once every write queued so far is done (before a lease ends, or before
        the engine recomputes pages a cancelled load was writing)."""
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
