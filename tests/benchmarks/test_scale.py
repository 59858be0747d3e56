"""``benchmarks/scale.py`` at tiny sizes: every section runs and reports its rows; no timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.benchmarks import benchmark

scale = benchmark("scale")
TINY = ["--sizes", "300", "--chain", "16", "--puts", "50", "--lookups", "20"]
TINY += ["--clients", "2", "--client-mb", "1", "--rounds", "1", "--lmcache-mb", "32"]


def test_every_section_reports_its_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "scale.json"
    missing = tmp_path / "no-venv" / "python"
    assert scale.main([*TINY, "--lmcache-python", str(missing), "--json", str(out)]) == 0
    report = json.loads(out.read_text())

    (eviction,) = report["eviction"]
    assert (eviction["blocks"], eviction["chain"]) == (300, 16)
    assert eviction["put_us"] > 0 and eviction["limit_put_us"] > 0

    (memory,) = report["memory"]
    assert (memory["blocks"], memory["block_bytes"]) == (300, 4096)
    assert memory["traced_per_block"] > 0 and memory["parts"]["index"] > 0
    assert memory["gc_objects_per_block"] > 0 and memory["gc_full_ms"] > 0
    if memory["arena_per_block"] is not None:  # the payloads are in the arena, one page each
        assert memory["arena_per_block"] == pytest.approx(4096, rel=0.05)

    rows = {(row["path"], row["op"], row["clients"]): row for row in report["clients"]}
    for path in ("shm", "stream"):
        for op in ("put", "get (out=)"):
            one, two = rows[path, op, 1], rows[path, op, 2]  # one client is always measured
            assert one["scaling"] == 1.0 and two["gbps"] > 0 and two["scaling"] > 0
            assert two["client_bytes"] == 1 << 20
            assert (two["vs_raw"] is None) == (path == "shm")
            assert two["pass_fail"] in {"pass", "fail"}
    assert rows["raw gRPC", "put", 1]["gbps"] > 0 and rows["raw gRPC", "get (out=)", 1]["gbps"] > 0

    lmcache, skipped = report["lmcache"], report["lmcache"]["skipped"]
    assert skipped.startswith("LMCache row skipped") and str(missing) in skipped
    assert [row["path"].split(",")[0] for row in lmcache["rows"]] == [
        "BlockStore put / get (new bytes)",
        "daemon",
    ]
    assert all(row["store_gbps"] > 0 and row["retrieve_gbps"] > 0 for row in lmcache["rows"])
    text = capsys.readouterr().out
    assert text.count("\n|---") == 4 and "LMCache row skipped" in text


def test_the_lmcache_python_is_the_flag_then_the_env_then_the_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / "venv-python"
    monkeypatch.setattr(scale, "LMCACHE_VENV", venv)
    monkeypatch.delenv("KVSTORE_LMCACHE_PYTHON", raising=False)
    assert scale.lmcache_python(None) is None
    row, why = scale.lmcache_row(None, 32, 1)
    assert row is None and "no venv; make one with" in why and "lmcache==0.5.6" in why
    venv.touch()
    assert scale.lmcache_python(None) == venv
    monkeypatch.setenv("KVSTORE_LMCACHE_PYTHON", "/from/env")
    assert scale.lmcache_python(None) == Path("/from/env")
    assert scale.lmcache_python("/from/flag") == Path("/from/flag")


def test_block_sizes_must_be_multiples_of_64() -> None:
    with pytest.raises(SystemExit):
        scale.parse_args(["--block-bytes", "100"])
    shape = scale.Shape.of(256)  # small blocks take their own size in the arena
    assert (shape.size, shape.page_bytes, shape.slot_bytes) == (256, 256, 256)
    assert scale.Shape.of(4096).meta.layout.payload_bytes == 4096
