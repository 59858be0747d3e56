"""The Llama model and checkpoint loading against Hugging Face's LlamaForCausalLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstore.inference_adapter import (
    Engine,
    LlamaConfig,
    LlamaModel,
    Request,
    SamplingParams,
    load_model,
    read_config,
)
from kvstore.inference_adapter import model as model_module
from kvstore.inference_adapter.model import SCRATCH_PAGE_TOKENS
from kvstore.inference_adapter.pages import AttentionBatch, decode_batch, pages_for, prefill_batch
from kvstore.inference_adapter.weights import weight_files
from kvstore.kernels.paged import slot_mapping
from kvstore.kernels.rope import Llama3Scaling, RopeConfig, UnsupportedRopeScalingError
from tests.inference_adapter.conftest import hf_model, save_tiny_model, tiny_config

PROMPT = torch.randint(0, 192, (40,), generator=torch.Generator().manual_seed(3))
ATOL = 1e-4


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(ids[None]).logits[0]
    return logits


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_logits_match_transformers(tmp_path: Path, rope: str) -> None:
    config = tiny_config(rope=rope)
    reference = hf_model(config)
    reference.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    expected = hf_logits(reference, PROMPT)
    torch.testing.assert_close(model.prompt_logits(PROMPT), expected, atol=ATOL, rtol=0)
    if rope == "llama3":  # the scaling changes the result: the test is not blind to it
        plain = hf_model(tiny_config())
        assert not torch.allclose(hf_logits(plain, PROMPT), expected, atol=1e-3)


def test_config_reads_a_saved_checkpoint(tiny_llama3_model_dir: Path) -> None:
    config = read_config(tiny_llama3_model_dir)
    scaling = Llama3Scaling(8.0, 1.0, 4.0, 32)
    assert config == LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=192,
        rope=RopeConfig(16, 10000.0, scaling),
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        dtype=torch.float32,
    )


def test_null_config_values_take_their_defaults() -> None:
    config = LlamaConfig.from_dict(tiny_config(num_key_value_heads=None, head_dim=None))
    assert (config.num_key_value_heads, config.head_dim) == (4, 16)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            UnsupportedRopeScalingError,
            "yarn",
        ),
        ({"model_type": "gpt2"}, ValueError, "model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, ValueError, "hidden_act must be silu"),
        ({"vocab_size": None}, ValueError, "config needs vocab_size"),
        ({"num_hidden_layers": "2"}, ValueError, "num_hidden_layers must be an integer"),
        ({"rms_norm_eps": True}, ValueError, "rms_norm_eps must be a number"),
        ({"tie_word_embeddings": 1}, ValueError, "tie_word_embeddings must be true or false"),
        ({"num_key_value_heads": 3}, ValueError, "multiple of num_key_value_heads"),
        ({"dtype": "int8"}, ValueError, "dtype must be one of"),
    ],
)
def test_bad_configs_are_refused(
    change: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        LlamaConfig.from_dict({**tiny_config(), **change})


def test_sharded_and_tied_checkpoints_load(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=True, num_hidden_layers=3)
    reference = hf_model(config)
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(weight_files(tmp_path)) > 1
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.embed_tokens.weight
    expected = hf_logits(reference, PROMPT)
    torch.testing.assert_close(model.prompt_logits(PROMPT), expected, atol=ATOL, rtol=0)


def test_load_casts_to_the_dtype_asked_for(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    reference = load_model(tiny_model_dir).prompt_logits(PROMPT)
    logits = model.prompt_logits(PROMPT).float()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


def test_the_config_carries_the_dtype_the_weights_are_in(tiny_model_dir: Path) -> None:
    assert load_model(tiny_model_dir).config.dtype == torch.float32
    assert load_model(tiny_model_dir, dtype=torch.bfloat16).config.dtype == torch.bfloat16
    config = read_config(tiny_model_dir)
    model = LlamaModel.from_config(config, dtype=torch.bfloat16)
    assert model.config.dtype == model.dtype == torch.bfloat16
    assert config.dtype == torch.float32  # the caller's config is left as it was


def test_weights_that_do_not_fit_are_named(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    weights = {**model.state_dict(), "norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"norm\.weight \(3,\) \(expected \(64,\)\)"):
        LlamaModel.from_weights(model.config, weights)
    rebuilt = LlamaModel.from_weights(model.config, model.state_dict(), dtype=torch.float16)
    assert rebuilt.config.dtype == rebuilt.dtype == torch.float16


def test_missing_weights_are_named(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path, tiny_config(num_hidden_layers=1))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"missing \['layers\.1\.input_layernorm\.weight'"):
        load_model(folder)
    for path in weight_files(folder):
        path.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_model(folder)


def test_random_init_is_deterministic_and_a_real_llama() -> None:
    config = LlamaConfig.from_dict(tiny_config(rope="llama3"))
    model = LlamaModel.from_config(config, seed=5)
    again = LlamaModel.from_config(config, seed=5)
    other = LlamaModel.from_config(config, seed=6)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    # The same weights in transformers give the same logits.
    reference = hf_model(tiny_config(rope="llama3"))
    hf_names = {
        f"model.{k}" if k != "lm_head.weight" else k: v for k, v in model.state_dict().items()
    }
    reference.load_state_dict(hf_names)
    expected = hf_logits(reference, PROMPT)
    torch.testing.assert_close(model.prompt_logits(PROMPT), expected, atol=ATOL, rtol=0)


def kv_of(model: LlamaModel, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Pool KV of ``tokens``: the first ``prefill`` in one prefill, then one decode step
    each (as an engine computes a prompt, then its reply)."""
    page = SCRATCH_PAGE_TOKENS
    pages = list(range(pages_for(len(tokens), page)))
    pool = model.new_kv_pool(len(pages), page)
    model(tokens[:prefill], prefill_batch(pages, 0, prefill, page, model.device), pool)
    for position in range(prefill, len(tokens)):
        batch = decode_batch([pages], [position + 1], page, model.device)
        model(tokens[position : position + 1], batch, pool)
    return pool.flatten(2, 3)[:, :, : len(tokens)]  # [layers, 2, tokens, kv_heads, head_dim]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_kv_is_the_same_bits_however_tokens_are_batched(dtype: torch.dtype) -> None:
    """A token's KV from a decode step equals its KV from a prefill of 100. Without the
    float64 accumulation the bfloat16 case fails here (torch's bfloat16 CPU matmul rounds
    differently from 46 rows on); float16 is held to the same rule."""
    sizes = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9}
    config = LlamaConfig.from_dict(tiny_config(**sizes, num_key_value_heads=3, head_dim=64))
    model = LlamaModel.from_config(config, seed=1, dtype=dtype)
    tokens = torch.randint(0, 192, (100,), generator=torch.Generator().manual_seed(5))
    prefilled = kv_of(model, tokens, prefill=100)
    for split in (1, 37, 64):
        assert torch.equal(
            kv_of(model, tokens, prefill=split).view(torch.int16), prefilled.view(torch.int16)
        )


@pytest.mark.parametrize("head_dim", [48, 80, 96])
def test_head_dims_that_are_no_power_of_two_match_transformers(
    tmp_path: Path, head_dim: int
) -> None:
    reference = hf_model(tiny_config(head_dim=head_dim))
    reference.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.head_dim == head_dim
    expected = hf_logits(reference, PROMPT)
    torch.testing.assert_close(model.prompt_logits(PROMPT), expected, atol=ATOL, rtol=0)
    # A cached prefix (prefill) and a decode step go through the same kernels.
    request = Request("r", PROMPT.tolist(), SamplingParams(max_tokens=4))
    Engine(model, num_pages=8, page_tokens=16).generate([request])
    ids = torch.tensor([PROMPT.tolist()])
    hf = reference.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0
    )
    assert request.output == hf[0, len(PROMPT) :].tolist()


def packed_prefill(lengths: tuple[int, ...], page_tokens: int) -> tuple[AttentionBatch, int]:
    """A prefill batch of sequences from scratch, packed back to back, each in its own pages;
    and the pages they need."""
    tables, first = [], 0
    for length in lengths:
        tables.append(list(range(first, first + pages_for(length, page_tokens))))
        first += len(tables[-1])
    width = max(map(len, tables))
    block_tables = torch.tensor([[*t, *[0] * (width - len(t))] for t in tables], dtype=torch.int32)
    slots = [
        slot_mapping(torch.tensor(t), 0, n, page_tokens)
        for t, n in zip(tables, lengths, strict=True)
    ]
    offsets = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    batch = AttentionBatch(
        positions=torch.cat([torch.arange(n) for n in lengths]),
        slots=torch.cat(slots),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=block_tables,
        cu_seqlens_q=offsets,
        max_query_len=max(lengths),
        dense_lens=lengths,
    )
    return batch, first


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_dense_prefill_matches_the_paged_kernels(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, tolerance: float
) -> None:
    """Two GQA sequences from scratch: SDPA (CUDA's path, forced here; K/V heads repeated in
    float32, SDPA's own GQA in bfloat16) gives the paged reference's logits within rounding,
    and writes the same K/V into the pool."""
    model = LlamaModel.from_config(LlamaConfig.from_dict(tiny_config()), seed=2, dtype=dtype)
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    batch, num_pages = packed_prefill((23, 40), page_tokens=8)
    ids = torch.randint(0, 192, (63,), generator=torch.Generator().manual_seed(4))
    results = {}
    for mode in ("never", "always"):
        monkeypatch.setattr(model_module, "DENSE_PREFILL", mode)
        pool = model.new_kv_pool(num_pages, 8)
        results[mode] = (model.compute_logits(model(ids, batch, pool)), pool)
    (paged, paged_pool), (dense, dense_pool) = results["never"], results["always"]
    torch.testing.assert_close(dense, paged, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(dense_pool, paged_pool, atol=tolerance, rtol=tolerance)
    assert not torch.equal(dense[:23], dense[23:46])  # two sequences, not one repeated


def test_dense_prefill_runs_on_cuda_only_and_never_over_a_cached_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert model_module.uses_dense_prefill(torch.device("cuda"))
    assert not model_module.uses_dense_prefill(torch.device("cpu"))  # CPU results unchanged
    monkeypatch.setattr(model_module, "DENSE_PREFILL", "always")
    assert model_module.uses_dense_prefill(torch.device("cpu"))
    cpu = torch.device("cpu")
    assert prefill_batch([0, 1], 0, 12, 8, cpu).dense_lens == (12,)
    assert prefill_batch([0, 1], 8, 4, 8, cpu).dense_lens is None  # attends over the pool
    assert decode_batch([[0, 1]], [12], 8, cpu).dense_lens is None


def test_the_engine_answers_alike_through_either_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    model = LlamaModel.from_config(LlamaConfig.from_dict(tiny_config()), seed=3)
    outputs = {}
    for mode in ("never", "always"):
        monkeypatch.setattr(model_module, "DENSE_PREFILL", mode)
        requests = [
            Request(f"r{n}", PROMPT[:n].tolist(), SamplingParams(max_tokens=5)) for n in (9, 40)
        ]
        Engine(model, num_pages=16, page_tokens=8).generate(requests)
        outputs[mode] = [request.output for request in requests]
    assert outputs["always"] == outputs["never"]


def test_moving_the_model_moves_its_rope_tables() -> None:
    """``model.to(device)`` (``meta`` here) takes the RoPE tables along, in float32."""
    config = LlamaConfig.from_dict(tiny_config())
    model = LlamaModel.from_config(config).to("meta", torch.bfloat16)
    assert model.rope_tables.cos.device.type == "meta" == model.rope_tables.sin.device.type
    assert model.rope_tables.cos.dtype == torch.float32
