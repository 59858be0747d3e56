"""The bench's PNG plots (matplotlib, headless ``Agg`` backend, imported on first use).

- :func:`ttft_cdf`: one panel per workload, the CDF of measured turns' TTFT for each mode
  (log scale); the ShareGPT panel adds the sweep's store configurations as thin lines.
- :func:`hit_rate_by_tier`: per store configuration, the tokens loaded from each tier as a
  share of what an unbounded store would have loaded (stacked: the bar is the hit rate),
  with the 85% goal drawn across.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvstore.inference_adapter.bench.report import HIT_RATE_GOAL, TIERS, Summary
from kvstore.inference_adapter.bench.runner import ModeRun

__all__ = ["hit_rate_by_tier", "ttft_cdf"]

TIER_COLOURS = {"host": "#4c72b0", "ssd": "#dd8452", "redis": "#c44e52"}


def _headless() -> None:
    import matplotlib

    matplotlib.use("Agg")


def ttft_cdf(main: Sequence[ModeRun], sweep: Sequence[ModeRun], path: Path) -> Path:
    """Writes the TTFT CDFs of ``main`` (and ``sweep`` on its workload) to ``path``."""
    _headless()
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(run.workload for run in main))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for run in [r for r in main if r.workload == workload]:
            ax.plot(*_cdf(run), label=run.label, linewidth=2, drawstyle="steps-post")
        for run in [r for r in sweep if r.workload == workload]:
            ax.plot(
                *_cdf(run), label=run.label, linewidth=1, linestyle="--", drawstyle="steps-post"
            )
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.set_ylabel("share of turns")
        ax.set_title(workload)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def hit_rate_by_tier(summaries: Sequence[Summary], path: Path) -> Path:
    """Writes the stacked hit-rate bars of ``summaries`` (kvstore runs) to ``path``."""
    _headless()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(summaries) + 2, 4))
    labels = [f"{s.store}\n{s.policy}" for s in summaries]
    bottom = [0.0] * len(summaries)
    for tier in TIERS:
        shares = [s.tier_tokens[tier] / max(s.reusable_tokens, 1) for s in summaries]
        ax.bar(labels, shares, bottom=bottom, label=tier, color=TIER_COLOURS[tier])
        bottom = [b + share for b, share in zip(bottom, shares, strict=True)]
    for x, total in enumerate(bottom):
        ax.text(x, total + 0.01, f"{total:.0%}", ha="center", va="bottom", fontsize=8)
    ax.axhline(HIT_RATE_GOAL, color="grey", linestyle=":", label=f"goal {HIT_RATE_GOAL:.0%}")
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("hit rate (tokens loaded / reusable)")
    ax.set_title(f"{summaries[0].workload if summaries else ''}: hit rate by tier configuration")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cdf(run: ModeRun) -> tuple[list[float], list[float]]:
    ttft = sorted(record.ttft_s * 1e3 for record in run.records if not record.warmup)
    return ttft, [(i + 1) / len(ttft) for i in range(len(ttft))]
