"""The kernel checks again on CUDA at realistic sizes (Llama-3-8B-like heads, long contexts;
Phi-like head_dims that are not powers of two)."""

from __future__ import annotations

import pytest
import torch

from kvstore.kernels.attention import prefill_attention_reference, prefill_attention_triton
from kvstore.kernels.copy import (
    load_blocks_reference,
    load_blocks_triton,
    save_blocks_reference,
    save_blocks_triton,
)
from kvstore.kernels.decode import decode_attention_reference, decode_attention_triton
from kvstore.kernels.rope import Llama3Scaling, RopeConfig, rope_tables
from kvstore.kernels.tuning import TUNING_ENV
from tests.kernels.cases import EACH_DTYPE, TOLERANCES, paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CUDA = torch.device("cuda")
NUM_HEADS, NUM_KV_HEADS = 32, 8


@pytest.fixture(autouse=True)
def _defaults_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks run the default launches: timing every candidate of every dtype and
    head_dim would compile dozens of kernels. The tuners' own test turns timing back on."""
    monkeypatch.setenv(TUNING_ENV, "0")


@EACH_DTYPE
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_prefill_with_long_cached_prefixes(head_dim: int, dtype: torch.dtype) -> None:
    batch = paged_batch(
        q_lens=[512, 1, 300, 1024],
        seq_lens=[2048, 3001, 300, 1724],
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        page_tokens=16,
        dtype=dtype,
        device=CUDA,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens)
    kwargs = {"max_query_len": batch.max_query_len}
    expected = prefill_attention_reference(*args, batch.block_tables, **kwargs)
    out = prefill_attention_triton(*args, batch.block_tables, **kwargs)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@EACH_DTYPE
@pytest.mark.parametrize("head_dim", [96, 128])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_over_long_contexts(
    num_splits: int | None, head_dim: int, dtype: torch.dtype
) -> None:
    seq_lens = torch.randint(1, 4096, (16,), generator=torch.Generator().manual_seed(0))
    batch = paged_batch(
        q_lens=[1] * 16,
        seq_lens=seq_lens.tolist(),
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        page_tokens=16,
        dtype=dtype,
        device=CUDA,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    expected = decode_attention_reference(*args)
    out = decode_attention_triton(*args, num_splits=num_splits)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@EACH_DTYPE
@pytest.mark.parametrize("head_dim", [80, 128])
def test_copy_rope_of_full_blocks_is_bit_exact(head_dim: int, dtype: torch.dtype) -> None:
    """Eight 256-token blocks of a 32-layer model into 16-token pages, and back."""
    gen = torch.Generator(device=CUDA).manual_seed(0)
    blocks, layers, block_tokens, page_tokens = 8, 32, 256, 16
    staging = torch.randn(
        blocks, layers, 2, block_tokens, NUM_KV_HEADS, head_dim, generator=gen, device=CUDA
    ).to(dtype)
    num_pages = blocks * block_tokens // page_tokens + 4
    pool = torch.zeros(layers, 2, num_pages, page_tokens, NUM_KV_HEADS, head_dim, device=CUDA)
    pool = pool.to(dtype)
    slots = torch.randperm(num_pages * page_tokens, generator=gen, device=CUDA)
    slots = slots[: blocks * block_tokens].view(blocks, block_tokens).contiguous()
    positions = torch.arange(blocks * block_tokens, device=CUDA).view(blocks, -1) + 70000
    rope = rope_tables(
        RopeConfig(head_dim, 500000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192)), 1 << 17, CUDA
    )
    by_kernel, by_reference = pool.clone(), pool.clone()
    load_blocks_triton(staging, by_kernel, slots, positions, rope)
    load_blocks_reference(staging, by_reference, slots, positions, rope)
    assert torch.equal(by_kernel, by_reference)
    saved_kernel, saved_reference = torch.zeros_like(staging), torch.zeros_like(staging)
    save_blocks_triton(by_kernel, saved_kernel, slots, positions, rope)
    save_blocks_reference(by_kernel, saved_reference, slots, positions, rope)
    assert torch.equal(saved_kernel, saved_reference)
    torch.testing.assert_close(saved_kernel.float(), staging.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("page_tokens", [16, 256])
def test_load_layer_reads_host_memory_straight_into_pages(page_tokens: int) -> None:
    """1B-like blocks of 256 tokens scattered in pinned host memory (mapped under unified
    addressing, as a registered arena is), one kernel per layer into 16- and 256-token pages
    of our engine's pool layout, equal to the reference's copies on the CPU."""
    from kvstore.client.tensors import HostMapped
    from kvstore.kernels.transfer import load_layer_reference, load_layer_triton

    heads, dim, block_tokens, num_blocks, layers = 8, 64, 256, 24, 2
    per_block = block_tokens // page_tokens
    block_shape = (layers, 2, block_tokens, heads, dim)
    blocks = torch.randn(num_blocks, *block_shape).to(torch.bfloat16)
    block_bytes = blocks[0].numel() * 2
    arena = torch.zeros(block_bytes * 2 * num_blocks, dtype=torch.uint8).pin_memory()
    offsets = torch.randperm(2 * num_blocks)[:num_blocks] * block_bytes
    for block, offset in zip(blocks, offsets.tolist(), strict=True):
        arena[offset : offset + block_bytes] = block.reshape(-1).view(torch.uint8)
    num_pages = num_blocks * per_block + 5
    pages = torch.randperm(num_pages)[: num_blocks * per_block].view(num_blocks, per_block)
    source = HostMapped(arena.data_ptr(), arena.numel())
    for layer in range(layers):
        pool = torch.zeros(2, num_pages, page_tokens, heads, dim, dtype=torch.bfloat16)
        expected = pool.clone()
        at = offsets + layer * (block_bytes // layers)
        load_layer_reference(arena, at, expected[0], expected[1], pages)
        on_gpu = pool.to(CUDA)
        load_layer_triton(source, at.to(CUDA), on_gpu[0], on_gpu[1], pages.to(CUDA))
        assert torch.equal(on_gpu.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_paths_and_launches_this_gpu_picks_compute_the_same_attention(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tuners time their candidates on this GPU and keep one per shape; whichever they
    keep (a launch of our kernel, or SDPA over the gathered pages), the result is right."""
    monkeypatch.setenv(TUNING_ENV, "1")
    from kvstore.kernels.attention import PATH_TUNER, prefill_attention_fastest
    from kvstore.kernels.decode import DECODE_TUNER

    batch = paged_batch(
        q_lens=[512, 1, 300],
        seq_lens=[2048, 3001, 300],
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=128,
        page_tokens=16,
        dtype=dtype,
        device=CUDA,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens)
    kwargs = {"max_query_len": batch.max_query_len}
    expected = prefill_attention_reference(*args, batch.block_tables, **kwargs)
    for _ in range(2):  # the first call chooses, the second runs the choice
        out = prefill_attention_fastest(*args, batch.block_tables, **kwargs)
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])
    assert len(PATH_TUNER.chosen()) >= 1

    decode = paged_batch(
        q_lens=[1] * 8, seq_lens=[4096] * 8, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
        head_dim=128, page_tokens=16, dtype=dtype, device=CUDA,
    )  # fmt: skip
    args = (decode.q, decode.k_cache, decode.v_cache, decode.seq_lens, decode.block_tables)
    expected = decode_attention_reference(*args)
    torch.testing.assert_close(
        decode_attention_triton(*args).float(), expected.float(), **TOLERANCES[dtype]
    )
    assert len(DECODE_TUNER.chosen()) >= 1
