"""The worker side: stored blocks into vLLM's KV tensors layer by layer, new blocks out.

Per step, in vLLM's order:

1. ``start(plan)`` (vLLM's ``start_load_kv``, before the forward pass when the step loads,
   after it otherwise): when the plan has loads, one thread leases the step's blocks from the
   daemon (``host_blocks``: the arena itself on the shm plane, a download otherwise) and
   then writes layer after layer into vLLM's blocks with the engine-neutral
   :class:`~kvstore.inference_adapter.core.transfer.LayerWriter` (on CUDA one kernel per
   layer reading the registered arena; stored K is after RoPE, at the positions it goes back
   to),
   flagging layer ``i`` once it is queued. vLLM computes layer ``i`` meanwhile. On CUDA the
   writes go on a side stream that first waits for vLLM's stream as ``start`` found it, with
   one event per layer (:class:`~kvstore.inference_adapter.core.transfer.LayerSignals`, as in
   our engine's loader).
2. ``wait_layer(i)`` (vLLM's ``wait_for_layer_load``, before layer ``i``'s attention):
   returns when layer ``i`` is queued, having made vLLM's current stream wait for its event
   (the host does not wait for the copy). A failure or the deadline cancels the load: from then
   on the thread never writes vLLM's tensors again (each layer write holds a lock that
   cancelling takes, and the writes already queued land first), and every vLLM block the
   load was to fill is reported by
   ``take_failed_blocks`` so vLLM recomputes those tokens (``kv_load_failure_policy:
   "recompute"``).
3. ``capture(i, saves)`` (vLLM's ``save_kv_layer``, after layer ``i``'s attention): copies
   layer ``i`` of the step's new full blocks out of vLLM's tensors into staging on vLLM's
   device, as vLLM holds them (on a copy thread of its own on the CPU, on the caller's
   stream on CUDA, where the save queue's thread later copies the staging straight into the
   arena slots the daemon reserved: no host bounce buffer; queued saves hold at most
   ``save_queue_blocks`` blocks of device memory, and a save the device has no memory for
   is dropped). The
   blocks a step saves are chosen when their first layer is captured: only as many as the
   bounded save queue takes; the rest are dropped and counted.
4. ``finish_step()`` (``wait_for_save``): hands the staged blocks to the save queue, whose
   thread puts them while vLLM runs the next step. A prefill instance that hands its KV off
   (``handoff_timeout_s`` set) waits instead until they are committed (within that bound):
   the step's output, hence a finished request's reply, then follows its saves, and the
   decode instance it is handed to finds them; every save of the step is taken (the queue
   waits for room rather than dropping one). On the CPU it waits for the copy thread
   first; on CUDA it waits for nothing: the job carries an event recorded on vLLM's stream
   after the copies out, which the queue's thread waits for. Either way no vLLM block is
   read after the step's work: a later write to it (vLLM freeing and reusing it) is queued
   on the same stream, after the copies.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from kvstore.client import KVStoreClient, Namespace, SharedLease, WriteStatus, shard_keys
from kvstore.client.tensors import HostBlocks
from kvstore.inference_adapter.core.saver import SaveJob, SaveQueue
from kvstore.inference_adapter.core.threads import torch_ops_alone
from kvstore.inference_adapter.core.timeline import HitTimeline, PhaseHistograms, now
from kvstore.inference_adapter.core.transfer import LayerKV, LayerSignals, LayerWriter, staging_for
from kvstore.inference_adapter.vllm.layout import gather
from kvstore.inference_adapter.vllm.link import Link
from kvstore.inference_adapter.vllm.scheduler import LoadSpec, SaveSpec, StepPlan

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 1.0  # a load through a lookup's lease ends at least this long before it


class _LinkPutter:
    """``put`` through the link, so saves reconnect like everything else."""

    def __init__(self, link: Link) -> None:
        self._link = link

    def put(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        blocks: Sequence[torch.Tensor],
        *,
        parent: bytes = b"",
    ) -> list[WriteStatus]:
        def put(client: KVStoreClient) -> list[WriteStatus]:
            return client.put(namespace, keys, blocks, parent=parent)

        return self._link.call(put)


@dataclass(slots=True)
class _Load:
    """One step's loads, run by one thread."""

    specs: tuple[LoadSpec, ...]
    signals: LayerSignals
    deadline: float
    timeline: HitTimeline
    failed: bool = False
    cancelled: bool = False


class WorkerSide:
    """Loads and saves of one vLLM worker; see the module docstring.

    Args:
        link: The daemon.
        namespace: The model and tenant; its block layout is the stored form.
        layers: Per attention layer in model order, its K/V views.
        save_queue_blocks: Most blocks waiting to be put.
        load_timeout_s: How long ``wait_layer`` waits for one layer.
        rank: This worker's tensor-parallel rank: it saves and loads its share of the KV
            heads under that rank's keys (``shard_keys``), so ranks never collide.
        handoff_timeout_s: With a value, a step ends once its saves are committed, or
            after this long (a prefill instance: see step 4).
    """

    def __init__(
        self,
        link: Link,
        namespace: Namespace,
        layers: Sequence[LayerKV],
        *,
        save_queue_blocks: int,
        load_timeout_s: float,
        rank: int = 0,
        handoff_timeout_s: float | None = None,
    ) -> None:
        self.namespace = namespace
        self.handoff_timeout_s = handoff_timeout_s
        self.rank = rank
        self.layers = list(layers)
        self.block_tokens = namespace.model.block_tokens
        self.per_block = self.block_tokens // self.layers[0].block_size
        self.load_timeout_s = load_timeout_s
        self.device = self.layers[0].k.device
        self.dtype = getattr(torch, namespace.model.dtype)
        self._link = link
        self._saves = SaveQueue(_LinkPutter(link), namespace, save_queue_blocks)
        self._threads = ThreadPoolExecutor(
            1, thread_name_prefix="kvstore-vllm-load", initializer=torch_ops_alone
        )
        self._copier = ThreadPoolExecutor(
            1, thread_name_prefix="kvstore-vllm-copy", initializer=torch_ops_alone
        )
        self._copies: list[Future[None]] = []
        self._load: _Load | None = None
        self._write_lock = threading.Lock()
        self._failed_blocks: set[int] = set()
        self._staged: list[tuple[SaveSpec, torch.Tensor]] | None = None
        self.counts = Counter[str]()
        self.phases = PhaseHistograms()  # the worker's part of each hit: lease, layers
        self.observed: list[dict[str, float]] = []  # phases observed since taken
        self.handoff_waits: list[float] = []  # seconds steps waited for their saves, since taken
        self._observed_lock = threading.Lock()

    # Loads ---------------------------------------------------------------------------------

    def start(self, plan: StepPlan) -> None:
        """Begins the step: its loads start on the load thread."""
        if not plan.loads:
            self._load = None
            return
        timeline = HitTimeline(len(self.layers))
        timeline.load_started = timeline.arrived
        signals = LayerSignals(len(self.layers), timeline=timeline)
        signals.after_engine(self.device)  # on vLLM's thread: after what its stream queued
        load = _Load(plan.loads, signals, time.monotonic() + self.load_timeout_s, timeline)
        self._load = load
        self.counts["load_blocks"] += sum(len(spec.keys) for spec in plan.loads)
        self._threads.submit(self._run_load, load)

    def wait_layer(self, layer: int) -> None:
        """Returns once layer ``layer`` of the step's loads is written (or they failed)."""
        load = self._load
        if load is None:
            return
        ready = load.signals.wait(layer, max(0.0, load.deadline - time.monotonic()))
        if not ready or load.failed:
            self._cancel(load, "timed out" if not ready else "failed")

    def take_failed_blocks(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._write_lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    @torch.inference_mode()
    def _run_load(self, load: _Load) -> None:
        try:
            self._link.call(lambda client: self._load_from(client, load))
        except Exception as error:
            blocks = sum(len(spec.keys) for spec in load.specs)
            log.warning("kvstore load of %d blocks failed (%s); vLLM recomputes", blocks, error)
            load.failed = True
            load.signals.release_all()

    def _load_from(self, client: KVStoreClient, load: _Load) -> None:
        """Takes each request's blocks (those the scheduler's lookup leased for this rank,
        where they lie in this process's mapping of the arena; else it leases them now),
        then writes them layer by layer and ends the leases. A request whose chain comes
        back short (evicted, or corrupt and dropped by the daemon) loads the blocks that
        came; vLLM recomputes from the first missing one."""
        with contextlib.ExitStack() as leases:
            groups: list[tuple[HostBlocks, torch.Tensor]] = []
            for spec in load.specs:
                keys = shard_keys(spec.keys, self.rank)
                shared = spec.leases[self.rank] if self.rank < len(spec.leases) else None
                if shared is not None:  # the worker's to end, used or not
                    leases.callback(client.release_lease, shared.lease_id)
                blocks = self._adopt(client, shared, len(keys), load)
                if blocks is None:
                    blocks = leases.enter_context(client.host_blocks(self.namespace, keys))
                    load.timeline.lease_answered = now()
                    self.counts["leased_blocks"] += len(blocks)
                else:
                    self.counts["lookup_leased_blocks"] += len(blocks)
                if len(blocks) < len(spec.keys):
                    spec = self._short(spec, len(blocks))
                if len(blocks):
                    groups.append((blocks, self._pages(spec)))
            self._write_layers(load, groups)

    def _observe(self, timeline: HitTimeline) -> None:
        """The worker's phases of a step's load: leasing (when the lookup had not), the
        first layer and the rest, from the load's start."""
        phases = {name: seconds for name, seconds in timeline.phases().items()
                  if name in ("first_layer", "layers")}  # fmt: skip
        if not math.isnan(timeline.lease_answered):
            phases["lease"] = timeline.lease_answered - timeline.load_started
        self.phases.observe(phases)
        with self._observed_lock:
            self.observed.append(phases)

    def take_observed(self) -> list[dict[str, float]]:
        """The hit phases observed since the last call (for vLLM's connector stats)."""
        with self._observed_lock:
            observed, self.observed = self.observed, []
        return observed

    def take_handoff_waits(self) -> list[float]:
        """Seconds each step that saved waited for its saves' commit (the hand-off), since
        the last call."""
        with self._observed_lock:
            waits, self.handoff_waits = self.handoff_waits, []
        return waits

    def _adopt(
        self, client: KVStoreClient, shared: SharedLease | None, count: int, load: _Load
    ) -> HostBlocks | None:
        """The ``count`` blocks the scheduler's lookup leased, where they lie here; None when
        it leased fewer, the lease is about to end, or this process maps another arena (the
        daemon restarted since). The load must end while the lease holds: its deadline is
        brought forward to that (a load past it fails, and vLLM recomputes)."""
        if shared is None or len(shared.offsets) < count:
            return None
        if shared.alive_until - time.monotonic() <= LEASE_MARGIN_S:
            return None
        blocks = client.shared_blocks(self.namespace, shared)
        if blocks is None:
            return None
        load.deadline = min(load.deadline, shared.alive_until - LEASE_MARGIN_S)
        return HostBlocks(blocks.source, blocks.offsets[:count], blocks.mapped)

    def _short(self, spec: LoadSpec, got: int) -> LoadSpec:
        """Counts the blocks of ``spec`` past ``got`` as failed; the spec for the rest."""
        per = self.per_block
        with self._write_lock:
            for index in range(got * per, len(spec.block_ids)):
                if spec.first_block * per + index >= spec.skip_before:
                    self._failed_blocks.add(spec.block_ids[index])
        self.counts["missing_blocks"] += len(spec.keys) - got
        return replace(spec, keys=spec.keys[:got], block_ids=spec.block_ids[: got * per])

    def _write_layers(self, load: _Load, groups: Sequence[tuple[HostBlocks, torch.Tensor]]) -> None:
        if not groups:
            load.signals.release_all()
            return
        try:
            with load.signals.writing():
                writer = LayerWriter(groups, self.layers, self.namespace.model.layout().layer_bytes)
            load.signals.can_write(writer.write, writer.write_many if writer.whole else None)
            load.signals.write_all()
        finally:
            load.signals.stop()  # the leases end on return

    def _pages(self, spec: LoadSpec) -> torch.Tensor:
        """vLLM block ids ``[n, per_block]`` of each stored block's parts; -1 for the parts
        vLLM computes itself (before ``skip_before``)."""
        n, per = len(spec.keys), self.per_block
        ids = torch.tensor(spec.block_ids, dtype=torch.int64).view(n, per)
        sequence_index = spec.first_block * per + torch.arange(n * per).view(n, per)
        return torch.where(sequence_index >= spec.skip_before, ids, -1)

    def _cancel(self, load: _Load, why: str) -> None:
        with self._write_lock:
            if load.cancelled:
                return
            load.cancelled = True
            for spec in load.specs:
                per = self.per_block
                for index, block in enumerate(spec.block_ids):
                    if spec.first_block * per + index >= spec.skip_before:
                        self._failed_blocks.add(block)
        load.signals.stop()  # writes already queued land before vLLM recomputes
        self.counts["failed_loads"] += 1
        log.debug("kvstore load %s; %d vLLM blocks recomputed", why, len(self._failed_blocks))

    # Saves ---------------------------------------------------------------------------------

    def capture(self, layer: int, saves: Sequence[SaveSpec]) -> None:
        """Copies layer ``layer`` of the step's new blocks ``saves`` into staging (on vLLM's
        device).

        On CUDA the copies are queued on the caller's stream (ordered after the attention
        that wrote the layer). On the CPU they run on the connector's copy thread, which
        ``finish_step`` waits for: small torch ops called from vLLM's forward thread pay
        for its OpenMP team (measured here: ~60 ms for an op that takes ~1.5 ms on a thread
        of its own), and the copies overlap the next layers' compute.
        """
        if not saves:
            return
        if self._staged is None:
            self._staged = self._admit(saves)
        if self.device.type == "cuda":
            self._copy_layer(layer, self._staged)
        else:
            self._copies.append(self._copier.submit(self._copy_layer, layer, self._staged))

    @torch.inference_mode()
    def _copy_layer(self, layer: int, staged: Sequence[tuple[SaveSpec, torch.Tensor]]) -> None:
        # inference_mode is per thread: vLLM's staging tensors are inference tensors
        for spec, staging in staged:
            ids = torch.tensor(spec.block_ids, dtype=torch.int64, device=self.device)
            ids = ids.view(len(spec.keys), self.per_block)
            k, v = gather(self.layers[layer], ids)
            staging[:, layer, 0].copy_(k, non_blocking=True)
            staging[:, layer, 1].copy_(v, non_blocking=True)

    def finish_step(self) -> None:
        """Hands the step's staged blocks to the save queue: without the hand-off it never
        waits for a put; with it, it returns once they are committed (step 4)."""
        staged, self._staged = self._staged or [], None
        load, self._load = self._load, None  # the step is over: its layers were all waited for
        if load is not None and not load.failed and not load.cancelled:
            self._observe(load.timeline)
        copies, self._copies = self._copies, []
        failed = False
        for copy in copies:  # vLLM may reuse its blocks once this returns
            try:
                copy.result()
            except Exception:
                log.warning("copying blocks out for a save failed", exc_info=True)
                failed = True
        if failed:
            self.counts["dropped_saves"] += sum(len(spec.keys) for spec, _ in staged)
            return
        ready = None  # on CUDA: the copies out are queued on vLLM's stream, not waited for
        if staged and self.device.type == "cuda":
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream(self.device))
        began, handoff = time.monotonic(), self.handoff_timeout_s
        for spec, staging in staged:
            keys = shard_keys((spec.parent, *spec.keys), self.rank)
            job = SaveJob(keys=tuple(keys[1:]), parent=keys[0], blocks=staging, ready=ready)
            if handoff is not None and not self._saves.has_room(len(job.keys)):
                self._saves.drain(_left(began, handoff))
            if self._saves.offer(job):
                self.counts["queued_saves"] += len(spec.keys)
            else:
                self.counts["dropped_saves"] += len(spec.keys)
        if handoff is not None and staged:
            self._hand_off(began, handoff)

    def _hand_off(self, began: float, handoff: float) -> None:
        """Waits until the step's saves are committed, within ``handoff`` seconds of
        ``began``; the wait is observed, a timeout counted."""
        committed = self._saves.drain(_left(began, handoff))
        with self._observed_lock:
            self.handoff_waits.append(time.monotonic() - began)
        if not committed:
            self.counts["handoff_save_timeouts"] += 1
            log.warning(
                "a step's saves were not committed within handoff_timeout_s (%.1f s); the "
                "decode side recomputes what it misses",
                handoff,
            )

    def _admit(self, specs: Sequence[SaveSpec]) -> list[tuple[SaveSpec, torch.Tensor]]:
        """Staging for the saves the queue has room for, on vLLM's device: the save queue's
        thread copies it straight into the arena slots the daemon reserved (no host bounce
        buffer).
        A save that does not fit the queue, or the device's free memory, is dropped."""
        admitted: list[tuple[SaveSpec, torch.Tensor]] = []
        taken = 0
        room = self._saves.room()
        for spec in specs:
            n = len(spec.keys)
            fits = taken + n <= room or (not taken and self._saves.has_room(n))
            fits = fits or self.handoff_timeout_s is not None  # the step waits for room
            staging = self._staging(n) if fits else None
            if staging is None:
                self.counts["dropped_saves"] += n
                continue
            taken += n
            admitted.append((spec, staging))
        return admitted

    def _staging(self, num_blocks: int) -> torch.Tensor | None:
        try:
            return staging_for(self.namespace, num_blocks, self.device)
        except torch.OutOfMemoryError:
            return None

    def save_counts(self) -> Counter[str]:
        """What became of the blocks put so far (stored, dedup, refused, failed)."""
        counts = self._saves.counts
        return Counter(
            stored=counts.stored, dedup=counts.dedup, refused=counts.refused, failed=counts.failed
        )

    def wait_for_saves(self, timeout: float | None = None) -> bool:
        return self._saves.drain(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Cancels a running load, puts what is queued (within ``timeout``), stops threads."""
        if self._load is not None:
            self._cancel(self._load, "cancelled at shutdown")
        self._threads.shutdown(wait=True, cancel_futures=True)
        self._copier.shutdown(wait=True, cancel_futures=True)
        self._saves.close(timeout)
        with contextlib.suppress(Exception):
            self._link.close()


def _left(began: float, seconds: float) -> float:
    """What is left of ``seconds`` from ``began`` (``time.monotonic``), at least 0."""
    return max(0.0, began + seconds - time.monotonic())
