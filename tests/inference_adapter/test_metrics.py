"""The engine's Prometheus metrics, scraped over HTTP from a real endpoint."""

from __future__ import annotations

import socket

import pytest

from kvstore.inference_adapter import Engine, LlamaModel, Request, SamplingParams
from kvstore.inference_adapter.metrics import serve_engine_metrics
from tests.inference_adapter.test_engine import PAGE_TOKENS, model, random_prompt
from tests.support.daemon import scrape

__all__ = ["model"]  # the fixture


def test_a_scrape_shows_the_pools_hits_evictions_residency_and_tokens_by_level(
    model: LlamaModel,
) -> None:
    """A chat of 4 turns whose history stays resident, then sessions enough to evict: the
    endpoint says what the engine counted, and the levels add up to the prompt tokens."""
    engine = Engine(model, num_pages=24, page_tokens=PAGE_TOKENS, retain_pages=8)
    sampling = SamplingParams(max_tokens=6)
    stop, port = serve_engine_metrics(engine, "127.0.0.1:0")
    try:
        history: list[int] = []
        prompts = 0
        for turn in range(4):
            request = Request(f"t{turn}", history + random_prompt(9, turn), sampling)
            engine.generate([request])
            prompts += len(request.prompt)
            history = request.prompt + request.output
        for other in range(3):  # 3 x 5 idle pages more than 8 are kept: evictions
            engine.generate([Request(f"o{other}", random_prompt(40, 50 + other), sampling)])
            prompts += 40
        got = scrape(port)
    finally:
        stop()
    tokens = {level: got[f'kvstore_engine_prompt_tokens_total{{level="{level}"}}']
              for level in ("hbm", "host", "ssd", "redis", "computed")}  # fmt: skip
    assert tokens["hbm"] == engine.prompt_tokens["hbm"] > 0  # turns 2-4 mapped their history
    assert tokens["host"] == tokens["ssd"] == tokens["redis"] == 0  # no store here
    assert sum(tokens.values()) == prompts
    pool = engine.allocator
    assert got["kvstore_engine_hbm_hit_pages_total"] == pool.shared_pages > 0
    assert got["kvstore_engine_hbm_evicted_pages_total"] == pool.evicted_pages > 0
    assert got["kvstore_engine_hbm_resident_pages"] == pool.num_resident_pages == 8
    assert got["kvstore_engine_hbm_retain_pages"] == 8
    assert got["kvstore_engine_pool_pages"] == 24


def test_an_address_in_use_is_named(model: LlamaModel) -> None:
    engine = Engine(model, num_pages=4, page_tokens=PAGE_TOKENS)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError, match=f"metrics.listen {listen}"):
            serve_engine_metrics(engine, listen)
