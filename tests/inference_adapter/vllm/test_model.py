"""The connector's namespace from the geometry of vLLM's KV cache, and what it refuses, read
from vLLM-shaped configs (no vLLM needed).

The configs are plain objects with the attributes and methods vLLM's ``VllmConfig`` has
(``FakeModelConfig`` answers ``get_head_size`` and the rest from the HF config as vLLM does
for a standard decoder); a stock vLLM engine runs the connector in
tests/integration/test_vllm.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.inference_adapter.bench.vllm_chat import MODEL_SIZES
from kvstore.inference_adapter.vllm.model import model_namespace
from kvstore.inference_adapter.vllm.settings import ConnectorSettings
from kvstore.inference_adapter.weights import LlamaConfig, namespace_for, rope_identity

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **MODEL_SIZES["test"],
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}
SIZES = {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4}
# Tiny configs of the decoders the connector serves, as their config.json spells them.
DECODERS: dict[str, dict[str, Any]] = {
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SIZES,
              "num_key_value_heads": 2, "rope_theta": 1000000.0, "sliding_window": None},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **SIZES,
              "num_key_value_heads": 1, "head_dim": 128, "rope_theta": 1000000.0},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **SIZES,
                "num_key_value_heads": 2, "sliding_window": 4096},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **SIZES,
             "num_key_value_heads": 4, "rope_scaling": {"type": "longrope", "long_factor": [1.0],
                                                         "short_factor": [1.0]}},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **SIZES,
               "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
               "rope_parameters": {"rope_type": "linear", "factor": 8.0,
                                   "rope_theta": 1000000.0}},
}  # fmt: skip


class HfConfig(SimpleNamespace):
    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class FakeModelConfig(SimpleNamespace):
    """vLLM's ``ModelConfig`` as the connector reads it, for a standard decoder."""

    def get_head_size(self) -> int:
        hf = self.hf_config
        return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)

    def get_num_kv_heads(self, parallel: Any) -> int:
        return max(1, int(self.hf_config.num_key_value_heads) // parallel.tensor_parallel_size)

    def get_num_layers_by_block_type(self, parallel: Any, block_type: str) -> int:
        assert block_type == "attention"
        return int(self.hf_config.num_hidden_layers) // parallel.pipeline_parallel_size


def vllm_config(
    hf: dict[str, Any] | None = None,
    *,
    cache_dtype: str = "auto",
    tp: int = 1,
    pp: int = 1,
    block_size: int = 32,
    hybrid_manager_off: bool | None = True,
    **model: Any,
) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=FakeModelConfig(
            hf_config=HfConfig(**(LLAMA if hf is None else hf)),
            model="/models/x",
            dtype="float32",
            **model,
        ),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=hybrid_manager_off),
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


def test_a_llama3_scaled_llama_agrees_with_the_engine_too() -> None:
    scaled = {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}}  # fmt: skip
    got = model_namespace(vllm_config(scaled), SETTINGS)
    engine = namespace_for(
        LlamaConfig.from_dict(scaled), model_name="/models/x", block_tokens=32, tenant="t"
    )
    assert got.digest() == engine.digest()


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_any_decoder_gets_a_namespace_from_its_kv_geometry(name: str) -> None:
    hf = DECODERS[name]
    got = model_namespace(vllm_config(hf), SETTINGS).model
    head_dim = hf.get("head_dim", 64)
    assert (got.num_layers, got.num_kv_heads, got.head_dim) == (3, hf["num_key_value_heads"],
                                                               head_dim)  # fmt: skip
    assert got.layout().payload_bytes == 3 * 2 * 32 * hf["num_key_value_heads"] * head_dim * 4
    # The RoPE parameters tell models apart without being computed here.
    theta, scaling = rope_identity(hf, head_dim)
    assert (got.rope_theta, got.rope_scaling) == (theta, scaling)


def test_rope_parameters_alone_tell_two_otherwise_equal_models_apart() -> None:
    qwen = DECODERS["qwen2"]
    digests = {
        model_namespace(vllm_config(hf), SETTINGS).digest()
        for hf in (
            qwen,
            {**qwen, "rope_theta": 10000.0},
            {**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            {**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
            {**qwen, "partial_rotary_factor": 0.5},
        )
    }
    assert len(digests) == 5
    same = {"type": "yarn", "factor": 4}  # the legacy spelling and an int: the same model
    assert rope_identity({**qwen, "rope_scaling": same}, 64) == rope_identity(
        {**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 64
    )


@pytest.mark.parametrize(
    ("config", "settings", "message"),
    [
        (vllm_config(use_mla=True), SETTINGS, "MLA latent cache"),
        (vllm_config(is_hybrid=True), SETTINGS, "hybrid or attention-free"),
        (vllm_config(is_attention_free=True), SETTINGS, "hybrid or attention-free"),
        (vllm_config(is_encoder_decoder=True), SETTINGS, "encoder-decoder"),
        (vllm_config(cache_dtype="fp8"), SETTINGS, "needs kv_cache_dtype 'auto', got 'fp8'"),
        (vllm_config(pp=2), SETTINGS, "pipeline_parallel_size 1, got 2"),
        (
            vllm_config(DECODERS["gemma3"], hybrid_manager_off=False),
            SETTINGS,
            "separate groups for Gemma3ForCausalLM's sliding-window layers .* "
            "--disable-hybrid-kv-cache-manager",
        ),
        (
            vllm_config(block_size=32),
            ConnectorSettings(address="a", block_tokens=48),
            "block_tokens 48 must be a multiple of vLLM's block_size 32",
        ),
        (
            vllm_config({**LLAMA, "rope_scaling": "yarn"}),
            SETTINGS,
            "rope_scaling must be a mapping, got 'yarn'",
        ),
    ],
)
def test_what_cannot_be_served_exactly_is_refused_by_name(
    config: SimpleNamespace, settings: ConnectorSettings, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        model_namespace(config, settings)


def test_sliding_window_layers_are_served_when_vllm_keeps_one_kv_cache_group() -> None:
    """vLLM turns its hybrid KV-cache manager off when a connector is set (None: it decides
    itself): every layer then keeps full KV, which the store holds like any other."""
    for off in (True, None):
        got = model_namespace(vllm_config(DECODERS["gemma3"], hybrid_manager_off=off), SETTINGS)
        assert got.model.num_layers == 3


def test_tensor_parallel_ranks_store_their_share_of_the_kv_heads() -> None:
    """With TP each rank's cache holds num_kv_heads / TP heads: the namespace describes one
    rank's share and the rank count, apart from the unsplit model's."""
    whole = model_namespace(vllm_config(), SETTINGS)
    split = model_namespace(vllm_config(tp=2), SETTINGS)
    assert (split.model.num_kv_heads, split.model.tp_size) == (1, 2)
    assert split.model.layout().payload_bytes * 2 == whole.model.layout().payload_bytes
    assert split.digest() != whole.digest()
