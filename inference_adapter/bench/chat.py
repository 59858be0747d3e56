"""``kvstore bench chat``: multi-turn chat TTFT, prefill throughput and hit rates vs recompute.

    kvstore bench chat [--preset default|quick|smoke] [--quick] [--out DIR] [--json FILE]
                       [--workloads sharegpt,multi_round_qa,long_document]
                       [--sweep | --no-sweep] [--no-plots] [--dir DIR] [--seed N]

Builds a random model and the workloads of the preset, starts a daemon per store
configuration, replays every workload in recompute and kvstore mode (turn by turn, in the
same run), then the ShareGPT tier sweep and policy comparison. Prints the markdown tables
and writes them to ``DIR/chat.md``, the figures and per-turn records to ``DIR/chat.json``
(or ``--json``), and ``DIR/ttft_cdf.png`` and ``DIR/hit_rate_by_tier.png``. Exits 1, naming
the turn, when a kvstore run generated other tokens than recompute. Entry points:
``main(argv)``, and ``add_bench_parser`` for the ``kvstore`` command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path

import platformdirs
import torch

from kvstore.inference_adapter.bench import plots
from kvstore.inference_adapter.bench.presets import PRESETS, Preset, main_setup, tier_setups
from kvstore.inference_adapter.bench.replay import BenchmarkError
from kvstore.inference_adapter.bench.report import (
    as_json,
    goals,
    markdown,
    record_json,
    summarize,
)
from kvstore.inference_adapter.bench.runner import ChatBench, ModeRun, progress
from kvstore.inference_adapter.bench.workloads import (
    Workload,
    long_document,
    multi_round_qa,
    sharegpt,
)

__all__ = ["add_bench_parser", "main", "run_bench"]

BUILDERS: dict[str, Callable[[Preset, int], Workload]] = {
    "sharegpt": lambda preset, seed: sharegpt(preset.sharegpt, seed=seed, **_sizes(preset)),
    "multi_round_qa": lambda preset, seed: multi_round_qa(preset.qa, seed=seed, **_sizes(preset)),
    "long_document": lambda preset, seed: long_document(
        preset.document, seed=seed, **_sizes(preset)
    ),
}


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
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction,
                        help="tier sweep and policy comparison (default: per preset)")  # fmt: skip
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    parser.add_argument("--dir", type=Path, help="parent of the SSD tier's scratch directory "
                        "(default: the user cache dir)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="model weights and workloads")


def _workloads(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if unknown := [name for name in names if name not in BUILDERS]:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; known: {list(BUILDERS)}")
    return names


def run_bench(args: argparse.Namespace) -> int:
    """The bench; returns 0, or 1 when a kvstore run generated other tokens."""
    preset: Preset = PRESETS[args.preset]
    with _LoadWatch() as load:
        runs = _run_all(args, preset)
    if runs is None:
        return 1
    about = _about(preset, runs[0], load)
    _write(args, about, *runs)
    return 0


def _run_all(
    args: argparse.Namespace, preset: Preset
) -> tuple[list[Workload], list[ModeRun], list[ModeRun]] | None:
    """Every workload's modes and the sweep; None when a kvstore run generated other tokens
    (the error is printed)."""
    scratch = args.dir or Path(platformdirs.user_cache_dir("kvstore")) / "bench"
    scratch.mkdir(parents=True, exist_ok=True)
    workloads = [BUILDERS[name](preset, args.seed) for name in args.workloads]
    bench = ChatBench(preset, seed=args.seed, scratch=scratch)
    main_runs: list[ModeRun] = []
    sweep_runs: list[ModeRun] = []
    try:
        for workload in workloads:
            progress(
                f"{workload.name}: {len(workload.turns)} turns, {workload.num_sessions} sessions"
            )
            main_runs += bench.compare(workload, main_setup(workload, preset))
            if workload.name == "sharegpt" and _sweep(args, preset):
                redis = shutil.which("redis-server") is not None
                if not redis:
                    progress("redis-server not installed: no Redis row in the sweep")
                for setup in tier_setups(workload, preset, redis=redis):
                    sweep_runs.append(bench.kvstore_only(workload, setup, main_runs[-2]))
    except BenchmarkError as error:
        print(f"kvstore bench chat: FAILED: {error}", file=sys.stderr)
        return None
    return workloads, main_runs, sweep_runs


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


def _sweep(args: argparse.Namespace, preset: Preset) -> bool:
    return preset.sweep if args.sweep is None else bool(args.sweep)


def _write(
    args: argparse.Namespace,
    about: dict[str, str],
    workloads: Sequence[Workload],
    main_runs: Sequence[ModeRun],
    sweep_runs: Sequence[ModeRun],
) -> None:
    modes = [summarize(run) for run in main_runs]
    main_sharegpt = next(
        (s for s in modes if s.workload == "sharegpt" and s.mode == "kvstore"), None
    )
    sweep = [summarize(run) for run in sweep_runs]
    if sweep and main_sharegpt is not None:
        sweep.append(main_sharegpt)
    found = goals(modes, main_sharegpt)
    text = markdown(about, modes, sweep, found)
    print(text)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "chat.md").write_text(text)
    report = {
        "about": about,
        "workloads": {w.name: {**w.params, **_realised(w)} for w in workloads},
        "modes": [as_json(s) for s in modes],
        "sweep": [as_json(s) for s in sweep],
        "goals": [
            {"what": g.what, "value": g.value, "target": g.target, "met": g.verdict} for g in found
        ],
        "turns": [
            {
                "workload": run.workload,
                "mode": run.mode,
                "label": run.label,
                "records": [record_json(r) for r in run.records],
            }
            for run in [*main_runs, *sweep_runs]
        ],
    }
    json_path: Path = args.json or out / "chat.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    written = [out / "chat.md", json_path]
    if args.plots:
        written.append(plots.ttft_cdf(main_runs, sweep_runs, out / "ttft_cdf.png"))
        if sweep:
            written.append(plots.hit_rate_by_tier(sweep, out / "hit_rate_by_tier.png"))
    progress("wrote " + ", ".join(str(path) for path in written))


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


def _about(preset: Preset, workloads: Sequence[Workload], load: _LoadWatch) -> dict[str, str]:
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
    }


def _describe(workload: Workload) -> str:
    realised = _realised(workload)
    return (
        f"{workload.name} {realised['sessions']:.0f} sessions, {realised['turns']:.0f} turns "
        f"(mean {realised['mean_turns']:.2f} turns, {realised['multi_turn_share']:.0%} "
        f"multi-turn, {realised['warmup_turns']:.0f} warm-up)"
    )


if __name__ == "__main__":
    sys.exit(main())
