"""A Hugging Face transformers bridge: a ``DynamicCache`` that restores from and saves to kvstore.

A stock ``LlamaForCausalLM`` keeps K after RoPE in its cache, ``[batch, kv_heads, seq,
head_dim]`` per layer; the store keeps the same values block by block (block ``b`` of a
chain holds positions ``b * block_tokens ..``, where a prefix hit puts it back, so a
restored cache holds the bits transformers computed). :class:`KVStoreCache` moves them:

1. ``restore(input_ids)``: looks the prompt's block keys up, fetches the held leading blocks
   (at most ``len(prompt) - 1`` tokens, so the model computes at least one) and fills the
   cache with them;
2. ``model.generate(input_ids, past_key_values=cache)``: transformers skips the cached
   prefix and prefills only the rest;
3. ``save(sequences)``: after generation, the full blocks the store lacks are ``put``
   (parent = the previous block's key).

``generate_with_store(model, input_ids, client, namespace)`` does the three steps. Batch size
1 only. A daemon that cannot be reached means nothing restored and nothing saved, never an
exception. ``hf_namespace(model, model_name=...)`` builds the namespace from the model's
config, the same fingerprint the engine uses for the same weights, so both share blocks.
"""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation import utils as generation_utils

from kvstore.client import ROOT_KEY, KVStoreClient, Namespace, block_keys
from kvstore.inference_adapter.weights import LlamaConfig, namespace_for

__all__ = ["KVStoreCache", "generate_with_store", "hf_namespace"]

log = logging.getLogger(__name__)


def hf_namespace(
    model: PreTrainedModel, *, model_name: str, tenant: str = "", block_tokens: int = 256
) -> Namespace:
    """The namespace of a Llama-family transformers model's KV (its config and dtype); the
    engine's ``namespace_for`` gives the same one for the same weights."""
    config = LlamaConfig.from_dict(model.config.to_dict())
    return namespace_for(
        config, model_name=model_name, block_tokens=block_tokens, dtype=model.dtype, tenant=tenant
    )


class KVStoreCache(DynamicCache):
    """A ``DynamicCache`` whose prompt prefix comes from kvstore; see the module docstring.

    Args:
        client: A connected blocking client.
        namespace: The model and tenant (``hf_namespace``).
        model: The transformers model the cache serves.
    """

    def __init__(self, client: KVStoreClient, namespace: Namespace, model: PreTrainedModel) -> None:
        super().__init__()
        self.client = client
        self.namespace = namespace
        self._device = model.device
        self._held: set[bytes] = set()
        self.restored_tokens = 0
        self.saved_blocks = 0

    def restore(self, input_ids: torch.Tensor) -> int:
        """Fills the empty cache with the prompt's stored prefix.

        Args:
            input_ids: ``[1, seq]`` token ids.

        Returns:
            How many leading tokens were restored (a multiple of ``block_tokens``).

        Raises:
            ValueError: A batch size other than 1, or the cache is not empty.
        """
        tokens = _single_row(input_ids)
        if self.get_seq_length() != 0:
            raise ValueError("restore needs an empty cache")
        keys = block_keys(tokens, self.namespace)
        bt = self.namespace.model.block_tokens
        try:
            held = self.client.lookup(self.namespace, keys)
            self._held = set(keys[:held])
            usable = min(held, (len(tokens) - 1) // bt)
            payloads = self.client.get(self.namespace, keys[:usable]) if usable else []
        except Exception:
            log.warning("restoring from the store failed; computing the prompt", exc_info=True)
            return 0
        if not payloads:
            return 0
        staging = self._as_blocks(payloads)  # [n, num_layers, 2, bt, kv_heads, head_dim]
        for layer in range(staging.size(1)):
            k, v = (_as_sequence(staging[:, layer, i]) for i in (0, 1))  # [kv_heads, seq, head_dim]
            self.update(k[None].contiguous(), v[None].contiguous(), layer)
        self.restored_tokens = len(payloads) * bt
        return self.restored_tokens

    def save(self, sequence: torch.Tensor) -> int:
        """Puts the full blocks of ``sequence`` whose KV the cache holds and the store lacks
        (one lookup finds which, unless every block was found at restore).

        Args:
            sequence: ``[1, seq]`` or ``[seq]``: prompt + generated tokens.

        Returns:
            Blocks put (0 when the daemon cannot be reached).
        """
        tokens = _single_row(sequence)[: self.get_seq_length()]
        keys = block_keys(tokens, self.namespace)
        if all(key in self._held for key in keys):
            return 0
        try:
            # Blocks past the prompt may be held too: an earlier call that generated the same
            # tokens saved them (only the prompt's keys were looked up at restore).
            first = self.client.lookup(self.namespace, keys)
            if first == len(keys):
                self._held.update(keys)
                return 0
            new = keys[first:]  # held blocks are a prefix: the rest is one run of the chain
            blocks = self._gather(first, len(keys))
            parent = keys[first - 1] if first else ROOT_KEY
            self.client.put(self.namespace, new, list(blocks), parent=parent)
        except Exception:
            log.warning("saving up to %d blocks to the store failed", len(keys), exc_info=True)
            return 0
        self._held.update(new)
        self.saved_blocks += len(new)
        return len(new)

    def _gather(self, first: int, end_block: int) -> torch.Tensor:
        """Blocks ``first .. end_block - 1`` of the cache in the store's layout."""
        bt = self.namespace.model.block_tokens
        start, end = first * bt, end_block * bt
        layers = []
        for layer in self.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
                raise ValueError(f"cache layer {type(layer).__name__} holds no K/V tensors")
            k = keys[0, :, start:end]  # [kv_heads, seq, head_dim], after RoPE
            v = values[0, :, start:end]
            layers.append(torch.stack((_as_blocks_of(k, bt), _as_blocks_of(v, bt)), dim=1))
        # [n, num_layers, 2, bt, kv_heads, head_dim]
        return torch.stack(layers, dim=1).contiguous()

    def _as_blocks(self, payloads: list[bytes]) -> torch.Tensor:
        model = self.namespace.model
        dtype = getattr(torch, model.dtype)
        flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=dtype)
        return flat.view(len(payloads), *model.layout().shape).to(self._device)


def generate_with_store(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    client: KVStoreClient,
    namespace: Namespace,
    **generate_kwargs: object,
) -> tuple[torch.Tensor, KVStoreCache]:
    """``model.generate`` with the prompt's prefix restored from and new blocks saved to kvstore.

    Returns:
        The generated sequences (as ``model.generate`` returns them) and the cache, whose
        ``restored_tokens`` and ``saved_blocks`` say what the store did.
    """
    cache = KVStoreCache(client, namespace, model)
    cache.restore(input_ids)
    # transformers 5 renamed generate's ``past_key_values`` to ``cache``; older versions lack it.
    name = (
        "cache"
        if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ())
        else "past_key_values"
    )
    generate_kwargs[name] = cache
    sequences = model.generate(input_ids, **generate_kwargs)  # type: ignore[operator]
    cache.save(sequences)
    return sequences, cache


def _single_row(ids: torch.Tensor) -> torch.Tensor:
    if ids.dim() == 2:
        if ids.size(0) != 1:
            raise ValueError(f"the store bridge takes batch size 1, got {ids.size(0)}")
        ids = ids[0]
    return ids.detach().cpu()


def _as_sequence(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, bt, kv_heads, head_dim]`` -> ``[kv_heads, n * bt, head_dim]``."""
    return blocks.flatten(0, 1).transpose(0, 1)


def _as_blocks_of(seq: torch.Tensor, bt: int) -> torch.Tensor:
    """``[kv_heads, n * bt, head_dim]`` -> ``[n, bt, kv_heads, head_dim]``."""
    heads, length, dim = seq.shape
    return seq.transpose(0, 1).reshape(length // bt, bt, heads, dim)
