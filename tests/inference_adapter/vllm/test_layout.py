"""vLLM's KV layouts (CPU, CUDA packed, CUDA split NHD and HND) on CPU tensors.

Each layout is built the way vLLM allocates it (same shapes and strides), filled with values
derived from (block, head, token, dim), and checked where vLLM's attention reads them (the
slicing of vLLM's backends, restated here) and against the store's form: a block
``[2, block_tokens, kv_heads, head_dim]`` per layer, K after RoPE, bit for bit as vLLM holds it.

``KVSTORE_TEST_DEVICE=cuda`` runs them on CUDA tensors (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvstore.inference_adapter.vllm.layout import LayerKV, gather, layer_kv, layout_of
from kvstore.kernels.transfer import load_layer

BLOCKS, HEADS, SIZE, DIM = 12, 2, 32, 64
DEVICE = torch.device(os.environ.get("KVSTORE_TEST_DEVICE", "cpu"))


def packed() -> torch.Tensor:
    """``[num_blocks, kv_heads, block_size, 2 * head_dim]``: the CPU backend's tensor, and
    flash attention's standardized per-layer view on CUDA."""
    return torch.zeros(BLOCKS, HEADS, SIZE, 2 * DIM, device=DEVICE)


def split_nhd() -> torch.Tensor:
    """CUDA flash-attention's ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
    return torch.zeros(2, BLOCKS, SIZE, HEADS, DIM, device=DEVICE)


def split_hnd() -> torch.Tensor:
    """The same logical shape, heads outside tokens in memory (``VLLM_KV_CACHE_LAYOUT=HND``)."""
    return torch.zeros(2, BLOCKS, HEADS, SIZE, DIM, device=DEVICE).transpose(2, 3)


LAYOUTS = {
    "cpu": ("cpu", packed),
    "packed": ("packed", packed),
    "split_nhd": ("split", split_nhd),
    "split_hnd": ("split", split_hnd),
}


def vllm_k_v(layout: str, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[num_blocks, block_size, kv_heads, head_dim]`` sliced the way vLLM's
    attention backends slice them (cpu_attn.py, flash_attn.py)."""
    if layout == "cpu":  # K's region is [head_dim, block_size] (the C++ vec kernels)
        blocks, heads, size, _ = kv.shape
        k, v = kv.view(blocks, heads, size * 2, -1).chunk(2, dim=2)
        return k.reshape(blocks, heads, DIM, size).permute(0, 3, 1, 2), v.transpose(1, 2)
    if layout == "packed":  # (B, H, N, 2*D) -> (B, N, H, D) twice
        k, v = kv.transpose(1, 2).split(DIM, dim=-1)
        return k, v
    return kv[0], kv[1]


def truth(kv_index: int) -> torch.Tensor:
    """``[BLOCKS, SIZE, HEADS, DIM]``: a distinct value per (K/V, block, token, head, dim)."""
    b, t, h, d = torch.meshgrid(
        *(torch.arange(n, dtype=torch.float32, device=DEVICE) for n in (BLOCKS, SIZE, HEADS, DIM)),
        indexing="ij",
    )
    return kv_index * 1e6 + b * 1e4 + h * 1e3 + t * 10 + d / 100


def fill(layer: LayerKV) -> None:
    layer.k.copy_(truth(0))
    layer.v.copy_(truth(1))


@pytest.mark.parametrize(("layout", "make"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_views_share_memory_and_put_k_and_v_where_vllm_reads_them(layout, make) -> None:  # type: ignore[no-untyped-def]
    kv = make()
    layer = layer_kv(kv, layout, num_kv_heads=HEADS, head_dim=DIM)
    assert layer.k.shape == layer.v.shape == (BLOCKS, SIZE, HEADS, DIM)
    fill(layer)
    k, v = vllm_k_v(layout, kv)
    assert torch.equal(k, truth(0)) and torch.equal(v, truth(1))
    assert layer.block_size == SIZE


def test_the_cpu_layout_keeps_a_heads_k_dimension_major_before_its_v() -> None:
    kv = packed()
    fill(layer_kv(kv, "cpu", num_kv_heads=HEADS, head_dim=DIM))
    flat = kv[3, 1].reshape(-1)  # one block, one head: [2 * block_size * head_dim]
    assert torch.equal(flat[: SIZE * DIM], truth(0)[3, :, 1].t().reshape(-1))
    assert torch.equal(flat[SIZE * DIM :], truth(1)[3, :, 1].reshape(-1))


def test_the_layout_is_chosen_by_device_and_rank() -> None:
    assert layout_of(torch.zeros(BLOCKS, HEADS, SIZE, 2 * DIM)) == "cpu"
    assert layout_of(split_nhd()) == layout_of(split_hnd()) == "split"
    meta = torch.empty(BLOCKS, HEADS, SIZE, 2 * DIM, device="meta")
    assert layout_of(meta) == "packed"  # a non-CPU device: flash attention's view


def test_hnd_strides_put_heads_outside_tokens() -> None:
    kv = split_hnd()
    assert kv.stride(3) > kv.stride(2)  # heads vary slower than tokens in memory
    layer = layer_kv(kv, "split", num_kv_heads=HEADS, head_dim=DIM)
    fill(layer)
    assert torch.equal(kv.transpose(2, 3).contiguous()[0, 3, 1, 5], truth(0)[3, 5, 1])


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        ("cpu", (BLOCKS, HEADS, SIZE, DIM)),
        ("packed", (BLOCKS, 3, SIZE, 2 * DIM)),
        ("split", (3, BLOCKS, SIZE, HEADS, DIM)),
        ("split", (BLOCKS, HEADS, SIZE, 2 * DIM)),
        ("cpu", (BLOCKS, SIZE, HEADS * DIM)),
    ],
)
def test_an_unexpected_shape_is_refused_with_its_shape(layout: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"of shape \(" + ", ".join(map(str, shape))):
        layer_kv(torch.zeros(shape), layout, num_kv_heads=HEADS, head_dim=DIM)


def test_a_cpu_layout_with_strided_rows_is_refused() -> None:
    kv = torch.zeros(BLOCKS, HEADS, 2 * DIM, SIZE, device=DEVICE).transpose(2, 3)  # strided
    with pytest.raises(ValueError, match="'cpu' layout"):
        layer_kv(kv, "cpu", num_kv_heads=HEADS, head_dim=DIM)
    with pytest.raises(ValueError, match="unknown KV layout 'nhd'"):
        layer_kv(packed(), "nhd", num_kv_heads=HEADS, head_dim=DIM)


@pytest.mark.parametrize(("layout", "make"), LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("per_block", [1, 2])
def test_gather_joins_vllm_blocks_into_stored_blocks_bit_for_bit(layout, make, per_block) -> None:  # type: ignore[no-untyped-def]
    layer = layer_kv(make(), layout, num_kv_heads=HEADS, head_dim=DIM)
    fill(layer)
    ids = torch.tensor([[7, 2], [4, 9]], device=DEVICE)[:, :per_block]
    block_tokens = SIZE * per_block
    k, v = gather(layer, ids)
    assert k.shape == v.shape == (2, block_tokens, HEADS, DIM)
    for n in range(2):
        for part in range(per_block):
            tokens = slice(part * SIZE, (part + 1) * SIZE)
            assert torch.equal(v[n, tokens], truth(1)[ids[n, part]])
            assert torch.equal(k[n, tokens], truth(0)[ids[n, part]])  # K as vLLM holds it


def load(target: LayerKV, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor) -> None:
    """What a load does with stored blocks: ``load_layer`` from memory holding them side by
    side as the store lays a layer out, into ``pages`` (-1: vLLM computed that part)."""
    blocks = torch.stack([k, v], dim=1).contiguous()  # [n, 2, block_tokens, kv_heads, dim]
    layer_bytes = blocks[0].numel() * blocks.element_size()
    offsets = torch.arange(len(blocks), device=DEVICE) * layer_bytes
    load_layer(blocks.view(-1).view(torch.uint8), offsets, target.k, target.v, pages)


@pytest.mark.parametrize(("layout", "make"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_load_inverts_gather_and_writes_only_its_blocks(layout, make) -> None:  # type: ignore[no-untyped-def]
    if layout == "cpu" and DEVICE.type == "cuda":
        pytest.skip("the CPU backend's layout (K dimension-major) occurs on the CPU only")
    source = layer_kv(make(), layout, num_kv_heads=HEADS, head_dim=DIM)
    fill(source)
    ids = torch.tensor([[1, 6], [8, 3]], device=DEVICE)
    k, v = gather(source, ids)

    target_kv = make()
    target = layer_kv(target_kv, layout, num_kv_heads=HEADS, head_dim=DIM)
    target_ids = torch.tensor([[10, 0], [5, 11]], device=DEVICE)
    load(target, k, v, target_ids)
    for src, dst in zip(ids.flatten().tolist(), target_ids.flatten().tolist(), strict=True):
        assert torch.equal(target.v[dst], truth(1)[src])
        assert torch.equal(target.k[dst], truth(0)[src])
    untouched = sorted(set(range(BLOCKS)) - set(target_ids.flatten().tolist()))
    assert not target.k[untouched].any() and not target.v[untouched].any()


def test_a_load_leaves_the_parts_vllm_computed_itself() -> None:
    source = layer_kv(split_nhd(), "split", num_kv_heads=HEADS, head_dim=DIM)
    fill(source)
    ids = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
    k, v = gather(source, ids)
    target = layer_kv(split_nhd(), "split", num_kv_heads=HEADS, head_dim=DIM)
    target.k.fill_(-1.0)
    only_last = torch.tensor([[-1, -1], [-1, 4]], device=DEVICE)  # only the last part loads
    load(target, k, v, only_last)
    assert torch.equal(target.k[4], truth(0)[4]) and torch.equal(target.v[4], truth(1)[4])
    assert bool((target.k[1:4] == -1.0).all()) and not target.v[1:4].any()
