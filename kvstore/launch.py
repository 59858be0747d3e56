"""Command lines that start Python modules of this installation in a child process.

Every child gets ``-P``: without it, Python puts the child's working directory first on
``sys.path``, and from a checkout's root its ``kvstore/`` folder would stand in for the
installed package (or a link tree on ``PYTHONPATH``) without the subpackages that live in
other folders (``kvstore.tiers`` is ``tiers/``), and its other folders would shadow installed
packages of the same name (``kernels``).
"""

from __future__ import annotations

import os
import sys


def module_command(
    module: str, *args: str, python: str | os.PathLike[str] | None = None
) -> list[str]:
    """``python -P -m MODULE ARGS``; ``python`` defaults to this interpreter."""
    return [os.fspath(python or sys.executable), "-P", "-m", module, *args]


def kvstore_command(*args: str) -> list[str]:
    """The ``kvstore`` command line (``python -P -m kvstore ARGS``) on this interpreter."""
    return module_command("kvstore", *args)
