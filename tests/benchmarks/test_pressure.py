"""``benchmarks/pressure.py`` on a small tier: every phase runs, the writer evicts, the lag
metric is read; no timings asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.benchmarks import benchmark

pressure = benchmark("pressure")

pytestmark = pytest.mark.slow


def test_a_small_run_measures_every_phase_while_the_writer_evicts(tmp_path: Path) -> None:
    out = tmp_path / "pressure.json"
    argv = ["--sizes", "2048", "--lookups", "30", "--put-blocks", "64", "--writer-duty", "0.5"]
    assert pressure.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["blocks"], row["phase"]) for row in rows] == [
        (2048, "idle"),
        (2048, "evicting"),
        (2048, "idle again"),
    ]
    idle, evicting, _ = rows
    assert idle["lookups"] == 30  # the evicting phase goes on, 30 at a time, until a drain
    assert evicting["lookups"] >= 30 and evicting["lookups"] % 30 == 0
    assert idle["evictions"] == 0 < evicting["evictions"]
    for row in rows:  # a bucket bound: the metric was scraped and had observations
        assert 0 < row["lag_p99_ms"] <= row["lag_worst_ms"] < float("inf")
        assert 0 < row["p50_ms"] <= row["p99_ms"]


def test_a_writer_duty_outside_0_1_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        pressure.main(["--writer-duty", "0"])
    assert "--writer-duty must be in (0, 1], got 0.0" in capsys.readouterr().err
