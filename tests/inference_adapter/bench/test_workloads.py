"""The real-conversation ShareGPT workload: its tokens, caps, window cuts and arrivals."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from kvstore.inference_adapter.bench.sharegpt import (
    Conversation,
    Exchange,
    Tokenizer,
    reply_tokens,
    sample_conversations,
)
from kvstore.inference_adapter.bench.workloads import DatasetShape, Workload, sharegpt_dataset
from kvstore.inference_adapter.sessions import ByteTokenizer
from kvstore.inference_adapter.tokenizer import ChatTokenizer

GENERATED = 4


class FramedBytes:
    """Bytes as tokens (``ByteTokenizer``), ChatML-like framing with ids 256-259."""

    vocab_size, end_of_turn_id = 260, 257
    start, system = 256, 258

    def __init__(self) -> None:
        self.bytes = ByteTokenizer(256)

    def encode(self, text: str) -> list[int]:
        return self.bytes.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.bytes.decode(tokens)

    def turn_tokens(self, content: str, *, first: bool, role: str = "user") -> list[int]:
        head = [self.system, self.end_of_turn_id] if first else []
        return [*head, self.start, *self.encode(content), self.end_of_turn_id, self.start]


def conversation(name: str, turns: int, words: int = 3) -> Conversation:
    exchanges = tuple(
        Exchange(" ".join([f"q{t}"] * words), " ".join([f"a{t}"] * 2 * words)) for t in range(turns)
    )
    return Conversation(name, exchanges)


def build(
    chats: Sequence[Conversation],
    tokenizer: Tokenizer,
    *,
    window: int = 1 << 20,
    seed: int = 0,
    **shape: float,
) -> Workload:
    return sharegpt_dataset(
        DatasetShape(sessions=len(chats), **shape),  # type: ignore[arg-type]
        chats,
        tokenizer,
        generated=GENERATED,
        window=window,
        seed=seed,
    )


def by_session(workload: Workload) -> dict[str, list[tuple[int, ...]]]:
    """Each session's whole history as the replay builds it (generated tokens as -1)."""
    history: dict[str, list[tuple[int, ...]]] = {}
    for turn in workload.turns:
        history.setdefault(turn.session_id, []).append(
            (*turn.message, *[-1] * GENERATED, *turn.tail)
        )
    return history


def expected_turns(chat: Conversation, tokenizer: Tokenizer, cap: int) -> list[tuple[int, ...]]:
    """What the builder should make of ``chat``: framed messages, capped replies."""
    turns = []
    for index, exchange in enumerate(chat.exchanges):
        human = tokenizer.encode(exchange.human)
        text = tokenizer.decode(human[:cap]) if len(human) > cap else exchange.human
        reply = reply_tokens(tokenizer, tokenizer.encode(exchange.gpt)[:cap])
        turns.append(
            (*tokenizer.turn_tokens(text, first=index == 0), *[-1] * GENERATED, *reply[GENERATED:])
        )
    return turns


def test_turns_are_framed_messages_and_the_rest_of_each_reply() -> None:
    tokenizer = FramedBytes()
    chats = [conversation("a", 3), conversation("b", 1)]
    workload = build(chats, tokenizer)
    assert by_session(workload) == {
        chat.id: expected_turns(chat, tokenizer, 1024) for chat in chats
    }
    assert workload.name == "sharegpt" and workload.num_sessions == 2
    p = workload.params
    assert p["sharegpt.dataset_mean_turns"] == 2.0 and p["sharegpt.dataset_multi_turn_share"] == 0.5
    assert p["sharegpt.dataset_mean_message_tokens"] == len("q0 q0 q0")
    assert p["sharegpt.dataset_mean_answer_tokens"] == len("a0 a0 a0 a0 a0 a0")
    assert p["sharegpt.mean_answer_tokens"] == len("a0 a0 a0 a0 a0 a0") + 1
    assert p["sharegpt.cut_turns"] == p["sharegpt.capped_messages"] == 0


def test_long_messages_and_replies_keep_their_first_tokens() -> None:
    tokenizer = FramedBytes()
    chats = [conversation("a", 2, words=20)]
    workload = build(chats, tokenizer, max_message_tokens=10, max_answer_tokens=30)
    first, second = workload.turns
    assert first.message == (258, 257, 256, *tokenizer.encode("q0 q0 q0 q"), 257, 256)
    assert len(first.tail) == 30 + 1 - GENERATED and first.tail[-1] == 257
    assert second.message[0] == 256  # no system head after the first turn
    assert workload.params["sharegpt.capped_messages"] == 2
    assert workload.params["sharegpt.capped_answers"] == 2


def test_a_session_ends_before_the_turn_that_would_overflow_the_window() -> None:
    tokenizer = FramedBytes()
    chats = [conversation("long", 6), conversation("short", 1), conversation("wide", 2, 40)]
    per_turn = len(expected_turns(chats[0], tokenizer, 1024)[1])  # a later turn of "long"
    window = len(expected_turns(chats[0], tokenizer, 1024)[0]) + 2 * per_turn
    workload = build(chats, tokenizer, window=window)
    turns = {session: len(history) for session, history in by_session(workload).items()}
    assert turns == {"long": 3, "short": 1}  # "wide" does not fit even its first turn
    assert max(workload.final_lengths(GENERATED).values()) <= window
    assert workload.params["sharegpt.cut_turns"] == 3 + 2
    assert workload.params["sharegpt.cut_sessions"] == 2


def test_arrivals_are_seeded_poisson_sessions_with_gaps_and_a_warm_up() -> None:
    tokenizer = FramedBytes()
    chats = [conversation(f"c{i}", 1 + i % 3) for i in range(20)]
    workload = build(chats, tokenizer, seed=5, warmup_share=0.25)
    assert workload == build(chats, tokenizer, seed=5, warmup_share=0.25)
    assert workload.turns != build(chats, tokenizer, seed=6, warmup_share=0.25).turns
    arrivals = [turn.arrival_s for turn in workload.turns]
    assert arrivals == sorted(arrivals)
    starts = {t.session_id: t.arrival_s for t in workload.turns if t.index == 1}
    assert [starts[chat.id] for chat in chats] == sorted(starts.values())
    warm = {t.session_id for t in workload.turns if t.warmup and t.index == 1}
    assert warm == {f"c{i}" for i in range(5)}  # 25% of 20 sessions
    assert not workload.turns[-1].warmup


def test_real_conversations_are_what_smollm2s_tokenizer_makes_of_them(
    smollm2_tokenizer: Tokenizer, sharegpt_file: Path
) -> None:
    smollm2 = smollm2_tokenizer
    chats = sample_conversations(sharegpt_file, 6, seed=0, pool=300)
    cap = 256
    workload = build(chats, smollm2, max_message_tokens=cap, max_answer_tokens=cap)
    assert smollm2.vocab_size == 49152
    assert by_session(workload) == {chat.id: expected_turns(chat, smollm2, cap) for chat in chats}
    assert all(0 <= token < smollm2.vocab_size for t in workload.turns for token in t.message)
    counts = [len(chat.exchanges) for chat in chats]
    assert workload.params["sharegpt.dataset_mean_turns"] == statistics.mean(counts)


def test_turns_and_replies_add_up_to_the_rendered_chat(smollm2_tokenizer: ChatTokenizer) -> None:
    """The framing matches the chat template: the prompt of a session's next turn is the
    template's rendering of the conversation so far, token for token."""
    smollm2, render = smollm2_tokenizer, smollm2_tokenizer.render
    history: list[int] = []
    messages: list[dict[str, str]] = []
    for index, exchange in enumerate(conversation("x", 3, words=5).exchanges):
        history += smollm2.turn_tokens(exchange.human, first=index == 0)
        messages.append({"role": "user", "content": exchange.human})
        assert history == smollm2.encode(render(messages, add_generation_prompt=True))
        history += reply_tokens(smollm2, smollm2.encode(exchange.gpt))
        messages.append({"role": "assistant", "content": exchange.gpt})
