"""``kvstore chat``: the scripted demo, on a daemon it starts itself, with a tiny model."""

from __future__ import annotations

import argparse
import re

import pytest

from kvstore.inference_adapter.demo import add_chat_parser, main, run_chat, script

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"]


def test_the_demo_loads_history_from_the_store_and_answers_like_recompute(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [*TINY, "--notes", "2", "--turns", "3", "--page-tokens", "32", "--max-tokens", "4"]
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("turn ")]
    assert len(lines) == 3
    assert all(line.endswith("same reply") for line in lines)
    assert re.search(r"turn 1: prompt \d+ tokens \| loaded 0, computed \d+", lines[0])
    for line in lines[1:]:  # later turns load the history from the host tier
        assert re.search(r"loaded [1-9]\d* \(host \d+ blocks\)", line), line
        assert re.search(r"TTFT [\d.]+ ms with the store, [\d.]+ ms recomputing", line)


def test_chat_is_a_subcommand_parser() -> None:
    parser = argparse.ArgumentParser(prog="kvstore")
    add_chat_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["chat", "--turns", "2", "--address", "unix:/run/kvstore/kvstore.sock"]
    )
    assert (
        args.run is run_chat
        and args.turns == 2
        and args.address == "unix:/run/kvstore/kvstore.sock"
    )


def test_the_script_opens_with_the_document() -> None:
    messages = script(3)
    assert "Note 3:" in messages[0] and "Note 4:" not in messages[0]
    assert len(messages) == 5
