"""The transformers bridge: a stock ``LlamaForCausalLM.generate`` restoring from kvstore."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient, UnavailableError, WriteStatus
from kvstore.inference_adapter.hf_bridge import KVStoreCache, generate_with_store, hf_namespace
from kvstore.inference_adapter.interfaces import Request, SamplingParams
from kvstore.inference_adapter.weights import namespace_for
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_restored_cache_holds_the_bits_the_model_computed(
    models: TinyModels, client: KVStoreClient, dtype: torch.dtype
) -> None:
    model = copy.deepcopy(models.hf).to(dtype)
    namespace = hf_namespace(model, model_name="tiny", block_tokens=PAGE, tenant=f"bits-{dtype}")
    assert namespace.model.dtype == str(dtype).removeprefix("torch.")
    prompt = torch.tensor([MESSAGES[0] + MESSAGES[1]])  # 58 tokens: 3 blocks
    generate_with_store(model, prompt, client, namespace, max_new_tokens=1, do_sample=False)
    cache = KVStoreCache(client, namespace, model)
    assert cache.restore(prompt) == 48
    with torch.no_grad():
        own = model(prompt, use_cache=True).past_key_values
    for restored, computed in zip(cache.layers, own.layers, strict=True):
        assert torch.equal(restored.keys, computed.keys[:, :, :48])
        assert torch.equal(restored.values, computed.values[:, :, :48])


def test_a_repeated_prompt_puts_nothing_it_saved_before(
    models: TinyModels, client: KVStoreClient
) -> None:
    """The second call generates the same reply: its output block is held already."""
    namespace = bridge_namespace(models, "bridge-again")
    statuses: list[WriteStatus] = []
    put = client.put

    def spy(*args: Any, **kwargs: Any) -> list[WriteStatus]:
        statuses.extend(result := put(*args, **kwargs))
        return result

    client.put = spy  # type: ignore[method-assign]
    prompt = torch.tensor([MESSAGES[0]])  # 37 tokens: the reply's KV fills block 2
    options: dict[str, Any] = {"max_new_tokens": 12, "do_sample": False}
    first, cache = generate_with_store(models.hf, prompt, client, namespace, **options)
    assert cache.saved_blocks == 3 and statuses == [WriteStatus.STORED] * 3
    again, cache = generate_with_store(models.hf, prompt, client, namespace, **options)
    assert torch.equal(again, first)
    assert cache.restored_tokens == 32 and cache.saved_blocks == 0
    assert statuses == [WriteStatus.STORED] * 3  # nothing was sent twice


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
