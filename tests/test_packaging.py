"""The daemon and the client need no torch (pyproject.toml: torch comes with the extras).

- With torch, triton and transformers unimportable (tests/support/no_torch on ``PYTHONPATH``,
  so in the daemon too), the client and the daemon's modules import, a real ``kvstore serve``
  runs, and blocks make a bit-exact round trip on both data planes (tests/support/torchless.py);
  neither process ever tried to import torch.
- In a fresh venv where only ``pip install .`` ran (slow: a build and the base dependencies),
  torch is not installed, ``kvstore serve --help`` runs, and so does the same round trip;
  ``kvstore bench chat`` says the benchmarks run from a checkout.
- ``pip wheel .`` builds a wheel without the benchmarks (``kvstore.inference_adapter.bench``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvstore.launch import kvstore_command

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "support" / "torchless.py"
BLOCKER = REPO / "tests" / "support" / "no_torch"
PACKAGE_FOLDERS = ["kvstore", "wire", "tiers", "client", "protos", "kernels", "inference_adapter"]


def run(command: list[str | Path], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result


def source_copy(tmp_path: Path) -> Path:
    """What a build needs, copied, so that a build leaves the repository alone."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy2(REPO / name, source / name)
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(
            REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    return source


def check_round_trips(report: dict[str, object]) -> None:
    assert report["torch_importable"] is False
    assert report["torch_in_modules"] == []
    assert report["daemon_maps_libtorch"] is False
    assert report["daemon_exit"] == 0
    planes = report["planes"]
    assert isinstance(planes, list)
    assert [plane["plane"] for plane in planes] == ["shm", "stream"]
    for plane in planes:
        assert plane["statuses"] == ["STORED"] * 8, plane
        assert all(plane["exact"].values()), plane
        assert plane["view_tensors_error"].startswith("torch: view_tensors needs torch"), plane


def test_importing_the_client_and_the_daemon_loads_no_torch(tmp_path: Path) -> None:
    """Where torch is installed (this venv), still nothing imports it."""
    modules = ["kvstore.client", "kvstore.cli", "kvstore.server", "kvstore.service"]
    code = f"import json, sys; import {', '.join(modules)}; print(json.dumps(list(sys.modules)))"
    loaded = json.loads(run([sys.executable, "-P", "-c", code], tmp_path).stdout)
    assert [name for name in loaded if name.partition(".")[0] in ("torch", "triton")] == []


def test_the_daemon_and_the_client_run_with_torch_blocked(tmp_path: Path) -> None:
    reports = tmp_path / "imports"
    reports.mkdir()
    result = run(
        [sys.executable, "-P", SCRIPT],
        tmp_path,
        PYTHONPATH=str(BLOCKER),
        NO_TORCH_REPORT_DIR=str(reports),
    )
    report = json.loads(result.stdout.splitlines()[-1])
    check_round_trips(report)
    assert report["attempts_before_use"] == []  # importing the client and the daemon
    by_pid = {int(path.stem): json.loads(path.read_text()) for path in reports.glob("*.json")}
    daemon = by_pid[report["daemon_pid"]]  # type: ignore[index]
    assert daemon["argv"][1] == "serve"
    assert daemon["attempts"] == [] and daemon["loaded"] == []  # never tried to import torch


def test_engine_commands_name_the_missing_extra(tmp_path: Path) -> None:
    command = kvstore_command("chat", "--help")
    env = {**os.environ, "PYTHONPATH": str(BLOCKER)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert "kvstore chat: needs torch, which is not installed" in result.stderr
    assert "kvstore[engine]" in result.stderr


@pytest.mark.slow
def test_a_fresh_venv_with_only_pip_install_runs_without_torch(tmp_path: Path) -> None:
    source = source_copy(tmp_path)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path)  # no system site packages
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", "-c", REPO / "requirements.lock", source], tmp_path)

    installed = run([python, "-m", "pip", "list", "--format=json"], tmp_path).stdout
    names = {package["name"].lower() for package in json.loads(installed)}
    assert "kvstore" in names
    assert not names & {"torch", "triton", "transformers"}
    assert not [name for name in names if name.startswith("nvidia")]
    assert (
        "usage: kvstore serve"
        in run([venv / "bin" / "kvstore", "serve", "--help"], tmp_path).stdout
    )
    report = json.loads(run([python, SCRIPT], tmp_path).stdout.splitlines()[-1])
    check_round_trips(report)
    assert str(report["client_dir"]).startswith(str(venv))  # the installed package, not the repo
    bench = subprocess.run([venv / "bin" / "kvstore", "bench", "chat", "--help"], cwd=tmp_path,
                           capture_output=True, text=True)  # fmt: skip
    assert bench.returncode == 2, bench.stderr
    assert "kvstore bench chat: the benchmarks are not in the installed package" in bench.stderr


def test_the_wheel_holds_no_benchmark_module(tmp_path: Path) -> None:
    """``pip wheel .`` leaves ``kvstore.inference_adapter.bench`` out (it runs from a checkout)
    and keeps the runtime: the daemon, the wire layer, the client and the vLLM connector."""
    source = source_copy(tmp_path)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", tmp_path / "dist", source], tmp_path)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("kvstore-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert [name for name in names if "/bench/" in name] == []
    for module in ["cli", "store", "wire/blocks", "client/client", "inference_adapter/vllm/worker"]:
        assert f"kvstore/{module}.py" in names
    assert (REPO / "inference_adapter" / "bench" / "chat.py").exists()  # the check can fail
