"""Prefetch hints on real conversations: hit rate and store time per turn, with and without.

    python -m benchmarks.hints [--sessions 999] [--rate 2] [--gap 60] [--host 0.05]
                               [--ssd 0.25] [--lookahead 49] [--json FILE]

Replays ShareGPT V3 conversations (``kvstore dataset fetch``; whitespace-split words as
tokens, ChatML-like framing) through an in-process ``BlockStore``: a host tier of ``--host``
and a write-back SSD tier (real files) of ``--ssd`` of the working set ``W`` (every full
block of every session's final context). Sessions arrive one per ``1/--rate`` s, the turns
of one session ``--gap`` s apart on average (exponential), as ``kvstore bench chat`` draws
them; turns are served in arrival order. Each turn looks its prompt up, reads the held
prefix (promoting it) and puts the rest of the prompt and its reply.

Rows, one replay each on a store of its own, interleaved turn by turn:

- ``lru``: no hints;
- ``scheduler_aware``: the same policy the hints feed, no hints;
- ``hints, next N turns``: each turn is hinted once, when it enters a look-ahead of the
  next ``--lookahead`` queued turns (the look-ahead of issue 12's thrashing run);
- ``hints, sized by bytes``: the look-ahead holds the queued turns whose prompts' KV fits,
  in sum, the share of the host tier one hint may promote (``eviction.hint_share``);
- ``oracle``: Belady's choice (the block read again farthest in the future goes first),
  no hints: a bound no online policy reaches, to show what the capacity allows.

Columns: hit rate (blocks read / blocks an unbounded store would have held for the
prompt), the part of it from the host tier, store time per turn (mean and p99, the hint
calls included), its ratio to the limit (the fastest unhinted online row; the best
unhinted hit rate is the other limit), promotions. A hinted row passes when it
costs at most 1.2x the limit's time per turn for a hit rate no lower (issue 12). The
hazard table shows why queue look-ahead cannot see a returning session: the share of
sessions with ``k`` turns that have another, and the mean time a hint would need to
cover (the gap) against the time the queue covers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import heapq
import json
import math
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import uvloop

from kvstore.index import BlockMeta
from kvstore.inference_adapter.bench.sharegpt import dataset_path, sample_conversations
from kvstore.inference_adapter.bench.workloads import (
    DatasetShape,
    TurnSpec,
    Workload,
    sharegpt_dataset,
)
from kvstore.policies import EvictionPolicy, LruPolicy, eviction_policy, write_policy
from kvstore.store import BlockStore, StoreTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.ssd import SsdTier
from kvstore.wire.blocks import ROOT_KEY, BlockLayout, Codec

from .daemon import percentiles_ms

LAYOUT = BlockLayout(num_layers=1, num_kv_heads=1, block_tokens=16, head_dim=8, dtype="float16")
BLOCK = LAYOUT.payload_bytes  # 512 B: the replay is about placement, not bytes moved
NAMESPACE = hashlib.sha256(b"hints-bench").digest()
META = BlockMeta(NAMESPACE, LAYOUT.block_tokens, LAYOUT)
PAYLOAD = bytes(range(256)) * (BLOCK // 256)
HINT_SHARE = 0.25  # the config default of eviction.hint_share
TIME_LIMIT = 1.2  # hinted time per turn / unhinted, at most (issue 12)


class Words:
    """Whitespace words as token ids (a vocabulary grown as words are seen), with
    ChatML-like turn framing: enough for the bench's ``Tokenizer`` protocol."""

    END_OF_TURN = 0

    def __init__(self) -> None:
        self._ids: dict[str, int] = {"<|end|>": 0, "<|user|>": 1, "<|assistant|>": 2}
        self._words = list(self._ids)

    @property
    def vocab_size(self) -> int:
        return len(self._words)

    @property
    def end_of_turn_id(self) -> int | None:
        return self.END_OF_TURN

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = len(self._words)
                self._words.append(word)
            ids.append(self._ids[word])
        return ids

    def decode(self, tokens: Sequence[int]) -> str:
        return " ".join(self._words[token] for token in tokens)

    def turn_tokens(self, content: str, *, first: bool, role: str = "user") -> list[int]:
        return [1, *self.encode(content), 0, 2]


@dataclass(frozen=True, slots=True)
class Turn:
    """A turn's keys: its prompt's full blocks, and its context's after the reply."""

    session: str
    index: int
    arrival_s: float
    prompt: list[bytes]
    after: list[bytes]


class Oracle(LruPolicy):
    """Belady's choice, a bound no online policy reaches: the candidate read again farthest
    in the future goes first (it reads the replay's future). Candidates (each tier's
    leaves) are LRU's; the order is a heap of (next read, block) with stale entries
    refreshed as they surface."""

    def __init__(self, turns: Sequence[Turn]) -> None:
        super().__init__()
        self._reads: dict[bytes, deque[int]] = {}  # block id -> turns that read it
        self._due = [[key + NAMESPACE for key in turn.prompt] for turn in turns]
        for position, blocks in enumerate(self._due):
            for block in blocks:
                self._reads.setdefault(block, deque()).append(position)
        self.position = 0  # the turn being served
        self._heaps: dict[str, list[tuple[float, bytes]]] = {}
        self._latest: dict[tuple[str, bytes], float] = {}  # the entry that stands for a key

    def advance(self, position: int) -> None:
        """Moves to turn ``position``; the blocks the turns passed would have read (read or
        not: a miss stops a prompt's reads) are ordered by their next read again."""
        passed, self.position = self._due[self.position : position], position
        for blocks in passed:
            for block in blocks:
                self.accessed(block)

    def next_read(self, block: bytes) -> float:
        reads = self._reads.get(block)
        while reads and reads[0] < self.position:
            reads.popleft()
        return reads[0] if reads else math.inf

    def inserted(self, tier: str, key: bytes, *, first: bool = False) -> None:
        super().inserted(tier, key, first=first)
        self._push(tier, key)

    def accessed(self, key: bytes) -> None:
        for tier, order in self._order.items():
            if key in order:
                self._push(tier, key)

    def _push(self, tier: str, key: bytes) -> None:
        due = self.next_read(key)
        self._latest[tier, key] = due
        heapq.heappush(self._heaps.setdefault(tier, []), (-due, key))

    def victims(self, tier: str) -> Iterator[bytes]:
        heap, order = self._heaps.get(tier, []), self._order.get(tier, {})
        offered: list[tuple[float, bytes]] = []
        try:
            while heap:
                entry = heapq.heappop(heap)
                due, key = -entry[0], entry[1]
                if key not in order or self._latest.get((tier, key)) != due:
                    continue  # no longer a candidate, or a newer entry stands for it
                if due != self.next_read(key):
                    self._push(tier, key)  # its read passed unseen: ordered again
                    continue
                offered.append(entry)
                del self._latest[tier, key]  # offered once per scan
                yield key
        finally:  # the keys offered but not taken stay candidates
            for due, key in offered:
                if key in order:
                    self._latest[tier, key] = -due
                    heapq.heappush(heap, (due, key))


@dataclass(frozen=True, slots=True)
class Setup:
    name: str
    policy: str  # a registered eviction policy, or "oracle"
    hints: str  # "none", "turns" (the next --lookahead turns), "bytes" (sized by bytes)


@dataclass(frozen=True, slots=True)
class Row:
    setup: str
    hit_rate: float
    host_hit_rate: float
    turn_ms: float
    turn_p99_ms: float
    time_ratio: float
    promotions: int
    hinted_turns: float  # queued turns named per turn served (each turn is hinted once)
    passed: bool | None  # None: the limit row itself, or an unhinted row


def chain_keys(tokens: Sequence[int]) -> list[bytes]:
    """Chained block keys of the full blocks of ``tokens`` (the store does not care how
    they were derived, only that equal prefixes give equal keys)."""
    keys, parent = [], ROOT_KEY
    step = LAYOUT.block_tokens
    for start in range(0, len(tokens) - step + 1, step):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + step])
        parent = hashlib.blake2b(parent + block, digest_size=32).digest()
        keys.append(parent)
    return keys


def turns_of(workload: Workload) -> list[Turn]:
    contexts: dict[str, list[int]] = {}
    turns = []
    for spec in workload.turns:
        context = contexts.setdefault(spec.session_id, [])
        prompt = context + list(spec.message)
        context[:] = prompt + list(spec.tail)
        turns.append(
            Turn(
                spec.session_id, spec.index, spec.arrival_s, chain_keys(prompt), chain_keys(context)
            )
        )
    return turns


def working_set(turns: Sequence[Turn]) -> int:
    """``W``: bytes of every distinct full block the replay puts."""
    return len({key for turn in turns for key in turn.after}) * BLOCK


class Replay:
    """One setup's replay on a fresh store."""

    def __init__(self, store: BlockStore, turns: Sequence[Turn], setup: Setup, lookahead: int):
        self.store, self.turns, self.setup, self.lookahead = store, turns, setup, lookahead
        self.host = store.tiers[0].tier
        self.put: set[bytes] = set()  # every key put so far: what an unbounded store holds
        self.read = self.read_host = self.reusable = self.hinted = 0
        self.window_end = self.window_bytes = 0  # turns hinted so far; their prompts' KV

        self.seconds: list[float] = []  # store time of each turn served

    async def step(self, position: int) -> None:
        """Serves turn ``position`` (its hints first), timed."""
        if isinstance(self.store.policy, Oracle):
            self.store.policy.advance(position)
        began = time.perf_counter()
        await self.hint(position)
        await self.serve(self.turns[position])
        self.seconds.append(time.perf_counter() - began)

    async def hint(self, position: int) -> None:
        """Hints each queued turn once, as it enters the look-ahead (an engine hints a
        request when it is queued): the next ``lookahead`` turns, or (``bytes``) the next
        turns whose prompts' KV fits, in sum, the share of the host tier a hint may use."""
        if self.setup.hints == "none":
            return
        if position < self.window_end:
            self.window_bytes -= len(self.turns[position].prompt) * BLOCK  # served: out
        budget = HINT_SHARE * self.host.capacity()
        for queued in range(max(self.window_end, position + 1), len(self.turns)):
            turn = self.turns[queued]
            if self.setup.hints == "turns" and queued > position + self.lookahead:
                break
            size = len(turn.prompt) * BLOCK
            if self.setup.hints == "bytes" and self.window_bytes + size > budget:
                break
            await self.store.prefetch(turn.prompt, NAMESPACE)
            self.window_end, self.window_bytes = queued + 1, self.window_bytes + size
            self.hinted += 1

    async def serve(self, turn: Turn) -> None:
        found = await self.store.lookup(turn.prompt, NAMESPACE)
        read = 0
        for key in turn.prompt[: found.num_blocks]:
            if await self.store.get(key, NAMESPACE) is None:
                break  # evicted since the lookup: the rest is recomputed
            read += 1
        self.read += read
        self.read_host += sum(tier == "host" for tier in found.tiers[:read])
        for key in turn.prompt:
            if key not in self.put:
                break
            self.reusable += 1
        parent = turn.after[read - 1] if read else ROOT_KEY
        for key in turn.after[read:]:
            await self.store.put(key, parent, META, PAYLOAD)
            self.put.add(key)
            parent = key


def store_for(
    setup: Setup, host_bytes: int, ssd_bytes: int, directory: Path, turns: Sequence[Turn]
) -> BlockStore:
    tiers = [
        StoreTier(HostTier(host_bytes), None, write_policy("write_through", 1)),
        StoreTier(
            SsdTier(directory, ssd_bytes, fsync=False), Codec.RAW, write_policy("write_back", 1)
        ),
    ]
    policy: EvictionPolicy = (
        Oracle(turns) if setup.policy == "oracle" else eviction_policy(setup.policy)
    )
    return BlockStore(
        tiers,
        eviction=policy,
        maintenance_interval=3600.0,
        hint_share=HINT_SHARE,
    )


async def replay_all(
    setups: Sequence[Setup], turns: Sequence[Turn], host_bytes: int, ssd_bytes: int, lookahead: int
) -> list[tuple[Setup, Replay, list[float], int]]:
    """Every setup on a store of its own, interleaved turn by turn (each turn served by
    every setup in a row, the order rotating), so that the machine's drift moves all rows
    alike."""
    with tempfile.TemporaryDirectory(prefix="kvstore-hints-") as directory:
        async with contextlib.AsyncExitStack() as stack:
            runs = []
            for i, setup in enumerate(setups):
                store = store_for(setup, host_bytes, ssd_bytes, Path(directory) / str(i), turns)
                await stack.enter_async_context(store)
                store.register_namespace(NAMESPACE, "bench")
                runs.append(Replay(store, turns, setup, lookahead))
            for position in range(len(turns)):
                shift = position % len(runs)
                for run in runs[shift:] + runs[:shift]:
                    await run.step(position)
                if position % 500 == 0:
                    print(f"  turn {position} of {len(turns)}", file=sys.stderr, flush=True)
            return [(r.setup, r, r.seconds, r.store.stats().promotions) for r in runs]


def hazard(workload: Workload) -> list[tuple[int, int, float]]:
    """Per turn count ``k``: sessions with at least ``k`` turns, and the share of them with
    another (``k + 1``)."""
    counts: dict[str, int] = {}
    for turn in workload.turns:
        counts[turn.session_id] = max(counts.get(turn.session_id, 0), turn.index)
    rows = []
    for k in range(1, 8):
        reached = sum(n >= k for n in counts.values())
        if reached:
            rows.append((k, reached, sum(n > k for n in counts.values()) / reached))
    return rows


def queue_span_s(turns: Sequence[TurnSpec], lookahead: int) -> float:
    """Mean simulated time the next ``lookahead`` turns span."""
    spans = [
        turns[i + lookahead].arrival_s - turns[i].arrival_s
        for i in range(0, len(turns) - lookahead)
    ]
    return statistics.fmean(spans) if spans else 0.0


def rows_of(results: Sequence[tuple[Setup, Replay, list[float], int]]) -> list[Row]:
    """The rows, each hinted one held to the limit: the fastest time per turn and the best
    hit rate of the unhinted online rows (LRU, scheduler-aware)."""
    plain = [r for r in results if r[0].hints == "none" and r[0].policy != "oracle"]
    limit = min(statistics.fmean(seconds) for _, _, seconds, _ in plain)
    limit_hit = max(run.read / max(run.reusable, 1) for _, run, _, _ in plain)
    rows = []
    for setup, run, seconds, promotions in results:
        hit = run.read / max(run.reusable, 1)
        ratio = statistics.fmean(seconds) / limit
        hinted = setup.hints != "none"
        rows.append(
            Row(
                setup=setup.name,
                hit_rate=hit,
                host_hit_rate=run.read_host / max(run.reusable, 1),
                turn_ms=statistics.fmean(seconds) * 1e3,
                turn_p99_ms=percentiles_ms(seconds)[1],
                time_ratio=ratio,
                promotions=promotions,
                hinted_turns=run.hinted / max(len(seconds), 1),
                passed=(ratio <= TIME_LIMIT and hit >= limit_hit - 1e-9) if hinted else None,
            )
        )
    return rows


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| setup | hit rate | from host | ms/turn | p99 ms | time vs limit | promotions "
        "| turns hinted per turn | pass (<= 1.2x, hit rate no lower) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        verdict = "" if r.passed is None else ("pass" if r.passed else "FAIL")
        lines.append(
            f"| {r.setup} | {r.hit_rate:.1%} | {r.host_hit_rate:.1%} | {r.turn_ms:.2f} | "
            f"{r.turn_p99_ms:.2f} | {r.time_ratio:.2f}x | {r.promotions} | "
            f"{r.hinted_turns:.1f} | {verdict} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=999, help="conversations replayed")
    parser.add_argument("--rate", type=float, default=2.0, help="sessions arriving per second")
    parser.add_argument("--gap", type=float, default=60.0, help="mean seconds between turns")
    parser.add_argument("--host", type=float, default=0.05, help="host tier, share of W")
    parser.add_argument("--ssd", type=float, default=0.25, help="SSD tier, share of W")
    parser.add_argument("--lookahead", type=int, default=49, help="queued turns per hint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows as JSON")
    args = parser.parse_args(argv)

    chats = sample_conversations(dataset_path(), args.sessions, seed=args.seed)
    shape = DatasetShape(
        sessions=len(chats), arrival_rate=args.rate, mean_gap_s=args.gap, warmup_share=0.0
    )
    workload = sharegpt_dataset(shape, chats, Words(), generated=0, window=1 << 30, seed=args.seed)
    turns = turns_of(workload)
    w = working_set(turns)
    host, ssd = max(int(args.host * w), 64 * BLOCK), max(int(args.ssd * w), 64 * BLOCK)
    setups = [
        Setup("lru", "lru", "none"),
        Setup("scheduler_aware", "scheduler_aware", "none"),
        Setup(f"hints, next {args.lookahead} turns", "scheduler_aware", "turns"),
        Setup("hints, sized by bytes", "scheduler_aware", "bytes"),
        Setup("oracle (reads the future; a bound)", "oracle", "none"),
    ]

    rows = rows_of(uvloop.run(replay_all(setups, turns, host, ssd, args.lookahead)))
    print(
        f"{len(chats)} conversations, {len(turns)} turns, W = {w / 2**20:.1f} MiB "
        f"({w // BLOCK} blocks of {BLOCK} B); host {args.host:.0%} of W, SSD {args.ssd:.0%} "
        f"(write-back); one session per {1 / args.rate:g} s, turns {args.gap:g} s apart\n"
    )
    print(table(rows))
    span = queue_span_s(workload.turns, args.lookahead)
    print(
        f"\nThe next {args.lookahead} queued turns span {span:.1f} s on average; a session's "
        f"next turn comes {args.gap:g} s after its last.\n"
    )
    print("| turns so far | sessions | share with another turn |\n|---:|---:|---:|")
    for k, reached, share in hazard(workload):
        print(f"| {k} | {reached} | {share:.0%} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(row) for row in rows], out, indent=2)
    return 0 if all(row.passed is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
