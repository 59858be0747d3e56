"""Triton kernels (paged attention, copy+RoPE) with torch reference implementations.

Modules: ``paged`` (the pool / block table / slot layout shared with the adapter),
``attention`` (prefill with a cached prefix), ``decode`` (one-token decode, split-K),
``rope`` (RoPE tables, llama3 scaling, rotation), ``copy`` (fused copy + RoPE between the
store's staging buffers and the pool), ``dispatch`` (Triton on CUDA, torch elsewhere, or as
``KVSTORE_KERNELS`` says). This package imports only torch and triton.
"""

from kvstore.kernels.attention import accumulates_in_float64
from kvstore.kernels.dispatch import (
    KERNELS_ENV,
    Backend,
    decode_attention,
    kernel_backend,
    load_blocks,
    prefill_attention,
    save_blocks,
)
from kvstore.kernels.paged import gather_tokens, new_kv_pool, slot_mapping, write_tokens
from kvstore.kernels.rope import (
    Llama3Scaling,
    RopeConfig,
    RopeTables,
    UnsupportedRopeScalingError,
    apply_rope,
    inv_freq,
    rope_tables,
)

__all__ = [
    "KERNELS_ENV",
    "Backend",
    "Llama3Scaling",
    "RopeConfig",
    "RopeTables",
    "UnsupportedRopeScalingError",
    "accumulates_in_float64",
    "apply_rope",
    "decode_attention",
    "gather_tokens",
    "inv_freq",
    "kernel_backend",
    "load_blocks",
    "new_kv_pool",
    "prefill_attention",
    "rope_tables",
    "save_blocks",
    "slot_mapping",
    "write_tokens",
]
