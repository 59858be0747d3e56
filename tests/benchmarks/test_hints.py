"""``benchmarks/hints.py`` on a few real conversations: every row runs and counts; no timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.inference_adapter.bench.sharegpt import dataset_path
from tests.support.benchmarks import benchmark
from tests.support.files import fetched

hints = benchmark("hints")


def test_every_setup_replays_the_same_turns(tmp_path: Path) -> None:
    fetched(dataset_path)
    out = tmp_path / "hints.json"
    hints.main(["--sessions", "12", "--lookahead", "4", "--json", str(out)])  # 1: a slow row
    rows = {row["setup"]: row for row in json.loads(out.read_text())}
    assert list(rows) == [
        "lru",
        "scheduler_aware",
        "hints, next 4 turns",
        "hints, sized by bytes",
        "oracle (reads the future; a bound)",
    ]
    for name, row in rows.items():
        assert 0.0 <= row["host_hit_rate"] <= row["hit_rate"] <= 1.0, name
        assert (row["hinted_turns"] > 0) == name.startswith("hints"), name
        assert (row["passed"] is None) != name.startswith("hints"), name
    # Without hints scheduler-aware is LRU: the same replay reads and promotes the same.
    assert rows["lru"]["hit_rate"] == rows["scheduler_aware"]["hit_rate"]
    assert rows["lru"]["promotions"] == rows["scheduler_aware"]["promotions"]


def turn(prompt: list[bytes]) -> hints.Turn:
    return hints.Turn("s", 1, 0.0, prompt, prompt)


def test_the_oracle_offers_the_block_read_farthest_ahead_first() -> None:
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    ids = {key: key + hints.NAMESPACE for key in (a, b, c)}
    # Turn 0 reads a, b, c; turn 1 reads b; turn 2 reads a; c is never read again.
    oracle = hints.Oracle([turn([a, b, c]), turn([b]), turn([a])])
    for key in (a, b, c):
        oracle.inserted("host", ids[key])
    oracle.advance(1)
    assert list(oracle.victims("host")) == [ids[c], ids[a], ids[b]]
    oracle.advance(2)  # b's read passed: it is never read again now, so it goes first
    oracle.removed("host", ids[c])
    assert list(oracle.victims("host")) == [ids[b], ids[a]]
    scan = oracle.victims("host")
    assert next(scan) == ids[b]
    scan.close()  # offered, not taken: still a candidate
    assert list(oracle.victims("host")) == [ids[b], ids[a]]


@pytest.mark.parametrize("text", ["one two  three\nfour", ""])
def test_words_round_trip(text: str) -> None:
    words = hints.Words()
    assert words.decode(words.encode(text)) == " ".join(text.split())
