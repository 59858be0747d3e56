"""``load_layer``: blocks scattered in host memory into paged K/V of every layout, one layer
at a time; the Triton kernel (the interpreter here) bit-exact against the torch reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvstore.kernels.copy import save_blocks_reference
from kvstore.kernels.transfer import (
    LayerCopies,
    gather_pages,
    load_layer_reference,
    load_layer_triton,
)

Loader = Callable[..., None]
IMPLEMENTATIONS: dict[str, Loader] = {"triton": load_layer_triton, "torch": load_layer_reference}
# (kv_heads, head_dim, page_tokens, pages_per_block, num_blocks)
SHAPES = {
    "block-is-page": (2, 64, 16, 1, 3),
    "block-spans-pages": (3, 32, 4, 4, 3),
    "long-pages": (1, 16, 80, 1, 2),  # more tokens than one program's tile
}


@dataclass(frozen=True)
class Case:
    arena: torch.Tensor  # flat uint8: every block, layer-major, at scattered offsets
    blocks: torch.Tensor  # [num_blocks, num_layers, 2, block_tokens, kv_heads, head_dim]
    offsets: torch.Tensor  # [num_blocks] int64 byte offset of each block
    pages: torch.Tensor  # [num_blocks, pages_per_block] int64, some -1
    layer_bytes: int


def case(shape: str, dtype: torch.dtype, layers: int = 2, pages: str = "scattered") -> Case:
    """Blocks at scattered offsets; their pages scattered, consecutive with one skipped page
    in the first block (``runs``: runs of pages that a skip and block ends cut), or
    consecutive (``whole``: every block one run). ``chain`` and ``chain-runs``: ``whole``
    and ``runs`` with the blocks one after another in the arena, as a put of a chain leaves
    them (consecutive blocks into consecutive pages are one strided copy)."""
    heads, head_dim, page_tokens, per_block, num_blocks = SHAPES[shape]
    gen = torch.Generator().manual_seed(1)
    block_shape = (layers, 2, per_block * page_tokens, heads, head_dim)
    blocks = torch.randn(num_blocks, *block_shape, generator=gen).to(dtype)
    block_bytes = blocks[0].numel() * blocks.element_size()
    arena = torch.zeros(block_bytes * (2 * num_blocks + 1), dtype=torch.uint8)
    slots = torch.randperm(2 * num_blocks, generator=gen)[:num_blocks]
    if pages.startswith("chain"):
        slots = torch.arange(1, num_blocks + 1)
        pages = pages.removeprefix("chain").lstrip("-") or "whole"
    offsets = slots * block_bytes + 64  # 4-byte aligned, not block aligned
    for block, offset in zip(blocks, offsets.tolist(), strict=True):
        arena[offset : offset + block_bytes] = block.reshape(-1).view(torch.uint8)
    if pages == "scattered":
        order = torch.randperm(num_blocks * per_block + 3, generator=gen)
    else:
        order = torch.arange(3, 3 + num_blocks * per_block)
    targets = order[: num_blocks * per_block].view(num_blocks, per_block).clone()
    if pages != "whole":
        targets[0, min(1, per_block - 1) if pages == "runs" else -1] = -1
    return Case(arena, blocks, offsets, targets, block_bytes // layers)


def engine_pool(num_pages: int, heads: int, page_tokens: int, dim: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """Our engine's pool of one layer, ``[2, pages, page_tokens, heads, dim]``, as K/V views
    ``[pages, page_tokens, heads, dim]`` (also vLLM's split NHD layout)."""
    pool = torch.full((2, num_pages, page_tokens, heads, dim), -7.0).to(dtype)
    return pool, pool[0], pool[1]


def vllm_split_hnd(num_pages: int, heads: int, page_tokens: int, dim: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    pool = torch.full((2, num_pages, heads, page_tokens, dim), -7.0).to(dtype)
    return pool, pool[0].transpose(1, 2), pool[1].transpose(1, 2)


def vllm_packed(num_pages: int, heads: int, page_tokens: int, dim: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    pool = torch.full((num_pages, heads, page_tokens, 2 * dim), -7.0).to(dtype)
    return pool, pool[..., :dim].transpose(1, 2), pool[..., dim:].transpose(1, 2)


def separate(num_pages: int, heads: int, page_tokens: int, dim: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """K and V in tensors of their own (no common view of both)."""
    k, v = (torch.full((num_pages, page_tokens, heads, dim), -7.0).to(dtype) for _ in "kv")
    return torch.stack([k, v]), k, v


LAYOUTS = {
    "engine": engine_pool,
    "split-hnd": vllm_split_hnd,
    "packed": vllm_packed,
    "separate": separate,
}


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pages", ["scattered", "runs", "whole", "chain", "chain-runs"])
def test_every_layer_lands_in_its_pages_and_skipped_pages_are_untouched(
    name: str, layout: str, shape: str, dtype: torch.dtype, pages: str
) -> None:
    c = case(shape, dtype, pages=pages)
    heads, dim, page_tokens, per_block, num_blocks = SHAPES[shape]
    num_pages = num_blocks * per_block + 3
    for layer in range(c.blocks.size(1)):
        pool, k, v = LAYOUTS[layout](num_pages, heads, page_tokens, dim, dtype)
        before = pool.clone()
        offsets = c.offsets + layer * c.layer_bytes
        IMPLEMENTATIONS[name](c.arena, offsets, k, v, c.pages)
        written = torch.zeros(num_pages, dtype=torch.bool)
        for b in range(num_blocks):
            for p in range(per_block):
                page = int(c.pages[b, p])
                if page < 0:
                    continue
                written[page] = True
                tokens = slice(p * page_tokens, (p + 1) * page_tokens)
                assert torch.equal(k[page], c.blocks[b, layer, 0, tokens]), (b, p)
                assert torch.equal(v[page], c.blocks[b, layer, 1, tokens]), (b, p)
        # Pages no block names, and the skipped one, keep their bytes.
        k_before, v_before = LAYOUTS[layout](num_pages, heads, page_tokens, dim, dtype)[1:]
        assert torch.equal(k[~written], k_before[~written])
        assert torch.equal(v[~written], v_before[~written])
        assert pool.shape == before.shape


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_chain_into_consecutive_pages_is_one_copy_for_every_layer(shape: str) -> None:
    c = case(shape, torch.bfloat16, layers=3, pages="chain")
    heads, dim, page_tokens, per_block, num_blocks = SHAPES[shape]
    pool, k, v = engine_pool(num_pages := num_blocks * per_block + 3, heads, page_tokens, dim,
                             torch.bfloat16)  # fmt: skip
    copies = LayerCopies(c.arena, c.offsets.tolist(), k, c.pages, c.layer_bytes)
    assert len(copies._groups) == 1
    pages = c.pages.flatten()
    for layer in range(3):
        copies.write(layer, k, v)
        got = pool[:, pages].unflatten(1, (num_blocks, per_block)).transpose(0, 1)
        expected = c.blocks[:, layer].unflatten(2, (per_block, page_tokens))
        assert torch.equal(got, expected), layer
    assert num_pages == pool.size(1)


def test_a_bad_argument_is_named() -> None:
    c = case("block-is-page", torch.float32)
    _, k, v = engine_pool(6, 2, 16, 64, torch.float32)
    with pytest.raises(ValueError, match="pages must be"):
        load_layer_reference(c.arena, c.offsets, k, v, c.pages.int())
    with pytest.raises(ValueError, match="k and v must be"):
        load_layer_reference(c.arena, c.offsets, k, v[:, :1], c.pages)
    with pytest.raises(ValueError, match=r"offsets must be multiples of .* \(4 B\)"):
        load_layer_reference(c.arena, c.offsets + 2, k, v, c.pages)
    odd = torch.zeros(6, 16, 2, 3, dtype=torch.float16)  # 6-byte rows
    with pytest.raises(ValueError, match="whole 4-byte words"):
        load_layer_triton(c.arena, c.offsets, odd, odd.clone(), c.pages)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("order", ["runs", "scattered"])
def test_gather_pages_equals_the_slot_based_save(dtype: torch.dtype, order: str) -> None:
    """Blocks gathered by runs of pages hold what ``save_blocks`` (slot by slot) gathers."""
    gen = torch.Generator().manual_seed(3)
    layers, pages_total, page_tokens, heads, dim, per_block, num_blocks = 3, 20, 4, 2, 8, 3, 4
    pool = torch.randn(layers, 2, pages_total, page_tokens, heads, dim, generator=gen).to(dtype)
    if order == "runs":  # consecutive, a gap between the second and third block
        chosen = torch.cat([torch.arange(2, 8), torch.arange(10, 16)])
    else:
        chosen = torch.randperm(pages_total, generator=gen)[: num_blocks * per_block]
    pages = chosen.view(num_blocks, per_block)
    shape = (num_blocks, layers, 2, per_block * page_tokens, heads, dim)
    by_runs, by_slots = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    gather_pages(pool, pages, by_runs)
    slots = (pages[:, :, None] * page_tokens + torch.arange(page_tokens)).view(num_blocks, -1)
    save_blocks_reference(pool, by_slots, slots)
    assert torch.equal(by_runs, by_slots)
    assert torch.equal(by_runs[1, 2, 1, :page_tokens], pool[2, 1, int(pages[1, 0])])


def test_gather_pages_names_a_bad_argument() -> None:
    pool = torch.zeros(2, 2, 6, 4, 1, 8)
    out = torch.zeros(1, 2, 2, 8, 1, 8)
    with pytest.raises(ValueError, match=r"out must be \[1, 2, 2, 8, 1, 8\] torch.float32"):
        gather_pages(pool, torch.tensor([[0, 1]]), out[..., :4])
    with pytest.raises(ValueError, match=r"pages must be in 0..5, got \[\[0, 6\]\]"):
        gather_pages(pool, torch.tensor([[0, 6]]), out)
