"""Fetched files the real-model and real-data tests need (the SmolLM2 GGUF, ShareGPT V3).

``fetched(find)`` returns ``find()``'s path. Without the file the test skips with the
``FileNotFoundError``'s message, which says how to fetch it; with ``KVSTORE_REQUIRE_FILES=1``
(``make test`` sets it, after fetching both) it fails instead, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

REQUIRE_ENV = "KVSTORE_REQUIRE_FILES"


def fetched(find: Callable[[], Path]) -> Path:
    try:
        return find()
    except FileNotFoundError as error:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {error}")
        pytest.skip(str(error))
