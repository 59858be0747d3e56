"""The layering rule: a package imports only packages below it (ARCHITECTURE.md, Layers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Repository folder -> (import name, rank). Higher ranks may import lower ones, not the reverse.
LAYERS = {
    "protos": ("kvstore.protos", 0),
    "kernels": ("kvstore.kernels", 1),
    "tiers": ("kvstore.tiers", 2),
    "kvstore": ("kvstore", 3),
    "client": ("kvstore.client", 4),
    "inference_adapter": ("kvstore.inference_adapter", 5),
}


def layer_of(module: str) -> int | None:
    if module != "kvstore" and not module.startswith("kvstore."):
        return None
    for name, rank in sorted(LAYERS.values(), key=lambda item: -len(item[0])):
        if module == name or module.startswith(name + "."):
            return rank
    return None


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_packages_import_only_downwards(folder: str) -> None:
    own_rank = LAYERS[folder][1]
    violations = []
    for path in sorted((REPO / folder).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for module in imported_modules(path):
            rank = layer_of(module)
            if rank is not None and rank > own_rank:
                violations.append(f"{path.relative_to(REPO)} imports {module}")
    assert violations == []


def test_rule_detects_an_upward_import() -> None:
    assert layer_of("kvstore.client.keys") == 4
    assert layer_of("kvstore.store") == 3
    assert layer_of("kvstore.tiers.host") == 2
    assert layer_of("numpy") is None


@pytest.mark.parametrize("generic", ["tiers", "client", "kernels", "protos", "inference_adapter"])
def test_no_generic_top_level_names_are_installed(generic: str, tmp_path: Path) -> None:
    """What the install puts on sys.path, seen by a fresh interpreter outside the checkout
    (this process may have the checkout root last on sys.path: tests/support/benchmarks.py)."""
    code = f"import importlib.util as u; s = u.find_spec({generic!r}); print(s and s.origin)"
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert not done.stdout.strip().startswith(str(REPO / generic)), done.stdout
