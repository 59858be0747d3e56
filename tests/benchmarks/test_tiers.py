"""``benchmarks/tiers.py`` at tiny sizes on a redis-server and a Redis Cluster: the script runs
as it is run by hand, and every row it writes has a rate; no timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.redis


def test_the_redis_and_cluster_rows_round_trip_every_block(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    # 16 MiB a run: redis-benchmark times in whole milliseconds. 4 blocks a call: on the
    # cluster the limit runs one client per primary, 2 blocks each.
    args = ["--sizes", "1MiB", "--blocks", "16", "--rounds", "1", "--pipeline", "4"]
    args += ["--tiers", "redis,redis-cluster", "--dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.tiers", *args],  # as `make bench-tiers` runs it
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # a block that came back wrong exits non-zero

    rows = {(row["tier"], row["op"]): row for row in json.loads(out.read_text())["rows"]}
    limits = {
        "redis": "redis-benchmark -P 4 -c 1",
        "redis-cluster": "redis-benchmark --cluster --threads 1 -P 2 -c 3",
    }
    assert sorted(rows) == sorted(
        (tier, f"{op} (4/call)") for tier in limits for op in ("put_many", "get_many")
    )
    for (tier, op), row in rows.items():
        assert (row["block_bytes"], row["blocks"]) == (1 << 20, 16), (tier, op)
        assert row["gbps"] > 0 and row["limit_gbps"] > 0, (tier, op)
        assert row["ratio"] == pytest.approx(row["gbps"] / row["limit_gbps"]), (tier, op)
        assert row["limit_name"] == limits[tier], (tier, op)
        assert (row["target"], row["pass_fail"] in {"pass", "fail"}) == (0.4, True), (tier, op)
    table = [line for line in done.stdout.splitlines() if line.startswith("| redis-cluster ")]
    assert len(table) == 2 and all(limits["redis-cluster"] in line for line in table)
    assert list(tmp_path.iterdir()) == [out]  # the scratch directory went with the nodes' files
