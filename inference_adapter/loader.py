"""Layer-wise loading of stored blocks into our engine's paged pool.

One :class:`LayerLoad` per request moves the blocks the store holds for its prompt into the
pages the engine reserved, one layer at a time, while the engine computes:

1. fetch: the blocks the lookup leased (``client.find``: the leading ones in the arena, in
   the lookup's own round trip) are in hand at once; the rest, if any, are leased (and moved
   up into the arena) or downloaded by the load's worker thread as soon as the lookup
   answered, before the engine schedules the request, so it overlaps the wait in the queue.
   No byte is copied yet. The blocks then wait for :meth:`LayerLoad.start` to name the
   pages (at most ``hold_s``, within the lease);
2. per layer ``i``: the engine-neutral
   :class:`~kvstore.inference_adapter.core.transfer.LayerWriter` writes layer ``i`` of every
   block into its pages (a stored block is ``block_tokens // page_tokens`` pages): on CUDA
   one kernel reading the registered arena over the host link, on the CPU one copy per run
   of pages straight from the arena. Then layer ``i`` is flagged ready. The worker thread
   writes the layers in order while the engine computes; the engine's own thread writes a
   layer it waits for that the worker has not begun (it got there first: no thread
   wake-up per layer). Stored K is after RoPE, at the positions it was computed at: a
   prefix hit is a plain copy, bit for bit what the engine computed. Blocks placed
   elsewhere (a truncated chat) are downloaded into a staging buffer and have K re-rotated
   by the shift first (:func:`move_k`);
3. ``wait(i)`` returns once layer ``i`` is in the pool; ``False`` when the load failed or its
   deadline passed. Then :meth:`LayerLoad.cancel` has already run: nothing touches the pool
   any more (no write begins once cancelling started, and it waits for those in flight), so
   the engine may recompute into the same pages. When the daemon hands back only a leading
   part of the blocks (the rest was evicted since the lookup), that part is loaded and
   ``num_blocks`` says how much from the moment layer 0 is ready; the engine computes the
   rest. None at all is a failure.

CUDA: a load's layer copies run on a side stream that ``start`` makes wait for the engine's
stream; each layer records a CUDA event that the engine's stream waits on (``wait`` enqueues
the wait; it does not synchronise the host):
:class:`~kvstore.inference_adapter.core.transfer.LayerSignals`, as in vLLM's worker. The
leases end only once the side stream is done.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvstore.client import Found, KVStoreClient, Namespace
from kvstore.client.tensors import HostBlocks
from kvstore.inference_adapter.core.timeline import HitTimeline, now
from kvstore.inference_adapter.core.transfer import (
    LayerKV,
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
    layers: list[LayerKV] = field(init=False)  # the pool's layers as views, made once

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", engine_layers(self.kv_pool))

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
    """Loads ``keys`` into pool pages handed over later, layer by layer; see the module
    docstring.

    ``run`` (on a worker thread) gets the blocks: those ``found`` leased at the lookup are in
    hand already; the rest are leased (or downloaded) now. It then waits for :meth:`start` to
    name the pages and writes every layer nobody has begun; the engine's :meth:`wait` writes
    a layer itself when it gets there first. Blocks in hand wait ``hold_s`` at most for
    ``start``; then they are let go (the lease ends) and ``start`` answers ``False``.

    Args:
        client: The daemon's client.
        namespace: The model and tenant of the blocks.
        pool: The engine's pool and RoPE tables.
        keys: The blocks to load, in order (``start`` may load fewer).
        moves: ``(stored_at, positions)``, each ``[len(keys), block_tokens]`` int64: the
            positions each token's K was stored at and the one it has now; None when every
            block goes back where it was computed (a prefix hit: a plain copy).
        hold_s: How long fetched blocks wait for ``start`` (keep it within the lease).
        on_fetched: Called once on the worker thread when every block is leased (or
            downloaded), before the first layer is copied; also when the fetch fails.
        timeline: Marked when the lease is answered and as each layer is in the pool.
        found: The lookup that leased the leading blocks (``client.find``), if any: its lease
            is this load's, ended with it.
        help: Whether the engine's thread writes a layer it waits for that nobody has begun.
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
        timeline: HitTimeline | None = None,
        found: Found | None = None,
        help: bool = True,
    ) -> None:
        self._client = client
        self._on_fetched = on_fetched
        self._timeline = timeline
        self._namespace = namespace
        self._pool = pool
        self._keys = list(keys)
        self._moves = moves
        self._hold_s = hold_s
        self._found = found
        self.deadline = math.inf  # set by start
        self._signals = LayerSignals(pool.num_layers, help=help, timeline=timeline)
        self.failed = False
        self.num_blocks = len(self._keys)  # loaded (fewer when the daemon or start says so)
        self._cancelled = False
        self._let_go = False  # nobody started the load within hold_s: the blocks are gone
        self._lock = threading.Lock()
        self._given = threading.Event()  # start or cancel ran
        self._pages: torch.Tensor | None = None
        self._source: _Source | None = None  # the blocks in hand, once they are
        self._writable = False  # the pages and the blocks are known: layers may be written
        self._running = False  # run() began
        self._fetched_at = time.monotonic()
        if moves is None and found is not None and found.num_leased >= len(self._keys):
            self._source = _Leased([found.host_blocks()])  # the engine may write at once

    @property
    def in_hand(self) -> bool:
        """Whether every block is leased already (the lookup leased them): ``run`` has
        nothing to fetch, so it need only start once the load does."""
        return self._source is not None

    def start(self, pages: torch.Tensor, deadline: float) -> bool:
        """Loads the first ``len(pages)`` blocks into ``pages`` (``[n, block_tokens //
        page_tokens]`` int64, :func:`block_pages`), ``wait`` giving up after ``deadline``
        (``time.monotonic()``). Call it on the engine's thread: on CUDA the copies are
        ordered after the work it queued so far (earlier users of the pages).

        Returns:
            ``False`` when the fetched blocks were already let go (or the load cancelled):
            nothing is written; fetch again.
        """
        with self._lock:
            if not self._running and time.monotonic() - self._fetched_at > self._hold_s:
                self._let_go = True  # in hand too long, with nobody waiting: let them go
            refused = self._let_go or self._cancelled or self._given.is_set()
            orphan = self._take_found() if refused and not self._running else None
            if not refused:
                self._pages = pages
                self.num_blocks = min(self.num_blocks, pages.size(0))
                self.deadline = deadline
                self._signals.after_engine(self._pool.kv_pool.device)
                self._given.set()
                self._ready()
        self._release(orphan)  # refused, and no run() will end the lease
        return not refused

    def run(self) -> None:
        """Gets the blocks, waits for ``start``, writes every layer not yet written (on a
        worker thread), then ends the leases; failures end in ``failed``."""
        with self._lock:
            self._running = True
        try:
            with contextlib.ExitStack() as held:
                held.callback(self._release_found)
                source = self._source or self._fetch(held)
                held.callback(self._signals.stop)  # first on exit: no write reads the leases
                self._fetched()
                if self._wait_for_pages(source):
                    self._signals.write_all()
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
        """Blocks until ``layer`` is in the pool (writing it here when the load's thread has
        not begun it); ``False`` (and the load cancelled) on a failure or past the
        deadline."""
        timeout = max(0.0, self.deadline - time.monotonic())
        try:
            ready = self._signals.wait(layer, timeout)
        except Exception:
            log.warning("writing layer %d of a load failed; the engine recomputes", layer,
                        exc_info=True)  # fmt: skip
            ready = False
        if ready and not self.failed:
            return True
        self.cancel()
        return False

    def cancel(self) -> None:
        """Stops the load; once this returns, nothing writes the pool for it any more."""
        if self._signals.complete and not self.failed:  # every layer is in: nothing to stop
            self._cancelled = True
            return
        with self._lock:
            self._cancelled = True
            self.failed = True
            self._given.set()  # a fetch waiting for pages lets its blocks go
            orphan = None if self._running else self._take_found()  # no run() will end it
        self._release(orphan)
        self._signals.stop()  # writes in flight land before a recompute
        self._signals.release_all()

    @property
    def helped(self) -> int:
        """Layers the engine's thread wrote itself."""
        return self._signals.helped

    def _fetch(self, held: contextlib.ExitStack) -> _Source:
        """The blocks not in hand yet: the rest of a prefix hit leased (promoted into the
        arena), or, for blocks a reuse plan moves, downloaded and re-rotated."""
        if self._moves is not None:
            self._release_found()  # a moved load reads copies (K re-rotated), not the arena
            return self._download(self._moves)
        found = self._found
        leased = [found.host_blocks()] if found is not None and found.num_leased else []
        rest = self._keys[sum(len(b) for b in leased) :]
        if rest:
            blocks = held.enter_context(self._client.host_blocks(self._namespace, rest))
            leased.append(blocks)
        got = sum(len(b) for b in leased)
        if self._timeline is not None:
            self._timeline.lease_answered = now()
        self._found_blocks(got)
        return _Leased(leased)

    def _download(self, moves: tuple[torch.Tensor, torch.Tensor]) -> _Source:
        device = self._pool.kv_pool.device
        staging = staging_for(self._namespace, len(self._keys), device)
        download = None  # on CUDA a stream of its own: this thread's default one would queue
        if device.type == "cuda":  # behind the engine's work
            download = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        got = self._client.get(self._namespace, self._keys, out=list(staging), stream=download)
        self._found_blocks(len(got))
        return _Moved(staging, moves)

    def _wait_for_pages(self, source: _Source) -> bool:
        """Whether ``start`` named the pages within ``hold_s`` (else the blocks are let go)
        and the load goes on; the blocks can be written from then on."""
        self._given.wait(self._hold_s)
        with self._lock:
            if not self._given.is_set():
                self._let_go = True
            if self._let_go or self._cancelled:
                return False
            self._source = source
            self._ready()
            return True

    def _ready(self) -> None:
        """Under the lock: once both the pages and the blocks are known, either thread may
        write layers (the writer is made on the side stream, where its copies run)."""
        if self._pages is None or self._source is None or self._cancelled or self._writable:
            return
        self._writable = True
        pages = self._pages[: self.num_blocks]
        with self._signals.writing():
            write, whole = self._source.writer(pages, self._pool, self._namespace)
        self._signals.can_write(write, whole)

    def _release_found(self) -> None:
        with self._lock:
            found = self._take_found()
        self._release(found)

    def _take_found(self) -> Found | None:
        """Under the lock: the lookup's lease, now this caller's to end."""
        found, self._found = self._found, None
        return found

    def _release(self, found: Found | None) -> None:
        if found is not None and found.lease is not None:
            self._client.release(found)

    def _fetched(self) -> None:
        callback, self._on_fetched = self._on_fetched, None
        if callback is not None:
            callback()

    def _found_blocks(self, found: int) -> None:
        """The daemon gave the first ``found`` blocks: load those (none is a failure)."""
        if not found:
            raise LookupError(f"the daemon gave none of {len(self._keys)} blocks (evicted?)")
        if found < len(self._keys):
            log.info(
                "the daemon gave %d of %d blocks (evicted?); loading those", found, len(self._keys)
            )
        with self._lock:
            self.num_blocks = min(self.num_blocks, found)

    def _fail(self) -> None:
        self.failed = True
        self._signals.release_all()


_Writes = tuple[Callable[[int], None], Callable[[Sequence[int]], None] | None]


class _Source(Protocol):
    """Blocks in hand, and how a layer of them is written into pages (and, for a load
    written whole, all its layers at once: ``LayerSignals.can_write``)."""

    def writer(self, pages: torch.Tensor, pool: PoolHandles, namespace: Namespace) -> _Writes: ...


@dataclass(frozen=True, slots=True)
class _Leased:
    """A prefix hit: leased blocks, written straight from where they lie."""

    groups: list[HostBlocks]

    def writer(self, pages: torch.Tensor, pool: PoolHandles, namespace: Namespace) -> _Writes:
        n = len(pages)
        placed, at = [], 0
        for blocks in self.groups:
            take = min(len(blocks), n - at)
            if take <= 0:
                break
            part = HostBlocks(blocks.source, blocks.offsets[:take], blocks.mapped)
            placed.append((part, pages[at : at + take]))
            at += take
        layer_bytes = namespace.model.layout().layer_bytes
        writer = LayerWriter(placed, pool.layers, layer_bytes)
        return writer.write, writer.write_many if writer.whole else None


@dataclass(frozen=True, slots=True)
class _Moved:
    """Blocks placed elsewhere than they were computed: downloaded, K re-rotated per layer."""

    staging: torch.Tensor  # [n, num_layers, 2, block_tokens, kv_heads, head_dim]
    moves: tuple[torch.Tensor, torch.Tensor]

    def writer(self, pages: torch.Tensor, pool: PoolHandles, namespace: Namespace) -> _Writes:
        n = len(pages)
        slots = page_slots(pages, pool)
        stored_at, positions = (p[:n, :, None] for p in self.moves)  # over heads
        staging = self.staging

        def write(layer: int) -> None:
            blocks = staging[:n, layer : layer + 1]  # [n, 1, 2, tokens, kv_heads, head_dim]
            blocks[:, 0, 0] = move_k(blocks[:, 0, 0], stored_at, positions, pool.rope)
            load_blocks(blocks, pool.kv_pool[layer : layer + 1], slots)

        return write, None
