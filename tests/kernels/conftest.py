"""Kernel tests: Triton kernels against their torch references.

Without CUDA the Triton kernels run on the CPU through the Triton interpreter. Triton picks
the interpreter when a function is decorated, its own library included, so
``TRITON_INTERPRET`` must be set before anything imports triton; this file sets it. With
CUDA it is left alone and the same tests run the compiled kernels. Only these tests launch
Triton kernels, so the setting changes nothing in other folders' tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime.interpreter import InterpretedFunction

from kvstore.kernels import copy as copy_module

INTERPRETER_MISSING = not torch.cuda.is_available() and not isinstance(
    copy_module._copy_blocks_kernel, InterpretedFunction
)


@pytest.fixture(autouse=True, scope="session")
def triton_can_run() -> Iterator[None]:
    """Fail loudly, not with driver errors, when triton was imported before this file ran."""
    if INTERPRETER_MISSING:
        pytest.fail(
            "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; "
            "set it before triton is imported (the top-level tests/conftest.py, or the "
            "environment), or run tests/kernels on their own"
        )
    yield
