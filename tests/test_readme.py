"""The README's Python examples import and define what they show (their names exist)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    namespace: dict[str, object] = {}
    exec(compile(BLOCKS[index], f"README.md example {index}", "exec"), namespace)
    assert any(callable(value) for name, value in namespace.items() if not name.startswith("_"))


def test_readme_names_exactly_two_setup_commands() -> None:
    setup = README.read_text().split("## Set up on a fresh machine")[1].split("\n## ")[0]
    assert re.findall(r"```sh\n(.*?)\n```", setup, flags=re.DOTALL) == ["make serve", "make test"]


def test_readme_vllm_command_has_a_config_the_connector_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstore.inference_adapter.vllm.settings import ConnectorSettings

    (config,) = re.findall(r"--kv-transfer-config '(\{.*?\})'", README.read_text())
    transfer = json.loads(config)
    assert transfer["kv_connector"] == "KVStoreConnector"
    assert transfer["kv_connector_module_path"] == "kvstore.inference_adapter.vllm"
    assert transfer["kv_load_failure_policy"] == "recompute"
    extra = transfer["kv_connector_extra_config"]
    monkeypatch.setenv(extra["token_env"], "s3cret")
    settings = ConnectorSettings.from_extra_config(extra)
    assert settings.address.startswith("unix:") and settings.token() == "s3cret"
