"""The worker side against a real daemon, without vLLM: every layout, CPU and CUDA.

A "step" is driven the way vLLM's model runner drives it (``start``, per layer
``wait_layer`` and ``capture``, ``finish_step``). Blocks saved from one set of KV tensors are
loaded into another; every value read is checked against content derived from its (layer,
K/V, block, head, token, dim). The CUDA cases (marked ``gpu``) run the same code on CUDA
tensors of the same shapes and strides.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvstore.client import (
    ROOT_KEY,
    KVStoreClient,
    ModelFingerprint,
    Namespace,
    SharedLease,
    block_keys,
)
from kvstore.inference_adapter.vllm.layout import LayerKV, layer_kv
from kvstore.inference_adapter.vllm.link import Link
from kvstore.inference_adapter.vllm.scheduler import (
    LoadSpec,
    Match,
    SaveSpec,
    StepPlan,
    held_by_every_rank,
)
from kvstore.inference_adapter.vllm.worker import WorkerSide
from tests.support.daemon import Daemon
from tests.support.waiting import wait_for

LAYERS, HEADS, SIZE, DIM, BLOCKS = 3, 2, 32, 64, 16
PER_BLOCK = 2  # a stored block spans two vLLM blocks
BLOCK_TOKENS = SIZE * PER_BLOCK
NEVER_S = 3600.0  # past the test timeout (pytest's `timeout`): waiting for it is a failure


def make_layer(layout: str, device: str) -> torch.Tensor:
    if layout in ("cpu", "packed"):
        return torch.zeros(BLOCKS, HEADS, SIZE, 2 * DIM, device=device)
    if layout == "split_hnd":
        return torch.zeros(2, BLOCKS, HEADS, SIZE, DIM, device=device).transpose(2, 3)
    return torch.zeros(2, BLOCKS, SIZE, HEADS, DIM, device=device)


def content(layer: int, kv: int, tokens: int, offset: int = 0) -> torch.Tensor:
    """``[tokens, HEADS, DIM]`` values unique per (layer, K/V, token, head, dim)."""
    t, h, d = torch.meshgrid(
        torch.arange(offset, offset + tokens), torch.arange(HEADS), torch.arange(DIM), indexing="ij"
    )
    return (layer * 1e6 + kv * 5e5 + h * 1e5 + t * 10 + d / 64).float()


CASES = [
    pytest.param(layout, device, marks=[pytest.mark.gpu] if device == "cuda" else [])
    for device in ("cpu", "cuda")
    for layout in ("cpu", "packed", "split_nhd", "split_hnd")
    if not (device == "cuda" and layout == "cpu") and not (device == "cpu" and layout == "packed")
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    started = Daemon(tmp_path_factory.mktemp("daemon"), host_capacity="32MiB")
    started.start()
    yield started
    started.close()


def worker_for(
    daemon: Daemon,
    namespace: Namespace,
    layout: str,
    device: str,
    timeout_s: float = 10.0,
    rank: int = 0,
) -> tuple[WorkerSide, list[LayerKV]]:
    kind = "split" if layout.startswith("split") else layout
    layers = [
        layer_kv(make_layer(layout, device), kind, num_kv_heads=HEADS, head_dim=DIM)
        for _ in range(LAYERS)
    ]
    link = Link(
        daemon.address,
        namespace,
        retry_s=0.1,
        role="worker",
        call_timeout=timeout_s,
        wait_for_connect=True,
    )
    link.warm()  # as the connector does at start
    worker = WorkerSide(
        link, namespace, layers, save_queue_blocks=64, load_timeout_s=timeout_s, rank=rank
    )
    return worker, layers


def step(worker: WorkerSide, plan: StepPlan, compute: Callable[[int], None]) -> None:
    """One forward pass as vLLM runs it: under inference mode, layer by layer."""
    with torch.inference_mode():
        worker.start(plan)
        for layer in range(LAYERS):
            worker.wait_layer(layer)
            compute(layer)
            worker.capture(layer, plan.saves)
        worker.finish_step()


@pytest.mark.parametrize(("layout", "device"), CASES)
def test_blocks_saved_from_one_worker_load_into_another(
    daemon: Daemon, layout: str, device: str
) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = ModelFingerprint("worker-test", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS)
    namespace = Namespace(model, f"{layout}-{device}")
    tokens = list(range(7, 7 + 3 * BLOCK_TOKENS + 5))
    keys = block_keys(tokens, namespace)
    source_ids = (3, 9, 1, 12, 5, 0)  # scattered vLLM blocks holding the 3 stored blocks

    saver, source = worker_for(daemon, namespace, layout, device)

    def compute(layer: int) -> None:  # "attention" writes this step's KV
        for vllm_index, block in enumerate(source_ids):
            for kv, part in enumerate((source[layer].k, source[layer].v)):
                part[block] = content(layer, kv, SIZE, vllm_index * SIZE).to(device)

    save = SaveSpec("r", tuple(keys), ROOT_KEY, 0, source_ids)
    step(saver, StepPlan(saves=(save,)), compute)
    assert saver.wait_for_saves(30.0)
    assert saver.save_counts()["stored"] == 3
    saver.close()

    loader, target = worker_for(daemon, namespace, layout, device)
    target_ids = (10, 2, 14, 4, 6, 8)
    load = LoadSpec("r2", tuple(keys), 0, target_ids, skip_before=1)  # vLLM computed block 0
    step(loader, StepPlan(loads=(load,)), lambda layer: None)
    assert loader.take_failed_blocks() == set()
    for layer in range(LAYERS):
        for kv, part in enumerate((target[layer].k, target[layer].v)):
            assert not part[10].any()  # skipped: vLLM computed it itself
            for vllm_index, block in enumerate(target_ids[1:], start=1):
                expected = content(layer, kv, SIZE, vllm_index * SIZE).to(device)
                assert torch.equal(part[block], expected)  # a prefix hit is bit-exact
    loader.close()


def test_tensor_parallel_ranks_save_and_load_their_own_heads(daemon: Daemon) -> None:
    """TP=2: each rank's worker saves its share of the heads under its own keys, the
    scheduler's lookup counts a block only once every rank holds it (and leases each rank's
    blocks), and each rank loads back exactly what it saved, never the other's, through the
    lease the lookup took for it (no Acquire of its own), which it then ends."""
    model = ModelFingerprint("tp-test", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS, tp_size=2)
    namespace = Namespace(model, "tp")
    keys = tuple(block_keys(list(range(3, 3 + 3 * BLOCK_TOKENS + 5)), namespace))
    source_ids = (3, 9, 1, 12, 5, 0)
    with KVStoreClient(daemon.address, retries=0, timeout=10.0) as client:

        def release(leases: Sequence[SharedLease]) -> None:
            for lease in leases:
                client.release_lease(lease.lease_id)

        def held() -> Match:
            find = lambda shard: client.find(namespace, shard)  # noqa: E731
            return held_by_every_rank(find, keys, 2, release)

        for rank in (0, 1):
            saver, source = worker_for(daemon, namespace, "split_nhd", "cpu", rank=rank)

            def compute(layer: int, source: list[LayerKV] = source, rank: int = rank) -> None:
                for index, block in enumerate(source_ids):
                    for kv, part in enumerate((source[layer].k, source[layer].v)):
                        part[block] = content(layer, kv + 2 * rank, SIZE, index * SIZE)

            step(saver, StepPlan(saves=(SaveSpec("r", keys, ROOT_KEY, 0, source_ids),)), compute)
            assert saver.wait_for_saves(30.0) and saver.save_counts()["stored"] == 3
            saver.close()
            match = held()
            assert match.found.num_blocks == (0 if rank == 0 else 3)  # rank 1 had nothing yet
            if rank == 0:  # nothing to load: the scheduler ends the leases it took
                release([lease for lease in match.leases if lease is not None])
        assert [len(lease.offsets) for lease in match.leases if lease] == [3, 3]
        leases = match.leases

    target_ids = (10, 2, 14, 4, 6, 8)
    for rank in (1, 0):
        loader, target = worker_for(daemon, namespace, "split_nhd", "cpu", rank=rank)
        load = LoadSpec("r2", keys, 0, target_ids, skip_before=0, leases=leases)
        step(loader, StepPlan(loads=(load,)), lambda layer: None)
        assert loader.take_failed_blocks() == set()
        assert (loader.counts["lookup_leased_blocks"], loader.counts["leased_blocks"]) == (3, 0)
        for layer in range(LAYERS):
            for kv, part in enumerate((target[layer].k, target[layer].v)):
                for index, block in enumerate(target_ids):
                    expected = content(layer, kv + 2 * rank, SIZE, index * SIZE)
                    assert torch.equal(part[block], expected), (rank, layer, kv, index)
        loader.close()
    with KVStoreClient(daemon.address, retries=0, timeout=10.0) as client:
        wait_for(lambda: client.stats().active_leases == 0, timeout=10.0)  # both ended


def test_a_lookup_lease_the_worker_cannot_use_is_ended_and_the_blocks_leased_anew(
    daemon: Daemon,
) -> None:
    """A lease too close to its end for the load, or of an arena this process does not map
    (the daemon restarted since the lookup), is not read: the worker leases the blocks
    itself, loads them all the same, and ends the lookup's lease."""
    model = ModelFingerprint("worker-test", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS)
    namespace = Namespace(model, "unusable-lease")
    keys = tuple(block_keys(list(range(5, 5 + 2 * BLOCK_TOKENS + 1)), namespace))
    saver, source = worker_for(daemon, namespace, "cpu", "cpu")

    def compute(layer: int) -> None:
        for index, block in enumerate((0, 1, 2, 3)):
            for kv, part in enumerate((source[layer].k, source[layer].v)):
                part[block] = content(layer, kv, SIZE, index * SIZE)

    step(saver, StepPlan(saves=(SaveSpec("r", keys, ROOT_KEY, 0, (0, 1, 2, 3)),)), compute)
    assert saver.wait_for_saves(30.0)
    saver.close()
    with KVStoreClient(daemon.address, retries=0, timeout=10.0) as client:
        for unusable in ("expiring", "other arena"):
            found = client.find(namespace, keys).shared()
            assert found is not None and len(found.offsets) == 2
            if unusable == "expiring":
                found = dataclasses.replace(found, alive_until=time.monotonic() + 0.5)
            else:
                found = dataclasses.replace(found, arena_id=b"\0" * 16)
            loader, target = worker_for(daemon, namespace, "cpu", "cpu")
            load = LoadSpec("r2", keys, 0, (8, 9, 10, 11), skip_before=0, leases=(found,))
            step(loader, StepPlan(loads=(load,)), lambda layer: None)
            assert loader.take_failed_blocks() == set()
            assert (loader.counts["lookup_leased_blocks"], loader.counts["leased_blocks"]) == (0, 2)
            for layer in range(LAYERS):
                for index, block in enumerate((8, 9, 10, 11)):
                    assert torch.equal(
                        target[layer].k[block], content(layer, 0, SIZE, index * SIZE)
                    )
            loader.close()
            wait_for(lambda: client.stats().active_leases == 0, timeout=10.0), unusable


def test_a_missing_block_loads_the_prefix_and_reports_the_rest(daemon: Daemon) -> None:
    model = ModelFingerprint("worker-test", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS)
    namespace = Namespace(model, "missing")
    keys = block_keys(list(range(1, 3 * BLOCK_TOKENS + 1)), namespace)
    saver, _ = worker_for(daemon, namespace, "cpu", "cpu")
    save = SaveSpec("r", tuple(keys[:2]), ROOT_KEY, 0, (0, 1, 2, 3))
    step(saver, StepPlan(saves=(save,)), lambda layer: None)
    assert saver.wait_for_saves(30.0)
    saver.close()

    loader, _ = worker_for(daemon, namespace, "cpu", "cpu")
    load = LoadSpec("r2", tuple(keys), 0, (4, 5, 6, 7, 8, 9), skip_before=0)
    step(loader, StepPlan(loads=(load,)), lambda layer: None)
    assert loader.take_failed_blocks() == {8, 9}  # block 2 was never saved
    assert loader.counts["missing_blocks"] == 1
    loader.close()


def test_a_dead_daemon_fails_the_load_for_recompute_without_waiting(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path)  # never started
    model = ModelFingerprint("worker-test", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS)
    namespace = Namespace(model, "")
    # Timeouts past the test's own: a step that waited for one would never end.
    loader, target = worker_for(daemon, namespace, "cpu", "cpu", timeout_s=NEVER_S)
    keys = block_keys(list(range(1, BLOCK_TOKENS + 1)), namespace)
    step(loader, StepPlan(loads=(LoadSpec("r", tuple(keys), 0, (3, 4), 0),)), lambda layer: None)
    assert loader.take_failed_blocks() == {3, 4}
    assert not any(layer.k.any() or layer.v.any() for layer in target)
    # Saves to a dead daemon are counted as failed, never raised into the step.
    save = SaveSpec("r", tuple(keys), ROOT_KEY, 0, (3, 4))
    step(loader, StepPlan(saves=(save,)), lambda layer: None)
    assert loader.wait_for_saves(10.0)
    assert loader.save_counts()["failed"] == 1
    loader.close()


def test_saving_more_than_the_queue_holds_drops_and_counts(daemon: Daemon) -> None:
    model = ModelFingerprint("worker-test", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS)
    namespace = Namespace(model, "drops")
    link = Link(
        daemon.address,
        namespace,
        retry_s=0.1,
        role="worker",
        call_timeout=NEVER_S,  # a step that waited for the hung daemon would never end
        wait_for_connect=True,
    )
    layers = [
        layer_kv(make_layer("cpu", "cpu"), "cpu", num_kv_heads=HEADS, head_dim=DIM)
        for _ in range(LAYERS)
    ]
    worker = WorkerSide(link, namespace, layers, save_queue_blocks=2, load_timeout_s=NEVER_S)
    assert link.warm()
    keys = block_keys(list(range(1, 6 * BLOCK_TOKENS + 1)), namespace)
    saves = tuple(
        SaveSpec(f"r{i}", (keys[i],), keys[i - 1] if i else ROOT_KEY, i, (2 * i, 2 * i + 1))
        for i in range(6)
    )
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGSTOP)  # puts hang: the queue cannot drain meanwhile
    try:  # the steps end while the daemon is stopped: they never wait for it
        step(worker, StepPlan(saves=saves), lambda layer: None)
        step(worker, StepPlan(saves=saves[:1]), lambda layer: None)  # still full
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert worker.counts["queued_saves"] == 2 and worker.counts["dropped_saves"] == 5
    assert worker.wait_for_saves(30.0)
    assert worker.save_counts()["stored"] == 2
    with KVStoreClient(daemon.address) as client:
        assert client.lookup(namespace, keys) == 2  # the first two blocks of the chain
    worker.close()


def handoff_worker(daemon: Daemon, namespace: Namespace, timeout_s: float) -> WorkerSide:
    """A prefill instance's worker: a save queue of 2 blocks, its steps end once their saves
    are committed (or after ``timeout_s``)."""
    link = Link(daemon.address, namespace, retry_s=0.1, role="worker", call_timeout=NEVER_S,
                wait_for_connect=True)  # fmt: skip
    layers = [
        layer_kv(make_layer("cpu", "cpu"), "cpu", num_kv_heads=HEADS, head_dim=DIM)
        for _ in range(LAYERS)
    ]
    assert link.warm()
    return WorkerSide(link, namespace, layers, save_queue_blocks=2, load_timeout_s=NEVER_S,
                      handoff_timeout_s=timeout_s)  # fmt: skip


def test_a_prefill_step_ends_once_its_saves_are_readable_and_drops_none(daemon: Daemon) -> None:
    """With the hand-off the step's end is the hand-off: right after it (no wait for the
    queue), another client finds every block the step saved, though they were three times
    what the save queue holds (it waited for room instead of dropping)."""
    model = ModelFingerprint("worker-test", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS)
    namespace = Namespace(model, "handoff")
    worker = handoff_worker(daemon, namespace, timeout_s=NEVER_S)
    keys = block_keys(list(range(1, 6 * BLOCK_TOKENS + 1)), namespace)
    saves = tuple(
        SaveSpec(f"r{i}", (keys[i],), keys[i - 1] if i else ROOT_KEY, i, (2 * i, 2 * i + 1))
        for i in range(6)
    )
    with KVStoreClient(daemon.address) as client:
        for _ in range(3):  # a tight race, taken three times
            client.delete(namespace, keys[:1])
            assert client.lookup(namespace, keys) == 0
            step(worker, StepPlan(saves=saves), lambda layer: None)
            assert client.lookup(namespace, keys) == 6
    assert worker.counts["dropped_saves"] == 0 and worker.counts["queued_saves"] == 18
    assert worker.counts["handoff_save_timeouts"] == 0
    assert len(worker.take_handoff_waits()) == 3  # one wait observed a step
    worker.close()


def test_a_prefill_step_waits_for_a_hung_daemon_no_longer_than_its_bound(
    daemon: Daemon,
) -> None:
    model = ModelFingerprint("worker-test", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS)
    namespace = Namespace(model, "handoff-hung")
    bound = 0.5
    worker = handoff_worker(daemon, namespace, timeout_s=bound)
    keys = block_keys(list(range(1, BLOCK_TOKENS + 1)), namespace)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGSTOP)  # its put hangs
    try:
        began = time.monotonic()
        step(worker, StepPlan(saves=(SaveSpec("r", (keys[0],), ROOT_KEY, 0, (0, 1)),)),
             lambda layer: None)  # fmt: skip
        waited = time.monotonic() - began
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert waited >= bound  # it waited for the commit, up to its bound ...
    assert worker.counts["handoff_save_timeouts"] == 1  # ... and gave up, counted (the put
    # still hangs: a step that waited for it would never have returned, pytest's timeout)
    assert worker.wait_for_saves(30.0)
    worker.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_load_is_ordered_with_vllms_own_stream_both_ways(daemon: Daemon) -> None:
    # vLLM computes on a stream of its own. Queued there before the step: a long kernel, then
    # an earlier user of the pages writing them. The load must land after that write, and
    # what vLLM reads after wait_layer (on its stream) must be the loaded KV: a load on any
    # other stream without events would land first and be overwritten, or be read too soon.
    model = ModelFingerprint("worker-test", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS)
    namespace = Namespace(model, "cuda-streams")
    keys = block_keys(list(range(3, 3 + 2 * BLOCK_TOKENS)), namespace)
    source_ids, target_ids = (3, 9, 1, 12), (10, 2, 14, 4)
    saver, source = worker_for(daemon, namespace, "packed", "cuda")

    def compute(layer: int) -> None:
        for vllm_index, block in enumerate(source_ids):
            for kv, part in enumerate((source[layer].k, source[layer].v)):
                part[block] = content(layer, kv, SIZE, vllm_index * SIZE).cuda()

    step(saver, StepPlan(saves=(SaveSpec("r", tuple(keys), ROOT_KEY, 0, source_ids),)), compute)
    assert saver.wait_for_saves(30.0) and saver.save_counts()["stored"] == 2
    saver.close()

    loader, target = worker_for(daemon, namespace, "packed", "cuda", timeout_s=30.0)
    seen: list[list[torch.Tensor]] = []
    vllm_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(vllm_stream):
        torch.cuda._sleep(2_000_000_000)  # type: ignore[attr-defined]
        for layer in target:
            layer.k.fill_(-1.0)
            layer.v.fill_(-1.0)

        def read(layer: int) -> None:  # vLLM's attention reading the loaded pages
            seen.append([target[layer].k[list(target_ids)].clone()])

        load = LoadSpec("r2", tuple(keys), 0, target_ids, skip_before=0)
        step(loader, StepPlan(loads=(load,)), read)
    torch.cuda.synchronize()
    assert loader.take_failed_blocks() == set()
    for layer in range(LAYERS):
        expected = torch.stack(
            [content(layer, 0, SIZE, i * SIZE) for i in range(len(target_ids))]
        ).cuda()
        assert torch.equal(seen[layer][0], expected), f"layer {layer} read before it landed"
        assert torch.equal(target[layer].k[list(target_ids)], expected)
    loader.close()
