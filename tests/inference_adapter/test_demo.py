"""``kvstore chat`` on a daemon it starts itself: SmolLM2 (fp32, bf16) and the random model."""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path

import pytest

from kvstore.inference_adapter.demo import SCRIPT, add_chat_parser, main, run_chat

TINY = ["--random", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"]
TURN = re.compile(
    r"turn (\d+): prompt (\d+) tokens \| loaded (\d+)(?: \(host (\d+) blocks\))?, "
    r"computed (\d+) \| TTFT [\d.]+ m?s with the store, [\d.]+ m?s recomputing \([\d.]+x\) \| "
    r"(same reply|REPLIES DIFFER)"
)


def turn_lines(out: str) -> list[re.Match[str]]:
    return [match for line in out.splitlines() if (match := TURN.search(line))]


def check_turns(out: str, turns: int, block: int) -> None:
    """Every turn answered as recomputing did; turns after the first loaded the history."""
    lines = turn_lines(out)
    assert [int(line[1]) for line in lines] == list(range(1, turns + 1)), out
    assert all(line[6] == "same reply" for line in lines), out
    assert int(lines[0][3]) == 0 and "nothing stored yet" in out
    for previous, line in itertools.pairwise(lines):
        prompt, loaded, blocks = int(line[2]), int(line[3]), int(line[4])
        assert loaded == blocks * block > 0 and int(line[5]) == prompt - loaded
        assert loaded >= int(previous[2]) // block * block  # the whole previous prompt
    assert re.search(r"store: \d+ blocks loaded, \d+ saved, 0 dropped, 0 failed loads", out)


def test_the_random_model_chat_loads_history_and_answers_like_recompute(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [*TINY, "--script", "--turns", "3", "--page-tokens", "32", "--max-tokens", "4"]
    assert main(args) == 0
    check_turns(capsys.readouterr().out, 3, 32)


def test_a_bad_hbm_table_stops_the_chat_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "engine.toml").write_text("[hbm]\npages = -3\n")
    assert main([*TINY, "--script", "--config", str(tmp_path / "engine.toml")]) == 2
    assert "kvstore chat: hbm.pages must be >= 0, got -3" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["flag", "config"])
def test_with_hbm_pages_later_turns_map_the_history_kept_in_the_pool(
    how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*TINY, "--script", "--turns", "3", "--page-tokens", "32", "--max-tokens", "4"]
    if how == "flag":
        args += ["--hbm-pages", "64"]
    else:  # the [hbm] table of a TOML file
        (tmp_path / "engine.toml").write_text('[hbm]\npages = 64\npolicy = "lru"\n')
        args += ["--config", str(tmp_path / "engine.toml")]
    assert main([*args, "--metrics-listen", "127.0.0.1:0"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if re.search(r"turn \d+:", line)]
    assert len(lines) == 3 and all("same reply" in line for line in lines), out
    mapped = 0
    for line in lines[1:]:  # the history is in the pool: nothing loaded from the store
        hbm = re.search(r"loaded (\d+) \(hbm (\d+) blocks\)", line)
        assert hbm and int(hbm[1]) == int(hbm[2]) * 32 > 0, line
        mapped += int(hbm[1])
    # The chat's own turns only (the warm-up's tokens are the engine's, not the chat's).
    assert re.search(rf"prompt tokens by level: hbm {mapped} \(\d+%\), computed", out), out
    assert re.search(r"engine metrics on http://127\.0\.0\.1:\d+/metrics", out), out
    assert "store: 0 blocks loaded" in out


def test_smollm2_chat_streams_real_replies_and_reuses_history(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--script", "--turns", "3", "--max-tokens", "24"]) == 0
    out = capsys.readouterr().out
    check_turns(out, 3, 16)
    replies = [line for line in out.splitlines() if line.startswith("assistant: ")]
    assert len(replies) == 3 and all(len(reply.split()) >= 5 for reply in replies)  # text


def test_a_bf16_smollm2_chat_equals_recompute_on_every_turn(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Six turns in bfloat16: every prefix hit is the bits a prefill computes, the replies'
    KV (computed in decode steps) included."""
    assert main(["--script", "--dtype", "bfloat16", "--max-tokens", "24"]) == 0
    check_turns(capsys.readouterr().out, len(SCRIPT), 16)


def test_messages_come_from_a_file_one_per_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "chat.txt"
    script.write_text("first message\n\n  second message  \nthird\n")
    assert main([*TINY, "--script", str(script), "--max-tokens", "2"]) == 0
    assert len(turn_lines(capsys.readouterr().out)) == 3  # the blank line is no turn


def test_a_missing_model_file_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSTORE_MODEL_DIR", str(tmp_path))
    assert main(["--script"]) == 2
    assert "kvstore model fetch" in capsys.readouterr().err


def test_chat_is_a_subcommand_parser() -> None:
    parser = argparse.ArgumentParser(prog="kvstore")
    add_chat_parser(parser.add_subparsers())
    args = parser.parse_args(["chat", "--turns", "2", "--address", "unix:/run/kvstore/k.sock"])
    assert args.run is run_chat and args.turns == 2 and args.address == "unix:/run/kvstore/k.sock"
    assert args.script is None and not args.random  # interactive, SmolLM2
