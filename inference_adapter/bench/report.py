"""From per-turn records to the figures: summaries, goals, markdown tables and JSON.

Definitions (measured turns only: warm-up turns are left out):

- TTFT: the engine's admission-to-first-token time of the turn (queueing not included).
- prefill tokens/s: prompt tokens / the sum of TTFTs (a load counts as prefill done).
- decode tokens/s: tokens generated after the first / the time spent generating them.
- hit rate: tokens loaded / tokens an unbounded store would have loaded (every full block
  of history saved earlier; at least one prompt token is always computed). "prefill saved"
  is tokens loaded / all prompt tokens.
- tier tokens: loaded tokens by the tier that held them at lookup.
- logical bytes: every turn's whole KV (prompt and answer, full blocks) as if each request
  stored its own; stored bytes: the unique blocks the daemon stored; dedup = their ratio.
- the grid (real ShareGPT conversations): the hit rate of each tier stack (host, +SSD,
  +Redis) and policy at host tiers of given fractions of the working set ``W`` (every full
  block of every session's final context), one column per fraction.
- long turns: turns with at least ``LONG_HISTORY`` reusable tokens (turns 2 and later with
  that much history, or later questions over the shared document); the goal is their
  kvstore TTFT p50 at most ``TTFT_GOAL`` x recompute's.
- two nodes (``--nodes 2``, :mod:`.nodes`): per workload, recompute, the main kvstore run,
  one node on the nodes' tiers and the two nodes (all their turns, then each node's).
  "from turn 2" is the hit rate over the sessions' turns 2 and later (each follows a turn
  that ran on the other node); "Redis reads" are the blocks the daemons' Redis tiers
  served (their hits); the hit rate of both nodes counts against one unbounded store. Per
  turn: TTFT p50 / p90 and hit rate of each run over the sessions' N-th turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy

from kvstore.inference_adapter.bench.nodes import NODE_NAMES, SHARED, NodesComparison
from kvstore.inference_adapter.bench.presets import GridPoint
from kvstore.inference_adapter.bench.replay import TurnRecord
from kvstore.inference_adapter.bench.runner import RECOMPUTE, ModeRun, PoolRun, StoreReport
from kvstore.inference_adapter.levels import LEVELS

__all__ = ["Goal", "Grid", "Summary", "goals", "markdown", "nodes_json", "summarize"]

LONG_HISTORY = 2048
TTFT_GOAL = 0.2
HIT_RATE_GOAL = 0.85
TIERS = ("host", "ssd", "redis")

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Summary:
    """One mode (or store configuration) over one workload's measured turns."""

    workload: str
    mode: str
    store: str  # "-" for recompute, else the setup's name
    capacities: str
    policy: str
    turns: int
    ttft_ms: tuple[float, float, float]  # p50, p90, p99
    long_turns: int
    long_ttft_p50_ms: float | None
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prompt_tokens: int
    reusable_tokens: int
    loaded_tokens: int
    tier_tokens: dict[str, int]
    hit_rate: float | None  # None in recompute mode
    prefill_saved: float
    lookup_ms_p50: float
    load_wait_ms_p50: float
    compute_ms_p50: float  # TTFT minus lookup and load waits
    logical_bytes: int | None
    stored_bytes: int | None
    daemon_peak_rss_bytes: int | None
    failed_loads: int
    dropped_saves: int

    @property
    def dedup_ratio(self) -> float | None:
        if not self.logical_bytes or not self.stored_bytes:
            return None
        return self.logical_bytes / self.stored_bytes


@dataclass(frozen=True, slots=True)
class Goal:
    """One target of the issue, measured."""

    what: str
    value: float | None  # None: nothing to measure it on in this run
    target: str
    met: bool

    @property
    def verdict(self) -> str:
        return "n/a" if self.value is None else "yes" if self.met else "NO"


@dataclass(frozen=True, slots=True)
class Grid:
    """The hit-rate-by-tier grid: its points, their runs' summaries (same order) and ``W``,
    the working set its capacities are fractions of."""

    points: tuple[GridPoint, ...]
    summaries: tuple[Summary, ...]
    working_set_bytes: int

    def cells(self) -> list[tuple[GridPoint, Summary]]:
        return list(zip(self.points, self.summaries, strict=True))

    def as_json(self) -> list[dict[str, object]]:
        return [
            {
                "host_fraction": point.host_fraction,
                "host_bytes": point.setup.host_bytes,
                "working_set_bytes": self.working_set_bytes,
                "stack": point.stack,
                "policy": point.setup.policy,
                "capacities": point.setup.describe(),
                "hit_rate": summary.hit_rate,
                "tier_tokens": summary.tier_tokens,
            }
            for point, summary in self.cells()
        ]


def percentile(values: Sequence[float], q: float) -> float:
    return float(numpy.percentile(values, q)) if values else float("nan")


def long_turns(records: Sequence[TurnRecord]) -> list[TurnRecord]:
    return [r for r in records if r.reusable_tokens >= LONG_HISTORY]


def summarize(run: ModeRun) -> Summary:
    """The figures of ``run`` over its measured (non-warm-up) turns."""
    records = [record for record in run.records if not record.warmup]
    ttft = [r.ttft_s * 1e3 for r in records]
    long = [r.ttft_s * 1e3 for r in long_turns(records)]
    tiers = {tier: sum(r.tier_tokens.get(tier, 0) for r in records) for tier in LEVELS}
    store, reusable = run.store, sum(r.reusable_tokens for r in records)
    loaded, prompt = sum(r.loaded_tokens for r in records), sum(r.prompt_tokens for r in records)
    decode_s = sum(r.decode_s for r in records)
    return Summary(
        workload=run.workload,
        mode=run.mode,
        store=store.setup.name if store else "-",
        capacities=store.setup.describe() if store else "-",
        policy=store.setup.policy if store else "-",
        turns=len(records),
        ttft_ms=(percentile(ttft, 50), percentile(ttft, 90), percentile(ttft, 99)),
        long_turns=len(long),
        long_ttft_p50_ms=percentile(long, 50) if long else None,
        prefill_tokens_per_s=prompt / max(sum(r.ttft_s for r in records), 1e-9),
        decode_tokens_per_s=sum(r.decode_tokens for r in records) / max(decode_s, 1e-9),
        prompt_tokens=prompt,
        reusable_tokens=reusable,
        loaded_tokens=loaded,
        tier_tokens=tiers,
        hit_rate=(loaded / reusable if reusable else 0.0) if run.mode != RECOMPUTE else None,
        prefill_saved=loaded / max(prompt, 1),
        lookup_ms_p50=percentile([r.lookup_s * 1e3 for r in records], 50),
        load_wait_ms_p50=percentile([r.load_wait_s * 1e3 for r in records], 50),
        compute_ms_p50=percentile(
            [(r.ttft_s - r.lookup_s - r.load_wait_s) * 1e3 for r in records], 50
        ),
        logical_bytes=sum(r.logical_blocks for r in run.records) * store.payload_bytes
        if store
        else None,
        stored_bytes=store.stats.puts * store.payload_bytes if store else None,
        daemon_peak_rss_bytes=store.peak_rss_bytes if store else None,
        failed_loads=store.connector.failed_loads if store else 0,
        dropped_saves=store.connector.dropped_saves if store else 0,
    )


def goals(modes: Sequence[Summary], main_sharegpt: Summary | None) -> list[Goal]:
    """The issue's goals on this machine: long-turn TTFT ratio per workload, ShareGPT hit
    rate with host + SSD."""
    found: list[Goal] = []
    by_workload: dict[str, dict[str, Summary]] = {}
    for summary in modes:
        by_workload.setdefault(summary.workload, {})[summary.mode] = summary
    for workload, pair in by_workload.items():
        ratio = long_ratio(pair.get("kvstore"), pair.get("recompute"))
        found.append(
            Goal(
                f"{workload}: TTFT p50 of turns with >= {LONG_HISTORY} reusable tokens, "
                "kvstore / recompute",
                ratio,
                f"<= {TTFT_GOAL}",
                ratio is not None and ratio <= TTFT_GOAL,
            )
        )
    if main_sharegpt is not None and main_sharegpt.hit_rate is not None:
        rate = main_sharegpt.hit_rate
        found.append(
            Goal(
                f"sharegpt: hit rate with {main_sharegpt.store}",
                rate,
                f">= {HIT_RATE_GOAL:.0%}",
                rate >= HIT_RATE_GOAL,
            )
        )
    return found


def long_ratio(kvstore: Summary | None, recompute: Summary | None) -> float | None:
    if kvstore is None or recompute is None:
        return None
    if kvstore.long_ttft_p50_ms is None or not recompute.long_ttft_p50_ms:
        return None
    return kvstore.long_ttft_p50_ms / recompute.long_ttft_p50_ms


# Markdown ------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table with padded columns; numeric columns align right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    numeric = [bool(rows) and all(_is_number(row[i]) for row in rows) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        columns = zip(cells, widths, numeric, strict=True)
        return "| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in columns) + " |"

    rule = ["-" * (w - 1) + ":" if n else "-" * w for w, n in zip(widths, numeric, strict=True)]
    return [line(header), line(rule), *(line(row) for row in rows)]


def _is_number(cell: str) -> bool:
    try:
        float(cell.rstrip("%x"))
    except ValueError:
        return cell == "-"
    return True


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def mode_rows(summaries: Sequence[Summary]) -> list[str]:
    header = ("workload", "mode", "turns", "TTFT p50 ms", "p90 ms", "p99 ms",
              "prefill tok/s", "decode tok/s", "hit rate", "prefill saved")  # fmt: skip
    rows = [
        (s.workload, s.mode if s.mode == "recompute" else f"kvstore ({s.store})", str(s.turns),
         *(_ms(v) for v in s.ttft_ms), f"{s.prefill_tokens_per_s:.0f}",
         f"{s.decode_tokens_per_s:.0f}", _pct(s.hit_rate), _pct(s.prefill_saved))
        for s in summaries
    ]  # fmt: skip
    return table(header, rows)


def store_rows(summaries: Sequence[Summary]) -> list[str]:
    header = ("workload", "store", "policy", "host tokens", "SSD tokens", "Redis tokens",
              "logical MiB", "stored MiB", "dedup", "daemon RSS MiB", "failed loads")  # fmt: skip
    rows = [
        (s.workload, f"{s.store}: {s.capacities}", s.policy,
         *(str(s.tier_tokens[tier]) for tier in TIERS), _mib(s.logical_bytes),
         _mib(s.stored_bytes), _ratio(s.dedup_ratio), _mib(s.daemon_peak_rss_bytes),
         str(s.failed_loads))
        for s in summaries
        if s.mode != "recompute"
    ]  # fmt: skip
    return table(header, rows)


def long_rows(summaries: Sequence[Summary], recompute: dict[str, Summary]) -> list[str]:
    header = ("workload", "store", "policy", "long turns", "recompute TTFT p50 ms",
              "kvstore TTFT p50 ms", "kvstore / recompute")  # fmt: skip
    rows = []
    for s in summaries:
        if s.mode == "recompute" or s.workload not in recompute:
            continue
        base = recompute[s.workload]
        rows.append((s.workload, s.store, s.policy, str(s.long_turns),
                     _ms(base.long_ttft_p50_ms), _ms(s.long_ttft_p50_ms),
                     _ratio(long_ratio(s, base))))  # fmt: skip
    return table(header, rows)


def sweep_rows(summaries: Sequence[Summary], recompute: Summary | None) -> list[str]:
    header = ("store", "capacities", "policy", "hit rate", "host tokens", "SSD tokens",
              "Redis tokens", "TTFT p50 ms", "p90 ms", "long-turn TTFT / recompute")  # fmt: skip
    rows = [
        (s.store, s.capacities, s.policy, _pct(s.hit_rate),
         *(str(s.tier_tokens[tier]) for tier in TIERS), _ms(s.ttft_ms[0]), _ms(s.ttft_ms[1]),
         _ratio(long_ratio(s, recompute)))
        for s in summaries
    ]  # fmt: skip
    return table(header, rows)


def profile_rows(summaries: Sequence[Summary]) -> list[str]:
    header = ("workload", "store", "policy", "TTFT p50 ms", "lookup p50 ms",
              "waiting for loads p50 ms", "compute p50 ms")  # fmt: skip
    rows = [
        (s.workload, s.store, s.policy, _ms(s.ttft_ms[0]), f"{s.lookup_ms_p50:.1f}",
         f"{s.load_wait_ms_p50:.1f}", _ms(s.compute_ms_p50))
        for s in summaries
    ]  # fmt: skip
    return table(header, rows)


def grid_rows(grid: Grid) -> list[str]:
    """Hit rate per tier stack and policy (rows) and host tier (columns)."""
    cells = grid.cells()
    columns = list(dict.fromkeys(point.host_fraction for point, _ in cells))
    hosts = {point.host_fraction: point.setup.host_bytes for point, _ in cells}
    w = grid.working_set_bytes
    header = ["tiers", "policy", *(_host_column(f, hosts[f], w) for f in columns)]
    rates = {(p.stack, p.setup.policy, p.host_fraction): s.hit_rate for p, s in cells}
    rows = [
        [stack, policy, *(_pct(rates.get((stack, policy, f))) for f in columns)]
        for stack, policy in dict.fromkeys((p.stack, p.setup.policy) for p, _ in cells)
    ]
    return table(header, rows)


def _host_column(fraction: float, host_bytes: int, working_set: int) -> str:
    """``host 25% of working set (N MiB)``; a tier raised to hold the longest prompt says
    what it holds."""
    column = f"host {fraction:.0%} of working set ({_mib(host_bytes)} MiB)"
    if host_bytes > fraction * working_set + 1:
        column = f"host {fraction:.0%} of working set, raised to {host_bytes / working_set:.0%}"
        column += f" ({_mib(host_bytes)} MiB: the longest prompt)"
    return column


def grid_title(grid: Grid) -> str:
    """What the grid's tiers hold, in words."""
    w = grid.working_set_bytes
    ssd = next((p.setup.ssd_bytes for p in grid.points if p.setup.ssd_bytes), None)
    redis = next((p.setup.redis_bytes for p in grid.points if p.setup.redis_bytes), None)
    parts = [f"working set W = {_mib(w)} MiB (every full block of every session's final context)"]
    if ssd:
        parts.append(f"+SSD: an SSD tier of {ssd / w:.0%} of W ({_mib(ssd)} MiB)")
    if redis:
        parts.append(
            f"+Redis: that SSD and a Redis tier of {redis / w:.0%} of W ({_mib(redis)} MiB)"
        )
    return "Hit rate by tier (sharegpt; " + "; ".join(parts) + "):"


def goal_rows(found: Sequence[Goal]) -> list[str]:
    header = ("goal", "measured", "target", "met")
    rows = [
        (goal.what, "-" if goal.value is None else f"{goal.value:.2f}", goal.target,
         goal.verdict)
        for goal in found
    ]  # fmt: skip
    return table(header, rows)


def from_turn(run: ModeRun, first: int) -> ModeRun:
    """``run`` over its sessions' turns ``first`` and later."""
    return ModeRun(run.workload, run.mode, [r for r in run.records if r.index >= first], run.store)


def of_turn(run: ModeRun, index: int) -> ModeRun:
    """``run`` over its sessions' ``index``-th turns."""
    return ModeRun(run.workload, run.mode, [r for r in run.records if r.index == index], run.store)


def redis_reads(stores: Sequence[StoreReport]) -> int | None:
    """Blocks the daemons' Redis tiers served; None when none has one."""
    hits = [t.hits for store in stores for t in store.stats.tiers if t.name == "redis"]
    return sum(hits) if hits else None


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _hit(summary: Summary) -> str:
    """The hit rate, or "-" where there was nothing to hit (no turns, nothing reusable)."""
    return _pct(summary.hit_rate if summary.reusable_tokens else None)


def nodes_rows(comparisons: Sequence[NodesComparison]) -> list[str]:
    header = ("workload", "run", "turns", "TTFT p50 ms", "p90 ms", "hit rate",
              "from turn 2", "host tokens", "SSD tokens", "Redis tokens", "Redis reads",
              "failed loads")  # fmt: skip
    rows = []
    for c in comparisons:
        for label, run, stores in c.runs():
            s, later = summarize(run), summarize(from_turn(run, 2))
            tiers = [s.tier_tokens[tier] if stores else None for tier in TIERS]
            failed = sum(store.connector.failed_loads for store in stores) if stores else None
            rows.append((c.workload, label, str(s.turns), *(_ms(v) for v in s.ttft_ms[:2]),
                         _hit(s), _hit(later),
                         *(_count(n) for n in tiers), _count(redis_reads(stores)),
                         _count(failed)))  # fmt: skip
    return table(header, rows)


def node_turn_rows(comparisons: Sequence[NodesComparison]) -> list[str]:
    """Per session turn N: TTFT p50 / p90 and hit rate of each run, and where the two
    nodes' loads came from."""
    names = ("recompute", "main", "1 node", "2 nodes")
    header = ["workload", "turn", "turns", *(f"{name} p50 / p90 ms" for name in names)]
    header += [*(f"{name} hit rate" for name in names[1:]), "2 nodes host tokens"]
    header += ["2 nodes Redis tokens"]
    rows = []
    for c in comparisons:
        runs = [run for _, run, _ in c.runs()[: len(names)]]
        for index in sorted({r.index for r in c.recompute.records if not r.warmup}):
            s = [summarize(of_turn(run, index)) for run in runs]
            rows.append([c.workload, str(index), str(s[0].turns),
                         *(f"{_ms(x.ttft_ms[0])} / {_ms(x.ttft_ms[1])}" for x in s),
                         *(_hit(x) for x in s[1:]), str(s[-1].tier_tokens["host"]),
                         str(s[-1].tier_tokens["redis"])])  # fmt: skip
    return table(header, rows)


def nodes_title(comparisons: Sequence[NodesComparison]) -> str:
    c = comparisons[0]
    return (
        f"Two nodes (turn N of the k-th session on node (k + N) % 2; each node a daemon "
        f"with {c.setup.describe()}, {c.setup.policy}, sharing {SHARED[c.shared]}; "
        f"main: the kvstore run above, one node on {c.main.label}; 1 node: one node on "
        f"the nodes' tiers):"
    )


def nodes_json(c: NodesComparison) -> dict[str, object]:
    """One workload's two-node comparison: every run's summary, all turns and from turn 2,
    and per session turn."""

    def figures(run: ModeRun) -> dict[str, object] | None:
        s = summarize(run)
        return as_json(s) if s.turns else None

    def brief(run: ModeRun) -> dict[str, object] | None:
        s = summarize(run)
        rate = s.hit_rate if s.reusable_tokens else None
        fields = {"turns": s.turns, "ttft_ms": s.ttft_ms[:2], "hit_rate": rate}
        return {**fields, "tier_tokens": s.tier_tokens} if s.turns else None

    runs = c.runs()
    indices = sorted({r.index for r in c.recompute.records if not r.warmup})
    return {
        "workload": c.workload,
        "shared": c.shared,
        "node_tiers": c.setup.describe(),
        "node_policy": c.setup.policy,
        "rule": "turn N of the k-th session to arrive (k from 0) on node (k + N) % 2",
        "turns_per_node": {
            NODE_NAMES[n]: c.nodes.nodes.count(n) for n in range(len(c.nodes.stores))
        },
        "runs": [
            {
                "run": label,
                "all": figures(run),
                "from_turn_2": figures(from_turn(run, 2)),
                "redis_reads": redis_reads(stores),
            }
            for label, run, stores in runs
        ],
        "per_turn": [
            {"turn": index, **{label: brief(of_turn(run, index)) for label, run, _ in runs}}
            for index in indices
        ],
    }


def hbm_rows(pools: Sequence[PoolRun], recompute: Summary | None) -> list[str]:
    """The HBM level: per pool size, where the prompt tokens came from (shares of all
    prompt tokens, summing to 100% with the computed ones) and the TTFT."""
    header = ("HBM pool keeps", "pages", "hit rate", "hbm", "host", "SSD", "Redis", "computed",
              "TTFT p50 ms", "p90 ms", "TTFT p50 / recompute")  # fmt: skip
    rows = []
    for pool in pools:
        s = summarize(pool.run)
        prompt = max(s.prompt_tokens, 1)
        ratio = s.ttft_ms[0] / recompute.ttft_ms[0] if recompute else None
        rows.append((pool.keeps, str(pool.retain_pages), _pct(s.hit_rate),
                     *(_pct(s.tier_tokens[level] / prompt) for level in LEVELS),
                     _pct(1 - s.loaded_tokens / prompt), _ms(s.ttft_ms[0]), _ms(s.ttft_ms[1]),
                     _ratio(ratio)))  # fmt: skip
    return table(header, rows)


def hbm_json(pools: Sequence[PoolRun]) -> list[dict[str, object]]:
    return [
        {"keeps": pool.keeps, "retain_pages": pool.retain_pages, **as_json(summarize(pool.run))}
        for pool in pools
    ]


def markdown(
    about: dict[str, str],
    modes: Sequence[Summary],
    sweep: Sequence[Summary],
    found: Sequence[Goal],
    grid: Grid | None = None,
    nodes: Sequence[NodesComparison] = (),
    pools: Sequence[PoolRun] = (),
) -> str:
    """Every table of a run, with the machine and model lines first."""
    recompute = {s.workload: s for s in modes if s.mode == "recompute"}
    lines = [f"{key}: {value}" for key, value in about.items()]
    lines += ["", "Modes (measured turns; TTFT excludes queueing):", "", *mode_rows(modes)]
    lines += ["", "Store side of the kvstore runs:", "", *store_rows([*modes, *sweep])]
    lines += ["", f"Turns with >= {LONG_HISTORY} reusable tokens (history or shared document):"]
    lines += [""]
    lines += long_rows([*modes, *sweep], recompute)
    if sweep:
        lines += ["", "Tier sweep and policy comparison (sharegpt):", ""]
        lines += sweep_rows(sweep, recompute.get("sharegpt"))
    if grid is not None:
        lines += ["", grid_title(grid), "", *grid_rows(grid)]
    if nodes:
        lines += ["", nodes_title(nodes), "", *nodes_rows(nodes)]
        lines += ["", "Two nodes, per session turn N (measured turns):", ""]
        lines += node_turn_rows(nodes)
    if pools:
        workload = pools[0].run.workload
        lines += ["", f"The HBM level ({workload}): the engine's pool keeps finished requests' "
                  "pages resident; prompt tokens by level:", ""]  # fmt: skip
        lines += hbm_rows(pools, recompute.get(workload))
    lines += ["", "Where the kvstore TTFT goes (engine thread, p50 of each part):", ""]
    lines += profile_rows([s for s in [*modes, *sweep] if s.mode != "recompute"])
    lines += ["", "Goals:", "", *goal_rows(found)]
    return "\n".join(lines) + "\n"


def as_json(summary: Summary) -> dict[str, object]:
    return {**asdict(summary), "dedup_ratio": summary.dedup_ratio}


def record_json(record: TurnRecord) -> dict[str, object]:
    """A turn's record without its tokens (the outputs were checked equal already)."""
    fields = asdict(record)
    fields["output_tokens"] = len(fields.pop("output"))
    return fields
