"""Small GGUF files written with the gguf package's own writer, for the GGUF reader's tests.

``llama_writer(path, config)`` starts a file with the sizes of a Hugging Face config dict
(``tiny_config()``); add tensors and keys to it, then ``finish(writer)``.
``llama_cpp_tensors(state_dict, config)`` renames a ``LlamaForCausalLM`` state dict to
llama.cpp's tensor names and permutes Q and K as llama.cpp's converter does, so a tiny
transformers model can be written the way a real GGUF file holds it.
``gemma3_file(path, model)`` writes a transformers ``Gemma3ForCausalLM`` as llama.cpp's
converter does (its names, 1 added to every norm weight, no permutation).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import torch

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_writer(path: Path, config: Mapping[str, Any], arch: str = "llama") -> gguf.GGUFWriter:
    """A writer holding the sizes of ``config`` under ``arch``'s keys."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_tensors(
    state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, npt.NDArray[np.float32]]:
    """llama.cpp's names and Q/K layout for a ``LlamaForCausalLM`` state dict."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    for name, tensor in state_dict.items():
        array = tensor.detach().float().numpy().copy()
        if name == "lm_head.weight":
            tensors["output.weight"] = array
        elif name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = array
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = array
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if module == "self_attn.q_proj":
                array = _permute(array, heads)
            elif module == "self_attn.k_proj":
                array = _permute(array, kv_heads)
            tensors[f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"] = array
    return tensors


def _permute(array: npt.NDArray[np.float32], num_heads: int) -> npt.NDArray[np.float32]:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py)."""
    rows = array.shape[0]
    split = array.reshape(num_heads, 2, rows // num_heads // 2, *array.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(array.shape)


_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gemma3_file(path: Path, model: Any) -> None:
    """``model`` (a tiny ``Gemma3ForCausalLM``, tied embeddings) as a ``gemma3`` GGUF file."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        array = tensor.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            array = array + 1.0
        stem = name.removeprefix("model.").removesuffix(".weight")
        if stem == "embed_tokens":
            llama_cpp = "token_embd"
        elif stem == "norm":
            llama_cpp = "output_norm"
        else:
            _, layer, inner = stem.split(".", 2)
            llama_cpp = f"blk.{layer}.{_GEMMA3_NAMES[inner]}"
        writer.add_tensor(f"{llama_cpp}.weight", array)
    finish(writer)
