"""``benchmarks/pressure.py`` on a small tier: every phase runs, alternating, the writer
evicts only in its phase, the lag metrics are read; no timings asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.benchmarks import benchmark

pressure = benchmark("pressure")

pytestmark = pytest.mark.slow


def test_a_small_run_measures_every_phase_while_the_writer_evicts(tmp_path: Path) -> None:
    out = tmp_path / "pressure.json"
    argv = ["--sizes", "2048", "--lookups", "30", "--window", "15", "--put-blocks", "64",
            "--writer-duty", "0.5"]  # fmt: skip
    assert pressure.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["blocks"], row["phase"]) for row in rows] == [
        (2048, "idle"),
        (2048, "loaded"),
        (2048, "evicting"),
    ]
    idle, loaded, evicting = rows
    # The phases alternate window by window, the same number of times, until each holds
    # 30 lookups and the evicting one a drain.
    assert idle["windows"] == loaded["windows"] == evicting["windows"] >= 2
    assert idle["lookups"] == loaded["lookups"] == evicting["lookups"] == 15 * idle["windows"]
    # The measured daemon evicts only while its own writer puts: paused writers finished
    # their commits (and so their drains), and the loaded phase's writer puts elsewhere.
    assert idle["evictions"] == loaded["evictions"] == 0 < evicting["evictions"]
    for row in rows:  # bucket bounds: the metrics were scraped and had observations
        assert 0 < row["lag_p99_ms"] <= row["lag_worst_ms"] < float("inf")
        if not math.isnan(row["held_p99_ms"]):  # Linux: the lag less the core wait
            assert row["held_p99_ms"] <= row["lag_p99_ms"]
            assert row["held_worst_ms"] <= row["lag_worst_ms"]
        assert 0 < row["p50_ms"] <= row["p99_ms"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--writer-duty", "0"], "--writer-duty must be in (0, 1], got 0.0"),
        (["--window", "0"], "--window must be at least 1, got 0"),
        (["--lookups", "-1"], "--lookups must be at least 1, got -1"),
    ],
)
def test_options_out_of_range_are_refused_by_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        pressure.main(argv)
    assert message in capsys.readouterr().err
