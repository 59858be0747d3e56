"""The transformers bridge: a stock ``LlamaForCausalLM.generate`` restoring from kvstore."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient, UnavailableError
from kvstore.inference_adapter.connector import namespace_for
from kvstore.inference_adapter.hf_bridge import KVStoreCache, generate_with_store, hf_namespace
from kvstore.inference_adapter.interfaces import Request, SamplingParams
from tests.inference_adapter.test_connector import (
    MESSAGES,
    PAGE,
    TinyModels,
    client,
    daemon,
    hf_generate,
    models,
    store_engine,
)

__all__ = ["client", "daemon", "models"]  # fixtures shared with test_connector

MAX_TOKENS = 6


def bridge_namespace(models: TinyModels, tenant: str) -> Any:
    return hf_namespace(models.hf, model_name="tiny", block_tokens=PAGE, tenant=tenant)


def test_generate_with_store_answers_like_plain_generate_over_turns(
    models: TinyModels, client: KVStoreClient
) -> None:
    namespace = bridge_namespace(models, "bridge-turns")
    ids = torch.tensor([MESSAGES[0]])
    for index, message in enumerate([*MESSAGES[1:], []]):
        expected = models.hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        out, cache = generate_with_store(
            models.hf, ids, client, namespace, max_new_tokens=MAX_TOKENS, do_sample=False
        )
        assert torch.equal(out, expected)
        # What the previous turn saved (all but the last token's KV) comes back, in blocks.
        stored_before = (ids.size(1) - len(MESSAGES[index]) - 1) // PAGE * PAGE if index else 0
        assert cache.restored_tokens == min(stored_before, (ids.size(1) - 1) // PAGE * PAGE)
        assert cache.saved_blocks == (out.size(1) - 1) // PAGE - cache.restored_tokens // PAGE
        ids = torch.cat([out, torch.tensor([message], dtype=out.dtype)], dim=1)


def test_restored_keys_are_rotated_like_the_model_rotates_them(
    models: TinyModels, client: KVStoreClient
) -> None:
    namespace = bridge_namespace(models, "bridge-rope")
    prompt = torch.tensor([MESSAGES[0] + MESSAGES[1]])  # 58 tokens: 3 blocks
    generate_with_store(models.hf, prompt, client, namespace, max_new_tokens=1, do_sample=False)
    cache = KVStoreCache(client, namespace, models.hf)
    assert cache.restore(prompt) == 48
    with torch.no_grad():
        own = models.hf(prompt, use_cache=True).past_key_values
    for restored, computed in zip(cache.layers, own.layers, strict=True):
        torch.testing.assert_close(restored.keys, computed.keys[:, :, :48], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(restored.values, computed.values[:, :, :48])


def test_blocks_the_engine_saved_serve_the_bridge(
    models: TinyModels, client: KVStoreClient
) -> None:
    engine, connector = store_engine(models.engine, client, "shared")
    namespace = bridge_namespace(models, "shared")
    assert (
        namespace
        == connector.namespace
        == namespace_for(
            models.engine.config, model_name="tiny", block_tokens=PAGE, tenant="shared"
        )
    )
    prompt = MESSAGES[0] + MESSAGES[2]  # 67 tokens
    engine.generate([Request("engine", prompt, SamplingParams(max_tokens=MAX_TOKENS))])
    assert connector.wait_for_saves(10.0)
    ids = torch.tensor([prompt + MESSAGES[3]])
    out, cache = generate_with_store(
        models.hf, ids, client, namespace, max_new_tokens=MAX_TOKENS, do_sample=False
    )
    assert cache.restored_tokens == 64
    assert out[0, ids.size(1) :].tolist() == hf_generate(models, ids[0].tolist(), MAX_TOKENS)
    connector.close()


def test_an_unreachable_daemon_means_plain_generation(
    models: TinyModels, client: KVStoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable(*args: object, **kwargs: object) -> Any:
        raise UnavailableError("daemon down")

    monkeypatch.setattr(client, "lookup", unavailable)
    monkeypatch.setattr(client, "put", unavailable)
    ids = torch.tensor([MESSAGES[0] + MESSAGES[1]])
    out, cache = generate_with_store(
        models.hf, ids, client, bridge_namespace(models, "down"), max_new_tokens=4, do_sample=False
    )
    assert cache.restored_tokens == 0 and cache.saved_blocks == 0
    assert out[0, ids.size(1) :].tolist() == hf_generate(models, ids[0].tolist(), 4)


def test_the_bridge_takes_one_sequence(models: TinyModels, client: KVStoreClient) -> None:
    cache = KVStoreCache(client, bridge_namespace(models, "batch"), models.hf)
    with pytest.raises(ValueError, match="batch size 1"):
        cache.restore(torch.zeros(2, 20, dtype=torch.long))
