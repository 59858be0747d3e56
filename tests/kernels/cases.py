"""Builders shared by the kernel tests: paged batches from dense tensors, tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvstore.kernels.paged import new_kv_pool, slot_mapping, write_tokens

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
EACH_DTYPE = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
# Attention accumulates in float32 either way; the differences come from rounding the
# probabilities to the input dtype before P @ V and from the output cast.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
}


@dataclass(frozen=True)
class PagedBatch:
    """A batch of sequences with their KV scattered over shuffled pages of one layer."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_pool: torch.Tensor  # [1, 2, num_pages, page_tokens, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    block_tables: torch.Tensor  # [batch, max_pages] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    max_query_len: int

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv_pool[0, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv_pool[0, 1]


def paged_batch(
    *,
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_tokens: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> PagedBatch:
    """Random q, K and V; each sequence's KV written to its own shuffled pages, NaN elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_tokens) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3  # spare pages hold garbage nobody may read
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(pages_per_seq, default=0) + 1, dtype=torch.int32)
    pool = new_kv_pool(1, num_pages, page_tokens, num_kv_heads, head_dim, dtype=dtype)
    # NaN where no sequence's tokens are: a kernel that reads past a token's head_dim or
    # its sequence's end gets NaN in its output, even where the read is multiplied by zero.
    pool.fill_(float("nan"))
    keys, values, taken = [], [], 0
    for seq, (n, pages) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        tables[seq, :pages] = order[taken : taken + pages]
        taken += pages
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        write_tokens(pool[0, 0], pool[0, 1], k, v, slot_mapping(tables[seq], 0, n, page_tokens))
        keys.append(k.to(device))
        values.append(v.to(device))
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device),
        kv_pool=pool.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        keys=keys,
        values=values,
        max_query_len=max(q_lens, default=0),
    )
