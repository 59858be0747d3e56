"""The save queue against a real daemon: jobs put in order, the KV's event waited for first,
a full queue refusing at once; ``ready_event`` on the CPU, and (where there is one) a job on
CUDA copied straight from device memory into the daemon."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.client import ROOT_KEY, KVStoreClient, ModelFingerprint, Namespace, block_keys
from kvstore.inference_adapter.core.saver import SaveJob, SaveQueue, ready_event
from tests.support.daemon import running_daemon

MODEL = ModelFingerprint("saver", 2, 2, 16, "float32", block_tokens=4)
NAMESPACE = Namespace(MODEL, tenant="saver")


def blocks(count: int) -> torch.Tensor:
    return torch.randn(count, *MODEL.layout().shape)


class Ready:
    """Stands in for a CUDA event on the CPU: ``synchronize`` blocks until ``fire()``."""

    def __init__(self) -> None:
        self.fired = threading.Event()
        self.waited = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        assert self.fired.wait(10.0)

    def fire(self) -> None:
        self.fired.set()


def test_a_job_is_put_only_once_its_kv_is_ready(tmp_path: Path) -> None:
    keys = block_keys(list(range(8)), NAMESPACE)
    data = blocks(2)
    with (
        running_daemon(tmp_path, host_capacity="16MiB") as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=5.0) as client,
    ):
        queue = SaveQueue(client, NAMESPACE, capacity=4)
        ready = Ready()
        late = data.clone()
        job = SaveJob(tuple(keys), ROOT_KEY, late, ready=ready)  # type: ignore[arg-type]
        assert queue.offer(job)
        assert ready.waited.wait(10.0)
        late.copy_(data * 2)  # what the device copy would land before the event fires
        assert not queue.drain(0.2)  # still waiting for the event: nothing put
        assert client.lookup(NAMESPACE, keys) == 0
        ready.fire()
        assert queue.drain(10.0) and queue.counts.stored == 2
        got = client.get(NAMESPACE, keys)
        assert all(bytes(block) == (data[i] * 2).numpy().tobytes() for i, block in enumerate(got))
        queue.close()


def test_blocks_on_the_cpu_need_no_event() -> None:
    assert ready_event(blocks(1)) is None


@contextlib.contextmanager
def queue_on_cuda(tmp_path: Path, *, pin_arena: bool) -> Iterator[tuple[KVStoreClient, SaveQueue]]:
    """A daemon, a client of it, and a save queue putting through that client."""
    with (
        running_daemon(tmp_path, host_capacity="16MiB") as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=30.0, pin_arena=pin_arena) as client,
    ):
        queue = SaveQueue(client, NAMESPACE, capacity=4)
        yield client, queue
        queue.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_job_on_cuda_is_put_from_device_memory_once_its_event_fired(tmp_path: Path) -> None:
    keys = block_keys(list(range(8)), NAMESPACE)
    data = blocks(2).cuda()
    with queue_on_cuda(tmp_path, pin_arena=True) as (client, queue):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # type: ignore[attr-defined]  # the engine still computes
        late = data * 2  # queued behind the sleep on the engine's stream
        ready = ready_event(late)
        assert ready is not None and not ready.query()
        assert queue.offer(SaveJob(tuple(keys), ROOT_KEY, late, ready=ready))
        assert queue.drain(30.0) and queue.counts.stored == 2
        got = client.get(NAMESPACE, keys)
        expected = (data * 2).cpu()
        assert all(bytes(block) == expected[i].numpy().tobytes() for i, block in enumerate(got))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin_arena", [False, True])
def test_a_save_on_cuda_copies_on_its_own_stream_not_behind_the_engines_next_work(
    tmp_path: Path, pin_arena: bool
) -> None:
    # The put runs on the client's loop thread (and its copy threads), whose current stream
    # is the default one: unless the copy goes on the queue's stream, it waits for the
    # seconds of work the engine queued after the KV.
    keys = block_keys(list(range(8)), NAMESPACE)
    data = blocks(2).cuda()
    with queue_on_cuda(tmp_path, pin_arena=pin_arena) as (client, queue):
        late = data * 2
        ready = ready_event(late)
        torch.cuda._sleep(5_000_000_000)  # type: ignore[attr-defined]  # the engine's next layers
        assert queue.offer(SaveJob(tuple(keys), ROOT_KEY, late, ready=ready))
        assert queue.drain(30.0) and queue.counts.stored == 2
        engine_busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert engine_busy, "the save waited for the engine's work queued after its KV"
        got = client.get(NAMESPACE, keys)
        expected = late.cpu()
        assert all(bytes(block) == expected[i].numpy().tobytes() for i, block in enumerate(got))
