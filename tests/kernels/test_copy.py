"""Fused copy + RoPE: Triton kernels bit-exact against the torch references, round trips."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvstore.kernels.copy import (
    load_blocks_reference,
    load_blocks_triton,
    save_blocks_reference,
    save_blocks_triton,
)
from kvstore.kernels.rope import Llama3Scaling, RopeConfig, RopeTables, apply_rope, rope_tables
from tests.kernels.cases import DEVICE, EACH_DTYPE, TOLERANCES

# (num_layers, num_kv_heads, head_dim, block_tokens, page_tokens, num_blocks)
CASES = {
    "block-is-page": (2, 2, 128, 16, 16, 2),
    "block-spans-pages": (2, 1, 64, 12, 8, 3),
    "odd-sizes": (1, 3, 64, 5, 3, 2),
    # head_dims that are not powers of two: tiled padded, tail lanes masked.
    "head-dim-80": (2, 1, 80, 12, 8, 3),
    "head-dim-48": (1, 3, 48, 5, 3, 2),
    "head-dim-96": (1, 2, 96, 16, 16, 2),
}
MAX_POSITIONS = 1024
LLAMA3 = Llama3Scaling(8.0, 1.0, 4.0, 64)  # a short original context: every band is used


@dataclass(frozen=True)
class CopyCase:
    staging: torch.Tensor  # [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]
    kv_pool: torch.Tensor  # [num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]
    slots: torch.Tensor  # [num_blocks, block_tokens] int64, some -1
    positions: torch.Tensor  # [num_blocks, block_tokens]
    rope: RopeTables


def copy_case(case: str, dtype: torch.dtype, *, seed: int = 0) -> CopyCase:
    layers, heads, head_dim, block_tokens, page_tokens, blocks = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-blocks * block_tokens // page_tokens) + 2
    staging = torch.randn(blocks, layers, 2, block_tokens, heads, head_dim, generator=gen)
    pool = torch.randn(layers, 2, num_pages, page_tokens, heads, head_dim, generator=gen)
    slots = torch.randperm(num_pages * page_tokens, generator=gen)[: blocks * block_tokens]
    slots = slots.view(blocks, block_tokens).clone()
    slots[0, 1] = slots[-1, -1] = -1
    positions = torch.randint(0, MAX_POSITIONS, (blocks, block_tokens), generator=gen)
    rope = rope_tables(RopeConfig(head_dim, 500000.0, LLAMA3), MAX_POSITIONS, DEVICE)
    return CopyCase(
        staging.to(dtype).to(DEVICE),
        pool.to(dtype).to(DEVICE),
        slots.to(DEVICE),
        positions.to(DEVICE),
        rope,
    )


def pool_tokens(kv_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[num_tokens, num_layers, 2, heads, head_dim] of the given flat slots."""
    page_tokens = kv_pool.size(3)
    return kv_pool[:, :, slots // page_tokens, slots % page_tokens].permute(2, 0, 1, 3, 4)


def staging_tokens(staging: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[num_tokens, num_layers, 2, heads, head_dim] of the tokens whose slot is not -1."""
    blocks, tokens = (slots >= 0).nonzero(as_tuple=True)
    return staging[blocks, :, :, tokens]


@EACH_DTYPE
@pytest.mark.parametrize("case", sorted(CASES))
def test_load_kernel_matches_reference_bit_exactly(case: str, dtype: torch.dtype) -> None:
    c = copy_case(case, dtype)
    by_kernel, by_reference = c.kv_pool.clone(), c.kv_pool.clone()
    load_blocks_triton(c.staging, by_kernel, c.slots, c.positions, c.rope)
    load_blocks_reference(c.staging, by_reference, c.slots, c.positions, c.rope)
    assert torch.equal(by_kernel, by_reference)
    assert not torch.equal(by_kernel, c.kv_pool)


@EACH_DTYPE
@pytest.mark.parametrize("case", sorted(CASES))
def test_save_kernel_matches_reference_bit_exactly(case: str, dtype: torch.dtype) -> None:
    c = copy_case(case, dtype)
    by_kernel, by_reference = c.staging.clone(), c.staging.clone()
    save_blocks_triton(c.kv_pool, by_kernel, c.slots, c.positions, c.rope)
    save_blocks_reference(c.kv_pool, by_reference, c.slots, c.positions, c.rope)
    assert torch.equal(by_kernel, by_reference)
    skipped = c.slots < 0
    assert torch.equal(by_kernel.movedim(3, 1)[skipped], c.staging.movedim(3, 1)[skipped])


@EACH_DTYPE
@pytest.mark.parametrize("load", [load_blocks_triton, load_blocks_reference])
def test_load_copies_v_exactly_and_rotates_k_to_its_positions(
    load: Callable[..., None], dtype: torch.dtype
) -> None:
    c = copy_case("block-spans-pages", dtype)
    pool = c.kv_pool.clone()
    load(c.staging, pool, c.slots, c.positions, c.rope)
    valid = c.slots >= 0
    landed = pool_tokens(pool, c.slots[valid])
    staged = staging_tokens(c.staging, c.slots)
    assert torch.equal(landed[:, :, 1], staged[:, :, 1])
    rotated = apply_rope(staged[:, :, 0], c.positions[valid][:, None, None], c.rope)
    assert torch.equal(landed[:, :, 0], rotated)


@EACH_DTYPE
@pytest.mark.parametrize(
    ("load", "save"),
    [(load_blocks_triton, save_blocks_triton), (load_blocks_reference, save_blocks_reference)],
    ids=["triton", "reference"],
)
def test_without_rope_both_directions_are_plain_copies(
    load: Callable[..., None], save: Callable[..., None], dtype: torch.dtype
) -> None:
    c = copy_case("odd-sizes", dtype)
    pool, staging = c.kv_pool.clone(), torch.zeros_like(c.staging)
    load(c.staging, pool, c.slots)
    save(pool, staging, c.slots)
    assert torch.equal(staging_tokens(staging, c.slots), staging_tokens(c.staging, c.slots))


def test_one_layer_at_a_time_equals_all_layers_at_once() -> None:
    c = copy_case("block-is-page", torch.float16)
    whole, by_layer = c.kv_pool.clone(), c.kv_pool.clone()
    load_blocks_reference(c.staging, whole, c.slots, c.positions, c.rope)
    for layer in range(c.staging.size(1)):
        one = slice(layer, layer + 1)
        load_blocks_triton(c.staging[:, one], by_layer[one], c.slots, c.positions, c.rope)
    assert torch.equal(by_layer, whole)


@EACH_DTYPE
def test_save_then_load_at_shifted_positions_equals_rope_at_those_positions(
    dtype: torch.dtype,
) -> None:
    """Position-decoupled reuse: stored pre-RoPE K comes back rotated for its new place."""
    c = copy_case("block-spans-pages", dtype)
    pool = c.kv_pool.clone()
    load_blocks_triton(c.staging, pool, c.slots, c.positions, c.rope)  # K at its first place
    stored = torch.zeros_like(c.staging)
    save_blocks_triton(pool, stored, c.slots, c.positions, c.rope)
    original = staging_tokens(c.staging, c.slots)
    torch.testing.assert_close(staging_tokens(stored, c.slots), original, **TOLERANCES[dtype])
    shifted = (c.positions + 300) % MAX_POSITIONS
    load_blocks_triton(stored, pool, c.slots, shifted, c.rope)
    valid = c.slots >= 0
    expected = apply_rope(original[:, :, 0].float(), shifted[valid][:, None, None], c.rope)
    landed = pool_tokens(pool, c.slots[valid])[:, :, 0].float()
    torch.testing.assert_close(landed, expected, **TOLERANCES[dtype])


def bad_copy_args(c: CopyCase, **changes: object) -> dict[str, object]:
    args: dict[str, object] = {
        "staging": c.staging,
        "kv_pool": c.kv_pool,
        "slot_mapping": c.slots,
        "positions": c.positions,
        "rope": c.rope,
    }
    return {**args, **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (lambda c: {"staging": c.staging.half()}, "staging dtype must be one of float32"),
        (lambda c: {"staging": c.staging[..., :32]}, "staging must be contiguous"),
        (
            lambda c: {"staging": c.staging[:, :1]},
            "staging.shape[1] must equal kv_pool's num_layers",
        ),
        (lambda c: {"staging": c.staging.repeat(1, 1, 1, 1, 2, 1)}, "staging.shape[4] must equal"),
        (lambda c: {"kv_pool": c.kv_pool[:, :1]}, "kv_pool.shape[1] must equal 2"),
        (lambda c: {"kv_pool": c.kv_pool.double()}, "kv_pool dtype"),
        (lambda c: {"kv_pool": c.kv_pool[None]}, "kv_pool must be 6-D"),
        (lambda c: {"slot_mapping": c.slots.int()}, "slot_mapping dtype must be one of int64"),
        (
            lambda c: {"slot_mapping": c.slots[:, :3].contiguous()},
            "slot_mapping.shape[1] must equal",
        ),
        (lambda c: {"positions": c.positions.float()}, "positions dtype"),
        (lambda c: {"positions": None}, "positions and rope must be given together"),
        (lambda c: {"rope": rope_tables(RopeConfig(128), 8, DEVICE)}, "rope tables (head_dim 128"),
        (
            lambda c: {
                "staging": c.staging[..., :63].contiguous(),
                "kv_pool": c.kv_pool[..., :63].contiguous(),
            },
            "kv_pool head_dim must be even and in 2..256, got 63",
        ),
        (
            lambda c: {
                "staging": c.staging.repeat(1, 1, 1, 1, 1, 5),
                "kv_pool": c.kv_pool.repeat(1, 1, 1, 1, 1, 5),
            },
            "kv_pool head_dim must be even and in 2..256, got 320",
        ),
        (lambda c: {"staging": c.staging.to("meta")}, "staging must be on"),
    ],
)
@pytest.mark.parametrize("copy", [load_blocks_triton, save_blocks_reference])
def test_copies_reject_bad_arguments_by_name(
    changes: Callable[[CopyCase], dict[str, object]], message: str, copy: Callable[..., None]
) -> None:
    c = copy_case("block-spans-pages", torch.float32)
    with pytest.raises(ValueError, match=re.escape(message)):
        copy(**bad_copy_args(c, **changes(c)))
