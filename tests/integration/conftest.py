"""Options of the integration tests."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stress-seconds",
        type=float,
        default=None,
        help=(
            "seconds of load for tests/integration/test_stress.py, split between the daemon "
            "run and the in-process store run (default 65; env KVSTORE_STRESS_SECONDS). "
            "Only seen when tests/integration is named on the command line."
        ),
    )
