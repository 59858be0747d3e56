"""What the connector refuses to serve, read from a vLLM-shaped config (no vLLM needed).

The configs are plain objects with the attributes vLLM's ``VllmConfig`` has; the same
refusal through a real vLLM engine is in tests/integration/test_vllm.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.inference_adapter.bench.vllm_chat import MODEL_SIZES
from kvstore.inference_adapter.vllm.model import model_namespace
from kvstore.inference_adapter.vllm.settings import ConnectorSettings
from kvstore.inference_adapter.weights import LlamaConfig, namespace_for

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **MODEL_SIZES["test"],
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}


class HfConfig(SimpleNamespace):
    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def vllm_config(
    hf: dict[str, Any] | None = None,
    *,
    cache_dtype: str = "auto",
    tp: int = 1,
    pp: int = 1,
    block_size: int = 32,
) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=HfConfig(**(LLAMA if hf is None else hf)), model="/models/x", dtype="float32"
        ),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
    )


SETTINGS = ConnectorSettings(address="unix:/run/kvstore/kvstore.sock", tenant="t")


def test_a_llama_gets_the_namespace_kvstores_engine_derives() -> None:
    got = model_namespace(vllm_config(), SETTINGS)
    engine = namespace_for(
        LlamaConfig.from_dict(LLAMA), model_name="/models/x", block_tokens=32, tenant="t"
    )
    assert got.digest() == engine.digest()
    named = ConnectorSettings(address="a", tenant="t", model_name="org/x", block_tokens=64)
    other = model_namespace(vllm_config(), named)
    assert other.model.model_name == "org/x" and other.model.block_tokens == 64


@pytest.mark.parametrize(
    ("config", "settings", "message"),
    [
        (
            vllm_config({**LLAMA, "architectures": ["MistralForCausalLM"]}),
            SETTINGS,
            r"serves \['LlamaForCausalLM'\] models; this one is \['MistralForCausalLM'\]",
        ),
        (vllm_config({**LLAMA, "architectures": None}), SETTINGS, "this one is unnamed"),
        (vllm_config(cache_dtype="fp8"), SETTINGS, "needs kv_cache_dtype 'auto', got 'fp8'"),
        (vllm_config(tp=2), SETTINGS, "tensor_parallel_size 1 .* got 2 and 1"),
        (vllm_config(pp=2), SETTINGS, "got 1 and 2"),
        (
            vllm_config({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
            SETTINGS,
            "yarn",
        ),
        (
            vllm_config(block_size=32),
            ConnectorSettings(address="a", block_tokens=48),
            "block_tokens 48 must be a multiple of vLLM's block_size 32",
        ),
    ],
)
def test_what_cannot_be_served_exactly_is_refused_by_name(
    config: SimpleNamespace, settings: ConnectorSettings, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        model_namespace(config, settings)
