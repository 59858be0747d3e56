"""``kvstore bench chat --nodes 2`` on the smoke preset: two daemons (real processes) with
host tiers of their own, sharing a real Redis or nothing, sessions bouncing between them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.inference_adapter.bench import chat, runner
from kvstore.inference_adapter.bench.nodes import bounce
from kvstore.inference_adapter.bench.replay import TurnRecord
from kvstore.inference_adapter.bench.workloads import ShareGptShape, sharegpt

SMOKE = ["--preset", "smoke", "--seed", "1", "--no-sweep", "--no-plots", "--nodes", "2"]
SINGLE, TWO, NODE_B = "1 node, host+Redis, lru", "2 nodes", "2 nodes: node B"


def bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: str
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, int]]:
    """The sharegpt workload on two nodes sharing ``shared``: its nodes section, the two
    nodes' turn records, and how many turns each checked run compared with recompute."""
    compared: dict[str, int] = {}
    check = runner.check_same_outputs

    def counting(mode: str, got: Sequence[TurnRecord], expected: Sequence[TurnRecord]) -> None:
        assert [r.output for r in got] == [r.output for r in expected]
        compared[mode] = compared.get(mode, 0) + len(got)
        check(mode, got, expected)

    monkeypatch.setattr(runner, "check_same_outputs", counting)
    out = tmp_path / shared
    args = [*SMOKE, "--workloads", "sharegpt", "--shared-redis", shared, "--out", str(out)]
    assert chat.main([*args, "--dir", str(tmp_path)]) == 0
    report = json.loads((out / "chat.json").read_text())
    (section,) = report["nodes"]
    (two,) = [run for run in report["turns"] if run["label"].startswith("2 nodes")]
    return section, two["records"], compared


def runs(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {run["run"]: run for run in section["runs"]}


@pytest.mark.parametrize("shared", ["server", "cluster"])
def test_a_session_bouncing_between_nodes_reuses_its_kv_through_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: str
) -> None:
    section, records, compared = bench(tmp_path, monkeypatch, shared)
    turns = section["turns_per_node"]["A"] + section["turns_per_node"]["B"]
    # Every turn of both extra runs generated recompute's tokens (the bench exited 0).
    assert compared["kvstore on 2 nodes"] == compared["kvstore (host+Redis)"] == turns
    by_run = runs(section)
    node_b, single = by_run[NODE_B], by_run[SINGLE]
    later = node_b["from_turn_2"]
    assert later["turns"] > 0 and later["tier_tokens"]["redis"] > 0
    assert node_b["redis_reads"] > 0  # the daemon's count of blocks its Redis tier served
    # Each of node B's later turns follows one on node A: part of its prompt is in Redis.
    on_b = [r for r in records if r["node"] == "B" and r["index"] >= 2]
    assert on_b and all(r["tier_tokens"].get("redis", 0) > 0 for r in on_b)
    assert later["hit_rate"] >= single["from_turn_2"]["hit_rate"] - 0.05
    assert later["hit_rate"] >= 0.9
    assert by_run[TWO]["all"]["hit_rate"] >= 0.9


def test_without_a_shared_redis_node_b_recomputes_what_node_a_computed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    section, records, compared = bench(tmp_path, monkeypatch, "none")
    assert compared["kvstore on 2 nodes"] == len(records)
    node_b = runs(section)[NODE_B]
    assert node_b["redis_reads"] is None and node_b["from_turn_2"]["tier_tokens"]["redis"] == 0
    previous: dict[str, dict[str, Any]] = {}
    checked = 0
    for record in records:
        before = previous.get(record["session_id"])
        previous[record["session_id"]] = record
        if before is None or record["node"] != "B":
            continue
        # At most what node B computed itself two turns ago: never the turn node A ran.
        assert record["loaded_tokens"] <= before["history_tokens"]
        assert record["reusable_tokens"] > before["history_tokens"]
        checked += 1
    assert checked > 0
    assert node_b["from_turn_2"]["hit_rate"] < 0.8


def test_turns_of_a_session_alternate_between_the_nodes() -> None:
    shape = ShareGptShape(sessions=6)
    workload = sharegpt(shape, seed=3, vocab_size=256, generated=3, window=2048)
    nodes = bounce(workload)
    last: dict[str, tuple[int, int]] = {}
    for turn, node in zip(workload.turns, nodes, strict=True):
        if turn.session_id in last:
            index, was = last[turn.session_id]
            assert turn.index == index + 1 and node != was
        last[turn.session_id] = (turn.index, node)
    assert {0, 1} == set(nodes)


def test_a_missing_redis_server_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(chat.shutil, "which", lambda name: None)
    assert chat.main([*SMOKE, "--out", str(tmp_path / "out")]) == 2
    assert "needs redis-server" in capsys.readouterr().err
