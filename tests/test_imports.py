"""No module of ours stands in for a package that a dependency imports.

The checkout's root holds folders whose names are import names elsewhere (``kernels/`` is
also Hugging Face's ``kernels``, which transformers >= 5.25 imports), and ``kvstore/`` alone
is not the package (its subpackages live in other folders). So the root must never come
before the installed packages (or a link tree) on ``sys.path``: every child Python runs with
``-P``, ``benchmarks`` is a package that moves the root behind everything else, and nothing
puts a folder of the repository on ``sys.path`` ahead of them. The names the repository could
expose at top level are checked against every installed distribution's.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.launch import kvstore_command, module_command

REPO = Path(__file__).resolve().parents[1]
# Import names that dependencies import when they are there, beyond what is installed here.
IMPORTED_WHEN_PRESENT = {"kernels", "tokenizers", "safetensors", "accelerate", "flash_attn"}
# Root folders whose names the layout fixes; safe only because the root never leads sys.path.
LAYOUT_NAMES = {"kernels"}
# `python -m` children that need the checkout root on sys.path (benchmarks moves it last) or
# that import nothing a folder there could shadow.
ROOT_CHILDREN = ("benchmarks.", "pip", "venv")


def repository_names() -> set[str]:
    """Top-level import names the checkout's root offers: modules and regular packages."""
    names = {path.stem for path in REPO.glob("*.py")}
    return names | {path.parent.name for path in REPO.glob("*/__init__.py")}


def installed_names(python: str) -> set[str]:
    """Top-level import names of the distributions installed there, but kvstore's own."""
    code = "import importlib.metadata as m, json; print(json.dumps(m.packages_distributions()))"
    done = subprocess.run([python, "-P", "-c", code], capture_output=True, text=True, check=True)
    provided: dict[str, list[str]] = json.loads(done.stdout)
    return {name for name, dists in provided.items() if set(dists) - {"kvstore"}}


def python_sources() -> list[Path]:
    skip = {".venv", "build", ".git"}
    return [p for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts)]


def test_no_name_of_ours_is_one_that_a_dependency_imports() -> None:
    installed = installed_names(sys.executable)
    vllm_python = os.environ.get("KVSTORE_VLLM_PYTHON")
    if vllm_python and Path(vllm_python).exists():
        installed |= installed_names(vllm_python)
    assert repository_names() & (installed | IMPORTED_WHEN_PRESENT) == LAYOUT_NAMES
    # What the checkout root serves (behind everything else) must not be installed at all.
    assert not {"kvstore", "benchmarks", "tests"} & installed


def test_the_rule_sees_a_module_at_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tokenizers.py").write_text("")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "docs").mkdir()  # no __init__: a namespace portion loses to a real package
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert repository_names() == {"tokenizers", "kernels"}


def test_every_child_python_keeps_its_working_directory_off_sys_path() -> None:
    """Each ``[sys.executable, ...]`` command line starts with ``-P``, but for the children
    that import from the checkout root (run from there, behind everything else)."""
    found = []
    for path in python_sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.List) and node.elts):
                continue
            first = ast.unparse(node.elts[0])
            if first != "sys.executable":
                continue
            flag, module = (
                [e.value if isinstance(e, ast.Constant) else None for e in node.elts[1:3]]
                + [None, None]
            )[:2]
            from_root = flag == "-m" and str(module).startswith(ROOT_CHILDREN)
            if flag != "-P" and not from_root:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
    assert kvstore_command("serve") == [sys.executable, "-P", "-m", "kvstore", "serve"]
    assert module_command("m", python="/x/python") == ["/x/python", "-P", "-m", "m"]


def test_nothing_puts_a_folder_of_ours_ahead_on_sys_path() -> None:
    pattern = re.compile(
        r"sys\.path\.insert|sys\.path\[0\]|PYTHONPATH\"?: *(str\()?(TESTS|ROOT|REPO)"
    )
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in python_sources()
        if path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_benchmarks_move_the_checkout_root_behind_installed_packages(tmp_path: Path) -> None:
    """``python -m benchmarks.X`` from the root: an installed ``kernels`` is the one imported."""
    installed = tmp_path / "installed"
    (installed / "kernels").mkdir(parents=True)
    (installed / "kernels" / "__init__.py").write_text("CUDAProperties = object\n")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    (site_packages,) = (venv / "lib").glob("python3.*/site-packages")
    (site_packages / "installed.pth").write_text(f"{installed}\n")
    for imports, expected in [("", REPO), ("import benchmarks; ", installed)]:
        probe = imports + "import importlib.util as u; print(u.find_spec('kernels').origin)"
        done = subprocess.run(
            [venv / "bin" / "python", "-c", probe], cwd=REPO, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert Path(done.stdout.strip()) == expected / "kernels" / "__init__.py", probe
