"""The package's names, imported on first use: each one in ``__all__`` has a home and loads."""

from __future__ import annotations

import kvstore.inference_adapter as package


def test_every_exported_name_has_a_home_and_loads() -> None:
    assert set(package.__all__) == set(package._HOMES)
    for name in package.__all__:
        assert getattr(package, name) is not None, name
