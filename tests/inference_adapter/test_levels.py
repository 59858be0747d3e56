"""The levels line the engines and benches print."""

from __future__ import annotations

from kvstore.inference_adapter.levels import by_level


def test_levels_print_in_hierarchy_order_with_shares_and_skip_empty_ones() -> None:
    line = by_level({"host": 100, "hbm": 300, "ssd": 0}, computed=100)
    assert line == "prompt tokens by level: hbm 300 (60%), host 100 (20%), computed 100 (20%)"
    assert by_level({}, computed=0) == "prompt tokens by level: "
