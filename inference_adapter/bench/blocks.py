"""``kvstore bench blocks``: what a larger store block costs in prefix hits on real chats.

    kvstore bench blocks [--conversations N] [--block-tokens 16,32,...] [--window W]
                         [--seed N] [--json FILE]

The store keeps whole blocks only: a turn's unsaved tail (the tokens past its last full
block) is recomputed at the next turn. Larger blocks move faster (one transfer of 512 KiB
instead of 16 of 32 KiB) but leave a longer tail. This measures that tail on real ShareGPT
V3 conversations (:mod:`.sharegpt`, ``kvstore dataset fetch``), tokenized as the chat server
frames them with SmolLM2-135M-Instruct's tokenizer and chat template (its GGUF file,
``kvstore model fetch``); nothing runs a model.

Per conversation (teacher forcing: each reply is the dataset's, as the history holds it),
turn ``t``'s prompt is the history so far plus the message; when turn ``t - 1`` ended, the
store held the full blocks of what that turn computed (its prompt and its reply but the last
token, whose KV is never computed). Turn ``t`` loads the leading stored blocks of its prompt,
at most all but its last token's block (the engine computes at least one token). The first
turn of every conversation shares the chat template's preamble (a default system message)
with every other: its full blocks are held too. A conversation stops before a turn whose
prompt and reply pass ``--window`` tokens.

Per block size: the tokens loaded over the prompt tokens of every turn (the prefill a store
saves), the same over what a store keeping every token would load (``block_tokens`` 1: the
tail saved), the mean tail a turn recomputes, and the mean blocks a hit moves. Prints a
markdown table; ``--json`` writes it with the sample's sizes. Exit status 2 when the model
or the dataset is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstore.inference_adapter.bench import sharegpt
from kvstore.inference_adapter.bench.runner import progress
from kvstore.inference_adapter.models import model_path
from kvstore.inference_adapter.tokenizer import ChatTokenizer

__all__ = ["Chat", "Row", "chats", "main", "reuse"]

BLOCK_TOKENS = (16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation's turns as token counts: ``(message, reply)`` per turn, and the
    preamble its first prompt shares with every other conversation."""

    turns: tuple[tuple[int, int], ...]
    shared: int


@dataclass(frozen=True, slots=True)
class Row:
    """One block size's figures over every turn of the sample."""

    block_tokens: int
    turns: int
    prompt_tokens: int
    loaded_tokens: int
    hit_rate: float  # loaded / prompt tokens
    of_every_token: float  # loaded / what a store keeping every token would load
    mean_tail: float  # tokens per turn recomputed beyond what every-token reuse would
    mean_hit_blocks: float  # blocks per turn that loads any


def reuse(chats: Sequence[Chat], block_tokens: int) -> Row:
    """Prefix reuse of ``chats`` with blocks of ``block_tokens`` (module docstring)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    turns = prompt_tokens = loaded = ideal = hits = hit_blocks = 0
    for chat in chats:
        computed = 0  # tokens whose KV the last turn computed (and saved, in whole blocks)
        history = 0
        for index, (message, reply) in enumerate(chat.turns):
            prompt = history + message
            held = chat.shared if index == 0 else computed  # prefix tokens the store saw
            usable = min(held, prompt - 1)
            blocks = usable // block_tokens
            turns += 1
            prompt_tokens += prompt
            loaded += blocks * block_tokens
            ideal += usable
            hits += blocks > 0
            hit_blocks += blocks
            history = prompt + reply
            computed = history - 1
    return Row(
        block_tokens,
        turns,
        prompt_tokens,
        loaded,
        loaded / max(1, prompt_tokens),
        loaded / max(1, ideal),
        (ideal - loaded) / max(1, turns),
        hit_blocks / max(1, hits),
    )


def chats(
    conversations: Sequence[sharegpt.Conversation], tokenizer: ChatTokenizer, window: int
) -> list[Chat]:
    """Token counts of each conversation's turns, as the chat server frames them, up to the
    first turn that would pass ``window`` tokens."""
    first = [tokenizer.turn_tokens(text, first=True) for text in ("a", "b")]
    shared = next(
        (i for i, (x, y) in enumerate(zip(*first, strict=False)) if x != y), len(first[0])
    )
    result = []
    for conversation in conversations:
        turns, length = [], 0
        for index, exchange in enumerate(conversation.exchanges):
            message = len(tokenizer.turn_tokens(exchange.human, first=index == 0))
            reply = len(sharegpt.reply_tokens(tokenizer, tokenizer.encode(exchange.gpt)))
            if length + message + reply > window:
                break
            turns.append((message, reply))
            length += message + reply
        if turns:
            result.append(Chat(tuple(turns), shared))
    return result


def render(rows: Sequence[Row], about: dict[str, object]) -> str:
    head = ("block tokens", "hit rate", "of every token", "mean tail", "blocks per hit")
    lines = [
        ", ".join(f"{key} {value}" for key, value in about.items()),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" for _ in head) + "|",
    ]
    for row in rows:
        cells = (str(row.block_tokens), f"{row.hit_rate:.3f}", f"{row.of_every_token:.3f}",
                 f"{row.mean_tail:.1f}", f"{row.mean_hit_blocks:.1f}")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="kvstore bench blocks", description=description)
    parser.add_argument("--conversations", type=int, default=1000, help="%(default)s")
    parser.add_argument("--block-tokens", default=",".join(map(str, BLOCK_TOKENS)),
                        help="comma-separated (%(default)s)")  # fmt: skip
    parser.add_argument("--window", type=int, default=32768, help="context tokens (%(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    try:
        sizes = sorted({int(part) for part in args.block_tokens.split(",")})
    except ValueError:
        parser.error(f"--block-tokens: not comma-separated integers: {args.block_tokens!r}")
    if min(sizes) < 1 or args.conversations < 1 or args.window < 2:
        parser.error("--block-tokens and --conversations must be >= 1, --window >= 2")
    try:
        model_file, data_file = model_path("smollm2"), sharegpt.dataset_path()
    except FileNotFoundError as error:
        print(f"kvstore bench blocks: {error}", file=sys.stderr)
        return 2
    progress(f"tokenizing {args.conversations} conversations")
    tokenizer = ChatTokenizer.from_gguf(model_file)
    sample = sharegpt.sample_conversations(data_file, args.conversations, seed=args.seed)
    sample_chats = chats(sample, tokenizer, args.window)
    rows = [reuse(sample_chats, size) for size in sizes]
    about: dict[str, object] = {
        "conversations": len(sample_chats),
        "turns": rows[0].turns if rows else 0,
        "window": args.window,
        "seed": args.seed,
        "tokenizer": model_file.name,
    }
    text = render(rows, about)
    print(text, end="")
    if args.json:
        report = {"about": about, "rows": [asdict(row) for row in rows]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
