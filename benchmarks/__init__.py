"""The benchmarks, a package run from the checkout root: ``python -m benchmarks.NAME``.

Its modules import one another as part of it (``from .daemon import ...``), never as
top-level modules, so no file here can stand in for a package of the same name that a
dependency imports. ``python -m`` (and ``-c``) put the working directory first on
``sys.path``; from the checkout root that exposes its folders as top-level names (``kernels/``
is also the import name of a package on PyPI that transformers imports). Importing this
package moves the checkout root behind every other entry, so an installed package or a link
tree always wins, and the root still serves ``benchmarks`` and ``tests``.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _root_last(path: list[str]) -> None:
    """Moves the entries of ``path`` that name the checkout root to its end (in place)."""
    ours = [entry for entry in path if os.path.abspath(entry or os.curdir) == _ROOT]
    if ours:
        path[:] = [entry for entry in path if entry not in ours] + [_ROOT]


_root_last(sys.path)
