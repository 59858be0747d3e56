"""``benchmarks/kernels.py`` at its small size on the CPU: every row carries its same-run limit
and ratio, and a row is judged against its target only for the Triton kernels on CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.kernels import COPY_LIMIT, Row, table

ROOT = Path(__file__).resolve().parents[2]


def test_every_row_has_its_limit_and_ratio(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    args = ["--device", "cpu", "--size", "small", "--repeats", "1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["backend"] == "torch"
    names = [row["name"].split(" (")[0] for row in record["rows"]]
    assert names == ["decode attention", "copy+RoPE load", "copy+RoPE save", "prefill attention"]
    for row in record["rows"]:
        assert row["seconds"] > 0 and row["limit_seconds"] > 0, row
        assert row["ratio"] == row["limit_seconds"] / row["seconds"], row
        assert row["target"] in (0.8, 0.85, 1.0), row
    assert done.stdout.count("| info |") == 4  # the CPU's references are not judged


def test_a_row_passes_at_its_target_and_fails_below_it() -> None:
    at = Row("at", 1.0, 2e9, "GB/s", COPY_LIMIT, 0.85, 0.85)
    below = Row("below", 1.0, 2e9, "GB/s", COPY_LIMIT, 0.84, 0.85)
    judged = table([at, below], judged=True).splitlines()[2:]
    assert [line.rsplit("|", 2)[1].strip() for line in judged] == ["pass", "fail"]
    assert "| info |" in table([at], judged=False)
