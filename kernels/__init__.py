"""Triton kernels (paged attention, copy+RoPE) with torch reference implementations.

Modules: ``paged`` (the pool / block table / slot layout shared with the adapter),
``attention`` (prefill with a cached prefix), ``decode`` (one-token decode, split-K),
``rope`` (RoPE tables, llama3 scaling, rotation), ``copy`` (fused copy + RoPE between the
store's staging buffers and the pool), ``tuning`` (launch settings and prefill's path chosen
per shape on the GPU itself), ``dispatch`` (Triton on CUDA, torch elsewhere, or as
``KVSTORE_KERNELS`` says). This package imports only torch and triton.

Names are imported from their modules (``from kvstore.kernels.rope import RopeConfig``): the
package imports nothing itself, so the vLLM connector, which moves KV with ``transfer``,
loads no attention kernel.
"""
