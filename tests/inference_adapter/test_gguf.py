"""GGUF files into kvstore's Llama model: a real SmolLM2 against transformers' reading of the
same file, tiny files written here against the transformers model they were made from, and
the files the reader refuses. A tiny Gemma 3 file back into the Hugging Face checkpoint it
was made from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kvstore.inference_adapter import Engine, LlamaConfig, LlamaModel, Request, SamplingParams
from kvstore.inference_adapter.gguf import (
    load_gguf_model,
    read_gguf_config,
    read_gguf_weights,
    write_hf_checkpoint,
)
from kvstore.inference_adapter.tokenizer import ChatTokenizer
from kvstore.kernels.rope import RopeConfig, UnsupportedRopeScalingError
from tests.inference_adapter.conftest import hf_model, tiny_config, transformers
from tests.inference_adapter.gguf_files import (
    finish,
    gemma3_file,
    llama_cpp_tensors,
    llama_writer,
)

CHAT = [
    {
        "role": "user",
        "content": (
            "I am planning a three-day trip to Lisbon in early May with a budget of about 600 "
            "euros. Which neighbourhoods should I stay in, how do I get around, and which two "
            "day trips by train are worth it? I do not speak Portuguese and I would rather "
            "avoid renting a car. Please keep the answer short and practical."
        ),
    }
]
GREEDY_TOKENS = 16
MAX_ABS_DIFF = 1e-3  # fp32 against eager attention: measured 0 (sdpa is ~7e-5 from eager)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path: Path) -> Any:
    """transformers' reading of the file: its GGUF config, dequantisation and Q/K
    un-permutation into its own ``LlamaForCausalLM`` (fp32, eager attention).

    ``from_pretrained(folder, gguf_file=...)`` does exactly this (its state dict was checked
    equal), but insists on ``accelerate``, which the dev extras do not install."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name
    )
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    tensors = load_gguf_checkpoint(str(smollm2_path), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def chat_prompt(smollm2_tokenizer: ChatTokenizer) -> list[int]:
    return smollm2_tokenizer.encode(smollm2_tokenizer.render(CHAT))


def test_config_is_read_from_the_metadata(smollm2_path: Path) -> None:
    assert read_gguf_config(smollm2_path) == LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope=RopeConfig(64, 100000.0),
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # the file has no output.weight
        dtype=torch.float32,
    )


def test_weights_are_transformers_own(smollm2: LlamaModel, hf_smollm2: Any) -> None:
    reference = hf_smollm2.state_dict()
    for name, tensor in smollm2.state_dict().items():
        expected = reference[name if name == "lm_head.weight" else f"model.{name}"]
        assert torch.equal(tensor, expected), name
    assert smollm2.lm_head.weight is smollm2.embed_tokens.weight


def test_logits_match_transformers(
    smollm2: LlamaModel, hf_smollm2: Any, chat_prompt: list[int]
) -> None:
    assert 90 <= len(chat_prompt) <= 130
    ids = torch.tensor(chat_prompt)
    with torch.no_grad():
        expected = hf_smollm2(ids[None]).logits[0]
    diff = (smollm2.prompt_logits(ids) - expected).abs().max().item()
    assert diff < MAX_ABS_DIFF, f"max abs logit difference {diff:.2e}"


def test_greedy_continuation_matches_transformers(
    smollm2: LlamaModel,
    smollm2_tokenizer: ChatTokenizer,
    hf_smollm2: Any,
    chat_prompt: list[int],
) -> None:
    sampling = SamplingParams(
        max_tokens=GREEDY_TOKENS, stop_token_ids=smollm2_tokenizer.stop_token_ids
    )
    request = Request("lisbon", list(chat_prompt), sampling)
    Engine(smollm2, num_pages=16, page_tokens=16).generate([request])
    with torch.no_grad():
        out = hf_smollm2.generate(
            torch.tensor([chat_prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False
        )
    assert request.output == out[0, len(chat_prompt) :].tolist()
    assert len(request.output) == GREEDY_TOKENS  # a reply, not an early stop


@pytest.mark.parametrize("tied", [False, True])
def test_a_tiny_llama_cpp_file_loads_as_the_model_it_was_made_from(
    tmp_path: Path, tied: bool
) -> None:
    config = tiny_config(tie_word_embeddings=tied)
    reference = hf_model(config)
    writer = llama_writer(tmp_path / "tiny.gguf", config)
    tensors = llama_cpp_tensors(reference.state_dict(), config)
    if tied:
        del tensors["output.weight"]
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    finish(writer)
    q_proj = reference.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(tensors["blk.0.attn_q.weight"], q_proj)  # permuted in the file
    read = read_gguf_weights(tmp_path / "tiny.gguf")
    assert np.array_equal(read["layers.0.self_attn.q_proj.weight"], q_proj)
    model = load_gguf_model(tmp_path / "tiny.gguf")
    assert model.config.tie_word_embeddings is tied
    prompt = torch.randint(0, 192, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(prompt[None]).logits[0]
    torch.testing.assert_close(model.prompt_logits(prompt), expected, atol=1e-4, rtol=0)
    half = load_gguf_model(tmp_path / "tiny.gguf", dtype=torch.bfloat16)
    assert half.dtype == half.config.dtype == torch.bfloat16
    assert (half.lm_head.weight is half.embed_tokens.weight) is tied


def write_tiny(path: Path, arch: str = "llama") -> gguf.GGUFWriter:
    """A tiny file's writer with one F32 tensor, left open for more."""
    writer = llama_writer(path, tiny_config(), arch=arch)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    return writer


def test_other_architectures_are_refused(tmp_path: Path) -> None:
    writer = write_tiny(tmp_path / "gpt2.gguf", arch="gpt2")
    finish(writer)
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        read_gguf_config(tmp_path / "gpt2.gguf")


def test_rope_scaling_is_refused_by_name(tmp_path: Path) -> None:
    writer = write_tiny(tmp_path / "yarn.gguf")
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    finish(writer)
    with pytest.raises(UnsupportedRopeScalingError, match="'yarn'"):
        load_gguf_model(tmp_path / "yarn.gguf")
    writer = write_tiny(tmp_path / "llama31.gguf")
    writer.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    finish(writer)
    with pytest.raises(UnsupportedRopeScalingError, match=r"rope_freqs\.weight"):
        read_gguf_config(tmp_path / "llama31.gguf")


def test_a_quant_type_gguf_cannot_dequantise_is_refused_by_name(tmp_path: Path) -> None:
    writer = write_tiny(tmp_path / "q8k.gguf")
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K][1]  # 256 values each
    raw = np.zeros((192, block_bytes), dtype=np.uint8)  # [vocab, 256] as one block per row
    writer.add_tensor("token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    finish(writer)
    with pytest.raises(ValueError, match=r"'token_embd\.weight' is Q8_K"):
        load_gguf_model(tmp_path / "q8k.gguf")


def test_foreign_tensors_and_missing_ones_are_named(tmp_path: Path) -> None:
    writer = write_tiny(tmp_path / "vision.gguf")
    writer.add_tensor("v.patch_embd.weight", np.ones(4, dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match=r"'v\.patch_embd\.weight' has no place"):
        load_gguf_model(tmp_path / "vision.gguf")
    finish(write_tiny(tmp_path / "norm-only.gguf"))
    with pytest.raises(ValueError, match=r"missing \['embed_tokens\.weight'"):
        load_gguf_model(tmp_path / "norm-only.gguf")
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_model(tmp_path / "not.gguf")
    with pytest.raises(FileNotFoundError):
        read_gguf_config(tmp_path / "absent.gguf")


def test_a_gemma3_file_becomes_the_checkpoint_it_was_made_from(tmp_path: Path) -> None:
    """Six layers (five over a 16-token window, one global, as llama.cpp lays Gemma 3 out),
    norms shifted by 1 in the file: the exported checkpoint has the same config and weights,
    and gives the same logits over a prompt longer than the window."""
    config = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, vocab_size=192, max_position_embeddings=512,
        sliding_window=16, query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=1e4,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)  # random: a missed shift shows
    gemma3_file(tmp_path / "tiny.gguf", reference)
    folder = write_hf_checkpoint(tmp_path / "tiny.gguf", tmp_path / "hf", tokenizer=False)
    exported = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"):
        assert getattr(exported.config, key) == getattr(config, key), key
    assert exported.config.architectures == ["Gemma3ForCausalLM"]
    expected, got = reference.state_dict(), exported.state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():  # norms went through + 1 - 1 in float32
        torch.testing.assert_close(got[name], tensor, atol=3e-7 if "norm" in name else 0, rtol=0)
    prompt = torch.randint(0, 192, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(exported(prompt).logits, reference(prompt).logits)
    half = write_hf_checkpoint(
        tmp_path / "tiny.gguf", tmp_path / "bf16", dtype=torch.bfloat16, tokenizer=False
    )
    assert "bfloat16" in (half / "config.json").read_text()
    finish(write_tiny(tmp_path / "llama.gguf"))
    with pytest.raises(ValueError, match="'llama' cannot be written as a Hugging Face"):
        write_hf_checkpoint(tmp_path / "llama.gguf", tmp_path / "no")
