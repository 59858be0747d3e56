"""RoPE tables and rotation against Hugging Face transformers' Llama implementation."""

from __future__ import annotations

import pytest
import torch

from kvstore.kernels.rope import (
    Llama3Scaling,
    RopeConfig,
    RopeTables,
    UnsupportedRopeScalingError,
    apply_rope,
    inv_freq,
    rope_tables,
)
from tests.kernels.cases import EACH_DTYPE

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
transformers = pytest.importorskip("transformers")

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# (head_dim, rope_theta, rope_scaling): Llama 2 style, Llama 3.1 style, a small llama3 model,
# and head_dims that are not powers of two (Phi-2's 80 among them).
CONFIGS = {
    "default-128": (128, 10000.0, None),
    "llama3-128": (128, 500000.0, LLAMA3),
    "llama3-64": (
        64,
        500000.0,
        {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 4096},
    ),
    "default-48": (48, 10000.0, None),
    "default-80": (80, 10000.0, None),
    "llama3-96": (96, 500000.0, LLAMA3),
}
MAX_POSITIONS = 1 << 17
# Across the llama3 low, medium and high frequency bands and past the original context.
POSITIONS = [0, 1, 2, 7, 100, 1023, 4095, 8191, 8192, 9000, 20000, 65537, MAX_POSITIONS - 1]
# HF rounds cos/sin to the input dtype and rotates in it; ours rotates in float32.
HF_TOLERANCES = {
    torch.float16: {"atol": 8e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 6e-2, "rtol": 3e-2},
    torch.float32: {"atol": 1e-6, "rtol": 1e-6},
}


def hf_config(case: str) -> transformers.LlamaConfig:
    head_dim, theta, scaling = CONFIGS[case]
    return transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=MAX_POSITIONS,
    )


def hf_rotate(config: transformers.LlamaConfig, x: torch.Tensor) -> torch.Tensor:
    """x: [1, heads, len(POSITIONS), head_dim] rotated by transformers."""
    rotary = modeling_llama.LlamaRotaryEmbedding(config=config)
    cos, sin = rotary(x, torch.tensor([POSITIONS]))
    _, rotated = modeling_llama.apply_rotary_pos_emb(x, x, cos, sin)
    return rotated


@pytest.fixture(scope="module")
def tables() -> dict[str, RopeTables]:
    return {
        case: rope_tables(RopeConfig.from_hf_config(hf_config(case).to_dict()), MAX_POSITIONS)
        for case in CONFIGS
    }


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_inv_freq_is_bit_identical_to_transformers(case: str) -> None:
    config = hf_config(case)
    expected = modeling_llama.LlamaRotaryEmbedding(config=config).inv_freq
    assert torch.equal(inv_freq(RopeConfig.from_hf_config(config.to_dict())), expected)


@EACH_DTYPE
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_rotation_matches_transformers_apply_rotary_pos_emb(
    case: str, dtype: torch.dtype, tables: dict[str, RopeTables]
) -> None:
    head_dim = CONFIGS[case][0]
    x = torch.randn(1, 2, len(POSITIONS), head_dim, generator=torch.Generator().manual_seed(3))
    x = x.to(dtype)
    ours = apply_rope(x, torch.tensor(POSITIONS), tables[case])
    expected = hf_rotate(hf_config(case), x)
    torch.testing.assert_close(ours.float(), expected.float(), **HF_TOLERANCES[dtype])


@EACH_DTYPE
def test_unrotate_then_rotate_at_the_same_positions_gives_k_back(
    dtype: torch.dtype, tables: dict[str, RopeTables]
) -> None:
    k = torch.randn(len(POSITIONS), 4, 128, generator=torch.Generator().manual_seed(4))
    positions = torch.tensor(POSITIONS)[:, None]
    rope = tables["llama3-128"]
    stored = apply_rope(k.to(dtype), positions, rope, inverse=True)
    back = apply_rope(stored, positions, rope)
    torch.testing.assert_close(back.float(), k.to(dtype).float(), **HF_TOLERANCES[dtype])


def test_rotating_at_shifted_positions_equals_rope_at_those_positions(
    tables: dict[str, RopeTables],
) -> None:
    k = torch.randn(len(POSITIONS), 4, 128, generator=torch.Generator().manual_seed(5))
    rope = tables["llama3-128"]
    old = torch.tensor(POSITIONS)[:, None]
    new = (old + 12345) % MAX_POSITIONS  # a truncated context lands elsewhere
    cached = apply_rope(k, old, rope)
    moved = apply_rope(apply_rope(cached, old, rope, inverse=True), new, rope)
    torch.testing.assert_close(moved, apply_rope(k, new, rope), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "longrope", "su", "mrope"])
def test_unsupported_scaling_types_are_refused_by_name(kind: str) -> None:
    with pytest.raises(UnsupportedRopeScalingError, match=f"'{kind}' is not supported"):
        RopeConfig.from_scaling(128, 10000.0, {"rope_type": kind, "factor": 2.0})
    with pytest.raises(ValueError, match=kind):  # the legacy spelling, and a ValueError
        RopeConfig.from_scaling(128, 10000.0, {"type": kind, "factor": 2.0})


def test_partial_rotary_factor_is_refused() -> None:
    with pytest.raises(UnsupportedRopeScalingError, match="partial_rotary_factor"):
        RopeConfig.from_scaling(
            128, 10000.0, {"rope_type": "default", "partial_rotary_factor": 0.5}
        )


def test_config_spellings_of_transformers_4_and_5_agree() -> None:
    v5 = {"head_dim": 128, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}
    v4 = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "rope_theta": 500000,
        "rope_scaling": LLAMA3,
    }
    legacy_scaling = {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    legacy = {**v4, "rope_scaling": {"type": "llama3", **legacy_scaling}}
    expected = RopeConfig(128, 500000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192))
    assert {RopeConfig.from_hf_config(c) for c in (v5, v4, legacy)} == {expected}
    assert RopeConfig.from_hf_config({"head_dim": 64}) == RopeConfig(64)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({**LLAMA3, "factor": None}, "llama3 rope scaling needs numbers"),
        ({k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}, "needs numbers"),
        ({**LLAMA3, "low_freq_factor": 4.0}, "low_freq_factor < high_freq_factor"),
        ({**LLAMA3, "original_max_position_embeddings": 0}, "must be positive"),
    ],
)
def test_bad_llama3_parameters_are_refused(scaling: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RopeConfig.from_scaling(128, 500000.0, scaling)


def test_bad_configs_and_tables_are_refused() -> None:
    for bad in (97, 0, 264):
        with pytest.raises(ValueError, match=f"head_dim must be even and in 2..256, got {bad}"):
            RopeConfig(bad)
    with pytest.raises(ValueError, match="theta must be a positive"):
        RopeConfig(64, theta=0.0)
    with pytest.raises(ValueError, match="cos dtype"):
        RopeTables(torch.zeros(4, 32, dtype=torch.float64), torch.zeros(4, 32))
    with pytest.raises(ValueError, match="sin shape"):
        RopeTables(torch.zeros(4, 32), torch.zeros(5, 32))
    rope = rope_tables(RopeConfig(64), 8)
    with pytest.raises(ValueError, match="does not match tables for head_dim 64"):
        apply_rope(torch.zeros(2, 128), torch.zeros(2, dtype=torch.int64), rope)
    with pytest.raises(ValueError, match="positions must be an int32 or int64"):
        apply_rope(torch.zeros(2, 64), torch.zeros(2), rope)
