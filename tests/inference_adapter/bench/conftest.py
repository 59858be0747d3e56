"""The ShareGPT V3 file for the bench tests: ``sharegpt_file`` is the fetched dataset
(``kvstore dataset fetch`` puts it in the user cache); without it the tests that use it skip,
saying how to fetch it (``tests.support.files``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.inference_adapter.bench.sharegpt import dataset_path
from tests.support.files import fetched


@pytest.fixture(scope="session")
def sharegpt_file() -> Path:
    return fetched(dataset_path)
