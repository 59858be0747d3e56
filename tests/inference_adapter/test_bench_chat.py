"""``kvstore bench chat`` on its smoke preset: the machinery and its checks, no timings."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstore.inference_adapter.bench import add_bench_parser, main
from kvstore.inference_adapter.bench.chat import run_bench
from kvstore.inference_adapter.bench.workloads import (
    DocumentShape,
    QaShape,
    ShareGptShape,
    long_document,
    multi_round_qa,
    sharegpt,
)
from kvstore.kernels.transfer import LayerCopies

SMOKE = ["--preset", "smoke", "--seed", "1"]


def test_the_smoke_bench_writes_tables_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [*SMOKE, "--workloads", "sharegpt,long_document", "--out", str(out)]
    assert main([*args, "--dir", str(tmp_path)]) == 0
    assert {"chat.md", "chat.json", "ttft_cdf.png", "hit_rate_by_tier.png"} <= {
        path.name for path in out.iterdir()
    }
    report = json.loads((out / "chat.json").read_text())
    modes = {(m["workload"], m["mode"]): m for m in report["modes"]}
    assert set(modes) == {
        (workload, mode)
        for workload in ("sharegpt", "long_document")
        for mode in ("recompute", "kvstore")
    }
    for (_, mode), summary in modes.items():
        assert summary["loaded_tokens"] == sum(summary["tier_tokens"].values())
        assert summary["loaded_tokens"] <= summary["reusable_tokens"]
        if mode == "recompute":
            assert summary["loaded_tokens"] == 0 and summary["hit_rate"] is None
        else:
            assert summary["loaded_tokens"] > 0 and summary["stored_bytes"] > 0
    # Every question after the first loads the shared document, stored once.
    assert modes["long_document", "kvstore"]["dedup_ratio"] > 1.5
    assert [row["store"] for row in report["sweep"]][:2] == ["host only", "host+SSD/4"]
    assert report["sweep"][-1]["store"] == "host+SSD"  # the main run closes the sweep
    text = (out / "chat.md").read_text()
    assert "| workload" in text and "Goals:" in text and "preset: smoke" in text
    assert "The HBM level (sharegpt)" in text


def test_the_hbm_level_serves_resident_history_with_recompute_tokens(tmp_path: Path) -> None:
    """The workload with the most sessions again with the engine's pool keeping none, one
    or every session resident: tokens equal recompute's (checked by the bench, exit 0);
    with no pool every hit comes from the store, with every session kept the history comes
    from HBM and the store loads nothing; the levels and the computed tokens add up to the
    prompt tokens in every row."""
    out = tmp_path / "out"
    args = [*SMOKE, "--workloads", "sharegpt", "--no-sweep", "--no-plots", "--out", str(out)]
    assert main([*args, "--dir", str(tmp_path)]) == 0
    report = json.loads((out / "chat.json").read_text())
    pools = {row["keeps"]: row for row in report["hbm"]}
    sessions = report["workloads"]["sharegpt"]["sessions"]
    assert list(pools) == ["none", "1 session", f"all {sessions} sessions"]
    assert [p["retain_pages"] for p in pools.values()] == sorted(
        p["retain_pages"] for p in pools.values()
    )
    for row in pools.values():
        assert row["loaded_tokens"] == sum(row["tier_tokens"].values()) <= row["prompt_tokens"]
        assert set(row["tier_tokens"]) == {"hbm", "host", "ssd", "redis"}
    none, every = pools["none"], pools[f"all {sessions} sessions"]
    assert none["tier_tokens"]["hbm"] == 0 < none["loaded_tokens"]
    assert every["tier_tokens"]["hbm"] == every["loaded_tokens"] >= none["loaded_tokens"]
    assert every["tier_tokens"]["host"] == every["tier_tokens"]["ssd"] == 0
    text = (out / "chat.md").read_text()
    assert "| HBM pool keeps" in text and "| none" in text


def test_the_bench_fails_loudly_when_the_store_serves_other_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real: Callable[..., None] = LayerCopies.write_layers

    def noisy(copies: LayerCopies, layers: list[tuple[int, torch.Tensor, ...]]) -> None:
        real(copies, layers)
        for _, k, *_ in layers:
            for _, at, count, runs, _ in copies._groups:  # the pages it wrote
                pages = slice(at, at + runs * count)
                k[pages] = torch.randn_like(k[pages]) * 10  # wrong KV

    monkeypatch.setattr(LayerCopies, "write_layers", noisy)
    args = [*SMOKE, "--workloads", "sharegpt", "--no-sweep", "--no-plots"]
    assert main([*args, "--out", str(tmp_path / "out"), "--dir", str(tmp_path)]) == 1
    assert "generated other tokens than recompute" in capsys.readouterr().err
    assert not (tmp_path / "out" / "chat.json").exists()


def test_bench_chat_is_a_kvstore_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="kvstore")
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "chat", "--quick", "--no-sweep"])
    assert args.run is run_bench and args.preset == "quick" and args.sweep is False
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "chat", "--workloads", "sharegpt,nope"])


def test_the_sharegpt_shape_keeps_its_statistics() -> None:
    shape = ShareGptShape(sessions=400)
    workload = sharegpt(shape, vocab_size=512, generated=8, window=1 << 20, seed=3)
    turns: dict[str, int] = {}
    for turn in workload.turns:
        turns[turn.session_id] = max(turns.get(turn.session_id, 0), turn.index)
    assert sum(n > 1 for n in turns.values()) / len(turns) == pytest.approx(0.73, abs=0.005)
    assert statistics.mean(turns.values()) == pytest.approx(5.75, rel=0.15)
    messages = statistics.mean(len(turn.message) for turn in workload.turns)
    answers = statistics.mean(8 + len(turn.tail) for turn in workload.turns)
    assert messages == pytest.approx(56 * 1.3, rel=0.1)
    assert answers == pytest.approx(203 * 1.3, rel=0.1)
    arrivals = [turn.arrival_s for turn in workload.turns]
    assert arrivals == sorted(arrivals)
    assert any(turn.warmup for turn in workload.turns) and not workload.turns[-1].warmup


def test_sessions_end_before_they_overflow_the_window() -> None:
    workload = sharegpt(
        ShareGptShape(sessions=50), vocab_size=512, generated=8, window=2048, seed=0
    )
    assert max(workload.final_lengths(8).values()) <= 2048


def test_multi_round_qa_shares_the_system_prompt_and_goes_round_robin() -> None:
    shape = QaShape(users=3, rounds=2, system_tokens=40, history_tokens=30, answer_tokens=10)
    workload = multi_round_qa(shape, vocab_size=512, generated=4, window=4096, seed=0)
    assert [t.session_id for t in workload.turns] == ["user-00", "user-01", "user-02"] * 2
    first = [t.message for t in workload.turns[:3]]
    assert first[0][:40] == first[1][:40] == first[2][:40] and first[0][40:70] != first[1][40:70]
    assert all(len(t.message) == shape.question_tokens for t in workload.turns[3:])
    assert all(len(t.tail) == 6 for t in workload.turns)
    with pytest.raises(ValueError, match="positions"):
        multi_round_qa(shape, vocab_size=512, generated=4, window=100, seed=0)


def test_every_question_reads_the_same_document() -> None:
    shape = DocumentShape(document_tokens=100, questions=3, question_tokens=5)
    workload = long_document(shape, vocab_size=512, generated=4, window=4096, seed=0)
    documents = {turn.message[:100] for turn in workload.turns}
    assert len(documents) == 1 and workload.num_sessions == 3
