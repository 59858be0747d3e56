"""``kvstore bench hit`` on a real daemon, small: its rows, phases and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.inference_adapter.bench.hit import main
from kvstore.inference_adapter.core.timeline import PHASES


def test_a_small_run_writes_every_row_and_phase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hit.json"
    args = ["--tokens", "256,512", "--cold", "2", "--hits", "3", "--concurrent", "1,2"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [(row["name"], row["tokens"]) for row in report["rows"]]
    assert names == [("cold", 256), ("warm", 256), ("warm", 512), ("warm, gRPC calls", 256)]
    for row in report["rows"]:
        assert 0 < row["p50_ms"] <= row["p90_ms"]
        assert row["copy_ms"] > 0 and row["fixed_ms"] >= 0
        assert set(row["phases_ms"]) == set(PHASES) - {"total"}
        assert row["phases_ms"]["lookup"] > 0
        assert row["phases_ms"]["lease"] == 0  # the lookup leased the blocks: no second call
    assert [c["requests"] for c in report["concurrent"]] == [1, 2]
    assert report["about"]["Health p50 ms"] > 0
    table = capsys.readouterr().out
    assert "| warm, gRPC calls 256 |" in table and "| requests at once |" in table
