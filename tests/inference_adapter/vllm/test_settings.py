"""``kv_connector_extra_config``: defaults, and every bad value refused by name."""

from __future__ import annotations

import pytest

from kvstore.inference_adapter.vllm.settings import ConnectorSettings


def test_only_the_address_is_needed() -> None:
    settings = ConnectorSettings.from_extra_config({"address": "unix:/run/kvstore/kvstore.sock"})
    assert settings.tenant == "" and settings.token() is None and settings.block_tokens is None
    assert settings.lookup_timeout_s == 0.5 and settings.save_queue_blocks == 256
    assert settings.use_shm and settings.pin_arena  # only acted on with CUDA


def test_the_token_comes_from_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAM_A_TOKEN", "s3cret")
    settings = ConnectorSettings.from_extra_config(
        {"address": "localhost:7070", "tenant": "team-a", "token_env": "TEAM_A_TOKEN"}
    )
    assert settings.token() == "s3cret" and settings.tenant == "team-a"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, 'needs "address"'),
        ({"address": ""}, "'address' must be a non-empty string, got ''"),
        ({"address": "a", "adress": "b"}, r"unknown key\(s\) \['adress'\]"),
        ({"address": "a", "block_tokens": 0}, "'block_tokens' must be an integer >= 1, got 0"),
        ({"address": "a", "block_tokens": "64"}, "'block_tokens' must be an integer"),
        ({"address": "a", "lookup_timeout_s": -1}, "'lookup_timeout_s' must be seconds > 0"),
        ({"address": "a", "load_timeout_s": float("nan")}, "'load_timeout_s' must be seconds"),
        ({"address": "a", "use_shm": "yes"}, "'use_shm' must be true or false, got 'yes'"),
        ({"address": "a", "pin_arena": 1}, "'pin_arena' must be true or false, got 1"),
        ({"address": "a", "token_env": "KVSTORE_TEST_UNSET_VAR"}, "'KVSTORE_TEST_UNSET_VAR'"),
        ({"address": "a", "save_queue_blocks": True}, "'save_queue_blocks' must be an integer"),
        ({"address": "a", "handoff": "on"}, "'handoff' must be true or false, got 'on'"),
        ({"address": "a", "handoff_timeout_s": 0}, "'handoff_timeout_s' must be seconds > 0"),
    ],
)
def test_bad_values_are_refused_by_name(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorSettings.from_extra_config(extra)


def test_a_producer_hands_off_unless_told_otherwise() -> None:
    plain = ConnectorSettings.from_extra_config({"address": "a"})
    assert plain.hands_off("kv_producer") and not plain.hands_off("kv_both")
    assert plain.handoff_timeout_s == 30.0
    on = ConnectorSettings.from_extra_config({"address": "a", "handoff": True})
    assert on.hands_off("kv_both")
    off = ConnectorSettings.from_extra_config({"address": "a", "handoff": False})
    assert not off.hands_off("kv_producer")
