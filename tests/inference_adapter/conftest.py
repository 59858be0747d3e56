"""Tiny Llama checkpoints for the engine-side tests, written by transformers itself.

``tiny_config()`` is a Hugging Face ``config.json`` dict small enough for CPU tests (GQA,
head_dim 16); ``tiny_config(rope="llama3")`` adds llama3 frequency scaling with an original
context short enough that the test prompts cross it. ``save_tiny_model(folder, config)``
saves a randomly initialised ``LlamaForCausalLM`` there with ``save_pretrained``
(safetensors) and returns it. The fixtures ``tiny_model_dir`` and ``tiny_llama3_model_dir``
give such folders under the test's tmp_path.

A real model, loaded once per session: ``smollm2_path`` is SmolLM2-135M-Instruct's GGUF file
in the user cache (``kvstore model fetch`` or ``make model`` puts it there; without it the
tests that use it skip, saying so), ``smollm2`` the float32 ``LlamaModel`` built from it and
``smollm2_tokenizer`` its ``ChatTokenizer``, shared by every test: do not change them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.inference_adapter.gguf import load_gguf_model
from kvstore.inference_adapter.model import LlamaModel
from kvstore.inference_adapter.models import model_path
from kvstore.inference_adapter.tokenizer import ChatTokenizer
from tests.support.files import fetched

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny_config(rope: str = "default", **overrides: object) -> dict[str, object]:
    """A config.json dict: 64 hidden, 2 layers, 4 heads over 2 KV heads, vocab 192."""
    config: dict[str, object] = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 192,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    if rope == "llama3":
        config["rope_scaling"] = dict(LLAMA3_SCALING)
    elif rope != "default":
        raise ValueError(f"rope must be default or llama3, got {rope!r}")
    return {**config, **overrides}


def hf_model(config: dict[str, object], seed: int = 0) -> Any:
    """A random ``LlamaForCausalLM`` in eval mode, fp32, eager attention."""
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(**config, attn_implementation="eager")
    return transformers.LlamaForCausalLM(hf_config).eval()


def save_tiny_model(folder: Path, config: dict[str, object], seed: int = 0) -> Path:
    """Save a random ``LlamaForCausalLM`` of ``config`` to ``folder`` and return ``folder``."""
    hf_model(config, seed).save_pretrained(folder)
    return folder


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    """A tiny Llama checkpoint folder (plain RoPE)."""
    return save_tiny_model(tmp_path / "tiny-llama", tiny_config())


@pytest.fixture
def tiny_llama3_model_dir(tmp_path: Path) -> Path:
    """A tiny Llama checkpoint folder with llama3 RoPE scaling."""
    return save_tiny_model(tmp_path / "tiny-llama3", tiny_config(rope="llama3"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file; skips, saying how to fetch it, when it is absent."""
    return fetched(lambda: model_path("smollm2"))


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> LlamaModel:
    """SmolLM2-135M-Instruct as kvstore's float32 ``LlamaModel`` (shared by the session)."""
    return load_gguf_model(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path) -> ChatTokenizer:
    """SmolLM2-135M-Instruct's tokenizer and ChatML template, from the same file."""
    return ChatTokenizer.from_gguf(smollm2_path)
