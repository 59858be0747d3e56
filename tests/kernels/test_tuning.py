"""Choices made on the device (kernels/tuning.py): the fastest candidate per shape, kept;
every launch a GPU may pick computes the same attention (checked under the interpreter);
the SDPA prefill path matches the reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstore.kernels import tuning
from kvstore.kernels.attention import (
    prefill_attention_fastest,
    prefill_attention_reference,
    prefill_attention_sdpa,
    prefill_attention_triton,
    prefill_launches,
)
from kvstore.kernels.copy import (
    copy_launches,
    load_blocks_reference,
    load_blocks_triton,
    save_blocks_reference,
    save_blocks_triton,
)
from kvstore.kernels.decode import (
    decode_attention_reference,
    decode_attention_triton,
    decode_launches,
)
from kvstore.kernels.tuning import Launch, Tuner, bucket
from tests.kernels.cases import DTYPES, EACH_DTYPE, TOLERANCES, paged_batch
from tests.kernels.test_attention import decode_batch, prefill_batch, run_prefill
from tests.kernels.test_copy import copy_case

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class Clock:
    """A fake measure: each candidate's cost by name, and the calls it was asked to time."""

    def __init__(self, costs: dict[str, float]) -> None:
        self.costs = costs
        self.timed: list[str] = []

    def __call__(self, run: Callable[[], object], device: torch.device) -> float:
        name = run()
        assert isinstance(name, str)
        self.timed.append(name)
        return self.costs[name]


def named(*names: str) -> dict[str, Callable[[], str]]:
    return {name: (lambda name=name: name) for name in names}  # type: ignore[misc]


def test_the_fastest_candidate_is_kept_per_key_and_timed_once() -> None:
    clock = Clock({"default": 2.0, "wide": 1.0, "deep": 3.0})
    tuner = Tuner("test", measure=clock)
    assert tuner.run("a", named("default", "wide", "deep"), CUDA) == "wide"
    assert tuner.run("a", named("default", "wide", "deep"), CUDA) == "wide"
    assert clock.timed == ["default", "wide", "deep"]  # the second call timed nothing
    clock.costs["deep"] = 0.5
    assert tuner.run("b", named("default", "wide", "deep"), CUDA) == "deep"  # its own key
    assert tuner.chosen() == {"a": "wide", "b": "deep"}


def test_a_candidate_that_fails_is_left_out_and_all_failing_raise_the_defaults_error() -> None:
    def broken() -> str:
        raise RuntimeError("out of shared memory")

    tuner = Tuner("test", measure=Clock({"default": 2.0, "wide": 1.0}))
    candidates = {"default": (lambda: "default"), "huge": broken, "wide": (lambda: "wide")}
    assert tuner.run("a", candidates, CUDA) == "wide"
    with pytest.raises(RuntimeError, match="out of shared memory"):
        tuner.run("b", {"default": broken, "huge": broken}, CUDA)


def test_off_cuda_or_switched_off_the_default_runs_untimed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock({"default": 2.0, "wide": 1.0})
    tuner = Tuner("test", measure=clock)
    assert tuner.run("a", named("default", "wide"), CPU) == "default"
    monkeypatch.setenv(tuning.TUNING_ENV, "0")
    assert tuner.run("a", named("default", "wide"), CUDA) == "default"
    assert clock.timed == [] and tuner.chosen() == {}
    with pytest.raises(ValueError, match="no candidates"):
        tuner.run("a", {}, CUDA)


def test_buckets_and_launch_names() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [
        0, 1, 2, 4, 4, 8, 1024, 1024, 2048,
    ]  # fmt: skip
    assert str(Launch()) == "default"
    assert str(Launch(64, 8, 3, 128)) == "m=128 n=64 warps=8 stages=3"
    assert Launch(64, 8).options() == {"num_warps": 8}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_decode_launch_a_gpu_may_pick_computes_the_same_attention(
    dtype: torch.dtype,
) -> None:
    batch, num_splits = decode_batch("gqa4-splits", dtype)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    expected = decode_attention_reference(*args)
    launches = decode_launches(dtype, cuda=True)
    assert launches[0] == Launch() and len(set(launches)) == len(launches) > 1
    for launch in launches:  # the interpreter ignores warps and stages; the tiles it runs
        out = decode_attention_triton(*args, num_splits=num_splits, launch=launch)
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["gqa4-head-dim-96"])
def test_every_prefill_launch_a_gpu_may_pick_computes_the_same_attention(
    case: str, dtype: torch.dtype
) -> None:
    batch = prefill_batch(case, dtype)
    expected = run_prefill(batch)
    group = batch.q.size(1) // batch.k_cache.size(2)
    launches = prefill_launches(dtype, group, cuda=True)
    assert launches[0] == Launch() and len(set(launches)) == len(launches) > 1
    assert any(launch.heads == group for launch in launches)  # K/V tiles shared by a group
    for launch in launches:
        out = prefill_attention_triton(
            batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
            batch.block_tables, max_query_len=batch.max_query_len, launch=launch,
        )  # fmt: skip
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@EACH_DTYPE
@pytest.mark.parametrize("case", ["gqa2-tiles", "mha-odd-pages", "gqa4-head-dim-96"])
def test_the_sdpa_prefill_path_matches_the_reference(case: str, dtype: torch.dtype) -> None:
    batch = prefill_batch(case, dtype)
    expected = run_prefill(batch, prefill_attention_reference)
    torch.testing.assert_close(
        run_prefill(batch, prefill_attention_sdpa).float(), expected.float(), **TOLERANCES[dtype]
    )
    # Off CUDA the fastest path is the paged kernel, untimed.
    torch.testing.assert_close(
        run_prefill(batch, prefill_attention_fastest).float(),
        expected.float(),
        **TOLERANCES[dtype],
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_copy_launch_a_gpu_may_pick_moves_the_same_bytes(dtype: torch.dtype) -> None:
    c = copy_case("block-is-page", dtype)
    rows = c.staging.size(3) * c.staging.size(4)
    launches = copy_launches(rows, c.staging.size(5), cuda=True)
    assert launches[0] == Launch() and len(set(launches)) == len(launches) > 1
    loaded, saved = c.kv_pool.clone(), c.staging.clone()
    load_blocks_reference(c.staging, loaded, c.slots, c.positions, c.rope)
    save_blocks_reference(c.kv_pool, saved, c.slots, c.positions, c.rope)
    for launch in launches:
        pool, staging = c.kv_pool.clone(), c.staging.clone()
        load_blocks_triton(c.staging, pool, c.slots, c.positions, c.rope, launch=launch)
        save_blocks_triton(c.kv_pool, staging, c.slots, c.positions, c.rope, launch=launch)
        assert torch.equal(pool, loaded) and torch.equal(staging, saved), launch


@pytest.mark.parametrize("heads", [1, 3, 6])
def test_a_tile_may_hold_any_divisor_of_the_gqa_group_and_nothing_else(heads: int) -> None:
    batch = paged_batch(
        q_lens=[21, 1, 40], seq_lens=[50, 30, 40], num_heads=12, num_kv_heads=2, head_dim=64,
        page_tokens=8, dtype=torch.float32,
    )  # fmt: skip
    args = (batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
            batch.block_tables)  # fmt: skip
    expected = prefill_attention_reference(*args, max_query_len=batch.max_query_len)
    launch = Launch(16, block_m=32, heads=heads)  # 3 heads: 10 queries, 30 of 32 rows
    out = prefill_attention_triton(*args, max_query_len=batch.max_query_len, launch=launch)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match="must divide the GQA group"):
        prefill_attention_triton(*args, max_query_len=40, launch=Launch(16, block_m=32, heads=4))
