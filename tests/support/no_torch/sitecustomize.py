"""On ``PYTHONPATH``, this makes torch, triton and transformers unimportable in every Python
process started with it (``site`` imports ``sitecustomize`` at start), as if not installed.

An import of one of them, or of a submodule, raises ``ModuleNotFoundError`` and is recorded
in ``ATTEMPTS``. At exit, when ``NO_TORCH_REPORT_DIR`` is set, the process writes
``<pid>.json`` there: its ``argv``, its ``attempts`` and the blocked modules ``loaded`` (in
``sys.modules``; none can be, unless imported before this file ran).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

BLOCKED = ("torch", "triton", "transformers")
ATTEMPTS: list[str] = []


class _Blocker(MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] in BLOCKED:
            ATTEMPTS.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)
        return None


def _report() -> None:
    folder = os.environ.get("NO_TORCH_REPORT_DIR")
    if folder:
        loaded = sorted(name for name in sys.modules if name.partition(".")[0] in BLOCKED)
        report = {"argv": sys.argv, "attempts": ATTEMPTS, "loaded": loaded}
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as file:
            json.dump(report, file)


sys.meta_path.insert(0, _Blocker())
atexit.register(_report)
