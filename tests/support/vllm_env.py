"""The vLLM environment the tests run vLLM in (``make vllm-venv``; ``KVSTORE_VLLM_PYTHON``).

:data:`VLLM_PYTHON` is its interpreter: the variable's path, a relative one taken from the
checkout (``make test`` passes one; not resolved: a venv's python is a link).
:func:`require_vllm` skips the caller (a test, or with ``module_level`` its whole module)
when it is missing, unless ``KVSTORE_REQUIRE_VLLM=1``, which makes that an error.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / os.environ.get("KVSTORE_VLLM_PYTHON", "build/vllm-venv/bin/python")


def require_vllm(*, module_level: bool = False) -> Path:
    """:data:`VLLM_PYTHON`, or a skip (an error under ``KVSTORE_REQUIRE_VLLM=1``)."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("KVSTORE_REQUIRE_VLLM") == "1":
            raise RuntimeError(f"KVSTORE_REQUIRE_VLLM=1 but {VLLM_PYTHON} does not exist")
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (make vllm-venv)",
                    allow_module_level=module_level)  # fmt: skip
    return VLLM_PYTHON
