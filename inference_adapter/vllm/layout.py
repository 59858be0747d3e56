"""vLLM's per-layer KV tensors, seen as K and V ``[num_blocks, block_size, kv_heads, head_dim]``.

vLLM hands the connector one tensor per attention layer (``register_kv_caches``). Three
layouts occur; all are read and written through strided views (nothing is copied to read
the layout), picked by :func:`layout_of` from the device and the shape:

- ``cpu``: the CPU backend's ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, which it
  splits as ``[num_blocks, kv_heads, 2 * block_size, head_dim]``: per block and head, K's
  region then V's (``vllm/v1/attention/backends/cpu_attn.py``). Its C++ kernels (the
  ``vec`` and ``vec16`` ISAs) keep K's region dimension-major, ``[head_dim, block_size]``,
  and V's token-major, ``[block_size, head_dim]``. That is read off the kernel's behaviour,
  not a documented contract, so the connector checks it at start with vLLM's own cache
  write (``connector.check_cpu_layout``) and refuses to run where it does not hold.
- ``packed``: the same shape on CUDA (vLLM 0.32's standardized ``[B, H, N, C]`` per-layer
  view for flash attention), with K and V side by side in the last dimension.
- ``split``: ``[2, num_blocks, block_size, kv_heads, head_dim]``, K at 0 and V at 1, with
  tokens outside heads in memory (NHD) or heads outside tokens (HND, strides permuted).

The store keeps a block ``[num_layers, 2, block_tokens, kv_heads, head_dim]`` (kvstore's own
engine writes the same form) with K after RoPE, as vLLM holds it: block ``b`` of a chain at
positions ``b * block_tokens ..``, the only positions a prefix hit loads it at, so a load
gives vLLM back its own bits. A stored block spans ``block_tokens // block_size``
consecutive vLLM blocks. :func:`gather` reads blocks of one layer into that form (plain
torch on the tensors' device); a load writes them back with
:func:`kvstore.kernels.transfer.load_layer`.
"""

from __future__ import annotations

import torch

from kvstore.inference_adapter.core.transfer import LayerKV

__all__ = ["LAYOUTS", "LayerKV", "gather", "layer_kv", "layout_of"]

LAYOUTS = ("cpu", "packed", "split")


def layout_of(kv: torch.Tensor) -> str:
    """The layout name of one layer's KV tensor (see the module docstring)."""
    if kv.dim() == 5:
        return "split"
    return "cpu" if kv.device.type == "cpu" else "packed"


def layer_kv(kv: torch.Tensor, layout: str, *, num_kv_heads: int, head_dim: int) -> LayerKV:
    """K and V views of one layer's KV tensor in ``layout``.

    Raises:
        ValueError: The shape or strides do not fit ``layout`` for ``num_kv_heads`` and
            ``head_dim`` (the message gives the shape, so an unsupported backend is named at
            start, before anything is served).
    """
    shape = tuple(kv.shape)
    four = kv.dim() == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_dim
    if layout == "packed" and four:
        return LayerKV(kv[..., :head_dim].transpose(1, 2), kv[..., head_dim:].transpose(1, 2))
    if layout == "cpu" and four and kv.stride(3) == 1 and kv.stride(2) == 2 * head_dim:
        blocks, heads, size, _ = shape
        halves = kv.view(blocks, heads, 2, size * head_dim)
        k = halves[:, :, 0].view(blocks, heads, head_dim, size).permute(0, 3, 1, 2)
        v = halves[:, :, 1].view(blocks, heads, size, head_dim).transpose(1, 2)
        return LayerKV(k, v)
    five = kv.dim() == 5 and shape[0] == 2 and shape[3:] == (num_kv_heads, head_dim)
    if layout == "split" and five:
        return LayerKV(kv[0], kv[1], kv)
    expected = {
        "cpu": f"[num_blocks, {num_kv_heads}, block_size, {2 * head_dim}] with contiguous rows",
        "packed": f"[num_blocks, {num_kv_heads}, block_size, {2 * head_dim}]",
        "split": f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]",
    }
    if layout not in expected:
        raise ValueError(f"unknown KV layout {layout!r}; known: {list(LAYOUTS)}")
    raise ValueError(
        f"a KV cache layer of shape {shape} (strides {kv.stride()}) is not the {layout!r} "
        f"layout {expected[layout]}: this attention backend's layout is not supported"
    )


def gather(layer: LayerKV, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored blocks of one layer read out of vLLM's blocks.

    Args:
        layer: The layer's views.
        block_ids: ``[n, per_block]`` int64, the vLLM blocks making each stored block.

    Returns:
        K and V ``[n, block_tokens, kv_heads, head_dim]``, new tensors.
    """
    k, v = (part[block_ids].flatten(1, 2) for part in (layer.k, layer.v))
    return k, v
