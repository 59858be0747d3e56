"""Kernel throughput beside a limit measured in the same run, on the same device.

    python -m benchmarks.kernels [--device cuda|cpu] [--dtype float16] [--size small|large]
                                 [--repeats R] [--json out.json]

The kernels run through ``kvstore.kernels``' dispatch, so on CUDA the Triton kernels run and
on the CPU the torch references do (``KVSTORE_KERNELS`` overrides); the first line printed
says which path ran. Each row is compared with a plain mechanism on the same device:

- decode attention and copy+RoPE (load: staging -> pool with K rotated; save: pool ->
  staging with K un-rotated) against ``Tensor.copy_`` moving the same number of bytes
  (bytes read + bytes written; a copy of N bytes moves 2N). Bandwidth = bytes moved / time.
- prefill attention (new tokens over a cached prefix) against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same sequences held densely,
  in TFLOP/s of the causal score and value products.

Every measurement runs one untimed warm-up call, then ``R`` timed calls; a row shows the
median. ``--size large`` (the default on CUDA) uses Llama-3-8B-like heads and long contexts.
Each row shows the ratio (limit's time / kernel's time) and, for the Triton kernels on CUDA,
whether it reaches its target (decode >= 0.8x, copy+RoPE >= 0.85x, prefill >= 1.0x); on the
CPU the rows are "info".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kvstore.kernels.attention import PATH_TUNER, PREFILL_TUNER
from kvstore.kernels.copy import COPY_TUNER
from kvstore.kernels.decode import DECODE_TUNER
from kvstore.kernels.dispatch import (
    decode_attention,
    kernel_backend,
    load_blocks,
    prefill_attention,
    save_blocks,
)
from kvstore.kernels.rope import RopeConfig, rope_tables

GB = 1e9
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_TOKENS = 32, 8, 128, 16
# size -> (decode batch, decode context, copy blocks, copy layers, prefill prefixes, new tokens)
SIZES = {
    "small": (4, 1024, 2, 4, [256, 512], 128),
    "large": (32, 4096, 8, 32, [2048, 1024, 4096, 0], 1024),
}
BLOCK_TOKENS = 256
COPY_LIMIT = "copy_ of the same bytes"
SDPA_LIMIT = "scaled_dot_product_attention, dense"
# The ratios a CUDA run of the Triton kernels must reach (limit's time / kernel's time).
DECODE_TARGET, COPY_TARGET, PREFILL_TARGET = 0.8, 0.85, 1.0


@dataclass(frozen=True)
class Row:
    """A kernel's median time beside its limit's, measured in the same run on the same work."""

    name: str
    seconds: float
    amount: float  # bytes moved, or flops
    unit: str
    limit: str  # the plain mechanism it is compared with
    limit_seconds: float
    target: float  # the ratio (limit's time / kernel's time) a GPU run must reach

    def rate(self, seconds: float | None = None) -> float:
        spent = self.seconds if seconds is None else seconds
        return self.amount / spent / (GB if self.unit == "GB/s" else 1e12)

    @property
    def ratio(self) -> float:
        return self.limit_seconds / self.seconds


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_baseline(moved_bytes: int, device: torch.device, repeats: int) -> float:
    """Seconds for ``Tensor.copy_`` of moved_bytes / 2 bytes (so it moves moved_bytes)."""
    src = torch.ones(moved_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    return timed(lambda: dst.copy_(src), device, repeats)


def paged_pool(num_tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pages = -(-num_tokens // PAGE_TOKENS) + 1
    shape = (1, 2, pages, PAGE_TOKENS, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=device).to(dtype)


def tables_for(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """Each sequence on its own pages, shuffled."""
    counts = [-(-n // PAGE_TOKENS) for n in seq_lens]
    order = torch.randperm(sum(counts)).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(counts) + 1, dtype=torch.int32)
    for row, start in enumerate(torch.tensor([0, *counts]).cumsum(0)[:-1].tolist()):
        tables[row, : counts[row]] = order[start : start + counts[row]]
    return tables.to(device)


def bench_decode(
    batch: int, context: int, dtype: torch.dtype, device: torch.device, repeats: int
) -> list[Row]:
    seq_lens = [context] * batch
    pool = paged_pool(sum(seq_lens), dtype, device)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    tables = tables_for(seq_lens, device)
    seconds = timed(
        lambda: decode_attention(q, pool[0, 0], pool[0, 1], lens, tables), device, repeats
    )
    moved = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * pool.element_size() + 2 * q.nbytes
    label = f"decode attention (batch {batch}, context {context})"
    limit = copy_baseline(moved, device, repeats)
    return [Row(label, seconds, moved, "GB/s", COPY_LIMIT, limit, DECODE_TARGET)]


def bench_copy(
    blocks: int, layers: int, dtype: torch.dtype, device: torch.device, repeats: int
) -> list[Row]:
    staging = torch.randn(
        blocks, layers, 2, BLOCK_TOKENS, NUM_KV_HEADS, HEAD_DIM, device=device
    ).to(dtype)
    num_pages = blocks * BLOCK_TOKENS // PAGE_TOKENS + 1
    pool = torch.zeros(
        layers, 2, num_pages, PAGE_TOKENS, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device
    )
    slots = (
        torch.randperm(num_pages * PAGE_TOKENS, device=device)[: blocks * BLOCK_TOKENS]
        .view(blocks, -1)
        .contiguous()
    )
    positions = torch.arange(blocks * BLOCK_TOKENS, device=device).view(blocks, -1) + 1000
    rope = rope_tables(RopeConfig(HEAD_DIM, 500000.0), blocks * BLOCK_TOKENS + 1000, device)
    moved = 2 * staging.nbytes
    load = timed(lambda: load_blocks(staging, pool, slots, positions, rope), device, repeats)
    save = timed(lambda: save_blocks(pool, staging, slots, positions, rope), device, repeats)
    label = f"({blocks} blocks x {layers} layers x {BLOCK_TOKENS} tokens)"
    limit = copy_baseline(moved, device, repeats)
    return [
        Row(f"copy+RoPE load {label}", load, moved, "GB/s", COPY_LIMIT, limit, COPY_TARGET),
        Row(f"copy+RoPE save {label}", save, moved, "GB/s", COPY_LIMIT, limit, COPY_TARGET),
    ]


def bench_prefill(
    prefixes: list[int], new: int, dtype: torch.dtype, device: torch.device, repeats: int
) -> list[Row]:
    seq_lens = [prefix + new for prefix in prefixes]
    pool = paged_pool(sum(seq_lens), dtype, device)
    q = torch.randn(new * len(prefixes), NUM_HEADS, HEAD_DIM, device=device).to(dtype)
    cu = torch.arange(0, new * (len(prefixes) + 1), new, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    tables = tables_for(seq_lens, device)
    paged = timed(
        lambda: prefill_attention(q, pool[0, 0], pool[0, 1], cu, lens, tables, max_query_len=new),
        device,
        repeats,
    )
    dense = [
        (
            q[i * new : (i + 1) * new].transpose(0, 1)[None],
            torch.randn(1, NUM_KV_HEADS, n, HEAD_DIM, device=device).to(dtype),
        )
        for i, n in enumerate(seq_lens)
    ]
    masks = [torch.ones(new, n, dtype=torch.bool, device=device).tril(n - new) for n in seq_lens]

    def sdpa() -> None:
        for (query, kv), mask in zip(dense, masks, strict=True):
            F.scaled_dot_product_attention(query, kv, kv, attn_mask=mask, enable_gqa=True)

    visible = sum(new * prefix + new * (new + 1) // 2 for prefix in prefixes)
    flops = 4 * visible * NUM_HEADS * HEAD_DIM
    label = f"prefill attention (prefixes {prefixes}, {new} new tokens each)"
    limit = timed(sdpa, device, repeats)
    return [Row(label, paged, flops, "TFLOP/s", SDPA_LIMIT, limit, PREFILL_TARGET)]


def table(rows: list[Row], judged: bool) -> str:
    """The rows as a Markdown table; pass/fail only where ``judged`` (else "info")."""
    lines = [
        "| kernel | ms | rate | limit | limit ms | limit rate | ratio | target | pass/fail |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        verdict = ("pass" if row.ratio >= row.target else "fail") if judged else "info"
        lines.append(
            f"| {row.name} | {row.seconds * 1e3:.3f} | {row.rate():.3f} {row.unit} | "
            f"{row.limit} | {row.limit_seconds * 1e3:.3f} | "
            f"{row.rate(row.limit_seconds):.3f} {row.unit} | {row.ratio:.2f} | "
            f">= {row.target:g}x | {verdict} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--size", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    size = args.size or ("large" if device.type == "cuda" else "small")
    batch, context, blocks, layers, prefixes, new = SIZES[size]
    backend = kernel_backend(device)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{torch.get_num_threads()} CPU threads"
    )
    path = "Triton kernels" if backend == "triton" else "torch reference"
    print(f"path: {path} on {device.type} ({where}); {args.dtype}, size {size}")
    torch.manual_seed(0)
    rows = bench_decode(batch, context, dtype, device, args.repeats)
    rows += bench_copy(blocks, layers, dtype, device, args.repeats)
    rows += bench_prefill(prefixes, new, dtype, device, args.repeats)
    judged = backend == "triton" and device.type == "cuda"  # the targets are the GPU's
    print(table(rows, judged))
    chosen = {
        tuner.name: {str(key): name for key, name in tuner.chosen().items()}
        for tuner in (DECODE_TUNER, COPY_TUNER, PREFILL_TUNER, PATH_TUNER)
    }
    for tuned, picks in chosen.items():
        for key, name in picks.items():
            print(f"chosen on this device: {tuned} {key}: {name}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "backend": backend,
                    "device": where,
                    "dtype": args.dtype,
                    "size": size,
                    "rows": [asdict(row) | {"ratio": row.ratio} for row in rows],
                    "chosen": chosen,
                },
                out,
                indent=2,
            )


if __name__ == "__main__":
    main()
