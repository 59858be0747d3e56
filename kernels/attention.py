"""Prefill attention over a paged KV cache with a cached prefix.

A batch holds sequences of different lengths. Sequence b has ``seq_lens[b]`` tokens of KV in
the cache (its cached prefix followed by its new tokens: the caller writes the new tokens'
K/V into the cache first, ``kvstore.kernels.paged.write_tokens``) and ``q_len_b =
cu_seqlens_q[b + 1] - cu_seqlens_q[b]`` new queries packed in ``q``. New query i sits at
position ``seq_lens[b] - q_len_b + i`` and attends causally to keys ``0 ..`` that position.
Query heads are a multiple of KV heads (GQA): query head h reads KV head
``h // (num_heads // num_kv_heads)``.

::

    q:            [num_tokens, num_heads, head_dim]          new tokens of all sequences
    k_cache:      [num_pages, page_tokens, num_kv_heads, head_dim]
    v_cache:      [num_pages, page_tokens, num_kv_heads, head_dim]
    cu_seqlens_q: [batch + 1] int32, cu_seqlens_q[0] = 0
    seq_lens:     [batch] int32, >= each sequence's query count and >= 1 where it has queries
    block_tables: [batch, max_pages] int32
    -> out:       [num_tokens, num_heads, head_dim], q's dtype

``prefill_attention_triton`` is one flash-attention style kernel (online softmax in float32,
one program per query tile, sequence and query head, head_dim tiled padded to a power of two,
tail lanes masked). ``prefill_attention_reference`` is the torch version: per sequence,
gather the pages densely and run a masked softmax in float32.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvstore.kernels._checks import (
    FLOAT_DTYPES,
    check_head_dim,
    check_scale,
    check_size,
    check_tensor,
    head_dim_tile,
)
from kvstore.kernels.paged import check_caches, gather_tokens
from kvstore.kernels.tuning import Launch, Tuner, bucket

LOG2_E = 1.4426950408889634
PREFILL_TUNER = Tuner("prefill_attention launch")
PATH_TUNER = Tuner("prefill_attention path")


@triton.jit  # type: ignore[untyped-decorator]
def attend_pages(  # type: ignore[no-untyped-def]
    acc,  # [ROWS, BLOCK_D] float32 running output, lanes past HEAD_DIM zero
    l_i,  # [ROWS] running sum of exp2
    m_i,  # [ROWS] running max, log2 domain
    q,  # [ROWS, BLOCK_D], lanes past HEAD_DIM zero
    q_positions,  # [ROWS] a query sees keys at positions <= its own
    k_ptr,  # [num_pages, page_tokens, num_kv_heads, HEAD_DIM]
    v_ptr,  # [num_pages, page_tokens, num_kv_heads, HEAD_DIM], k_ptr's strides
    table,  # this sequence's row of block_tables, [max_pages] int32
    head_offset,  # kv_head * stride_head
    stride_page,
    stride_token,
    page_tokens,
    start,
    end,
    scale_log2,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Fold keys ``start .. end - 1`` of one sequence into a running softmax (flash
    attention, one KV head); returns the updated acc, l_i, m_i. ``CAUSAL``: a row sees only
    keys at positions up to ``q_positions``; without it, every key in the range is visible
    to every row (the tiles below a prefill tile's diagonal, and decode)."""
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    for block_start in range(start, end, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        pages = tl.load(table + keys // page_tokens, mask=key_ok, other=0).to(tl.int64)
        rows = pages * stride_page + (keys % page_tokens) * stride_token + head_offset
        # Zero tail lanes add nothing to q @ k and leave acc's tail lanes zero.
        kv_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            visible = key_ok[None, :] & (keys[None, :] <= q_positions[:, None])
        else:
            visible = key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit  # type: ignore[untyped-decorator]
def _prefill_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_ptr,  # [num_pages, page_tokens, num_kv_heads, HEAD_DIM]
    v_ptr,  # [num_pages, page_tokens, num_kv_heads, HEAD_DIM], k_ptr's strides
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM] contiguous
    cu_seqlens_q_ptr,  # [batch + 1] int32
    seq_lens_ptr,  # [batch] int32
    block_tables_ptr,  # [batch, max_pages] int32
    scale_log2,  # softmax scale * log2(e)
    q_stride_token,
    q_stride_head,
    out_stride_token,
    cache_stride_page,
    cache_stride_token,
    cache_stride_head,
    table_stride,
    page_tokens,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # A tile's BLOCK_M rows are (query, head) pairs: BLOCK_M // HEADS queries of HEADS query
    # heads that share one KV head (HEADS divides GROUP), so each K/V tile is read once for
    # all of them. HEADS = 1: one query head a program.
    QUERIES: tl.constexpr = BLOCK_M // HEADS
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    first_head = tl.program_id(2) * HEADS
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * QUERIES >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    pairs = tl.arange(0, BLOCK_M)
    queries = tile * QUERIES + pairs // HEADS
    heads = first_head + pairs % HEADS
    row_ok = (pairs < QUERIES * HEADS) & (queries < q_len)
    q_positions = seq_len - q_len + queries
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    tokens = (q_start + queries).to(tl.int64)
    q_rows = tokens * q_stride_token + heads * q_stride_head
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * table_stride
    head_offset = (first_head // GROUP).to(tl.int64) * cache_stride_head
    # Causal: no query of this tile sees past its last position. The key tiles wholly at or
    # before its first query's position are visible to every row: no mask; only the tiles
    # from there to the end cross the diagonal. Key 0 is visible to every row, so the
    # running max is finite after the first key block.
    end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * QUERIES)
    below = (seq_len - q_len + tile * QUERIES + 1) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = attend_pages(
        tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
        tl.zeros([BLOCK_M], tl.float32),
        tl.full([BLOCK_M], float("-inf"), tl.float32),
        q,
        q_positions,
        k_ptr,
        v_ptr,
        table,
        head_offset,
        cache_stride_page,
        cache_stride_token,
        page_tokens,
        0,
        below,
        scale_log2,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        DOT_FP32,
        DOT_PRECISION,
        False,
    )
    acc, l_i, _ = attend_pages(
        acc,
        l_i,
        m_i,
        q,
        q_positions,
        k_ptr,
        v_ptr,
        table,
        head_offset,
        cache_stride_page,
        cache_stride_token,
        page_tokens,
        below,
        end,
        scale_log2,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        DOT_FP32,
        DOT_PRECISION,
        True,
    )
    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    out_rows = tokens * out_stride_token + heads * HEAD_DIM
    tl.store(
        out_ptr + out_rows[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    q_shape: str,
    batch: int,
    scale: float | None,
) -> float:
    """Checks shared by prefill and decode; returns the softmax scale.

    Raises:
        ValueError: Naming the first offending argument.
    """
    check_tensor("q", q, shape=q_shape, dtypes=FLOAT_DTYPES, contiguous_dims=1)
    check_caches(k_cache, v_cache, dtype=q.dtype, device=q.device)
    num_heads, head_dim = q.shape[1:]
    check_head_dim("q", head_dim)
    check_size("k_cache", k_cache, 3, head_dim, "q's head_dim")
    if num_heads % k_cache.size(2):
        raise ValueError(
            f"q's num_heads ({num_heads}) must be a multiple of k_cache's num_kv_heads "
            f"({k_cache.size(2)})"
        )
    check_tensor("seq_lens", seq_lens, shape="[batch]", dtypes=(torch.int32,), device=q.device)
    check_size("seq_lens", seq_lens, 0, batch, "batch")
    check_tensor(
        "block_tables",
        block_tables,
        shape="[batch, max_pages]",
        dtypes=(torch.int32,),
        device=q.device,
        contiguous_dims=1,
    )
    check_size("block_tables", block_tables, 0, batch, "batch")
    return check_scale(scale, head_dim)


def _check_prefill_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float | None,
) -> float:
    check_tensor(
        "cu_seqlens_q", cu_seqlens_q, shape="[batch + 1]", dtypes=(torch.int32,), device=q.device
    )
    if cu_seqlens_q.numel() < 1:
        raise ValueError("cu_seqlens_q must hold batch + 1 >= 1 offsets, got none")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be an int >= 0, got {max_query_len!r}")
    batch = cu_seqlens_q.numel() - 1
    shape = "[num_tokens, num_heads, head_dim]"
    return check_attention_args(
        q, k_cache, v_cache, seq_lens, block_tables, q_shape=shape, batch=batch, scale=scale
    )


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    max_query_len: int,
    scale: float | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """Triton: causal attention of new tokens over their cached prefix and themselves.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, float16, bfloat16 or float32.
        k_cache: ``[num_pages, page_tokens, num_kv_heads, head_dim]``, q's dtype and device;
            already holds the new tokens' K.
        v_cache: Same, V.
        cu_seqlens_q: ``[batch + 1]`` int32 offsets of each sequence's queries in ``q``.
        seq_lens: ``[batch]`` int32 tokens of KV per sequence, prefix plus new.
        block_tables: ``[batch, max_pages]`` int32 pages of each sequence.
        max_query_len: The largest query count of any sequence (sizes the grid; a sequence
            with more queries gets unwritten output rows).
        scale: Softmax scale, ``1/sqrt(head_dim)`` when None.
        launch: Tiles, warps and stages; None: the fastest of ``prefill_launches`` for this
            shape on this GPU (:mod:`kvstore.kernels.tuning`), the default off CUDA.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: An argument has the wrong shape, dtype, layout or device.
    """
    scale = _check_prefill_args(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_query_len, scale
    )
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = seq_lens.numel()
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out

    group = num_heads // k_cache.size(2)

    def run(chosen: Launch) -> torch.Tensor:
        block_m = chosen.block_m or tile_sizes(q)[0]
        heads = chosen.heads or 1
        if group % heads or block_m < heads:
            raise ValueError(
                f"launch {chosen}: {heads} heads a tile must divide the GQA group ({group}) "
                f"and fit its {block_m} rows"
            )
        grid = (triton.cdiv(max_query_len, block_m // heads), batch, num_heads // heads)
        _prefill_attention_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            cu_seqlens_q,
            seq_lens,
            block_tables,
            scale * LOG2_E,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            *k_cache.stride()[:3],
            block_tables.stride(0),
            k_cache.size(1),
            GROUP=group,
            HEADS=heads,
            HEAD_DIM=head_dim,
            BLOCK_D=head_dim_tile(head_dim),
            BLOCK_M=block_m,
            BLOCK_N=chosen.block_n or tile_sizes(q)[1],
            **chosen.options(),
            **dot_options(q),
        )
        return out

    if launch is not None:
        return run(launch)
    candidates = {
        str(c): functools.partial(run, c) for c in prefill_launches(q.dtype, group, cuda=q.is_cuda)
    }
    return PREFILL_TUNER.run(prefill_key(q, k_cache, block_tables), candidates, q.device)


def prefill_launches(dtype: torch.dtype, group: int, *, cuda: bool) -> list[Launch]:
    """The prefill kernel's launch settings tried on CUDA, the default first: tiles of 64 or
    128 rows, key tiles of 32 to 128, 4 or 8 warps, 2 or 3 stages; with GQA, also tiles whose
    rows are the ``group`` query heads of a KV head (its K/V tiles read once for all)."""
    if not cuda:
        return [Launch()]
    if dtype == torch.float32:
        tried = [Launch(32, 4, 2, 64), Launch(16, 4, 2, 32)]
        shared = [Launch(32, 4, 2, 64, group)]
    else:
        tried = [Launch(64, 8, 3, 128), Launch(64, 4, 3, 128), Launch(32, 4, 3, 64),
                 Launch(64, 4, 2, 64), Launch(128, 8, 2, 64)]  # fmt: skip
        shared = [Launch(64, 4, 3, 64, group), Launch(64, 8, 3, 128, group),
                  Launch(32, 4, 2, 128, group)]  # fmt: skip
    fits = [launch for launch in shared if 1 < group <= launch.block_m // 16]
    return [Launch(), *tried, *fits]


def prefill_key(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor) -> object:
    """A prefill call's shape for the tuners: fixed sizes as they are, the varying ones
    (tokens, batch, pages of the longest sequence) in powers of two."""
    num_heads, head_dim = q.shape[1:]
    page_tokens, num_kv_heads = k_cache.shape[1:3]
    return (q.dtype, head_dim, num_heads // num_kv_heads, page_tokens, bucket(q.size(0)),
            bucket(block_tables.size(0)), bucket(block_tables.size(1) * page_tokens))  # fmt: skip


def prefill_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    max_query_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` per sequence over its pages gathered densely: the
    other path :func:`prefill_attention_fastest` may pick. Arguments and result as
    ``prefill_attention_triton``; it reads the lengths on the host (a device sync).

    Raises:
        ValueError: As the reference.
    """
    scale = _check_prefill_args(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_query_len, scale
    )
    return _per_sequence(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                         functools.partial(_sdpa, scale=scale))  # fmt: skip


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`attend` by ``scaled_dot_product_attention``, in the tensors' dtype."""
    new, seq_len = q.size(0), k.size(0)
    mask = None
    if new != seq_len:  # the queries sit at the end: each sees its prefix and itself
        mask = torch.ones(new, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - new)
    heads_first = [x.transpose(0, 1)[None] for x in (q, k, v)]  # [1, heads, tokens, dim]
    found = F.scaled_dot_product_attention(
        heads_first[0], heads_first[1], heads_first[2], attn_mask=mask,
        is_causal=mask is None, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return found[0].transpose(0, 1)


def prefill_attention_fastest(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    max_query_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Prefill by the faster path for this shape on this GPU: the paged Triton kernel (its
    launch tuned too), or SDPA over the gathered pages; the choice is logged once per shape
    (:mod:`kvstore.kernels.tuning`). Off CUDA, the Triton kernel. Arguments and result as
    ``prefill_attention_triton``."""
    args = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    candidates = {
        "triton": functools.partial(
            prefill_attention_triton, *args, max_query_len=max_query_len, scale=scale
        ),
        "sdpa": functools.partial(
            prefill_attention_sdpa, *args, max_query_len=max_query_len, scale=scale
        ),
    }
    return PATH_TUNER.run(prefill_key(q, k_cache, block_tables), candidates, q.device)


def dot_options(q: torch.Tensor) -> dict[str, bool | str | None]:
    """How the attention kernels call ``tl.dot`` for q's dtype and device.

    float32 multiplies in full precision (no TF32 rounding). The Triton interpreter
    multiplies bfloat16 operands as their raw 16-bit patterns, so off CUDA they are widened
    to float32 first; on CUDA they stay bfloat16 for the tensor cores.
    """
    widen = q.dtype == torch.bfloat16 and not q.is_cuda
    precise = q.dtype == torch.float32 or widen
    return {"DOT_FP32": widen, "DOT_PRECISION": "ieee" if precise else None}


def tile_sizes(q: torch.Tensor) -> tuple[int, int]:
    """(queries, keys) per tile. Small under the interpreter (quick, and the tests reach
    several tiles); halved for float32 on CUDA so pipelined K/V tiles fit shared memory."""
    if not q.is_cuda:
        return 16, 16
    return (32, 32) if q.dtype == torch.float32 else (64, 64)


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    max_query_len: int,
    scale: float | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """Torch reference of ``prefill_attention_triton`` (same arguments, same result;
    ``launch`` is ignored).

    Reads the lengths on the host, so it also checks them: a sequence with more queries than
    KV tokens, or more tokens than its pages hold, raises ValueError.
    """
    scale = _check_prefill_args(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_query_len, scale
    )
    return _per_sequence(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                         functools.partial(attend, scale=scale))  # fmt: skip


def _per_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    attend_one: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``attend_one(queries, keys, values)`` of each sequence, its pages gathered densely;
    the lengths read on the host and checked (ValueError naming the sequence)."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    offsets, lengths = cu_seqlens_q.tolist(), seq_lens.tolist()
    for seq, ((q_start, q_end), seq_len) in enumerate(
        zip(itertools.pairwise(offsets), lengths, strict=True)
    ):
        if not 0 <= q_end - q_start <= seq_len:
            raise ValueError(
                f"sequence {seq}: {q_end - q_start} queries need 0..seq_len ({seq_len}) of them"
            )
        if q_end == q_start:
            continue
        keys = gather_tokens(k_cache, block_tables[seq], seq_len)
        values = gather_tokens(v_cache, block_tables[seq], seq_len)
        out[q_start:q_end] = attend_one(q[q_start:q_end], keys, values)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal GQA attention of the last ``len(q)`` positions, in float32 (float64 for
    16-bit tensors on the CPU: then a query's result does not depend on how many queries or
    masked keys share the call, so a decode step and a prefill round alike).

    Args:
        q: ``[num_queries, num_heads, head_dim]``, the queries of positions
            ``len(k) - num_queries ..``.
        k: ``[num_keys, num_kv_heads, head_dim]``.
        v: ``[num_keys, num_kv_heads, head_dim]``.
        scale: Softmax scale.

    Returns:
        ``[num_queries, num_heads, head_dim]`` in q's dtype.
    """
    num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    # Query heads grouped under their KV head: [num_queries, num_kv_heads, group, head_dim].
    wide = torch.float64 if accumulates_in_float64(q) else torch.float32
    grouped = q.to(wide).view(num_queries, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("qhgd,khd->hgqk", grouped, k.to(wide)) * scale
    visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device)
    visible = visible.tril(num_keys - num_queries)
    probs = scores.masked_fill(~visible, -math.inf).softmax(dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.to(wide))
    return out.reshape(num_queries, num_heads, head_dim).to(q.dtype)


def accumulates_in_float64(x: torch.Tensor) -> bool:
    """Whether math on ``x`` accumulates in float64 to be batch-invariant: 16-bit tensors on
    the CPU, whose torch kernels round by batch shape (see ``attend``; the model's
    projections follow the same rule)."""
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
