"""``kvstore bench gpu`` on the CPU: a tiny model, two prompt lengths, a real daemon; the
report's structure and its checks (no timing thresholds: the figures only have to exist)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import cli
from kvstore.inference_adapter.bench import gpu
from kvstore.inference_adapter.bench.bandwidth import copy_limits
from kvstore.inference_adapter.bench.gpu_models import MODELS, model_config, random_model
from kvstore.inference_adapter.bench.gpu_report import render

TINY = ["--model", "test", "--prompts", "64,128", "--block-tokens", "16", "--page-tokens", "16",
        "--dtype", "float32", "--repeats", "1", "--copy-mib", "8"]  # fmt: skip
POSITIVE = ["ttft_recompute_ms", "ttft_hit_ms", "ttft_miss_ms", "ttft_save_run_ms",
            "hit_vs_recompute", "miss_vs_recompute", "load_ms", "load_gbps", "load_vs_limit",
            "save_ms", "save_gbps", "save_vs_limit", "lookup_ms", "miss_lookup_ms",
            "decode_tok_s_recompute", "decode_tok_s_miss",
            "miss_tok_s_vs_recompute"]  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    """One tiny run: (exit status, the JSON report, the printed table)."""
    out = tmp_path_factory.mktemp("bench-gpu") / "gpu.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        status = gpu.main([*TINY, "--json", str(out)])
    return status, json.loads(out.read_text()), printed.getvalue()


def test_every_row_answers_alike_and_has_positive_figures(
    report: tuple[int, dict[str, Any], str],
) -> None:
    status, data, _ = report
    assert status == 0
    assert set(data) == {"setup", "limits", "rows"}
    rows = data["rows"]
    assert [row["prompt_tokens"] for row in rows] == [64, 128]
    for row in rows:
        assert "skipped" not in row
        assert row["same_tokens"] is True
        assert all(row[name] > 0 for name in POSITIVE), row
        assert len(row["ttft_recompute_ms_all"]) == len(row["ttft_hit_ms_all"]) == 1
        assert len(row["ttft_miss_ms_all"]) == 1
        assert row["logit_max_diff"] < 1e-4  # the same kernels either way on the CPU


def test_the_hits_loaded_every_block_but_the_last_token_s(
    report: tuple[int, dict[str, Any], str],
) -> None:
    _, data, _ = report
    bytes_per_token = data["setup"]["kv_bytes_per_token"]
    assert bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers, K/V, KV heads, head_dim, float32
    for row in data["rows"]:
        tokens = row["prompt_tokens"]
        assert row["loaded_tokens"] == tokens - 16  # a whole block left to compute
        assert row["loaded_blocks_per_hit"] == tokens // 16 - 1
        assert row["load_bytes"] == row["loaded_tokens"] * bytes_per_token
        assert row["saved_blocks"] == tokens // 16
        assert row["save_bytes"] == row["kv_bytes"] == tokens * bytes_per_token


def test_the_setup_and_the_limits_are_recorded(report: tuple[int, dict[str, Any], str]) -> None:
    _, data, table = report
    setup, limits = data["setup"], data["limits"]
    assert setup["device_type"] == "cpu" and setup["model"] == "test"
    assert (setup["block_tokens"], setup["page_tokens"], setup["dtype"]) == (16, 16, "float32")
    assert setup["decode_tokens"] == 16
    assert setup["torch"] == torch.__version__ and setup["recompute_attention"] == "paged"
    assert setup["shape"]["layers"] == 2 and setup["data_plane"] == "shm"
    assert limits["load_limit"] == limits["save_limit"] == "memcpy_gbps"
    assert limits["memcpy_gbps"] > 0 and limits["copy_bytes"] == 8 << 20
    lines = table.splitlines()
    assert lines[0].startswith("kvstore bench gpu: CPU") and "memcpy" in lines[1]
    # the main table, the misses and the hit's phases: a line per prompt in each
    assert sum(line.startswith(("| 64 |", "| 128 |")) for line in lines) == 6
    assert any(line.startswith("store miss against recompute") for line in lines)


def test_a_miss_is_weighed_against_recompute(report: tuple[int, dict[str, Any], str]) -> None:
    """Each row's miss figures are the ratios of its medians, and its table line says them."""
    _, data, table = report
    for row in data["rows"]:
        assert row["ttft_miss_ms"] == row["ttft_miss_ms_all"][0]  # one miss: its median
        assert row["miss_vs_recompute"] == pytest.approx(
            row["ttft_miss_ms"] / row["ttft_recompute_ms"]
        )
        assert row["miss_overhead"] == pytest.approx(row["miss_vs_recompute"] - 1)
        assert row["miss_tok_s_vs_recompute"] == pytest.approx(
            row["decode_tok_s_miss"] / row["decode_tok_s_recompute"]
        )
        assert row["miss_lookup_ms"] < row["ttft_miss_ms"]  # the lookup is part of the TTFT
        misses = table.split("store miss against recompute")[1].split("store hit's TTFT")[0]
        (line,) = [x for x in misses.splitlines() if x.startswith(f"| {row['prompt_tokens']} |")]
        assert f" {row['miss_overhead'] * 100:+.1f}% |" in line
        assert f" {(row['miss_tok_s_vs_recompute'] - 1) * 100:+.1f}% |" in line


def test_a_miss_over_the_target_is_flagged(report: tuple[int, dict[str, Any], str]) -> None:
    _, data, _ = report
    limits = copy_limits(torch.device("cpu"), 1 << 20, repeats=1)
    row = data["rows"][0]
    for overhead, verdict in ((0.01, "| yes |"), (0.05, "| NO |")):
        changed = dict(row, miss_overhead=overhead, miss_vs_recompute=1 + overhead)
        (line,) = [
            line
            for line in render(data["setup"], limits, [changed]).splitlines()
            if f"{overhead * 100:+.1f}%" in line
        ]
        assert verdict in line


def test_a_hit_s_ttft_is_split_into_the_engine_thread_s_phases(
    report: tuple[int, dict[str, Any], str],
) -> None:
    _, data, _ = report
    for row in data["rows"]:
        phases = [row[f"hit_{name}_ms"] for name in ("lookup", "start_load", "layer_waits")]
        assert phases[0] > 0 and phases[1] > 0 and phases[2] >= 0 and row["hit_rest_ms"] > 0
        # one hit a row here: its phases and the rest add up to its TTFT
        assert sum(phases) + row["hit_rest_ms"] == pytest.approx(row["ttft_hit_ms"])


def run_one(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """A run of one 64-token prompt: (exit status, its row)."""
    out = tmp_path / "gpu.json"
    status = gpu.main([*TINY, "--prompts", "64", *args, "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    return status, row


def test_a_connector_that_refuses_the_sizes_skips_the_row(tmp_path: Path) -> None:
    status, row = run_one(tmp_path, "--page-tokens", "12")  # pages that do not tile a block
    assert status == 0
    assert "page_tokens (12)" in row["skipped"] and row["ttft_recompute_ms"] > 0
    assert row["decode_tok_s_recompute"] > 0
    assert "same_tokens" not in row and "ttft_miss_ms" not in row


def test_blocks_of_several_pages(tmp_path: Path) -> None:
    """The engine's pages smaller than the store's blocks, as on the GPU (16 and 256)."""
    status, row = run_one(tmp_path, "--page-tokens", "4")
    if "skipped" in row:
        pytest.skip(f"this connector refuses blocks of several pages: {row['skipped']}")
    assert status == 0 and row["same_tokens"] is True
    assert row["loaded_tokens"] == 48 and row["saved_blocks"] == 4


def test_the_model_shapes_are_llama_s() -> None:
    one_b, eight_b = model_config("1b", 32000), model_config("8b", 32000)
    one_b_kv = model_config("1b-kv", 32000)  # the 1B shape's KV around a small model
    for config, kib in ((one_b, 32), (eight_b, 128), (one_b_kv, 32)):  # KV per token, bf16
        assert (
            2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
            == kib << 10
        )
    assert one_b.tie_word_embeddings and not eight_b.tie_word_embeddings
    assert eight_b.intermediate_size == 14336 and one_b.vocab_size == 128256
    model = random_model(model_config("test", 64), torch.bfloat16, torch.device("cpu"))
    assert model.dtype == torch.bfloat16 and set(MODELS) == {"test", "1b-kv", "1b", "8b"}
    assert all(param.std() > 0 for name, param in model.named_parameters() if "norm" not in name)


def test_copy_limits_on_the_cpu() -> None:
    limits = copy_limits(torch.device("cpu"), 1 << 20, repeats=2)
    assert limits.rates["memcpy_gbps"] > 0 and "memcpy" in limits.describe()
    with pytest.raises(ValueError):
        copy_limits(torch.device("cpu"), 0)


def test_the_command_is_wired_into_kvstore(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "gpu", "--help"])
    assert exited.value.code == 0
    assert "--page-tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        gpu.main([*TINY, "--prompts", "16"])  # no longer than a block: nothing to load
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as exited:
        gpu.main([*TINY, "--decode-tokens", "1"])  # no token after the first: no decode rate
    assert exited.value.code == 2


def test_a_row_whose_tokens_differ_says_by_how_much(
    report: tuple[int, dict[str, Any], str],
) -> None:
    _, data, _ = report
    rows = [dict(data["rows"][0], same_tokens=False, logit_margin=0.004, logit_max_diff=0.02)]
    limits = copy_limits(torch.device("cpu"), 1 << 20, repeats=1)
    table = render(data["setup"], limits, rows)
    assert "| NO (margin 0.004, logits differ by 0.02) |" in table
