"""What the connector serves: the model vLLM runs, checked, and its kvstore namespace.

``model_namespace(vllm_config, settings)`` reads vLLM's config (``model_config.hf_config``,
``cache_config``, ``parallel_config``) and refuses, with a ``ValueError`` naming what it
found, a model whose KV the connector cannot store exactly: a non-Llama architecture, RoPE
scaling the kernels do not compute, a KV cache dtype other than the model's, tensor or
pipeline parallelism, a ``block_tokens`` that is not a multiple of vLLM's block size.
Otherwise the namespace is the one kvstore's engine derives from the same config
(``namespace_for``), so both read each other's blocks. No vLLM import: the config is read
through its attributes.
"""

from __future__ import annotations

from typing import Any

from kvstore.client import Namespace
from kvstore.inference_adapter.vllm.settings import ConnectorSettings
from kvstore.inference_adapter.weights import LlamaConfig, namespace_for

__all__ = ["SUPPORTED_ARCHITECTURES", "model_namespace"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def model_namespace(vllm_config: Any, settings: ConnectorSettings) -> Namespace:
    """The namespace of the model vLLM serves, after checking the connector can serve it.

    Raises:
        ValueError: The model, the KV dtype or the parallelism is one the connector cannot
            store exactly (the message names it).
    """
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    architectures = tuple(getattr(hf_config, "architectures", None) or ())
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        raise ValueError(
            f"KVStoreConnector serves {list(SUPPORTED_ARCHITECTURES)} models; this one is "
            f"{list(architectures) or 'unnamed'}"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise ValueError(f"KVStoreConnector needs kv_cache_dtype 'auto', got {cache_dtype!r}")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "KVStoreConnector runs with tensor_parallel_size 1 and pipeline_parallel_size 1, "
            f"got {parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size}"
        )
    config = LlamaConfig.from_dict(hf_config.to_dict())  # refuses unsupported RoPE scaling
    block_size = vllm_config.cache_config.block_size
    block_tokens = settings.block_tokens or block_size
    if block_tokens % block_size:
        raise ValueError(
            f"kv_connector_extra_config block_tokens {block_tokens} must be a multiple of "
            f"vLLM's block_size {block_size}"
        )
    return namespace_for(
        config,
        model_name=settings.model_name or str(model_config.model),
        block_tokens=block_tokens,
        dtype=model_config.dtype,
        tenant=settings.tenant,
    )
