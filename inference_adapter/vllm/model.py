"""What the connector serves: the KV cache vLLM keeps, checked, and its kvstore namespace.

``model_namespace(vllm_config, settings)`` reads the geometry of vLLM's KV cache from its
config (``model_config``: attention layers, KV heads, head size, dtype; ``cache_config``:
block size and KV dtype; ``parallel_config``: how many tensor-parallel ranks share the KV
heads, each rank storing its share under keys of its own), not the model's architecture:
any decoder whose attention keeps per-head K and V in vLLM's paged cache is served the
same way (Llama, Qwen2, Phi-3 and Gemma 2 run end to end in the tests). The blocks hold K
as vLLM rotated it, so RoPE is never computed here; its parameters only tell two models' KV
apart (:func:`~kvstore.inference_adapter.weights.rope_identity`). A Llama gets the
namespace kvstore's engine derives from the same config (``namespace_for``), so both read
each other's blocks.

Refused, with a ``ValueError`` naming what was found: a cache that is not per-head K and V
(MLA's compressed latents), state other than attention KV (hybrid Mamba-style and
attention-free models), cross-attention (encoder-decoder), a KV cache dtype other than the
model's, pipeline parallelism, separate KV-cache groups (vLLM's hybrid KV-cache manager
kept on for sliding-window layers), a ``block_tokens`` that is not a multiple of vLLM's
block size. No vLLM import: the config is read through its attributes.
"""

from __future__ import annotations

from typing import Any

from kvstore.client import ModelFingerprint, Namespace
from kvstore.inference_adapter.vllm.settings import ConnectorSettings
from kvstore.inference_adapter.weights import rope_identity

__all__ = ["model_namespace"]

SLIDING_LAYER_TYPES = ("sliding_attention", "sliding_window", "local_attention")


def model_namespace(vllm_config: Any, settings: ConnectorSettings) -> Namespace:
    """The namespace of the KV cache vLLM keeps, after checking the connector can store it.

    Raises:
        ValueError: The cache, the KV dtype or the parallelism is one the connector cannot
            store exactly (the message names it).
    """
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    _check_cache(model_config, vllm_config)
    block_size = vllm_config.cache_config.block_size
    block_tokens = settings.block_tokens or block_size
    if block_tokens % block_size:
        raise ValueError(
            f"kv_connector_extra_config block_tokens {block_tokens} must be a multiple of "
            f"vLLM's block_size {block_size}"
        )
    text = _text_config(model_config)
    head_dim = model_config.get_head_size()
    theta, scaling = rope_identity(text, head_dim)
    fingerprint = ModelFingerprint(
        model_name=settings.model_name or str(model_config.model),
        num_layers=model_config.get_num_layers_by_block_type(parallel, "attention"),
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_dim=head_dim,
        dtype=str(model_config.dtype).removeprefix("torch."),
        block_tokens=block_tokens,
        rope_theta=theta,
        rope_scaling=scaling,
        tp_size=parallel.tensor_parallel_size,
    )
    return Namespace(fingerprint, settings.tenant)


def _check_cache(model_config: Any, vllm_config: Any) -> None:
    """Raises ``ValueError`` for a KV cache the connector cannot store exactly."""
    model = _architectures(model_config)
    if getattr(model_config, "use_mla", False):
        raise ValueError(
            f"KVStoreConnector stores per-head K and V; {model} keeps an MLA latent cache "
            "(multi-head latent attention), which it does not support"
        )
    if getattr(model_config, "is_attention_free", False) or getattr(
        model_config, "is_hybrid", False
    ):
        raise ValueError(
            f"KVStoreConnector stores attention KV only; {model} keeps other state per "
            "request (a hybrid or attention-free model), which it does not support"
        )
    if getattr(model_config, "is_encoder_decoder", False):
        raise ValueError(
            f"KVStoreConnector serves decoder-only models; {model} is an encoder-decoder "
            "(cross-attention KV), which it does not support"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise ValueError(f"KVStoreConnector needs kv_cache_dtype 'auto', got {cache_dtype!r}")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "KVStoreConnector runs with pipeline_parallel_size 1, got "
            f"{parallel.pipeline_parallel_size}"
        )
    scheduler = getattr(vllm_config, "scheduler_config", None)
    grouped = getattr(scheduler, "disable_hybrid_kv_cache_manager", True) is False
    if grouped and _has_sliding_layers(_text_config(model_config)):
        raise ValueError(
            f"KVStoreConnector needs one KV-cache group; vLLM keeps separate groups for "
            f"{model}'s sliding-window layers (its hybrid KV-cache manager is on): start vLLM "
            "with --disable-hybrid-kv-cache-manager"
        )


def _text_config(model_config: Any) -> dict[str, Any]:
    """The language model's ``config.json`` dict (a multimodal model's text part)."""
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    found: dict[str, Any] = text.to_dict()
    return found


def _has_sliding_layers(text: dict[str, Any]) -> bool:
    layer_types = text.get("layer_types") or ()
    return bool(text.get("sliding_window")) or any(t in SLIDING_LAYER_TYPES for t in layer_types)


def _architectures(model_config: Any) -> str:
    names = getattr(model_config.hf_config, "architectures", None) or ["an unnamed model"]
    return "/".join(str(name) for name in names)
