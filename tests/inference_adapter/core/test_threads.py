"""``torch_ops_alone``: a connector thread's torch ops start no OpenMP team of their own
(one made every OpenMP thread of vLLM's sleep at its barriers; see the module docstring)."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstore.inference_adapter.core import threads
from kvstore.inference_adapter.core.threads import torch_ops_alone


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch on two threads in the calling thread, as vLLM runs it on a 2-core machine."""
    before = torch.get_num_threads()
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores: one thread starts no OpenMP team anyway")
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _threads_added_by(first: Callable[[], None] | None) -> tuple[int, int]:
    """OS threads a parallel copy adds to the process, run on a new thread that calls
    ``first`` before it, and torch's thread count there (counted while it still lives: an
    OpenMP team's threads end with the thread that made it)."""
    source = torch.randn(4 << 20)
    target = torch.empty_like(source)
    result: list[int] = []
    copied, done = threading.Event(), threading.Event()

    def run() -> None:
        if first is not None:
            first()
        tasks = len(os.listdir("/proc/self/task"))
        target.copy_(source)
        torch.add(source, 1, out=target)
        result.extend((len(os.listdir("/proc/self/task")) - tasks, torch.get_num_threads()))
        copied.set()
        done.wait()

    thread = threading.Thread(target=run)
    thread.start()
    copied.wait()
    done.set()
    thread.join()
    assert torch.equal(target, source + 1)
    return result[0], result[1]


def test_a_thread_that_calls_it_runs_its_ops_on_no_team(two_threads: None) -> None:
    added, count = _threads_added_by(None)
    assert (added, count) == (1, 2)  # the control: without it, a team of two
    assert _threads_added_by(torch_ops_alone) == (0, 1)
    assert torch.get_num_threads() == 2  # the caller's, and torch's setting, stay


def test_torchs_own_runtime_is_chosen_beside_another_wheels(tmp_path: Path) -> None:
    """Other wheels bundle a libgomp of their own (sentencepiece does, in vLLM's env);
    setting the count in that one would change nothing for torch's ops."""
    ours = threads._openmp()
    assert ours is not None
    other = tmp_path / "libgomp-0123abcd.so.1"
    shutil.copy(ours._name, other)
    ctypes.CDLL(str(other))  # a second runtime, loaded as a wheel's bundled one would be
    threads._openmp.cache_clear()
    try:
        chosen = threads._openmp()
        assert chosen is not None
        assert chosen._name == ours._name
        assert Path(chosen._name).is_relative_to(Path(torch.__file__).parent.parent)
    finally:
        threads._openmp.cache_clear()
