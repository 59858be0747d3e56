"""``benchmarks/gpu_check.sh`` dry-run on the CPU, in a GPU machine's situation.

There the machine's python holds torch and the carried packages but not kvstore, and the
script runs from the checkout root, where the checkout's own ``kvstore/`` folder (without
the subpackages that live in other folders) would shadow the link tree for any Python that
puts its working directory on ``sys.path``. Here a bare venv sees this venv's packages but
not its kvstore: an editable install's import hook is a ``.pth`` file, which a folder listed
in another ``.pth`` file does not run. ``GPU_CHECK_ALLOW_CPU=1``: the gpu tests skip; the
layout tests, the kernel benchmark, ``bench hit``, ``bench gpu`` and ``bench chat``'s HBM level
run on toy sizes, and each leaves what the GPU run will record, in the same form.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class DryRun:
    python: Path
    build: Path
    out: Path
    done: subprocess.CompletedProcess[str]


def bare_python(folder: Path) -> Path:
    """A venv with this interpreter's packages on its path and no kvstore."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True)
    (own_site,) = (folder / "lib").glob("python3.*/site-packages")
    (own_site / "packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    python = folder / "bin" / "python"
    probe = [python, "-c", "import importlib.util as u; print(u.find_spec('kvstore'))"]
    found = subprocess.run(probe, cwd=folder, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "None", found.stdout  # the trap needs kvstore absent
    return python


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> DryRun:
    top = tmp_path_factory.mktemp("gpu-check")
    python, build, out = bare_python(top / "bare"), top / "build", top / "out"
    env = {**os.environ, "PYTHON": str(python), "GPU_CHECK_ALLOW_CPU": "1",
           "GPU_CHECK_BUILD": str(build), "GPU_WHEELS": str(top / "no-wheels")}  # fmt: skip
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        ["benchmarks/gpu_check.sh", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return DryRun(python, build, out, done)


def test_it_runs_from_the_checkout_root_on_the_link_tree(dry_run: DryRun) -> None:
    output = dry_run.done.stdout + dry_run.done.stderr
    assert dry_run.done.returncode == 0, output[-4000:]
    device = (dry_run.out / "device.txt").read_text()
    tree = dry_run.build / "gpu-tree" / "kvstore"
    assert f"kvstore.inference_adapter: {tree}/inference_adapter/__init__.py" in device
    assert f"kvstore.tiers: {tree}/tiers/__init__.py" in device
    assert "cuda False" in device
    assert " passed" in (dry_run.out / "layout-cpu.txt").read_text()
    assert " skipped" in (dry_run.out / "gpu-tests.txt").read_text()
    assert "decode attention" in (dry_run.out / "kernels.txt").read_text()
    bench = json.loads((dry_run.out / "bench-gpu-test.json").read_text())
    assert [row["same_tokens"] for row in bench["rows"]] == [True, True]
    steps = (dry_run.out / "steps.txt").read_text().splitlines()[2:]
    names = ["bench-hit", "bench-gpu-test", "writers", "gpu-tests", "kernels", "chat-hbm",
             "layout-cpu"]  # fmt: skip
    assert [line.split(" | ")[0].lstrip("| ") for line in steps] == names
    assert all(line.split(" | ")[1] == "0" for line in steps), steps


def test_it_records_a_hits_fixed_cost_and_phases(dry_run: DryRun) -> None:
    assert dry_run.done.returncode == 0
    hit = json.loads((dry_run.out / "bench-hit.json").read_text())
    assert hit["about"]["device"] == "cpu"
    assert [(row["name"], row["tokens"], row["hits"]) for row in hit["rows"]] == [
        ("cold", 256, 3),
        ("warm", 256, 3),
        ("warm, gRPC calls", 256, 3),
    ]
    for row in hit["rows"]:
        assert 0 < row["p50_ms"] <= row["p90_ms"]
        assert row["copy_ms"] > 0 and row["fixed_ms"] >= 0
        assert {"lookup", "lease", "admit", "first_layer", "layers"} <= set(row["phases_ms"])
    assert [c["requests"] for c in hit["concurrent"]] == [1]
    assert "| warm 256 |" in (dry_run.out / "bench-hit.txt").read_text()


def test_it_records_the_kernels_with_the_tuners_picks(dry_run: DryRun) -> None:
    assert dry_run.done.returncode == 0
    kernels = json.loads((dry_run.out / "kernels.json").read_text())
    assert kernels["backend"] == "torch"  # no picks off CUDA: the tuners run their defaults
    tuners = {"decode_attention", "copy_blocks", "prefill_attention launch",
              "prefill_attention path"}  # fmt: skip
    assert set(kernels["chosen"]) == tuners
    assert len(kernels["rows"]) == 4
    assert all(row["ratio"] > 0 and row["limit_seconds"] > 0 for row in kernels["rows"])


def test_it_records_saves_and_many_writers(dry_run: DryRun) -> None:
    assert dry_run.done.returncode == 0
    writers = json.loads((dry_run.out / "writers.json").read_text())
    assert [row["op"] for row in writers["rows"]] == ["put", "get"]
    assert all(row["verified_blocks"] > 0 for row in writers["rows"])
    assert all(row["daemon_cpu_s_per_gib"] > 0 for row in writers["put_cpu"])
    assert [row["writers"] for row in writers["writers"]] == [1, 2]


def test_it_records_the_hbm_level_against_host_loads(dry_run: DryRun) -> None:
    assert dry_run.done.returncode == 0
    assert "The HBM level (sharegpt)" in (dry_run.out / "chat-hbm" / "chat.md").read_text()
    chat = json.loads((dry_run.out / "chat-hbm" / "chat.json").read_text())
    assert chat["about"]["device"] == "cpu"
    assert chat["about"]["turns with other tokens than recompute"] == "0"
    pools = chat["hbm"]
    assert [pool["keeps"] for pool in pools] == ["none", "1 session", "all 3 sessions"]
    assert [pool["retain_pages"] > 0 for pool in pools] == [False, True, True]
    hbm = [pool["tier_tokens"]["hbm"] for pool in pools]
    assert hbm[0] == 0 < hbm[1] <= hbm[2]
    assert pools[0]["tier_tokens"]["host"] > 0
    assert all(len(pool["ttft_ms"]) == 3 for pool in pools)  # p50, p90, p99


def test_daemons_that_tests_start_there_run_the_link_tree(dry_run: DryRun) -> None:
    """The gpu tests that start a daemon skip on the CPU: two CLI tests stand in for them."""
    assert dry_run.done.returncode == 0
    env = {**os.environ, "PYTHONPATH": str(dry_run.build / "gpu-tree")}
    names = ["test_serve_stats_and_sigterm", "test_stats_watch_prints_rates_of_what_happens"]
    command = [str(dry_run.python), "-P", "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    command += ["tests/kvstore/test_cli.py", "-k", " or ".join(names)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "2 passed" in done.stdout
