"""The layering rule: a package imports only the packages below it (ARCHITECTURE.md, Layers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Repository folder -> (import name, the folders it may import besides itself). The wire layer
# is what the daemon and the client share; the client imports it and the protos, never the
# daemon (``kvstore``, ``tiers``), and nothing but the engine side imports the client.
LAYERS: dict[str, tuple[str, frozenset[str]]] = {
    "protos": ("kvstore.protos", frozenset()),
    "wire": ("kvstore.wire", frozenset()),
    "kernels": ("kvstore.kernels", frozenset()),
    "tiers": ("kvstore.tiers", frozenset({"wire"})),
    "kvstore": ("kvstore", frozenset({"protos", "wire", "kernels", "tiers"})),
    "client": ("kvstore.client", frozenset({"protos", "wire"})),
    "inference_adapter": (
        "kvstore.inference_adapter",
        frozenset({"protos", "wire", "kernels", "tiers", "kvstore", "client"}),
    ),
}


def folder_of(module: str) -> str | None:
    """The repository folder a module lives in, or None outside the project."""
    if module != "kvstore" and not module.startswith("kvstore."):
        return None
    for folder, (name, _) in sorted(LAYERS.items(), key=lambda item: -len(item[1][0])):
        if module == name or module.startswith(name + "."):
            return folder
    return None


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from kvstore import client`` imports kvstore.client, not the daemon's package
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found += names if node.module == "kvstore" else [node.module]
    return found


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_packages_import_only_the_layers_below_them(folder: str) -> None:
    allowed = LAYERS[folder][1] | {folder}
    violations = []
    for path in sorted((REPO / folder).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for module in imported_modules(path):
            found = folder_of(module)
            if found is not None and found not in allowed:
                violations.append(f"{path.relative_to(REPO)} imports {module}")
    assert violations == []


def test_rule_detects_an_upward_import() -> None:
    assert folder_of("kvstore.client.keys") == "client"
    assert folder_of("kvstore.store") == "kvstore"
    assert folder_of("kvstore.tiers.host") == "tiers"
    assert folder_of("kvstore.wire.blocks") == "wire"
    assert folder_of("numpy") is None
    assert "kvstore" not in LAYERS["client"][1]  # the client never imports the daemon
    assert "tiers" not in LAYERS["client"][1]
    assert "client" not in LAYERS["kvstore"][1]  # nor the daemon the client


@pytest.mark.parametrize("generic", sorted(set(LAYERS) - {"kvstore"}))
def test_no_generic_top_level_names_are_installed(generic: str, tmp_path: Path) -> None:
    """What the install puts on sys.path, seen by a fresh interpreter outside the checkout
    (this process may have the checkout root last on sys.path: tests/support/benchmarks.py)."""
    code = f"import importlib.util as u; s = u.find_spec({generic!r}); print(s and s.origin)"
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert not done.stdout.strip().startswith(str(REPO / generic)), done.stdout
