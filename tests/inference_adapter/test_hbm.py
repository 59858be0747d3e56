"""The [hbm] table: checked as the daemon's config is, each error naming key and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import ConfigError
from kvstore.inference_adapter.hbm import HbmConfig, hbm_config, load_hbm_config


def test_a_table_gives_its_settings_and_defaults_fill_the_rest() -> None:
    assert hbm_config({}) == HbmConfig(pages=0, policy="scheduler_aware")
    assert hbm_config({"pages": 512, "policy": "lru"}) == HbmConfig(512, "lru")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"page": 5}, "unknown key 'hbm.page' (known keys: pages, policy)"),
        ({"pages": -1}, "hbm.pages must be >= 0, got -1"),
        ({"pages": "many"}, "hbm.pages"),
        ({"policy": "mru"}, "hbm.policy must be one of lru, scheduler_aware; got 'mru'"),
    ],
)
def test_a_bad_value_is_refused_by_name(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hbm_config(table)


def test_a_file_gives_its_hbm_table_and_a_flag_overrides_its_pages(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[hbm]\npages = 128\npolicy = "lru"\n')
    assert load_hbm_config(path) == HbmConfig(128, "lru")
    assert load_hbm_config(path, pages=0) == HbmConfig(0, "lru")
    assert load_hbm_config(None) == HbmConfig()
    path.write_text("[host]\ncapacity = '1GiB'\n")  # a daemon's table: not this file's
    with pytest.raises(ConfigError, match=r"unknown table\(s\) \['host'\] \(known: hbm\)"):
        load_hbm_config(path)
    path.write_text("[hbm\n")
    with pytest.raises(ConfigError, match="not TOML"):
        load_hbm_config(path)
