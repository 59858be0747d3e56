"""Layer-wise loading of stored blocks into the engine's paged pool.

One :class:`LayerLoad` per request moves the blocks the store holds for its prompt into the
pages the engine reserved, one layer at a time, on a worker thread, while the engine computes:

1. fetch: on the shared-memory plane, lease the blocks in the daemon's arena
   (``view_tensors``: no copy yet); on the stream plane, download them into ``staging``;
2. per layer ``i``: copy layer ``i`` of every block into ``staging[:, i]`` (the arena ->
   device transfer of the real thing), then ``load_blocks(staging[:, i:i+1], ...)`` scatters
   it into the pool and sets ``ready[i]``. The engine computes layer ``i - 1`` meanwhile.
   Stored K is after RoPE, at the positions it was computed at: a prefix hit is a plain
   copy, bit for bit what the engine computed. Blocks placed elsewhere (a truncated chat)
   have K re-rotated by the shift first (:func:`move_k`);
3. ``wait(i)`` returns once layer ``i`` is in the pool; ``False`` when the load failed or its
   deadline passed. Then :meth:`LayerLoad.cancel` has already run: nothing touches the pool
   any more (a layer copy holds ``_pool_lock``; cancelling takes it), so the engine may
   recompute into the same pages. When the daemon hands back only a leading part of the
   blocks (the rest was evicted since the lookup), that part is loaded and ``num_blocks``
   says how much from the moment layer 0 is ready; the engine computes the rest. None at
   all is a failure.

CUDA: all of a load's device work (the arena -> staging copies and the scatter) runs on a side
stream that first waits for the engine's stream; each layer records a CUDA event that the
engine's stream waits on (``wait`` enqueues the wait; it does not synchronise the host).
This path is written for CUDA but only the CPU path is exercised by the tests. On the CPU a
copy is done when ``load_blocks`` returns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.client import KVStoreClient, Namespace
from kvstore.kernels import RopeTables, apply_rope, load_blocks

__all__ = [
    "LayerLoad",
    "PoolHandles",
    "block_positions",
    "block_slots",
    "move_k",
    "staging_for",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolHandles:
    """The engine-side tensors a connector reads and writes."""

    kv_pool: torch.Tensor  # [num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]
    page_tokens: int
    rope: RopeTables  # on kv_pool's device, covering every position the engine uses

    @property
    def num_layers(self) -> int:
        return self.kv_pool.size(0)


def block_slots(pages: Sequence[int], blocks: Sequence[int], pool: PoolHandles) -> torch.Tensor:
    """Pool slots of whole blocks ``blocks`` of a sequence (block size = page size).

    Returns:
        ``[len(blocks), page_tokens]`` int64 on the pool's device.
    """
    device = pool.kv_pool.device
    page_ids = torch.tensor([pages[b] for b in blocks], dtype=torch.int64, device=device)
    rows = torch.arange(pool.page_tokens, dtype=torch.int64, device=device)
    return page_ids[:, None] * pool.page_tokens + rows[None, :]


def block_positions(starts: Sequence[int], block_tokens: int, device: torch.device) -> torch.Tensor:
    """Positions of the tokens of blocks starting at ``starts``: ``[len(starts), block_tokens]``."""
    first = torch.tensor(list(starts), dtype=torch.int64, device=device)
    return first[:, None] + torch.arange(block_tokens, dtype=torch.int64, device=device)[None, :]


def move_k(
    k: torch.Tensor, stored_at: torch.Tensor, positions: torch.Tensor, rope: RopeTables
) -> torch.Tensor:
    """K rotated to ``stored_at``, re-rotated to ``positions`` (one rounding: float32 between).

    Args:
        k: ``[..., block_tokens, head_dim]``, K after RoPE.
        stored_at: Positions K is rotated to, broadcastable to ``k.shape[:-1]``.
        positions: Where the tokens sit now, the same shape.
        rope: The tables K was rotated with.

    Returns:
        A new tensor like ``k``; tokens whose position is unchanged keep their bits.
    """
    back = apply_rope(k.float(), stored_at, rope, inverse=True)
    moved = apply_rope(back, positions, rope).to(k.dtype)
    return torch.where((stored_at == positions)[..., None], k, moved)


def staging_for(namespace: Namespace, num_blocks: int, device: torch.device) -> torch.Tensor:
    """An empty staging buffer ``[num_blocks, num_layers, 2, kv_heads, block_tokens, head_dim]``."""
    model = namespace.model
    shape = (num_blocks, model.num_layers, 2, model.num_kv_heads, model.block_tokens)
    return torch.empty((*shape, model.head_dim), dtype=getattr(torch, model.dtype), device=device)


class LayerLoad:
    """Loads ``keys`` into pool ``slots``, layer by layer; see the module docstring.

    Args:
        client: The daemon's client.
        namespace: The model and tenant of the blocks.
        pool: The engine's pool and RoPE tables.
        keys: The blocks to load, in order.
        slots: ``[len(keys), block_tokens]`` int64, where each token goes in the pool.
        moves: ``(stored_at, positions)``, each ``[len(keys), block_tokens]`` int64: the
            positions each token's K was stored at and the one it has now; None when every
            block goes back where it was computed (a prefix hit: a plain copy).
        deadline: ``time.monotonic()`` after which waiting gives up.
        on_fetched: Called once on the worker thread when the blocks are leased (or
            downloaded), before the first layer is copied; also when the fetch fails.
    """

    def __init__(
        self,
        client: KVStoreClient,
        namespace: Namespace,
        pool: PoolHandles,
        keys: Sequence[bytes],
        slots: torch.Tensor,
        moves: tuple[torch.Tensor, torch.Tensor] | None,
        deadline: float,
        on_fetched: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self._on_fetched = on_fetched
        self._namespace = namespace
        self._pool = pool
        self._keys = list(keys)
        self._slots = slots
        self._moves = moves
        self.deadline = deadline
        self.ready = [threading.Event() for _ in range(pool.num_layers)]
        self.failed = False
        self.num_blocks = len(self._keys)  # loaded (a prefix when the daemon gave fewer)
        self._cancelled = False
        self._pool_lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        if pool.kv_pool.is_cuda:
            self._stream = torch.cuda.Stream(pool.kv_pool.device)  # type: ignore[no-untyped-call]
            # Work the engine queued so far (these slot tensors, earlier users of the pages)
            # comes first.
            self._stream.wait_stream(torch.cuda.current_stream(pool.kv_pool.device))
        self._cuda_events: list[torch.cuda.Event] = []

    def run(self) -> None:
        """Fetches and copies every layer (on a worker thread); failures end in ``failed``."""
        device_work = (
            torch.cuda.stream(self._stream)
            if self._stream is not None
            else contextlib.nullcontext()
        )
        try:
            with device_work:
                staging = staging_for(self._namespace, len(self._keys), self._pool.kv_pool.device)
                if self._client.data_plane == "shm":
                    self._run_from_arena(staging)
                else:
                    self._run_from_stream(staging)
        except Exception:
            log.warning(
                "loading %d blocks failed; the engine recomputes", len(self._keys), exc_info=True
            )
            self._fail()
        finally:
            self._fetched()

    def wait(self, layer: int) -> bool:
        """Blocks until ``layer`` is in the pool; ``False`` (and the load cancelled) on a
        failure or past the deadline."""
        ready = self.ready[layer].wait(max(0.0, self.deadline - time.monotonic()))
        if ready and not self.failed:
            if self._stream is not None:
                stream = torch.cuda.current_stream(self._pool.kv_pool.device)
                stream.wait_event(self._cuda_events[layer])
            return True
        self.cancel()
        return False

    def cancel(self) -> None:
        """Stops the load; once this returns, the loader never writes the pool again."""
        with self._pool_lock:
            self._cancelled = True
            self.failed = True
        if self._stream is not None:
            self._stream.synchronize()  # copies already queued must land before a recompute
        for event in self.ready:
            event.set()

    def _run_from_arena(self, staging: torch.Tensor) -> None:
        layer_bytes = self._namespace.model.layout().layer_bytes
        with self._client.view_tensors(self._namespace, self._keys) as views:
            self._found(len(views))
            self._fetched()
            for layer in range(self._pool.num_layers):
                start = layer * layer_bytes
                for block, view in enumerate(views):
                    # [layer_bytes] uint8 of the arena -> staging[block, layer] on the device
                    staging[block, layer].view(-1).view(torch.uint8).copy_(
                        view[start : start + layer_bytes], non_blocking=True
                    )
                if not self._write_layer(staging, layer):
                    break
            if self._stream is not None:
                self._stream.synchronize()  # the arena slots are released on exit

    def _run_from_stream(self, staging: torch.Tensor) -> None:
        got = self._client.get(self._namespace, self._keys, out=list(staging))
        self._found(len(got))
        self._fetched()
        for layer in range(self._pool.num_layers):
            if not self._write_layer(staging, layer):
                break

    def _write_layer(self, staging: torch.Tensor, layer: int) -> bool:
        """Scatters layer ``layer`` of ``staging`` into the pool; ``False`` once cancelled."""
        with self._pool_lock:
            if self._cancelled:
                return False
            self._load(staging, layer)
            if self._stream is not None:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
                self._cuda_events.append(event)
        self.ready[layer].set()
        return True

    def _load(self, staging: torch.Tensor, layer: int) -> None:
        n = self.num_blocks
        blocks = staging[:n, layer : layer + 1]  # [n, 1, 2, kv_heads, block_tokens, head_dim]
        if self._moves is not None:
            stored_at, positions = (p[:n, None, :] for p in self._moves)  # over heads
            blocks[:, 0, 0] = move_k(blocks[:, 0, 0], stored_at, positions, self._pool.rope)
        load_blocks(blocks, self._pool.kv_pool[layer : layer + 1], self._slots[:n])

    def _fetched(self) -> None:
        callback, self._on_fetched = self._on_fetched, None
        if callback is not None:
            callback()

    def _found(self, found: int) -> None:
        """The daemon gave the first ``found`` blocks: load those (none is a failure)."""
        if not found:
            raise LookupError(f"the daemon gave none of {len(self._keys)} blocks (evicted?)")
        if found < len(self._keys):
            log.info(
                "the daemon gave %d of %d blocks (evicted?); loading those", found, len(self._keys)
            )
        self.num_blocks = found

    def _fail(self) -> None:
        self.failed = True
        for event in self.ready:
            event.set()
