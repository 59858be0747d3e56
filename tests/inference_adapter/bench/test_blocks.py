"""``kvstore bench blocks``: prefix reuse per block size, by hand and on real ShareGPT chats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.inference_adapter.bench import blocks
from kvstore.inference_adapter.bench.blocks import Chat, chats, reuse
from kvstore.inference_adapter.bench.sharegpt import Conversation, Exchange
from kvstore.inference_adapter.tokenizer import ChatTokenizer


def test_only_whole_blocks_of_what_the_last_turn_computed_are_loaded() -> None:
    # Turn 1: prompt 10, the shared preamble 6 -> one block of 4. It computes 10 + 20 - 1.
    # Turn 2: prompt 35, 29 held -> 7 blocks (28). Turn 3: prompt 45, 41 held -> 10 (40).
    chat = Chat(turns=((10, 20), (5, 7), (3, 4)), shared=6)
    row = reuse([chat], 4)
    assert (row.turns, row.prompt_tokens, row.loaded_tokens) == (3, 90, 72)
    assert row.hit_rate == pytest.approx(72 / 90)
    assert row.of_every_token == pytest.approx(72 / 76)  # 6 + 29 + 41 with every token kept
    assert row.mean_tail == pytest.approx(4 / 3) and row.mean_hit_blocks == pytest.approx(6)
    assert reuse([chat], 1).of_every_token == 1.0
    assert reuse([chat], 64).loaded_tokens == 0
    # The engine computes at least the prompt's last token, even when all of it is held.
    assert reuse([Chat(turns=((5, 1),), shared=9)], 1).loaded_tokens == 4
    with pytest.raises(ValueError, match="block_tokens must be >= 1, got 0"):
        reuse([chat], 0)


def test_turns_are_counted_as_the_chat_server_frames_them(
    smollm2_tokenizer: ChatTokenizer,
) -> None:
    conversation = Conversation(
        "c", (Exchange("Hello there", "Hi! How can I help?"), Exchange("Tell me a joke", "No."))
    )
    (chat,) = chats([conversation], smollm2_tokenizer, window=10_000)
    first = smollm2_tokenizer.turn_tokens("Hello there", first=True)
    assert chat.turns[0][0] == len(first)
    assert (
        0 < chat.shared < len(first)
        and first[: chat.shared]
        == (smollm2_tokenizer.turn_tokens("something else", first=True)[: chat.shared])
    )
    eot = smollm2_tokenizer.end_of_turn_id
    assert chat.turns[0][1] == len([*smollm2_tokenizer.encode("Hi! How can I help?"), eot])
    # A window that the second turn would pass ends the conversation before it.
    (cut,) = chats([conversation], smollm2_tokenizer, window=sum(chat.turns[0]) + 1)
    assert cut.turns == chat.turns[:1]


def test_on_real_chats_larger_blocks_never_load_more(
    sharegpt_file: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "blocks.json"
    argv = ["--conversations", "12", "--block-tokens", "256,16,64", "--json", str(out)]
    assert blocks.main(argv) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [row["block_tokens"] for row in rows] == [16, 64, 256]
    assert report["about"]["turns"] >= 12 and rows[0]["loaded_tokens"] > 0
    loaded = [row["loaded_tokens"] for row in rows]
    assert loaded == sorted(loaded, reverse=True)
    assert all(0 < row["of_every_token"] <= 1 for row in rows)
