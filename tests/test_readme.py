"""The README's examples: its Python imports and defines what it shows (the names exist), its
commands' connector configs are ones the connector accepts."""

from __future__ import annotations

import json
import re
import subprocess
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


def test_readme_pd_commands_give_a_producer_and_a_consumer_the_connector_accepts() -> None:
    """The prefill/decode block, run by bash with each ``vllm serve`` replaced by an echo of
    its config: a kv_producer and a kv_consumer, both accepted; the proxy's options parse."""
    from kvstore.inference_adapter.vllm.settings import ConnectorSettings

    section = README.read_text().split("### Prefill/decode disaggregation")[1]
    (block,) = re.findall(r"```sh\n(.*?)```", section.split("\n## ")[0], flags=re.DOTALL)
    script = re.sub(r"^vllm serve \$MODEL --port \d+ --kv-transfer-config", "echo", block,
                    flags=re.MULTILINE)  # fmt: skip
    proxy = [line for line in script.splitlines() if line.startswith("kvstore pd-proxy")]
    script = "\n".join(line for line in script.splitlines() if line not in proxy)
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    configs = [json.loads(line) for line in done.stdout.splitlines()]
    assert [config["kv_role"] for config in configs] == ["kv_producer", "kv_consumer"]
    for config in configs:
        settings = ConnectorSettings.from_extra_config(config["kv_connector_extra_config"])
        assert settings.hands_off(config["kv_role"]) == (config["kv_role"] == "kv_producer")
        assert settings.model_name == "meta-llama/Llama-3.2-1B-Instruct"
    (line,) = proxy
    from kvstore.inference_adapter.vllm import proxy as pd_proxy

    with pytest.raises(SystemExit) as shown:  # --help: the options parsed, then it exits
        pd_proxy.main([*line.split()[2:], "--help"])
    assert shown.value.code == 0
