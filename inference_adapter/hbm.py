"""The HBM level's settings: the engine's page pool between turns, in the daemon's style.

    [hbm]
    pages = 512                  # idle resident pages kept at most (0: the level is off)
    policy = "scheduler_aware"   # which idle page goes first: "lru", or "scheduler_aware"
                                 # (LRU, but pages of turns queued next go last)

``kvstore chat --config FILE`` reads the ``[hbm]`` table of a TOML file of its own (the
daemon's file has no such table: it refuses tables it does not know); ``--hbm-pages``
overrides ``pages``. Every value is checked once, naming the key and the value
(:class:`~kvstore.config.ConfigError`), as the daemon's are.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvstore.config import ConfigError, _check_choice, _section

__all__ = ["HBM_POLICIES", "HbmConfig", "hbm_config", "load_hbm_config"]

HBM_POLICIES: Final = ("lru", "scheduler_aware")


@dataclass(frozen=True, slots=True)
class HbmConfig:
    """The ``[hbm]`` table."""

    pages: int = 0
    policy: str = "scheduler_aware"


def hbm_config(table: Mapping[str, object]) -> HbmConfig:
    """The settings of an ``[hbm]`` table, checked.

    Raises:
        ConfigError: an unknown key, a wrong type, negative pages or an unknown policy.
    """
    config = _section(HbmConfig, table, "hbm")
    assert isinstance(config, HbmConfig)
    if config.pages < 0:
        raise ConfigError(f"hbm.pages must be >= 0, got {config.pages}")
    _check_choice("hbm.policy", config.policy, HBM_POLICIES)
    return config


def load_hbm_config(path: Path | None, *, pages: int | None = None) -> HbmConfig:
    """``path``'s ``[hbm]`` table (none: the defaults), with ``pages`` over its own.

    Raises:
        ConfigError: the file is not TOML, has tables other than ``[hbm]``, or a bad value.
        OSError: the file cannot be read.
    """
    table: Mapping[str, object] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: not TOML: {error}") from error
        unknown = sorted(set(data) - {"hbm"})
        if unknown:
            raise ConfigError(f"{path}: unknown table(s) {unknown} (known: hbm)")
        found = data.get("hbm", {})
        if not isinstance(found, Mapping):
            raise ConfigError(f"{path}: hbm must be a table, got {found!r}")
        table = found
    if pages is not None:
        table = {**table, "pages": pages}
    return hbm_config(table)
