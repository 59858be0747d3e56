"""KVSTORE_KERNELS picks Triton or the torch reference for each entry point."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstore.kernels import dispatch
from kvstore.kernels.rope import RopeConfig, rope_tables
from tests.kernels.cases import paged_batch

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("mode", "device", "expected"),
    [
        (None, CPU, "torch"),
        ("auto", CPU, "torch"),
        ("", CUDA, "triton"),
        ("AUTO", CUDA, "triton"),
        ("torch", CUDA, "torch"),
        ("triton", CUDA, "triton"),
        ("triton", CPU, "triton"),  # the interpreter is on in these tests (conftest)
    ],
)
def test_backend_follows_the_switch(
    mode: str | None, device: torch.device, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if mode is None:
        monkeypatch.delenv(dispatch.KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(dispatch.KERNELS_ENV, mode)
    assert dispatch.kernel_backend(device) == expected


def test_bad_switch_values_and_triton_without_a_gpu_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(dispatch.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="KVSTORE_KERNELS must be one of auto, triton, torch"):
        dispatch.kernel_backend(CPU)
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="needs the Triton interpreter"):
        dispatch.kernel_backend(CPU)


def recording(impl: Callable[..., object], name: str, calls: list[str]) -> Callable[..., object]:
    def spy(*args: object, **kwargs: object) -> object:
        calls.append(name)
        return impl(*args, **kwargs)

    return spy


@pytest.mark.parametrize("mode", ["triton", "torch"])
def test_every_entry_point_runs_the_chosen_implementation(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dispatch.KERNELS_ENV, mode)
    called: list[str] = []
    names = ["prefill_attention", "decode_attention", "load_blocks", "save_blocks"]
    for name in names:
        for backend, impl in dispatch.IMPLEMENTATIONS[name].items():
            spy = recording(impl, f"{name}_{backend}", called)
            monkeypatch.setitem(dispatch.IMPLEMENTATIONS[name], backend, spy)
    batch = paged_batch(
        q_lens=[1, 1],
        seq_lens=[3, 9],
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_tokens=4,
        dtype=torch.float32,
    )
    args = (batch.k_cache, batch.v_cache)
    dispatch.prefill_attention(
        batch.q, *args, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, max_query_len=1
    )
    dispatch.decode_attention(batch.q, *args, batch.seq_lens, batch.block_tables)
    staging = torch.zeros(1, 1, 2, 4, 1, 16, device=batch.q.device)
    slots = torch.arange(4, device=batch.q.device)[None]
    rope = rope_tables(RopeConfig(16), 8, batch.q.device)
    dispatch.load_blocks(staging, batch.kv_pool, slots, slots, rope)
    dispatch.save_blocks(batch.kv_pool, staging, slots, slots, rope)
    assert called == [f"{name}_{mode}" for name in names]
