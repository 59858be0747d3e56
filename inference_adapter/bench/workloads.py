"""The three chat workloads the bench replays, as turns in arrival order.

Every workload is a tuple of :class:`TurnSpec` sorted by simulated arrival time, drawn from
a seeded ``random.Random`` (the same seed gives the same tokens on every machine). A turn is
one user message; its answer is ``generated`` tokens sampled by the model (greedy, compared
between modes) followed by ``tail`` scripted tokens that stand for the rest of the answer
(see the bench package docstring for why). Builders:

- :func:`sharegpt`: the CachedAttention evaluation shape. Sessions arrive as a Poisson
  process; 73% are multi-turn (exactly, rounded) and the mean is 5.75 turns before the
  window cuts long sessions short; user messages ~56 words and
  answers ~203 words (lognormal), times ``tokens_per_word``; an exponential gap between the
  turns of a session. A session ends early rather than overflow the context window, so no
  turn is ever truncated. Turns that arrive before the ``warmup_share`` of sessions has
  arrived are marked warm-up and left out of the figures.
- :func:`multi_round_qa`: the LMCache multi-round QA shape. ``users`` users, ``rounds``
  rounds at a fixed QPS, round-robin over users; the first message of every user is a
  shared system prompt, a per-user history and a question; later ones are questions.
- :func:`long_document`: ``questions`` single-turn sessions over one shared document.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

__all__ = [
    "DocumentShape",
    "QaShape",
    "ShareGptShape",
    "TurnSpec",
    "Workload",
    "long_document",
    "multi_round_qa",
    "sharegpt",
]


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """One user message of a session and the scripted part of its answer."""

    session_id: str
    index: int  # 1 for the session's first turn
    arrival_s: float  # simulated arrival time (orders the replay; queueing is not timed)
    message: tuple[int, ...]
    tail: tuple[int, ...]  # answer tokens after the generated ones
    warmup: bool = False


@dataclass(frozen=True, slots=True)
class Workload:
    """A named workload: its turns in arrival order and the parameters that drew them."""

    name: str
    turns: tuple[TurnSpec, ...]
    params: dict[str, float] = field(default_factory=dict)

    @property
    def num_sessions(self) -> int:
        return len({turn.session_id for turn in self.turns})

    def final_lengths(self, generated: int) -> dict[str, int]:
        """Tokens in each session's context after its last turn."""
        lengths: dict[str, int] = {}
        for turn in self.turns:
            added = len(turn.message) + generated + len(turn.tail)
            lengths[turn.session_id] = lengths.get(turn.session_id, 0) + added
        return lengths


@dataclass(frozen=True, slots=True)
class ShareGptShape:
    """CachedAttention's ShareGPT statistics, scaled to a model by ``tokens_per_word``."""

    sessions: int = 24
    mean_turns: float = 5.75
    multi_turn_share: float = 0.73
    user_words: float = 56.0
    answer_words: float = 203.0
    tokens_per_word: float = 1.3
    length_sigma: float = 0.5  # lognormal spread of message and answer lengths
    arrival_rate: float = 1 / 20  # sessions per simulated second
    mean_gap_s: float = 60.0  # between the turns of one session
    warmup_share: float = 0.15  # of sessions; their early turns are not measured


@dataclass(frozen=True, slots=True)
class QaShape:
    """LMCache's multi-round QA benchmark (defaults there: 10, 5, 1000, 2000, 100, 0.5)."""

    users: int = 10
    rounds: int = 5
    system_tokens: int = 1000
    history_tokens: int = 2000
    answer_tokens: int = 100
    question_tokens: int = 40
    qps: float = 0.5


@dataclass(frozen=True, slots=True)
class DocumentShape:
    """Many questions over one long document."""

    document_tokens: int = 3000
    questions: int = 12
    question_tokens: int = 40
    answer_tokens: int = 64
    qps: float = 0.5


class _Draw:
    """Token and length draws from one seeded generator."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def tokens(self, count: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(self.vocab_size) for _ in range(count))

    def length(self, mean: float, sigma: float) -> int:
        """A lognormal length with this mean, at least 1 and at most 4x the mean."""
        drawn = self.rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)
        return max(1, min(round(drawn), round(4 * mean)))

    def num_turns(self, shape: ShareGptShape, multi_turn: bool) -> int:
        """1, or for a multi-turn session 2 + a geometric count whose mean makes the overall
        mean ``mean_turns``."""
        if not multi_turn:
            return 1
        extra_mean = (shape.mean_turns - (1 - shape.multi_turn_share)) / shape.multi_turn_share
        p = 1 / (extra_mean - 1)  # 2 + Geometric(p) on {0, 1, ...} has mean 2 + (1 - p) / p
        return 2 + int(math.log(1 - self.rng.random()) / math.log(1 - p))


def sharegpt(
    shape: ShareGptShape, *, vocab_size: int, generated: int, window: int, seed: int
) -> Workload:
    """The ShareGPT-shaped workload; see the module docstring.

    Args:
        shape: Session statistics.
        vocab_size: Token ids are drawn from ``0 .. vocab_size - 1``.
        generated: Answer tokens the model samples per turn (the rest is the tail).
        window: Context positions; a session stops before a turn that would not fit.
        seed: Seeds every draw.
    """
    draw = _Draw(seed, vocab_size)
    turns: list[TurnSpec] = []
    start, warmup_ends = 0.0, math.inf
    warmup_sessions = round(shape.warmup_share * shape.sessions)
    # Exactly the multi-turn share (rounded), so that small samples keep the shape.
    multi = set(
        draw.rng.sample(range(shape.sessions), round(shape.multi_turn_share * shape.sessions))
    )
    for s in range(shape.sessions):
        start += draw.rng.expovariate(shape.arrival_rate)
        if s == warmup_sessions:
            warmup_ends = start
        arrival, context = start, 0
        for index in range(1, draw.num_turns(shape, s in multi) + 1):
            message = draw.length(shape.user_words * shape.tokens_per_word, shape.length_sigma)
            answer = draw.length(shape.answer_words * shape.tokens_per_word, shape.length_sigma)
            answer = max(answer, generated)
            if context + message + answer > window:
                break
            turns.append(
                TurnSpec(
                    f"chat-{s:03d}",
                    index,
                    arrival,
                    draw.tokens(message),
                    draw.tokens(answer - generated),
                )
            )
            context += message + answer
            arrival += draw.rng.expovariate(1 / shape.mean_gap_s)
    turns.sort(key=lambda turn: turn.arrival_s)
    marked = [_mark_warmup(turn, turn.arrival_s < warmup_ends) for turn in turns]
    params = {f"sharegpt.{key}": float(value) for key, value in _fields(shape).items()}
    return Workload("sharegpt", tuple(marked), params)


def multi_round_qa(
    shape: QaShape, *, vocab_size: int, generated: int, window: int, seed: int
) -> Workload:
    """The multi-round QA workload; see the module docstring.

    Raises:
        ValueError: The last round would not fit the context window.
    """
    draw = _Draw(seed, vocab_size)
    final = shape.system_tokens + shape.history_tokens
    final += shape.rounds * (shape.question_tokens + max(shape.answer_tokens, generated))
    if final > window:
        raise ValueError(f"multi-round QA needs {final} positions, the window is {window}")
    system = draw.tokens(shape.system_tokens)
    histories = [draw.tokens(shape.history_tokens) for _ in range(shape.users)]
    turns = []
    for order, (r, u) in enumerate(itertools.product(range(shape.rounds), range(shape.users))):
        question = draw.tokens(shape.question_tokens)
        message = (*system, *histories[u], *question) if r == 0 else question
        tail = draw.tokens(max(shape.answer_tokens - generated, 0))
        turns.append(TurnSpec(f"user-{u:02d}", r + 1, order / shape.qps, message, tail))
    params = {f"qa.{key}": float(value) for key, value in _fields(shape).items()}
    return Workload("multi_round_qa", tuple(turns), params)


def long_document(
    shape: DocumentShape, *, vocab_size: int, generated: int, window: int, seed: int
) -> Workload:
    """The shared-document workload; see the module docstring.

    Raises:
        ValueError: A question and its answer would not fit the context window.
    """
    draw = _Draw(seed, vocab_size)
    needed = shape.document_tokens + shape.question_tokens + max(shape.answer_tokens, generated)
    if needed > window:
        raise ValueError(f"the document workload needs {needed} positions, the window is {window}")
    document = draw.tokens(shape.document_tokens)
    turns = tuple(
        TurnSpec(
            f"reader-{q:02d}",
            1,
            q / shape.qps,
            (*document, *draw.tokens(shape.question_tokens)),
            draw.tokens(max(shape.answer_tokens - generated, 0)),
        )
        for q in range(shape.questions)
    )
    params = {f"document.{key}": float(value) for key, value in _fields(shape).items()}
    return Workload("long_document", turns, params)


def _mark_warmup(turn: TurnSpec, warmup: bool) -> TurnSpec:
    return TurnSpec(turn.session_id, turn.index, turn.arrival_s, turn.message, turn.tail, warmup)


def _fields(shape: ShareGptShape | QaShape | DocumentShape) -> dict[str, float]:
    return {name: getattr(shape, name) for name in shape.__dataclass_fields__}
