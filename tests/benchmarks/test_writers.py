"""``benchmarks/writers.py`` at tiny sizes: every section runs against a real daemon and
writer processes, reports positive numbers and the blocks it read back; no timings asserted."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.support.benchmarks import benchmark

writers = benchmark("writers")

pytestmark = pytest.mark.slow

BLOCKS = 16  # of 64 KiB: 1 MiB a chain, per size and per writer
TINY = ["--sizes", "64KiB", "--total", "1MiB", "--writers", "1,2", "--writer-bytes", "1MiB",
        "--writer-block", "64KiB", "--rounds", "1"]  # fmt: skip


def test_a_small_run_reports_every_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "writers.json"
    assert writers.main([*TINY, "--json", str(out)]) == 0
    report = json.loads(out.read_text())

    assert [(row["op"], row["block_bytes"], row["blocks"]) for row in report["rows"]] == [
        ("put", 64 << 10, BLOCKS),
        ("get", 64 << 10, BLOCKS),
    ]
    for row in report["rows"]:
        assert row["gbps"] > 0 and row["limit_gbps"] > 0 and row["ratio"] > 0
        # A get after the warm-up round and after the timed one, and one after the CPU puts.
        assert row["verified_blocks"] == 3 * BLOCKS

    (cpu,) = report["put_cpu"]
    assert (cpu["block_bytes"], cpu["blocks"], cpu["puts"]) == (64 << 10, BLOCKS, 1)
    assert cpu["gbps"] > 0 and cpu["daemon_cpu_s_per_gib"] > 0 and cpu["client_cpu_s_per_gib"] > 0

    assert [row["writers"] for row in report["writers"]] == [1, 2]
    for row in report["writers"]:
        count = row["writers"]
        assert (row["block_bytes"], row["blocks"], row["rounds"]) == (64 << 10, BLOCKS, 1)
        assert row["gbps"] > 0 and row["limit_gbps"] > 0 and row["writer_gbps"] > 0
        assert len(row["put_seconds"]) == count and all(s > 0 for s in row["put_seconds"])
        assert row["release_to_done_s"] > 0
        assert row["daemon_cpu_s_per_gib"] > 0 and row["client_cpu_s_per_gib"] > 0
        assert row["verified_blocks"] == count * BLOCKS  # each writer got its chain back

    assert report["daemon_idle_cpu_s_per_s"] >= 0
    text = capsys.readouterr().out
    assert text.count("\n| ---") == 3 and "load avg" in text


def test_cpu_seconds_is_the_proc_stat_count_without_its_ticks() -> None:
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # some CPU time to count
        pass
    with open(f"/proc/{os.getpid()}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    ours = writers.cpu_seconds(os.getpid())
    assert ticks <= ours + 1e-3 and ours - ticks < 3 / os.sysconf("SC_CLK_TCK")


def test_options_that_store_nothing_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        writers.parse_args(["--sizes", "2MiB", "--total", "1MiB"])
    assert "--total (1048576) holds no block of [2097152]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        writers.parse_args(["--writers", "1,0"])
