"""The store connector: the engine's paged pool <-> the kvstore daemon (``KVConnector``).

Per request, in the engine's order (see :mod:`kvstore.inference_adapter.interfaces`):

1. ``num_loadable_tokens``: block keys of the prompt (``block_keys``), one ``find`` call: the
   held leading blocks and their tiers, those already in the arena leased in the same round
   trip (on the shm session's own socket when the daemon serves calls there); the answer is
   the held leading blocks, capped so at least one prompt token is computed. A request with
   a ``reuse`` plan (a truncated chat) looks up the plan's keys instead: KV computed at other
   positions, placed at the plan's. A daemon that cannot be reached answers 0 (counted in
   ``lookup_errors``), never an exception.
2. ``start_load``: a :class:`~kvstore.inference_adapter.loader.LayerLoad` (which leases on a
   worker thread whatever the lookup did not: blocks below the arena) writes them into the
   request's first pages layer by layer, on its worker thread, or on the engine's when the
   engine waits for a layer the worker has not begun: a plain copy for a prefix hit (stored
   K is after RoPE, at the positions it was computed at, so the pool gets back the engine's
   own bits in every dtype), K re-rotated by the shift for blocks a reuse plan moves;
   ``request.loaded_from`` counts the blocks by the tier they were found in.
3. ``wait_for_layer_load``: layer ``i`` is in the pool (``True``), or the load failed or
   timed out (``False``, and the loader no longer touches the pool: the engine recomputes).
   When the daemon gave only a leading part of the blocks (evicted since the lookup), layer
   0's answer lowers ``request.num_loaded_tokens`` to that part (``short_loads``,
   ``missing_blocks``) and the engine computes the rest.
4. ``save``: the full blocks of ``tokens[:num_tokens]`` the store does not hold yet (neither
   found at lookup nor saved earlier by this request) are copied out of the pool, keyed
   under the request's ``salt`` from its first approximate block on (on CUDA: one kernel
   into device memory, queued on the engine's stream), and offered to the bounded
   :class:`~kvstore.inference_adapter.core.saver.SaveQueue`, whose thread copies them straight
   into the arena slots the daemon reserved; when the queue is full (or the device has no memory
   for the gather) the blocks are dropped and counted in ``dropped_saves``.
5. ``request_finished``: cancels a load still running and forgets the request.

Besides the protocol: ``prefetch`` (a look-ahead hint for a queued session, sent now) and
``prefetch_after_next_load`` (sent once the next request's own blocks are leased, so the
promotion cannot evict them), ``wait_for_saves``, ``stats`` and ``close``. A stored block
is ``block_tokens // page_tokens`` whole pages (``page_tokens`` must divide the namespace's
``block_tokens``): large blocks move efficiently, small pages keep the pool's granularity.
On CUDA the layer copies run on a side stream (see :mod:`~kvstore.inference_adapter.loader`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvstore.client import ROOT_KEY, Found, KVStoreClient, Namespace, block_keys
from kvstore.inference_adapter.core.saver import SaveCounts, SaveJob, SaveQueue, ready_event
from kvstore.inference_adapter.core.threads import torch_ops_alone
from kvstore.inference_adapter.core.timeline import HitTimeline, now
from kvstore.inference_adapter.core.transfer import staging_for
from kvstore.inference_adapter.interfaces import Request
from kvstore.inference_adapter.loader import (
    LayerLoad,
    PoolHandles,
    block_pages,
    block_positions,
    page_slots,
)
from kvstore.kernels.dispatch import save_blocks
from kvstore.kernels.rope import RopeTables
from kvstore.kernels.transfer import gather_pages

__all__ = ["ConnectorStats", "StoreConnector"]

log = logging.getLogger(__name__)

DEFAULT_HOLD_S = 5.0  # half the daemon's default lease (server.lease_ttl = 10 s)


@dataclass(frozen=True, slots=True)
class ConnectorStats:
    """What the connector did so far, in blocks unless named otherwise."""

    lookups: int  # requests looked up
    lookup_errors: int  # lookups that failed (daemon unreachable, ...): answered 0
    loaded_blocks: int  # blocks whose load started
    refetches: int  # loads leased while queued, let go before admission, fetched again
    failed_loads: int  # loads that failed or timed out (the engine recomputed)
    short_loads: int  # loads the daemon gave only a leading part of (the rest computed)
    missing_blocks: int  # blocks those loads lacked
    queued_saves: int  # blocks offered to the save queue and taken
    dropped_saves: int  # blocks not saved because the queue was full
    saves: SaveCounts  # what the daemon answered for the blocks put so far
    prefetch_errors: int


@dataclass(slots=True)
class _Plan:
    """A request's admission decision and what it has told the store since."""

    load_keys: list[bytes] = field(default_factory=list)  # blocks to load, in position order
    stored_at: list[int] = field(default_factory=list)  # per load key, its first token's
    # position where it was computed (a prefix hit: the position it loads at)
    tiers: tuple[str, ...] = ()  # per load key, the tier it was found in
    known: set[bytes] = field(default_factory=set)  # keys the store holds or was handed
    load: LayerLoad | None = None
    timeline: HitTimeline | None = None
    found: Found | None = None  # the lookup, with the lease of the blocks it found in the arena
    worker: bool = False  # the load's worker thread was started


class StoreConnector:
    """Moves KV between an engine's paged pool and a kvstore daemon; see the module docstring.

    Args:
        client: A connected blocking client (give it few retries and a short timeout: a
            lookup is on the admission path).
        namespace: The model and tenant; its fingerprint must match the pool.
        kv_pool: The engine's pool ``[num_layers, 2, num_pages, page_tokens, kv_heads, head_dim]``.
        page_tokens: Tokens per page; must divide ``namespace.model.block_tokens``.
        rope_tables: The engine's RoPE tables (on the pool's device).
        save_queue_size: Most blocks waiting to be saved; more are dropped and counted. On
            CUDA the waiting blocks are held in device memory (at most this many).
        load_timeout_s: How long a request's load may take before the engine recomputes.
        load_workers: Loads running at once (one thread each).

    Raises:
        ValueError: ``page_tokens`` does not divide ``block_tokens``, or the pool does not
            match the namespace's fingerprint (the message names both values).
    """

    def __init__(
        self,
        client: KVStoreClient,
        namespace: Namespace,
        *,
        kv_pool: torch.Tensor,
        page_tokens: int,
        rope_tables: RopeTables,
        save_queue_size: int = 64,
        load_timeout_s: float = 10.0,
        load_workers: int = 2,
    ) -> None:
        self._pool = PoolHandles(kv_pool, page_tokens, rope_tables)
        _check_pool(namespace, self._pool)
        if load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s must be positive, got {load_timeout_s}")
        self.client = client
        self.namespace = namespace
        self.block_tokens = namespace.model.block_tokens
        self._per_block = self.block_tokens // page_tokens
        self.load_timeout_s = load_timeout_s
        self._plans: dict[str, _Plan] = {}
        self._prepared: dict[str, Future[_Plan]] = {}  # lookups of requests still queued
        self._hold_s = _hold_seconds(client)
        self._saves = SaveQueue(client, namespace, save_queue_size)
        # A load holds its worker from its lookup (its lease) to its last layer.
        self._loads = ThreadPoolExecutor(
            load_workers, thread_name_prefix="kvstore-load", initializer=torch_ops_alone
        )
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvstore-lookup")
        self._counts = Counter[str]()
        self._counts_lock = threading.Lock()
        self._deferred_hints: list[tuple[str, list[list[bytes]]]] = []
        self._hints_lock = threading.Lock()
        try:  # now, not in the first request's lookup
            client.open_session(namespace)
        except Exception as error:  # the daemon is down: the first lookup tries again
            log.warning("kvstore: cannot open a session with the daemon yet: %s", error)

    @property
    def pool(self) -> PoolHandles:
        """The engine's pool, page size and RoPE tables this connector reads and writes."""
        return self._pool

    # KVConnector -------------------------------------------------------------------------

    def num_loadable_tokens(self, request: Request) -> int:
        """Leading prompt tokens the store can provide (whole blocks, < ``len(prompt)``);
        their lease is taken now, on a worker thread. A request ``prepare`` looked up
        while it waited makes no call here when that lookup found all it could load."""
        self._count("lookups")
        request.loaded_from = {}
        plan = self._admission_plan(request)
        self._plans[request.request_id] = plan
        if not plan.load_keys:
            self._hints_in_background()  # nothing of this request's to protect
        return len(plan.load_keys) * self.block_tokens

    def start_load(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        """Starts loading the first ``num_tokens // page_tokens`` blocks into ``pages``."""
        plan = self._plans.setdefault(request.request_id, _Plan())
        num_blocks = min(num_tokens // self.block_tokens, len(plan.load_keys))
        if num_blocks == 0:
            self._drop_load(plan)
            return
        chosen = block_pages(pages, range(num_blocks), self._per_block)
        deadline = time.monotonic() + self.load_timeout_s
        if plan.timeline is not None:
            plan.timeline.load_started = now()
        if plan.load is None or not plan.load.start(chosen, deadline):
            self._count("refetches")  # its lease was let go while it waited: fetch again
            load = self._fetch(plan).load
            if load is not None:  # a new load takes its pages whenever it is fetched
                load.start(chosen, deadline)
        elif not plan.worker:  # its thread writes alongside the engine from now on
            plan.worker = True
            self._loads.submit(plan.load.run)
        request.loaded_from = dict(Counter(plan.tiers[:num_blocks]))
        self._count("loaded_blocks", num_blocks)

    def wait_for_layer_load(self, request: Request, layer: int) -> bool:
        """``True`` once layer ``layer`` of the load is in the pool (or nothing is loading)."""
        plan = self._plans.get(request.request_id)
        if plan is None or plan.load is None:
            return True
        if plan.load.wait(layer):
            loaded = plan.load.num_blocks
            if loaded * self.block_tokens < request.num_loaded_tokens:
                self._count("short_loads")
                self._count(
                    "missing_blocks", request.num_loaded_tokens // self.block_tokens - loaded
                )
                request.num_loaded_tokens = loaded * self.block_tokens
                request.loaded_from = dict(Counter(plan.tiers[:loaded]))
                plan.known.difference_update(plan.load_keys[loaded:])  # gone: save them again
            return True
        if request.loaded_from:
            self._count("failed_loads")
            request.loaded_from = {}
            plan.known.difference_update(plan.load_keys)  # maybe gone: save the recompute
        return False

    def save(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        """Queues the new full blocks of ``(prompt + output)[:num_tokens]``; never waits.
        Blocks wholly in pages the engine mapped from its pool (``num_resident_tokens``) are
        not offered: the request that computed them offered them then."""
        plan = self._plans.setdefault(request.request_id, _Plan())
        tokens = (request.prompt + request.output)[:num_tokens]
        keys = block_keys(tokens, self.namespace, request.salt)
        resident = request.num_resident_tokens // self.block_tokens
        new = [b for b, key in enumerate(keys) if b >= resident and key not in plan.known]
        for run in _runs(new):
            if not self._saves.has_room(len(run)):
                self._count("dropped_saves", len(run))
                continue
            try:
                blocks = self._gather(pages, run)
            except torch.OutOfMemoryError:  # queued saves hold device memory: none is left
                self._count("dropped_saves", len(run))
                continue
            job = SaveJob(
                keys=tuple(keys[b] for b in run),
                parent=keys[run[0] - 1] if run[0] else ROOT_KEY,
                blocks=blocks,
                ready=ready_event(blocks),
            )
            if self._saves.offer(job):
                plan.known.update(job.keys)
                self._count("queued_saves", len(run))
            else:
                self._count("dropped_saves", len(run))

    def request_finished(self, request: Request) -> None:
        """Forgets the request; a load still running (or a lease taken for it) ends first."""
        plan = self._plans.pop(request.request_id, None)
        prepared = self._prepared.pop(request.request_id, None)
        if prepared is not None:
            prepared.add_done_callback(_drop_prepared)
        if plan is not None:
            self._drop_load(plan)

    # Beyond the protocol -------------------------------------------------------------------

    def prepare(self, request: Request) -> None:
        """Looks up a request that waits to be admitted, and leases what the store holds for
        it, on a worker thread: by its admission the blocks are leased, so the fetch
        overlaps the wait. Calling it again for the same request does nothing; the lease is
        let go if the request is not admitted within ``hold_s`` (then it is fetched again).
        """
        if request.request_id in self._prepared or request.request_id in self._plans:
            return

        def look_up() -> _Plan:
            return self._fetch(self._lookup(request), queued=True)

        self._prepared[request.request_id] = self._lookups.submit(look_up)

    def prefetch(self, session_id: str, chains: Sequence[Sequence[bytes]]) -> int:
        """Tells the daemon a session runs soon (its chains move up to the host tier).

        Returns:
            Blocks the daemon queued for promotion; 0 when it cannot be reached.
        """
        try:
            return self.client.prefetch(session_id, self.namespace, chains)
        except Exception:
            log.warning("prefetch hint for session %s failed", session_id, exc_info=True)
            self._count("prefetch_errors")
            return 0

    def prefetch_after_next_load(self, session_id: str, chains: Sequence[Sequence[bytes]]) -> None:
        """Sends a prefetch hint once the next admitted request's own blocks are leased.

        Promoting a queued session's blocks may evict others from the host tier; sent after
        the running request's blocks are leased (or at its admission when it loads nothing),
        the hint cannot push out the blocks that request is about to load.
        """
        with self._hints_lock:
            self._deferred_hints.append((session_id, [list(chain) for chain in chains]))

    def _hints_in_background(self) -> None:
        """Sends the deferred hints, if any, from a worker thread: never on the engine's or
        a load's critical path (and no thread is woken when there are none)."""
        with self._hints_lock:
            if not self._deferred_hints:
                return
        with contextlib.suppress(RuntimeError):  # the connector is closed
            self._loads.submit(self._send_deferred_hints)

    def _send_deferred_hints(self) -> None:
        with self._hints_lock:
            hints, self._deferred_hints = self._deferred_hints, []
        for session_id, chains in hints:
            self.prefetch(session_id, chains)

    def wait_for_saves(self, timeout: float | None = None) -> bool:
        """Waits until every save queued so far reached the daemon; ``False`` on timeout."""
        return self._saves.drain(timeout)

    @property
    def dropped_saves(self) -> int:
        """Blocks not saved because the save queue was full."""
        return self._counts["dropped_saves"]

    def stats(self) -> ConnectorStats:
        with self._counts_lock:
            c = self._counts.copy()
        return ConnectorStats(
            lookups=c["lookups"],
            lookup_errors=c["lookup_errors"],
            loaded_blocks=c["loaded_blocks"],
            refetches=c["refetches"],
            failed_loads=c["failed_loads"],
            short_loads=c["short_loads"],
            missing_blocks=c["missing_blocks"],
            queued_saves=c["queued_saves"],
            dropped_saves=c["dropped_saves"],
            saves=self._saves.counts,
            prefetch_errors=c["prefetch_errors"],
        )

    def close(self, timeout: float | None = 5.0) -> None:
        """Cancels loads, puts the saves already queued (within ``timeout``), stops threads."""
        self._lookups.shutdown(wait=True, cancel_futures=True)
        for prepared in list(self._prepared.values()):
            _drop_prepared(prepared)
        for plan in list(self._plans.values()):
            self._drop_load(plan)
        self._loads.shutdown(wait=True, cancel_futures=True)
        self._saves.close(timeout)

    # Helpers -----------------------------------------------------------------------------

    def _admission_plan(self, request: Request) -> _Plan:
        """The plan of a request being admitted: the one ``prepare`` made (looked up again
        only when it could load more: blocks saved since may have joined), or a new one."""
        prepared = self._prepared.pop(request.request_id, None)
        if prepared is None:
            return self._fetch(self._lookup(request))
        plan = prepared.result()
        if len(plan.load_keys) < self._most_blocks(request):
            fresh = self._lookup(request)
            if len(fresh.load_keys) > len(plan.load_keys):
                self._drop_load(plan)
                return self._fetch(fresh)
            self._release(fresh.found)
        return plan

    def _lookup(self, request: Request) -> _Plan:
        """Which leading blocks of the request the store holds (no lease yet); an empty
        plan when the daemon cannot be reached (counted in ``lookup_errors``)."""
        candidates, stored_at = self._candidates(request)
        timeline = self._timeline(request)
        timeline.lookup_sent = now()
        try:
            found = self.client.find(self.namespace, candidates)
        except Exception:
            log.warning(
                "lookup of request %s failed; computing it", request.request_id, exc_info=True
            )
            self._count("lookup_errors")
            return _Plan(timeline=timeline)
        timeline.lookup_answered = now()
        held = candidates[: found.num_blocks]
        usable = min(len(held), self._most_blocks(request))
        return _Plan(
            load_keys=held[:usable],
            stored_at=stored_at[:usable],
            tiers=found.tiers[:usable],
            known=set(held),
            timeline=timeline,
            found=found,
        )

    def _timeline(self, request: Request) -> HitTimeline:
        """The request's timeline; one from now when the engine gave none."""
        if request.timeline is None:
            request.timeline = HitTimeline(self._pool.num_layers)
        return request.timeline

    def _most_blocks(self, request: Request) -> int:
        """The most blocks a load may give: at least one prompt token is computed."""
        return (len(request.prompt) - 1) // self.block_tokens

    def _fetch(self, plan: _Plan, *, queued: bool = False) -> _Plan:
        """Starts leasing the plan's blocks on a worker thread (when it has any); the load
        owns the lookup's lease from then on (a plan with nothing to load ends it now). The
        worker starts now when it has blocks to lease, or when the request is ``queued`` (it
        lets the lease go if the request waits too long); else with the load."""
        found, plan.found = plan.found, None
        if not plan.load_keys:
            self._release(found)
            return plan
        plan.load = LayerLoad(
            self.client,
            self.namespace,
            self._pool,
            plan.load_keys,
            self._moves(plan.stored_at),
            hold_s=self._hold_s,
            on_fetched=self._hints_in_background,
            timeline=plan.timeline,
            found=found,
        )
        plan.worker = queued or not plan.load.in_hand  # the lease overlaps the queue's wait
        if plan.worker:
            self._loads.submit(plan.load.run)
        return plan

    def _release(self, found: Found | None) -> None:
        """Ends a lookup's lease that no load took."""
        if found is not None and found.lease is not None:
            try:
                self.client.release(found)
            except Exception:  # it expires on the daemon
                log.debug("releasing a lookup's lease failed", exc_info=True)

    @staticmethod
    def _drop_load(plan: _Plan) -> None:
        if plan.load is not None:
            plan.load.cancel()

    def _candidates(self, request: Request) -> tuple[list[bytes], list[int]]:
        """Keys whose leading held run may be loaded at positions 0, block, 2 * block, ...,
        and the position each block's first token was computed at."""
        bt = self.block_tokens
        if not request.reuse:
            keys = block_keys(request.prompt, self.namespace, request.salt)
            return keys, [b * bt for b in range(len(keys))]
        keys, stored_at = [], []
        for index, block in enumerate(request.reuse):
            if block.position != index * bt:
                break  # loads fill a prefix of the pages; a gap ends the usable plan
            keys.append(block.key)
            stored_at.append(block.stored_at)
        return keys, stored_at

    def _moves(self, stored_at: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``LayerLoad``'s ``moves`` for blocks loaded at positions 0, block, ... that were
        computed at ``stored_at``; None when none moves."""
        bt, device = self.block_tokens, self._pool.kv_pool.device
        starts = [b * bt for b in range(len(stored_at))]
        if list(stored_at) == starts:
            return None
        return block_positions(stored_at, bt, device), block_positions(starts, bt, device)

    def _gather(self, pages: Sequence[int], blocks: Sequence[int]) -> torch.Tensor:
        """Blocks of the pool as the store lays them out (K after RoPE, as the pool holds it):
        one kernel on CUDA, a copy per run of consecutive pages elsewhere."""
        kv_pool = self._pool.kv_pool
        staging = staging_for(self.namespace, len(blocks), kv_pool.device)
        run = range(blocks[0], blocks[-1] + 1)  # a run of consecutive blocks
        chosen = block_pages(pages, run, self._per_block)
        if kv_pool.is_cuda:
            save_blocks(kv_pool, staging, page_slots(chosen, self._pool))
        else:
            gather_pages(kv_pool, chosen, staging)
        return staging

    def _count(self, name: str, amount: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] += amount


def _drop_prepared(prepared: Future[_Plan]) -> None:
    """Ends the lease a prepared lookup took for a request that will not run."""
    if not prepared.cancelled() and prepared.exception() is None:
        StoreConnector._drop_load(prepared.result())


def _runs(indices: Sequence[int]) -> list[list[int]]:
    """Consecutive runs of sorted block indices: [0, 1, 3] -> [[0, 1], [3]]."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _hold_seconds(client: KVStoreClient) -> float:
    """How long a leased load may wait for its pages: half the daemon's lease, so that the
    layer copies after it still run under the lease."""
    try:
        return client.server_info.lease_seconds / 2
    except Exception:  # not connected yet: the daemon's default lease
        return DEFAULT_HOLD_S


def _check_pool(namespace: Namespace, pool: PoolHandles) -> None:
    model = namespace.model
    if model.block_tokens % pool.page_tokens:
        raise ValueError(
            f"page_tokens ({pool.page_tokens}) must divide the namespace's block_tokens "
            f"({model.block_tokens}): a stored block is whole pages"
        )
    num_layers, _, _, _, kv_heads, head_dim = pool.kv_pool.shape
    expected = (model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)
    found = (num_layers, kv_heads, head_dim, str(pool.kv_pool.dtype).removeprefix("torch."))
    if found != expected:
        raise ValueError(
            f"kv_pool (layers, kv_heads, head_dim, dtype) = {found} does not match the "
            f"namespace's fingerprint {expected}"
        )
