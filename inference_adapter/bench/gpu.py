"""``kvstore bench gpu``: TTFT of a store hit and of a store miss against recomputing the
prompt, and the rates of KV loads and saves against the host link's, per prompt length, on
the GPU (tiny on the CPU).

One run builds a random Llama of ``--model``'s shape (:mod:`.gpu_models`) in ``--dtype``,
measures the copy limits (:mod:`.bandwidth`), starts a daemon (host tier only, 1.5 times the
largest prompt's KV; each row's blocks are deleted after it) and, per prompt length, with a
prompt of random tokens of its own, two engines alike but for the connector: one without
(store off), one with a ``StoreConnector`` (store on). After a miss and a hit of a short
prompt take the store engine's first-call costs:

1. recompute and miss, in turns (a shared machine's drift weighs on both alike), ``--repeats``
   of each after a warm-up pair, each run ``--decode-tokens`` long (greedy): recompute runs
   the row's prompt through the store-off engine; a miss runs a prompt of fresh random tokens
   (one a run: the store has never seen it) through the store-on engine, which looks it up,
   finds nothing, computes it and saves it (queued after the first token, put while it
   decodes; the blocks are deleted once saved, untimed). TTFT and decode tokens per second
   (the tokens after the first over the time after it) are medians; a miss's over
   recompute's is the miss overhead, its TTFT's target ``gpu_report.MISS_TTFT_TARGET`` (3%);
2. save run: the row's prompt through the store-on engine, once, one token; its TTFT over
   recompute's, less one, is the save overhead; the save rate is the KV stored over the time
   from ``save`` to the queue drained;
3. hit: the same prompt through that engine, a fresh request each time (median of
   ``--repeats`` after a warm-up), each one checked to have loaded its blocks;
4. load: the connector protocol alone (``num_loadable_tokens``, pages, ``start_load``, every
   layer's ``wait_for_layer_load``, device synchronised); the rate is the KV loaded over the
   time from ``start_load`` to synchronised (median of ``--repeats``; the lookup apart).

TTFT is the engine's own (admission to the first token, lookup and loads included); a hit's
is split into the engine thread's time in the lookup, in ``start_load``, waiting for layers,
and the rest (the tail's compute, sampling). The first
token of recompute, the save run and every hit must agree: exit status 1 when a row's differ.
A row whose connector refuses the block and page sizes (ValueError) is reported as skipped,
with its recompute figures. The tables and ``--json FILE`` (every figure: ``setup``,
``limits``, ``rows``) come from :mod:`.gpu_report`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvstore.client import KVStoreClient
from kvstore.inference_adapter.bench.bandwidth import copy_limits
from kvstore.inference_adapter.bench.daemon import TierSetup, running_store
from kvstore.inference_adapter.bench.gpu_models import DTYPES, MODELS, model_config, random_model
from kvstore.inference_adapter.bench.gpu_report import describe_setup, render
from kvstore.inference_adapter.bench.gpu_runs import GpuBench
from kvstore.inference_adapter.bench.replay import BenchmarkError
from kvstore.inference_adapter.bench.runner import progress

__all__ = ["main"]

MIB = 1 << 20
LIMIT_REPEATS = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore bench gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--prompts", type=_ints, default=[2048, 8192, 16384, 32000],
                        help="prompt lengths in tokens, comma-separated")  # fmt: skip
    parser.add_argument("--block-tokens", type=int, default=256, help="the store's block size")
    parser.add_argument("--page-tokens", type=int, default=16, help="the engine's page size")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure")
    parser.add_argument("--decode-tokens", type=int, default=16,
                        help="tokens of each recompute and miss run (decode tok/s: all but "
                             "the first)")  # fmt: skip
    parser.add_argument("--copy-mib", type=int, help="copy size of the limits (1024; CPU 64)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    prompts = sorted(set(args.prompts))
    if min(args.block_tokens, args.page_tokens, args.repeats) < 1:
        parser.error("--block-tokens, --page-tokens and --repeats must be >= 1")
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be >= 2 (decode is the tokens after the first)")
    if prompts[0] <= args.block_tokens:
        parser.error(f"every prompt must be longer than a block ({args.block_tokens} tokens)")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        return _bench(args, prompts)
    finally:
        torch.set_num_threads(threads)


def _bench(args: argparse.Namespace, prompts: list[int]) -> int:
    """Measures, prints the table, writes the JSON; the exit status."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = model_config(args.model, max_positions=prompts[-1] + args.decode_tokens)
    copy_mib = args.copy_mib or (1024 if device.type == "cuda" else 64)
    progress(f"copy limits ({copy_mib} MiB copies)")
    limits = copy_limits(device, copy_mib * MIB, LIMIT_REPEATS)
    progress(f"a random {args.model} model, {args.dtype}, on {device.type}")
    model = random_model(config, DTYPES[args.dtype], device)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    kv_per_token *= model.dtype.itemsize
    largest = prompts[-1] * kv_per_token  # each row's blocks are deleted after it
    host_bytes = max(64 * MIB, -(-largest * 3 // 2 // MIB) * MIB)  # 1.5x, in whole MiB
    rows = []
    try:
        with (
            running_store(TierSetup("host", host_bytes=host_bytes)) as store,
            KVStoreClient(
                store.address, retries=1, timeout=60.0, pin_arena=device.type == "cuda"
            ) as client,
        ):
            bench = GpuBench(model, client, args)
            for tokens in prompts:
                progress(f"prompt of {tokens} tokens")
                rows.append(bench.row(tokens, limits))
            data_plane = client.data_plane
    except BenchmarkError as error:
        print(f"kvstore bench gpu: {error}", file=sys.stderr)
        return 1
    setup = describe_setup(args, model, device, kv_per_token, host_bytes, data_plane)
    if args.json:
        report = {"setup": setup, "limits": limits.as_dict(), "rows": rows}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(render(setup, limits, rows))
    return 1 if any(row.get("same_tokens") is False for row in rows) else 0


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers needed, got {text!r}")
    return values


if __name__ == "__main__":
    sys.exit(main())
