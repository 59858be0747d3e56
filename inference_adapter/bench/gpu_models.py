"""The random models of ``kvstore bench gpu``: Llama shapes by name, built on the device.

``MODELS``: ``1b`` is Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query heads over 8 KV
heads of 64, intermediate 8192, tied embeddings, llama3 RoPE scaling: 32 KiB of KV per token
in bfloat16), ``8b`` Llama-3-8B's (32 layers, hidden 4096, 32 over 8 heads of 128,
intermediate 14336: 128 KiB per token), both with the 128,256-token vocabulary; ``test`` is
tiny, for the CPU. ``1b-kv`` keeps the 1B shape's KV (16 layers, 8 KV heads of 64: the same
32 KiB per token, so the same bytes to load) around a small model (hidden 512, 8 query heads,
intermediate 1024, 192 tokens): on the CPU it measures the load of a long prompt without
minutes of prefill per row. ``random_model`` draws the weights as ``LlamaModel.from_config`` does
(N(0, 0.02), norms at one) but on the model's device in its dtype, with the device's own
generator: ``from_config`` draws every weight on the CPU in float32, 32 GB and minutes for
the 8B shape. The weights differ from ``from_config``'s; only their shapes matter here.
:class:`TappedModel` keeps the last logits row it computed (the token a request sampled).
"""

from __future__ import annotations

import dataclasses

import torch

from kvstore.inference_adapter.model import INIT_STD, LlamaModel
from kvstore.inference_adapter.weights import LlamaConfig

__all__ = ["DTYPES", "MODELS", "TappedModel", "model_config", "random_model"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_LLAMA3 = {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256}
MODELS: dict[str, dict[str, object]] = {
    "test": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 192,
        "rope_theta": 10000.0,
    },
    "1b-kv": {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 192,
        "rope_theta": 500000.0,
    },
    "1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}


class TappedModel(LlamaModel):
    """A ``LlamaModel`` that keeps the last row of the logits it computed last."""

    last_logits: torch.Tensor | None = None  # [vocab_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        self.last_logits = logits[-1]
        return logits


def model_config(name: str, max_positions: int) -> LlamaConfig:
    """The architecture ``name`` of ``MODELS``, with room for ``max_positions`` positions.

    Raises:
        KeyError: No such model.
    """
    return LlamaConfig.from_dict({**MODELS[name], "max_position_embeddings": max_positions})


def random_model(config: LlamaConfig, dtype: torch.dtype, device: torch.device) -> TappedModel:
    """Random weights of ``config`` in ``dtype``, drawn on ``device`` (module docstring)."""
    config = dataclasses.replace(config, dtype=dtype)
    with torch.device("meta"):
        model = TappedModel(config, device=device)
    model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, INIT_STD, generator=generator)
    model.tie_weights()
    return model.eval().requires_grad_(False)
