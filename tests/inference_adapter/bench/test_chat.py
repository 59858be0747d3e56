"""``kvstore bench chat --dataset sharegpt`` on its smoke preset, end to end (real daemons)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstore.inference_adapter.bench import chat, runner
from kvstore.inference_adapter.bench.presets import PRESETS
from kvstore.inference_adapter.bench.replay import TurnRecord


def test_real_conversations_replay_with_the_same_tokens_and_fill_the_tier_grid(
    sharegpt_file: Path, smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[str, int]] = []
    check = runner.check_same_outputs

    def counting(mode: str, got: Sequence[TurnRecord], expected: Sequence[TurnRecord]) -> None:
        assert [r.output for r in got] == [r.output for r in expected]
        compared.append((mode, len(got)))
        check(mode, got, expected)

    monkeypatch.setattr(runner, "check_same_outputs", counting)
    out = tmp_path / "out"
    args = ["--preset", "smoke", "--dataset", "sharegpt", "--workloads", "sharegpt"]
    assert chat.main([*args, "--out", str(out), "--dir", str(tmp_path)]) == 0

    report = json.loads((out / "chat.json").read_text())
    params = report["workloads"]["sharegpt"]
    turns = int(params["turns"])
    assert turns == sum(n for mode, n in compared if mode == "kvstore")  # every turn, main run
    fractions = PRESETS["smoke"].host_fractions
    grid = report["grid"]
    assert len(report["hbm"]) == 3  # the HBM level: pools keeping none, one, all sessions
    assert len(compared) == turns + len(grid) + 3 and len(grid) == 3 * 2 * len(fractions)
    assert {(g["host_fraction"], g["stack"], g["policy"]) for g in grid} == {
        (f, stack, policy)
        for f in fractions
        for stack in ("host", "+SSD", "+Redis")
        for policy in ("lru", "scheduler_aware")
    }
    assert all(0.0 < g["hit_rate"] <= 1.0 for g in grid)
    assert params["sharegpt.dataset_conversations"] == PRESETS["smoke"].dataset.sessions
    assert params["sharegpt.dataset_mean_turns"] >= 1 and params["sharegpt.mean_answer_tokens"]

    text = (out / "chat.md").read_text()
    table = text[text.index("Hit rate by tier") :].split("\n\n")[1].splitlines()
    header = table[0]
    assert all(f"host {f:.0%} of working set" in header for f in fractions)
    assert [row.split("|")[1].strip() for row in table[2:]] == [
        "host",
        "host",
        "+SSD",
        "+SSD",
        "+Redis",
        "+Redis",
    ]
    assert "ShareGPT V3" in text and "vocab 49152" in text
    assert (out / "hit_rate_by_tier.png").exists()


def test_a_missing_dataset_is_named_with_the_command_that_fetches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSTORE_DATASET_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(chat, "chat_tokenizer", lambda: None)
    args = ["--preset", "smoke", "--dataset", "sharegpt", "--out", str(tmp_path / "out")]
    assert chat.main(args) == 2
    assert "kvstore dataset fetch" in capsys.readouterr().err
