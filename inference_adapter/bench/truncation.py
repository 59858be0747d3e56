"""``kvstore bench truncation``: perplexity and TTFT of reusing KV past a chat truncation.

    kvstore bench truncation [--smoke] [--conversations N] [--window W] [--seed N]
                             [--threads N] [--out DIR]

Real ShareGPT V3 conversations (:mod:`.sharegpt`, ``kvstore dataset fetch``) through
SmolLM2-135M-Instruct (its GGUF file, ``kvstore model fetch``), with a context window small
enough to truncate. Teacher forcing: each turn's prompt is the session's context, the human
message (``turn_tokens``) and the real reply (its text's tokens, then the end of turn), each
message and reply cut to its first tokens so that a turn fits. :func:`plan_turn` cuts the
context as the chat server does (the sinks kept, the oldest whole blocks dropped), and a
store-connected engine runs the prompt so that its KV is saved for the next turn. At each
turn that truncates, the reply's tokens are scored three ways on the same prompt:

- ``recompute``: a fresh prefill of the truncated prompt, no store;
- ``kvstore reuse``: the plan's stored blocks loaded at their new positions, K re-rotated
  by the shift (what the chat server does), the rest prefilled over them;
- ``naive reuse``: the same blocks at the same positions, K left rotated to the positions
  it was computed at (each ``stored_at`` set to its ``position``: a plain copy).

Perplexity is exp(mean NLL) over every scored reply token. TTFT is that of a one-token
generation of the prompt up to the reply (the kept context and the message: what the chat
server computes before the reply's first token), recompute against kvstore reuse
(admission, lookup and load included). Prints a markdown table and writes it to
``OUT/truncation.md``, every event to ``OUT/truncation.json``. Exit status 1 when a load
came up short or failed, a save was lost, or no turn truncated (the figures would not be
what they say); 2 when the model or the dataset is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from kvstore.client import KeySalt, KVStoreClient, Namespace
from kvstore.inference_adapter.bench import sharegpt
from kvstore.inference_adapter.bench.daemon import MIB, TierSetup, running_store
from kvstore.inference_adapter.bench.replay import BenchmarkError
from kvstore.inference_adapter.bench.report import percentile, table
from kvstore.inference_adapter.bench.runner import progress
from kvstore.inference_adapter.connector import StoreConnector
from kvstore.inference_adapter.engine import Engine
from kvstore.inference_adapter.gguf import load_gguf_model
from kvstore.inference_adapter.interfaces import Request, ReusedBlock, SamplingParams
from kvstore.inference_adapter.model import LlamaModel
from kvstore.inference_adapter.models import model_path
from kvstore.inference_adapter.sessions import TurnPlan, plan_turn
from kvstore.inference_adapter.tokenizer import ChatTokenizer
from kvstore.inference_adapter.weights import namespace_for

__all__ = ["SIZES", "Event", "Result", "Size", "Summary", "TruncationBench", "main", "naive_plan"]
__all__ += ["num_truncations", "perplexity", "plan_at", "reply_nll", "run_bench", "summarize"]

RECOMPUTE, REUSE, NAIVE = "recompute", "kvstore reuse", "naive reuse"
MODES = (RECOMPUTE, REUSE, NAIVE)
SAVE_DRAIN_TIMEOUT_S = 60.0
ONE_TOKEN = SamplingParams(max_tokens=1)  # TTFT, and turns whose reply is in the prompt
STORE = TierSetup("truncation", host_bytes=256 * MIB)  # ~10 contexts of 512 tokens


@dataclass(frozen=True, slots=True)
class Size:
    """How much the bench runs."""

    name: str
    window: int  # positions a session may use
    sink_tokens: int  # kept on truncation
    block_tokens: int  # the engine's page size, the store's block size
    conversations: int
    max_turns: int  # exchanges run per conversation, at most
    max_message_tokens: int  # each human message's text cut to this many tokens
    max_reply_tokens: int  # each reply's text cut to this many tokens
    min_truncations: int  # a conversation is picked when this many of its turns truncate
    pool: int  # conversations drawn from: the dataset's first ones


SIZES = {
    "default": Size("default", 512, 64, 16, 8, 8, 160, 160, 2, 2000),
    "smoke": Size("smoke", 256, 32, 16, 1, 6, 64, 96, 2, 200),
}


@dataclass(frozen=True, slots=True)
class Event:
    """One truncating turn, scored three ways."""

    conversation: str
    turn: int
    prompt_tokens: int
    dropped_tokens: int
    reply_tokens: int  # the scored tokens
    sink_blocks: int  # loaded at their own positions
    moved_blocks: int  # loaded at new positions
    nll: dict[str, float]  # mode -> summed NLL of the reply tokens
    ttft_s: dict[str, float]  # recompute and kvstore reuse


@dataclass(frozen=True, slots=True)
class Summary:
    """A run's figures."""

    conversations: int
    turns: int
    events: int
    scored_tokens: int
    dropped_tokens: int
    sink_blocks: int
    moved_blocks: int
    perplexity: dict[str, float]  # mode -> exp(mean NLL)
    ttft_p50_s: dict[str, float]  # recompute and kvstore reuse


def naive_plan(reuse: Sequence[ReusedBlock]) -> tuple[ReusedBlock, ...]:
    """``reuse`` with every block's K taken as if computed where it now lands: loaded by a
    plain copy, not re-rotated."""
    return tuple(dataclasses.replace(block, stored_at=block.position) for block in reuse)


def reply_nll(logits: torch.Tensor, prompt: Sequence[int], first_row: int, start: int) -> float:
    """Summed NLL of ``prompt[start:]`` under ``logits``.

    Args:
        logits: ``[rows, vocab]``; row ``i`` predicts prompt token ``first_row + i + 1``.
        prompt: The tokens.
        first_row: The position whose logits are row 0 (the loaded tokens before it).
        start: The first scored token; ``first_row < start < len(prompt)``.
    """
    if not first_row < start < len(prompt):
        raise ValueError(f"cannot score tokens {start}.. with logits from {first_row}")
    rows = logits[start - 1 - first_row : len(prompt) - 1 - first_row].float()
    targets = torch.tensor(prompt[start:], device=rows.device)
    return float(torch.nn.functional.cross_entropy(rows, targets, reduction="sum"))


def perplexity(nll: float, tokens: int) -> float:
    """exp(mean NLL); NaN for no tokens."""
    return math.exp(nll / tokens) if tokens else float("nan")


def summarize(events: Sequence[Event], conversations: int, turns: int) -> Summary:
    scored = sum(e.reply_tokens for e in events)
    return Summary(
        conversations=conversations,
        turns=turns,
        events=len(events),
        scored_tokens=scored,
        dropped_tokens=sum(e.dropped_tokens for e in events),
        sink_blocks=sum(e.sink_blocks for e in events),
        moved_blocks=sum(e.moved_blocks for e in events),
        perplexity={m: perplexity(sum(e.nll[m] for e in events), scored) for m in MODES},
        ttft_p50_s={m: percentile([e.ttft_s[m] for e in events], 50) for m in MODES[:2]},
    )


# Conversations ---------------------------------------------------------------------------

Turns = list[tuple[list[int], list[int]]]  # (message tokens, reply tokens) per exchange


def chat_turns(conversation: sharegpt.Conversation, tokenizer: ChatTokenizer, size: Size) -> Turns:
    """The conversation's first exchanges as a chat appends them, texts cut to size."""
    turns: Turns = []
    for i, exchange in enumerate(conversation.exchanges[: size.max_turns]):
        human = tokenizer.decode(tokenizer.encode(exchange.human)[: size.max_message_tokens])
        reply = tokenizer.encode(exchange.gpt)[: size.max_reply_tokens]
        turns.append(
            (tokenizer.turn_tokens(human, first=i == 0), sharegpt.reply_tokens(tokenizer, reply))
        )
    return turns


def pick_conversations(
    path: Path, tokenizer: ChatTokenizer, size: Size, seed: int
) -> list[tuple[str, Turns]]:
    """``size.conversations`` of the first ``size.pool``, in a seeded order, with at least
    ``size.min_truncations`` truncating turns."""
    pool = list(sharegpt.conversations(path, limit=size.pool))
    random.Random(f"truncation/{seed}").shuffle(pool)
    picked: list[tuple[str, Turns]] = []
    for conversation in pool:
        turns = chat_turns(conversation, tokenizer, size)
        if num_truncations(turns, size) >= size.min_truncations:
            picked.append((conversation.id, turns))
            if len(picked) == size.conversations:
                break
    return picked


def num_truncations(turns: Turns, size: Size) -> int:
    """How many of ``turns`` truncate their context; -1 when one does not fit at all."""
    context: list[int] = []
    count = 0
    for message, reply in turns:
        try:
            turn_plan = plan_at(size, context, [*message, *reply])
        except ValueError:
            return -1
        context, count = turn_plan.prompt, count + bool(turn_plan.dropped_tokens)
    return count


def plan_at(
    size: Size,
    context: list[int],
    tokens: list[int],
    namespace: Namespace | None = None,
    salt: KeySalt | None = None,
    origin: bytes = b"",
) -> TurnPlan:
    """:func:`plan_turn` at ``size``, the reply in the prompt (TTFT generates one token).

    Raises:
        ValueError: The turn does not fit the window even with all history dropped.
    """
    return plan_turn(
        context, tokens, window=size.window, max_tokens=1, sink_tokens=size.sink_tokens,
        block_tokens=size.block_tokens, namespace=namespace, salt=salt, origin=origin,
    )  # fmt: skip


# The runs ----------------------------------------------------------------------------------


class TruncationBench:
    """One model, a recompute engine and a store-connected one (``connect``, then ``run``)."""

    def __init__(self, model: LlamaModel, size: Size, *, model_name: str) -> None:
        self.size = size
        pages = size.window // size.block_tokens + 2
        self.recompute = Engine(model, num_pages=pages, page_tokens=size.block_tokens)
        self.store = Engine(model, num_pages=pages, page_tokens=size.block_tokens)
        self.namespace = namespace_for(
            model.config, model_name=model_name, block_tokens=size.block_tokens
        )
        for engine in (self.recompute, self.store):  # first-call costs outside the timings
            engine.generate([Request("warm-up", list(range(1, 40)), SamplingParams(max_tokens=2))])
        self.connector: StoreConnector | None = None
        self.num_turns = 0

    def connect(self, client: KVStoreClient) -> StoreConnector:
        """Binds a connector on ``client`` to the store engine; the caller closes it."""
        engine = self.store
        self.connector = engine.connector = StoreConnector(
            client,
            self.namespace,
            kv_pool=engine.kv_pool,
            page_tokens=engine.page_tokens,
            rope_tables=engine.rope_tables,
            save_queue_size=4 * (self.size.window // self.size.block_tokens),
        )
        return self.connector

    def run(self, session_id: str, turns: Turns) -> list[Event]:
        """Runs one conversation turn by turn; returns the events of its truncating turns.

        Raises:
            BenchmarkError: A load came up short or a save was lost.
            ValueError: A turn does not fit (:func:`num_truncations` says -1).
        """
        context: list[int] = []
        salt: KeySalt | None = None
        events: list[Event] = []
        origin = session_id.encode()
        for turn, (message, reply) in enumerate(turns):
            tokens = [*message, *reply]
            turn_plan = plan_at(self.size, context, tokens, self.namespace, salt, origin)
            if turn_plan.dropped_tokens:
                events.append(self._evaluate(session_id, turn, turn_plan, len(reply)))
            else:  # a prefix hit on the context's saved KV, saving the turn's
                request = Request(f"{session_id}/{turn}", turn_plan.prompt, ONE_TOKEN, salt=salt)
                self._run(self.store, request, len(context) // self.size.block_tokens)
            self._drain()
            context, salt = turn_plan.prompt, turn_plan.salt
            self.num_turns += 1
        return events

    def _evaluate(self, session_id: str, turn: int, plan: TurnPlan, reply_tokens: int) -> Event:
        """A truncating turn: the reply scored three ways, then TTFT of recompute and reuse."""
        name, prompt, reuse = f"{session_id}/{turn}", plan.prompt, plan.reuse
        start = len(prompt) - reply_tokens
        naive = naive_plan(reuse)
        nll = {
            RECOMPUTE: reply_nll(self.recompute.prefill_logits(prompt), prompt, 0, start),
            # Also saves the turn's KV for the next turn, as the chat server's turn would.
            REUSE: self._score(f"{name}/reuse", prompt, reuse, plan.salt, start),
            NAIVE: self._score(f"{name}/naive", prompt, naive, _naive_salt(plan.salt), start),
        }
        ttft = self._ttft(name, plan, prompt[:start])
        sinks = sum(block.position == block.stored_at for block in reuse)
        return Event(
            session_id, turn, len(prompt), plan.dropped_tokens, reply_tokens, sinks,
            len(reuse) - sinks, nll, ttft,
        )  # fmt: skip

    def _ttft(self, name: str, plan: TurnPlan, prompt: list[int]) -> dict[str, float]:
        """TTFT of the turn's prompt up to its reply (what a chat computes before the first
        token), recomputed and with the plan's blocks loaded; each first every other turn."""
        ttft: dict[str, float] = {}
        for mode in (REUSE, RECOMPUTE) if self.num_turns % 2 == 0 else (RECOMPUTE, REUSE):
            if mode == REUSE:
                request = Request(name, prompt, ONE_TOKEN, reuse=plan.reuse, salt=plan.salt)
                ttft[mode] = self._run(self.store, request, len(plan.reuse)).ttft_s
            else:
                request = Request(f"{name}/recompute", prompt, ONE_TOKEN)
                ttft[mode] = self._run(self.recompute, request, 0).ttft_s
        return ttft

    def _score(
        self,
        name: str,
        prompt: list[int],
        reuse: Sequence[ReusedBlock],
        salt: KeySalt | None,
        start: int,
    ) -> float:
        """Summed NLL of ``prompt[start:]`` with ``reuse`` loaded and the rest prefilled."""
        request = Request(name, prompt, ONE_TOKEN, reuse=reuse, salt=salt)
        logits = self.store.score(request)
        self._check_loaded(request, len(reuse))
        return reply_nll(logits, prompt, request.num_loaded_tokens, start)

    def _run(self, engine: Engine, request: Request, blocks: int) -> Request:
        """Generates one token (its ``ttft_s`` is the turn's TTFT), loading ``blocks`` blocks."""
        engine.generate([request])
        self._check_loaded(request, blocks)
        return request

    def _check_loaded(self, request: Request, blocks: int) -> None:
        if request.num_loaded_tokens < blocks * self.size.block_tokens:
            raise BenchmarkError(
                f"{request.request_id}: loaded {request.num_loaded_tokens} tokens, not the "
                f"{blocks} blocks it was to load"
            )

    def _drain(self) -> None:
        """Every save reached the daemon before the next turn looks its blocks up."""
        assert self.connector is not None, "connect() the bench before run()"
        if not self.connector.wait_for_saves(SAVE_DRAIN_TIMEOUT_S):
            raise BenchmarkError(f"saves still queued after {SAVE_DRAIN_TIMEOUT_S:.0f} s")
        if dropped := self.connector.dropped_saves:
            raise BenchmarkError(f"{dropped} blocks were not saved (the queue was full)")


def _naive_salt(salt: KeySalt | None) -> KeySalt:
    """A salt apart from the session's: naive KV is never loaded in place of its KV."""
    if salt is None:
        raise ValueError("a truncated turn's plan has a salt")
    return KeySalt(hashlib.sha256(b"naive\0" + salt.salt).digest(), salt.from_block)


# The command -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``kvstore bench truncation``; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="kvstore bench truncation", description=__doc__.split("\n")[0].split(": ", 1)[1]
    )
    parser.add_argument("--smoke", action="store_const", const="smoke", dest="size",
                        default="default", help="one short conversation (< 1 minute)")  # fmt: skip
    parser.add_argument("--conversations", type=int, help="default: per size")
    parser.add_argument("--window", type=int, help="context window (default: per size)")
    parser.add_argument("--seed", type=int, default=0, help="which conversations")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; "
                        "1 is faster on a busy machine)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("truncation-bench"),
                        help="for truncation.md and truncation.json (%(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    overrides = {"conversations": args.conversations, "window": args.window}
    size = dataclasses.replace(
        SIZES[args.size], **{key: value for key, value in overrides.items() if value is not None}
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        model_file, data_file = model_path("smollm2"), sharegpt.dataset_path()
        result = run_bench(size, model_file, data_file, seed=args.seed)
    except (FileNotFoundError, BenchmarkError) as error:
        print(f"kvstore bench truncation: {error}", file=sys.stderr)
        return 2 if isinstance(error, FileNotFoundError) else 1
    finally:
        torch.set_num_threads(threads)
    text = render(result)
    write(result, text, args.out)
    print(text, end="")
    return 0


@dataclass(frozen=True, slots=True)
class Result:
    """A run: on what, its sizes, its figures and its events."""

    about: dict[str, str]
    size: Size
    summary: Summary
    events: list[Event]


def run_bench(size: Size, model_file: Path, data_file: Path, *, seed: int) -> Result:
    """Picks the conversations, starts a daemon and runs them (see the module docstring).

    Raises:
        BenchmarkError: A load came up short or failed, a save was lost, or no turn
            truncated.
    """
    progress(f"loading {model_file.name} and its tokenizer")
    tokenizer = ChatTokenizer.from_gguf(model_file)
    picked = pick_conversations(data_file, tokenizer, size, seed)
    bench = TruncationBench(load_gguf_model(model_file), size, model_name=model_file.name)
    events: list[Event] = []
    with (
        running_store(STORE) as daemon,
        KVStoreClient(daemon.address, retries=1, timeout=10.0, pin_arena=True) as client,
        contextlib.closing(bench.connect(client)) as connector,
    ):
        for i, (conversation_id, turns) in enumerate(picked):
            progress(f"conversation {i + 1}/{len(picked)} ({conversation_id}, {len(turns)} turns)")
            events += bench.run(conversation_id, turns)
        if failed := connector.stats().failed_loads:
            raise BenchmarkError(f"{failed} loads failed (the engine recomputed them)")
    if not events:
        raise BenchmarkError(f"no turn of {len(picked)} conversations passed the window")
    summary = summarize(events, len(picked), bench.num_turns)
    return Result(_about(model_file, seed), size, summary, events)


def render(result: Result) -> str:
    """The run as markdown: what ran, one row per mode, then on what."""
    s, size = result.summary, result.size
    ppl, ttft = s.perplexity, s.ttft_p50_s
    rows = [
        [mode, f"{ppl[mode]:.3f}", f"{ppl[mode] / ppl[RECOMPUTE]:.3f}x",
         f"{ttft[mode] * 1000:.0f}" if mode in ttft else "-",
         f"{ttft[mode] / ttft[RECOMPUTE]:.2f}x" if mode in ttft else "-"]
        for mode in MODES
    ]  # fmt: skip
    header = ["mode", "perplexity", "vs recompute", "TTFT p50 (ms)", "vs recompute"]
    lines = [
        f"## Truncation: reuse vs recompute (size {size.name})",
        "",
        f"{s.conversations} ShareGPT V3 conversations, {s.turns} turns, {s.events} truncations "
        f"(window {size.window}, {size.sink_tokens} sink tokens, blocks of "
        f"{size.block_tokens}; {s.dropped_tokens} tokens dropped); {s.scored_tokens} reply "
        f"tokens scored; the reuse plans loaded {s.sink_blocks} sink blocks in place and "
        f"{s.moved_blocks} blocks at new positions.",
        "",
        *table(header, rows),
        "",
        *(f"- {key}: {value}" for key, value in result.about.items()),
    ]
    return "\n".join(lines) + "\n"


def write(result: Result, markdown: str, out: Path) -> None:
    """``out/truncation.md`` and ``out/truncation.json``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "truncation.md").write_text(markdown)
    record = {
        "about": result.about,
        "size": dataclasses.asdict(result.size),
        "summary": dataclasses.asdict(result.summary),
        "events": [dataclasses.asdict(event) for event in result.events],
    }
    (out / "truncation.json").write_text(json.dumps(record, indent=2) + "\n")


def _about(model_file: Path, seed: int) -> dict[str, str]:
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, "
        f"Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)",
        "model": f"{model_file.name} (dequantised to float32)",
        "method": "teacher forcing on the real replies, each message and reply cut to its "
        "first tokens; TTFT of a one-token generation of the truncated prompt up to its reply",
        "seed": str(seed),
    }


if __name__ == "__main__":
    sys.exit(main())
