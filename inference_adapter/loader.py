"""Layer-wise loading of stored blocks into our engine's paged pool.

One :class:`LayerLoad` per request moves the blocks the store holds for its prompt into the
pages the engine reserved, one layer at a time, on a worker thread, while the engine computes:

1. fetch, as soon as the lookup answered (before the engine schedules the request, so it
   overlaps the wait in the queue): lease the blocks (``host_blocks``: the arena itself on
   the shared-memory plane, one download otherwise); no byte is copied yet. The blocks then
   wait for :meth:`LayerLoad.start` to name the pages (at most ``hold_s``, within the
   lease);
2. per layer ``i``: the engine-neutral
   :class:`~kvstore.inference_adapter.core.transfer.LayerWriter` writes layer ``i`` of every
   block into its pages (a stored block is ``block_tokens // page_tokens`` pages): on CUDA
   one kernel reading the registered arena over the host link, on the CPU one copy per page
   straight from the arena. Then layer ``i`` is flagged ready. The
   engine computes layer ``i - 1`` meanwhile. Stored K is after RoPE, at the positions it
   was computed at: a prefix hit is a plain copy, bit for bit what the engine computed.
   Blocks placed elsewhere (a truncated chat) are downloaded into a staging buffer and have
   K re-rotated by the shift first (:func:`move_k`);
3. ``wait(i)`` returns once layer ``i`` is in the pool; ``False`` when the load failed or its
   deadline passed. Then :meth:`LayerLoad.cancel` has already run: nothing touches the pool
   any more (a layer copy holds ``_pool_lock``; cancelling takes it), so the engine may
   recompute into the same pages. When the daemon hands back only a leading part of the
   blocks (the rest was evicted since the lookup), that part is loaded and ``num_blocks``
   says how much from the moment layer 0 is ready; the engine computes the rest. None at
   all is a failure.

CUDA: a load's layer copies run on a side stream that ``start`` makes wait for the engine's
stream; each layer records a CUDA event that the engine's stream waits on (``wait`` enqueues
the wait; it does not synchronise the host):
:class:`~kvstore.inference_adapter.core.transfer.LayerSignals`, as in vLLM's worker. The
lease ends only once the side stream is done.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.client import KVStoreClient, Namespace
from kvstore.client.tensors import HostBlocks
from kvstore.inference_adapter.core.transfer import (
    LayerSignals,
    LayerWriter,
    engine_layers,
    staging_for,
)
from kvstore.kernels.dispatch import load_blocks
from kvstore.kernels.rope import RopeTables, apply_rope

__all__ = [
    "LayerLoad",
    "PoolHandles",
    "block_pages",
    "block_positions",
    "move_k",
    "page_slots",
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


def block_pages(pages: Sequence[int], blocks: range, per_block: int) -> torch.Tensor:
    """The pool pages of the consecutive blocks ``blocks`` of a sequence whose pages are
    ``pages``.

    Returns:
        ``[len(blocks), per_block]`` int64 (CPU): block ``b`` is pages
        ``pages[b * per_block : (b + 1) * per_block]``.
    """
    chosen = pages[blocks.start * per_block : blocks.stop * per_block]
    return torch.tensor(chosen, dtype=torch.int64).view(len(blocks), per_block)


def page_slots(block_pages: torch.Tensor, pool: PoolHandles) -> torch.Tensor:
    """Pool slots of every token of blocks laid on ``block_pages`` (``[n, per_block]``).

    Returns:
        ``[n, per_block * page_tokens]`` int64 on the pool's device.
    """
    n = block_pages.size(0)
    rows = torch.arange(pool.page_tokens, dtype=torch.int64)
    slots = block_pages[:, :, None] * pool.page_tokens + rows
    return slots.view(n, -1).to(pool.kv_pool.device)


def block_positions(starts: Sequence[int], block_tokens: int, device: torch.device) -> torch.Tensor:
    """Positions of the tokens of blocks starting at ``starts``: ``[len(starts), block_tokens]``."""
    first = torch.tensor(list(starts), dtype=torch.int64, device=device)
    return first[:, None] + torch.arange(block_tokens, dtype=torch.int64, device=device)[None, :]


def move_k(
    k: torch.Tensor, stored_at: torch.Tensor, positions: torch.Tensor, rope: RopeTables
) -> torch.Tensor:
    """K rotated to ``stored_at``, re-rotated to ``positions`` (one rounding: float32 between).

    Args:
        k: ``[..., head_dim]``, K after RoPE.
        stored_at: Positions K is rotated to, broadcastable to ``k.shape[:-1]``.
        positions: Where the tokens sit now, the same shape.
        rope: The tables K was rotated with.

    Returns:
        A new tensor like ``k``; tokens whose position is unchanged keep their bits.
    """
    back = apply_rope(k.float(), stored_at, rope, inverse=True)
    moved = apply_rope(back, positions, rope).to(k.dtype)
    return torch.where((stored_at == positions)[..., None], k, moved)


class LayerLoad:
    """Fetches ``keys`` now and loads them into pool pages handed over later, layer by
    layer; see the module docstring.

    ``run`` (on a worker thread) leases the blocks (or downloads them) at once, then waits
    for :meth:`start` to name the pages: the lease is taken when the request is looked up,
    not when the engine schedules it. Fetched blocks wait ``hold_s`` at most; then they are
    let go (the lease ends) and ``start`` answers ``False``.

    Args:
        client: The daemon's client.
        namespace: The model and tenant of the blocks.
        pool: The engine's pool and RoPE tables.
        keys: The blocks to fetch, in order (``start`` may load fewer).
        moves: ``(stored_at, positions)``, each ``[len(keys), block_tokens]`` int64: the
            positions each token's K was stored at and the one it has now; None when every
            block goes back where it was computed (a prefix hit: a plain copy).
        hold_s: How long fetched blocks wait for ``start`` (keep it within the lease).
        on_fetched: Called once on the worker thread when the blocks are leased (or
            downloaded), before the first layer is copied; also when the fetch fails.
    """

    def __init__(
        self,
        client: KVStoreClient,
        namespace: Namespace,
        pool: PoolHandles,
        keys: Sequence[bytes],
        moves: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        hold_s: float,
        on_fetched: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self._on_fetched = on_fetched
        self._namespace = namespace
        self._pool = pool
        self._keys = list(keys)
        self._moves = moves
        self._hold_s = hold_s
        self.deadline = math.inf  # set by start
        self._signals = LayerSignals(pool.num_layers)
        self.failed = False
        self.num_blocks = len(self._keys)  # loaded (fewer when the daemon or start says so)
        self._cancelled = False
        self._let_go = False  # nobody started the load within hold_s: the blocks are gone
        self._pool_lock = threading.Lock()
        self._given = threading.Event()  # start or cancel ran
        self._pages: torch.Tensor | None = None

    def start(self, pages: torch.Tensor, deadline: float) -> bool:
        """Loads the first ``len(pages)`` blocks into ``pages`` (``[n, block_tokens //
        page_tokens]`` int64, :func:`block_pages`) once fetched, ``wait`` giving up after
        ``deadline`` (``time.monotonic()``). Call it on the engine's thread: on CUDA the
        copies are ordered after the work it queued so far (earlier users of the pages).

        Returns:
            ``False`` when the fetched blocks were already let go (or the load cancelled):
            nothing is written; fetch again.
        """
        with self._pool_lock:
            if self._let_go or self._cancelled or self._given.is_set():
                return False
            self._pages = pages
            self.num_blocks = min(self.num_blocks, pages.size(0))
            self.deadline = deadline
            self._signals.after_engine(self._pool.kv_pool.device)
            self._given.set()
        return True

    def run(self) -> None:
        """Fetches, waits for ``start``, copies every layer (on a worker thread); failures
        end in ``failed``."""
        try:
            if self._moves is None:
                self._run_in_place()
            else:
                self._run_moved(self._moves)
        except Exception:
            if self._cancelled:  # the engine took another path: nothing waits for this one
                log.debug("a cancelled load of %d blocks ended", len(self._keys), exc_info=True)
            else:
                log.warning(
                    "loading %d blocks failed; the engine recomputes", len(self._keys),
                    exc_info=True,
                )  # fmt: skip
            self._fail()
        finally:
            self._fetched()

    def wait(self, layer: int) -> bool:
        """Blocks until ``layer`` is in the pool; ``False`` (and the load cancelled) on a
        failure or past the deadline."""
        timeout = max(0.0, self.deadline - time.monotonic())
        if self._signals.wait(layer, timeout) and not self.failed:
            return True
        self.cancel()
        return False

    def cancel(self) -> None:
        """Stops the load; once this returns, the loader never writes the pool again."""
        with self._pool_lock:
            self._cancelled = True
            self.failed = True
            self._given.set()  # a fetch waiting for pages lets its blocks go
        self._signals.synchronize()  # copies already queued must land before a recompute
        self._signals.release_all()

    def _run_in_place(self) -> None:
        """A prefix hit: every layer straight from where the blocks lie into the pages."""
        layer_bytes = self._namespace.model.layout().layer_bytes
        with self._client.host_blocks(self._namespace, self._keys) as leased:
            self._found(len(leased))
            self._fetched()
            pages = self._wait_for_pages()
            if pages is None:
                return
            n = self.num_blocks
            blocks = HostBlocks(leased.source, leased.offsets[:n], leased.mapped)
            with self._signals.writing():
                writer = LayerWriter(
                    [(blocks, pages)], engine_layers(self._pool.kv_pool), layer_bytes
                )
                for layer in range(self._pool.num_layers):
                    if not self._write_layer(layer, writer.write):
                        break
            self._signals.synchronize()  # the lease ends on exit

    def _run_moved(self, moves: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Blocks placed elsewhere than they were computed: downloaded into a staging
        buffer, K re-rotated by the shift, then scattered layer by layer."""
        device = self._pool.kv_pool.device
        staging = staging_for(self._namespace, len(self._keys), device)
        download = None  # on CUDA a stream of its own: this thread's default one would queue
        if device.type == "cuda":  # behind the engine's work
            download = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        got = self._client.get(self._namespace, self._keys, out=list(staging), stream=download)
        self._found(len(got))
        self._fetched()
        pages = self._wait_for_pages()
        if pages is None:
            return
        n = self.num_blocks
        slots = page_slots(pages[:n], self._pool)
        stored_at, positions = (p[:n, :, None] for p in moves)  # over heads

        def write(layer: int) -> None:
            blocks = staging[:n, layer : layer + 1]  # [n, 1, 2, tokens, kv_heads, head_dim]
            blocks[:, 0, 0] = move_k(blocks[:, 0, 0], stored_at, positions, self._pool.rope)
            load_blocks(blocks, self._pool.kv_pool[layer : layer + 1], slots)

        try:
            with self._signals.writing():
                for layer in range(self._pool.num_layers):
                    if not self._write_layer(layer, write):
                        break
        finally:
            # ``staging`` goes back to the caching allocator on return, on this thread's
            # stream: the side stream must have read it by then, or new work could reuse it.
            self._signals.synchronize()

    def _wait_for_pages(self) -> torch.Tensor | None:
        """The pages ``start`` named; None when it did not within ``hold_s`` (the blocks are
        let go) or the load was cancelled."""
        self._given.wait(self._hold_s)
        with self._pool_lock:
            if not self._given.is_set():
                self._let_go = True
            if self._let_go or self._cancelled:
                return None
            return self._pages

    def _write_layer(self, layer: int, write: Callable[[int], None]) -> bool:
        """``write(layer)`` into the pool, then ``ready[layer]``; ``False`` once cancelled."""
        with self._pool_lock:
            if self._cancelled:
                return False
            write(layer)
            self._signals.written(layer)
        return True

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
        with self._pool_lock:
            self.num_blocks = min(self.num_blocks, found)

    def _fail(self) -> None:
        self.failed = True
        self._signals.release_all()
