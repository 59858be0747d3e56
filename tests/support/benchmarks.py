"""The ``benchmarks`` package, imported as run: with the checkout root last on ``sys.path``.

pytest does not put the checkout root on ``sys.path``, and nothing may put ``benchmarks/``
there (its modules would become top-level names). Appended last, the root serves
``benchmarks`` (and the children a benchmark spawns, which inherit ``sys.path``) without
standing in for any installed package, as ``benchmarks/__init__.py`` arranges when run.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = str(Path(__file__).resolve().parents[2])


def root_on_path() -> None:
    """Appends the checkout root to ``sys.path`` (last), once: for ``benchmarks``, and for
    spawned children that unpickle a function of a test module (``tests....``)."""
    if ROOT not in sys.path:
        sys.path.append(ROOT)


def benchmark(name: str) -> ModuleType:
    """``benchmarks.<name>``, imported as a module of the package."""
    root_on_path()
    return importlib.import_module(f"benchmarks.{name}")
