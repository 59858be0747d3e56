"""A Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU) over a paged KV pool.

Every attention layer writes its new tokens' K/V into the pool and attends through the
paged kernels (``prefill_attention`` / ``decode_attention``: Triton on CUDA, the torch
reference elsewhere), so one code path serves prefill with a cached prefix and decode.
RoPE uses ``kvstore.kernels`` tables, the very ones the connector's copy kernels use, so
K rotated here and K rotated while loading from the store agree bit for bit. A prefill with
no cached prefix (``AttentionBatch.dense_lens``) still writes its K/V into the pool, but on
CUDA attends densely with torch's ``scaled_dot_product_attention`` (FlashAttention), faster
there than the paged Triton kernel (209 against 152 TFLOP/s on an H200), so a recompute is
timed at the device's best; ``DENSE_PREFILL`` forces either way.

Module names follow Hugging Face's ``LlamaForCausalLM`` (without its ``model.`` prefix), so
checkpoints load by name. Entry points: ``load_model(folder)`` reads a local checkpoint,
``LlamaModel.from_weights(config, weights)`` builds one from tensors by name (``load_model``
and the GGUF loader, ``gguf.py``, both end there), ``LlamaModel.from_config(config, seed=...)``
initialises one at random, deterministically. ``model.config.dtype`` is the weights' dtype.
The step API the engine drives is ``embed`` -> ``run_layer`` per layer -> ``compute_logits``
(``forward`` chains all layers); ``prompt_logits`` scores one token list on its own.

Batch invariance: a token's KV must not depend on how many tokens were computed with it
(a decode step computes one, a prefill hundreds), or a prefix hit on KV saved from decode
would differ from recomputing it. On the CPU, torch's 16-bit matrix products pick kernels by
the number of rows, which round differently (measured for bfloat16: 1 row vs 46 or more), and
the attention reference's float32 sums change with the number of queries and masked keys. So
in bfloat16 and float16 on the CPU every projection (``Linear``) and the attention reference
accumulate in float64, where the order of the sums no longer shows in the 16-bit result, and
a token's KV is the same bits however tokens are batched (``Linear`` keeps a float64 copy of
its weight: 8 bytes per parameter more). float32 keeps float32 sums, whose row-count effects
are an ulp (relative 1e-7). On CUDA the Triton kernels and cuBLAS are not batch-invariant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, Self

import torch
import torch.nn.functional as F
from torch import nn

from kvstore.inference_adapter.pages import AttentionBatch, pages_for, prefill_batch
from kvstore.inference_adapter.weights import LlamaConfig, read_config, read_weights
from kvstore.kernels.attention import accumulates_in_float64
from kvstore.kernels.dispatch import decode_attention, prefill_attention
from kvstore.kernels.paged import new_kv_pool, write_tokens
from kvstore.kernels.rope import RopeTables, apply_rope, rope_tables

INIT_STD = 0.02  # Hugging Face's default initializer_range
SCRATCH_PAGE_TOKENS = 16  # page size of the throwaway pool behind ``prompt_logits``
# Attention of a prefill without a cached prefix: "auto" is SDPA on CUDA and the paged kernels
# elsewhere (the CPU keeps its batch-invariant reference); "always" and "never" force one.
DENSE_PREFILL: Literal["auto", "always", "never"] = "auto"


def uses_dense_prefill(device: torch.device) -> bool:
    """Whether a prefill with no cached prefix on ``device`` attends through SDPA."""
    if DENSE_PREFILL == "auto":
        return device.type == "cuda"
    return DENSE_PREFILL == "always"


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...]
) -> torch.Tensor:
    """Causal GQA attention of sequences packed back to back, each over its own tokens only
    (no cached prefix), through ``F.scaled_dot_product_attention``.

    16-bit inputs with head_dim a multiple of 8 go as they are (``enable_gqa``: FlashAttention
    takes GQA); others get their K/V heads repeated for each query head, since SDPA's other
    fused kernels do not take GQA and its math fallback would hold every score.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, after RoPE.
        k: ``[num_tokens, num_kv_heads, head_dim]``, after RoPE.
        v: ``[num_tokens, num_kv_heads, head_dim]``.
        lengths: Each sequence's tokens, in order, summing to ``num_tokens``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype.
    """
    group = q.size(1) // k.size(1)
    gqa = q.dtype in (torch.float16, torch.bfloat16) and q.size(2) % 8 == 0
    outs = []
    splits = (t.split_with_sizes(lengths) for t in (q, k, v))
    for q_seq, k_seq, v_seq in zip(*splits, strict=True):
        if not gqa and group > 1:
            k_seq, v_seq = k_seq.repeat_interleave(group, 1), v_seq.repeat_interleave(group, 1)
        # SDPA takes [batch, heads, tokens, head_dim] (its fused kernels only in 4-d)
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q_seq, k_seq, v_seq))
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class Linear(nn.Linear):
    """``nn.Linear`` whose 16-bit CPU results do not depend on the batch (module docstring)."""

    _weight64: torch.Tensor | None = None
    _weight64_of: tuple[int, int] = (0, -1)  # (data_ptr, version) it was copied from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not accumulates_in_float64(x):
            return super().forward(x)
        source = (self.weight.data_ptr(), self.weight._version)
        if self._weight64 is None or self._weight64_of != source:
            self._weight64, self._weight64_of = self.weight.detach().double(), source
        bias = None if self.bias is None else self.bias.double()
        out: torch.Tensor = F.linear(x.double(), self._weight64, bias).to(x.dtype)
        return out


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as Hugging Face does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention whose K/V live in the paged pool."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def forward(
        self, x: torch.Tensor, batch: AttentionBatch, kv: torch.Tensor, rope: RopeTables
    ) -> torch.Tensor:
        """x: ``[num_tokens, hidden]``; kv: this layer's ``[2, num_pages, page_tokens,
        num_kv_heads, head_dim]``. Writes the tokens' K/V, returns ``[num_tokens, hidden]``."""
        num_tokens = x.size(0)
        positions = batch.positions[:, None]  # broadcast over heads
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, positions, rope), apply_rope(k, positions, rope)
        k_cache, v_cache = kv[0], kv[1]
        write_tokens(k_cache, v_cache, k, v, batch.slots)
        if batch.cu_seqlens_q is None:
            out = decode_attention(q, k_cache, v_cache, batch.seq_lens, batch.block_tables)
        elif batch.dense_lens is not None and uses_dense_prefill(q.device):
            out = dense_attention(q, k, v, batch.dense_lens)
        else:
            out = prefill_attention(
                q,
                k_cache,
                v_cache,
                batch.cu_seqlens_q,
                batch.seq_lens,
                batch.block_tables,
                max_query_len=batch.max_query_len,
            )
        projected: torch.Tensor = self.o_proj(out.flatten(1))
        return projected


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(hidden, inner, bias=bias)
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, batch: AttentionBatch, kv: torch.Tensor, rope: RopeTables
    ) -> torch.Tensor:
        h: torch.Tensor = x + self.self_attn(self.input_layernorm(x), batch, kv, rope)
        out: torch.Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


class LlamaModel(nn.Module):
    """A Llama causal LM. Build it on its final device: the RoPE tables do not follow
    ``.to()``."""

    def __init__(self, config: LlamaConfig, *, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # [max_position_embeddings, head_dim // 2] float32 cos and sin
        self.rope_tables = rope_tables(config.rope, config.max_position_embeddings, device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        """``to(device)`` and the like move the RoPE tables too (float32, never cast)."""
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        device = self.embed_tokens.weight.device
        if self.rope_tables.cos.device != device:  # made anew: they may be on "meta"
            config = self.config
            self.rope_tables = rope_tables(config.rope, config.max_position_embeddings, device)
        return self

    @classmethod
    def from_config(
        cls,
        config: LlamaConfig,
        *,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> LlamaModel:
        """Random weights, the same for the same seed on any device: N(0, 0.02) for
        matrices and embeddings, zeros for biases, ones for norms.

        Args:
            config: The architecture.
            seed: Seeds a CPU generator that draws every weight.
            dtype: Weight dtype; ``config.dtype`` when None.
            device: Where the model lives.
        """
        config = dataclasses.replace(config, dtype=dtype or config.dtype)
        with torch.device("meta"):
            model = cls(config, device=device)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, INIT_STD, generator=generator)
        model.to(dtype=config.dtype, device=device)
        model.tie_weights()
        return model.eval().requires_grad_(False)

    @classmethod
    def from_weights(
        cls,
        config: LlamaConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> LlamaModel:
        """A model holding ``weights``, named as its state dict (``embed_tokens.weight``,
        ``layers.0.self_attn.q_proj.weight``, ...; ``lm_head.weight`` may be left out when the
        embeddings are tied).

        Args:
            config: The architecture; the model's config is this one in ``dtype``.
            weights: Every tensor by name, in any dtype, on any device.
            dtype: Weight dtype; ``config.dtype`` when None.
            device: Where the model lives.

        Raises:
            ValueError: Names missing or unexpected, or a tensor whose shape does not fit.
        """
        config = dataclasses.replace(config, dtype=dtype or config.dtype)
        with torch.device("meta"):
            model = cls(config, device=device)
        tensors = {name: t.to(device=device, dtype=config.dtype) for name, t in weights.items()}
        if config.tie_word_embeddings and "embed_tokens.weight" in tensors:
            tensors.setdefault("lm_head.weight", tensors["embed_tokens.weight"])
        expected = model.state_dict()
        if set(tensors) != set(expected):
            missing = sorted(set(expected) - set(tensors))
            unexpected = sorted(set(tensors) - set(expected))
            raise ValueError(f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        misfits = [
            f"{name} {tuple(tensors[name].shape)} (expected {tuple(param.shape)})"
            for name, param in expected.items()
            if tensors[name].shape != param.shape
        ]
        if misfits:
            raise ValueError(f"shapes do not fit the config: {', '.join(misfits[:5])}")
        model.load_state_dict(tensors, assign=True)
        model.tie_weights()
        return model.eval().requires_grad_(False)

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (and the KV pool's) dtype."""
        return self.embed_tokens.weight.dtype

    def new_kv_pool(self, num_pages: int, page_tokens: int) -> torch.Tensor:
        """A zeroed pool for this model, on its device in its dtype:
        ``[num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]``."""
        config = self.config
        return new_kv_pool(
            config.num_hidden_layers,
            num_pages,
            page_tokens,
            config.num_key_value_heads,
            config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` int64 ids -> ``[num_tokens, hidden]``."""
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        return hidden

    def run_layer(
        self, layer: int, hidden: torch.Tensor, batch: AttentionBatch, kv_pool: torch.Tensor
    ) -> torch.Tensor:
        """Decoder layer ``layer`` on ``hidden`` ``[num_tokens, hidden]``; writes its K/V into
        ``kv_pool`` ``[num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]``."""
        out: torch.Tensor = self.layers[layer](hidden, batch, kv_pool[layer], self.rope_tables)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden]`` last-layer states -> ``[num_tokens, vocab_size]``."""
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits

    def forward(
        self, input_ids: torch.Tensor, batch: AttentionBatch, kv_pool: torch.Tensor
    ) -> torch.Tensor:
        """All layers over the tokens ``batch`` addresses: ``[num_tokens]`` ids ->
        ``[num_tokens, hidden]`` last-layer states (before the final norm)."""
        hidden = self.embed(input_ids)
        for layer in range(len(self.layers)):
            hidden = self.run_layer(layer, hidden, batch, kv_pool)
        return hidden

    @torch.inference_mode()
    def prompt_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_tokens, vocab_size]`` of one sequence ``[num_tokens]``, from scratch,
        in a throwaway pool."""
        num_tokens = input_ids.numel()
        num_pages = pages_for(num_tokens, SCRATCH_PAGE_TOKENS)
        kv_pool = self.new_kv_pool(num_pages, SCRATCH_PAGE_TOKENS)
        batch = prefill_batch(range(num_pages), 0, num_tokens, SCRATCH_PAGE_TOKENS, self.device)
        return self.compute_logits(self.forward(input_ids.to(self.device), batch, kv_pool))


def load_model(
    folder: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> LlamaModel:
    """Load a Hugging Face Llama checkpoint (``config.json`` + safetensors) from ``folder``.

    Args:
        folder: A local checkpoint folder, sharded or not.
        dtype: Weight dtype; the checkpoint's ``dtype`` when None.
        device: Where the model lives.

    Raises:
        FileNotFoundError: The config or the weights are missing.
        ValueError: An unsupported config, or weights that do not fit it.
    """
    config = read_config(folder)
    dtype = dtype or config.dtype
    weights = {
        name.removeprefix("model."): tensor
        for name, tensor in read_weights(folder, dtype=dtype, device=device).items()
        if not name.endswith("rotary_emb.inv_freq")  # old checkpoints stored it
    }
    try:
        return LlamaModel.from_weights(config, weights, dtype=dtype, device=device)
    except ValueError as error:
        raise ValueError(f"weights in {folder}: {error}") from error
