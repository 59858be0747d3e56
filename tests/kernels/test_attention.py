"""Prefill and decode attention: references against SDPA, Triton kernels against references."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kvstore.kernels.attention import prefill_attention_reference, prefill_attention_triton
from kvstore.kernels.decode import decode_attention_reference, decode_attention_triton
from tests.kernels.cases import DEVICE, EACH_DTYPE, TOLERANCES, PagedBatch, paged_batch

# (num_heads, num_kv_heads, head_dim, page_tokens, q_lens, seq_lens)
PREFILL_CASES = {
    "gqa4-prefixes": (4, 1, 64, 8, [5, 17, 0, 1], [13, 17, 9, 40]),
    "gqa2-tiles": (4, 2, 128, 16, [33, 3], [33, 24]),
    "mha-odd-pages": (2, 2, 64, 5, [7], [19]),
    # head_dims that are not powers of two: tiled padded, tail lanes masked.
    "gqa2-head-dim-80": (4, 2, 80, 8, [5, 17], [13, 20]),
    "mha-head-dim-48": (2, 2, 48, 5, [7, 1], [19, 6]),
    "gqa4-head-dim-96": (4, 1, 96, 16, [3, 20], [30, 20]),
    "mha-head-dim-8": (2, 2, 8, 4, [6], [9]),  # below tl.dot's 16: the tile stays 16
}
# (num_heads, num_kv_heads, head_dim, page_tokens, seq_lens, num_splits)
DECODE_CASES = {
    "gqa4-splits": (8, 2, 128, 16, [1, 17, 70, 33], 3),
    "mha-one-split": (4, 4, 64, 8, [5, 40], 1),
    "gqa3-empty-shares": (6, 2, 64, 7, [30, 2, 13], 4),
    "gqa4-head-dim-80": (8, 2, 80, 16, [1, 17, 40], 3),
    "mha-head-dim-48": (4, 4, 48, 8, [5, 40], 2),
    "gqa3-head-dim-96": (6, 2, 96, 7, [30, 2, 13], 4),
}


def sdpa(batch: PagedBatch, seq: int) -> torch.Tensor:
    """Dense attention of one sequence's queries, bottom-right causal, in float32."""
    q = batch.q[batch.cu_seqlens_q[seq] : batch.cu_seqlens_q[seq + 1]]
    k, v = batch.keys[seq], batch.values[seq]
    mask = torch.ones(q.size(0), k.size(0), dtype=torch.bool, device=q.device)
    mask = mask.tril(k.size(0) - q.size(0))
    out = F.scaled_dot_product_attention(
        *(x.float().transpose(0, 1) for x in (q, k, v)), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


def prefill_batch(case: str, dtype: torch.dtype) -> PagedBatch:
    heads, kv_heads, head_dim, page_tokens, q_lens, seq_lens = PREFILL_CASES[case]
    return paged_batch(
        q_lens=q_lens,
        seq_lens=seq_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_tokens=page_tokens,
        dtype=dtype,
    )


def decode_batch(case: str, dtype: torch.dtype) -> tuple[PagedBatch, int]:
    heads, kv_heads, head_dim, page_tokens, seq_lens, num_splits = DECODE_CASES[case]
    batch = paged_batch(
        q_lens=[1] * len(seq_lens),
        seq_lens=seq_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_tokens=page_tokens,
        dtype=dtype,
        seed=1,
    )
    return batch, num_splits


def run_prefill(
    batch: PagedBatch, impl: Callable[..., torch.Tensor] = prefill_attention_reference
) -> torch.Tensor:
    return impl(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.block_tables,
        max_query_len=batch.max_query_len,
    )


@EACH_DTYPE
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_reference_matches_sdpa_on_dense_tensors(case: str, dtype: torch.dtype) -> None:
    batch = prefill_batch(case, dtype)
    out = run_prefill(batch)
    for seq in range(batch.seq_lens.numel()):
        rows = slice(int(batch.cu_seqlens_q[seq]), int(batch.cu_seqlens_q[seq + 1]))
        torch.testing.assert_close(out[rows].float(), sdpa(batch, seq), **TOLERANCES[dtype])


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_reference_matches_sdpa_on_dense_tensors(case: str) -> None:
    batch, _ = decode_batch(case, torch.float32)
    out = decode_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables
    )
    expected = torch.cat([sdpa(batch, seq) for seq in range(batch.seq_lens.numel())])
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@EACH_DTYPE
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_kernel_matches_reference(case: str, dtype: torch.dtype) -> None:
    batch = prefill_batch(case, dtype)
    expected = run_prefill(batch)
    out = run_prefill(batch, prefill_attention_triton)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@EACH_DTYPE
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_kernel_matches_reference(case: str, dtype: torch.dtype) -> None:
    batch, num_splits = decode_batch(case, dtype)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    expected = decode_attention_reference(*args)
    out = decode_attention_triton(*args, num_splits=num_splits)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


def test_custom_scale_and_strided_caches_are_honoured() -> None:
    batch = prefill_batch("mha-odd-pages", torch.float32)
    # A pool whose layer holds [k, v] pages interleaved: non-default page strides.
    pool = batch.kv_pool.transpose(1, 2).contiguous().transpose(1, 2)
    args = (batch.q, pool[0, 0], pool[0, 1], batch.cu_seqlens_q, batch.seq_lens)
    expected = prefill_attention_reference(
        *args, batch.block_tables, max_query_len=batch.max_query_len, scale=0.3
    )
    out = prefill_attention_triton(
        *args, batch.block_tables, max_query_len=batch.max_query_len, scale=0.3
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_empty_batches_return_empty_outputs() -> None:
    batch = prefill_batch("mha-odd-pages", torch.float32)
    none = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for impl in (prefill_attention_triton, prefill_attention_reference):
        out = impl(
            batch.q[:0],
            batch.k_cache,
            batch.v_cache,
            none,
            none[:0],
            batch.block_tables[:0],
            max_query_len=0,
        )
        assert out.shape == (0, *batch.q.shape[1:])


def bad_prefill_args(batch: PagedBatch, **changes: object) -> dict[str, object]:
    args: dict[str, object] = {
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "cu_seqlens_q": batch.cu_seqlens_q,
        "seq_lens": batch.seq_lens,
        "block_tables": batch.block_tables,
        "max_query_len": batch.max_query_len,
    }
    return {**args, **changes}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: {"q": b.q.double()}, "q dtype"),
        (lambda b: {"q": b.q[:, :, :47].contiguous()}, "q head_dim must be even and in 2..256"),
        (lambda b: {"q": b.q.repeat(1, 1, 3)}, "q head_dim must be even and in 2..256, got 384"),
        (lambda b: {"q": b.q.transpose(1, 2).contiguous().transpose(1, 2)}, "q must be contiguous"),
        (lambda b: {"q": b.q[:, :1].expand(-1, 3, -1)}, "multiple of k_cache's num_kv_heads"),
        (lambda b: {"k_cache": b.k_cache.half()}, "k_cache dtype"),
        (lambda b: {"v_cache": b.v_cache[:2]}, "v_cache shape must equal"),
        (
            lambda b: {"v_cache": b.v_cache.repeat(1, 2, 1, 1)[:, : b.v_cache.size(1)]},
            "v_cache strides must equal",
        ),
        (
            lambda b: {
                "k_cache": b.k_cache[..., :32].contiguous(),
                "v_cache": b.v_cache[..., :32].contiguous(),
            },
            "k_cache.shape[3] must equal q's head_dim",
        ),
        (lambda b: {"cu_seqlens_q": b.cu_seqlens_q.long()}, "cu_seqlens_q dtype"),
        (lambda b: {"seq_lens": b.seq_lens[:0]}, "seq_lens.shape[0] must equal batch"),
        (lambda b: {"block_tables": b.block_tables.long()}, "block_tables dtype"),
        (lambda b: {"block_tables": b.block_tables[None]}, "block_tables must be 2-D"),
        (lambda b: {"max_query_len": -1}, "max_query_len"),
        (lambda b: {"scale": 0.0}, "scale must be a positive"),
        (lambda b: {"k_cache": b.k_cache.to("meta")}, "k_cache must be on"),
    ],
)
@pytest.mark.parametrize("impl", [prefill_attention_triton, prefill_attention_reference])
def test_prefill_rejects_bad_arguments_by_name(
    change: Callable[[PagedBatch], dict[str, object]], message: str, impl: Callable[..., object]
) -> None:
    batch = prefill_batch("gqa2-tiles", torch.float32)
    with pytest.raises(ValueError, match=re.escape(message)):
        impl(**bad_prefill_args(batch, **change(batch)))


@pytest.mark.parametrize("impl", [decode_attention_triton, decode_attention_reference])
def test_decode_rejects_bad_arguments_by_name(impl: Callable[..., object]) -> None:
    batch, _ = decode_batch("mha-one-split", torch.float32)
    args = (batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    with pytest.raises(ValueError, match="q must be 3-D"):
        impl(batch.q[0], *args)
    with pytest.raises(ValueError, match=re.escape("seq_lens.shape[0] must equal batch")):
        impl(batch.q[:1], *args)


def test_decode_kernel_rejects_bad_split_counts() -> None:
    batch, _ = decode_batch("mha-one-split", torch.float32)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables)
    for bad in (0, 17, 2.0):
        with pytest.raises(ValueError, match="num_splits"):
            decode_attention_triton(*args, num_splits=bad)


def test_reference_rejects_lengths_the_kernel_cannot_check() -> None:
    batch = prefill_batch("mha-odd-pages", torch.float32)
    short = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"7 queries need 0\.\.seq_len"):
        run_prefill(dataclasses.replace(batch, seq_lens=short))
    decode, _ = decode_batch("mha-one-split", torch.float32)
    with pytest.raises(ValueError, match="seq_lens must all be >= 1"):
        decode_attention_reference(
            decode.q, decode.k_cache, decode.v_cache, decode.seq_lens * 0, decode.block_tables
        )
