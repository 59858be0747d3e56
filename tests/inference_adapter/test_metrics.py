"""The engine's Prometheus metrics, scraped over HTTP from a real endpoint."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.inference_adapter import (
    Engine,
    LlamaModel,
    Request,
    SamplingParams,
    StoreConnector,
    namespace_for,
)
from kvstore.inference_adapter.core.timeline import PHASES
from kvstore.inference_adapter.metrics import serve_engine_metrics
from tests.inference_adapter.test_engine import PAGE_TOKENS, model, random_prompt
from tests.support.daemon import running_daemon, scrape

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


def test_every_store_hit_is_timed_phase_by_phase(model: LlamaModel, tmp_path: Path) -> None:
    """A miss, then two hits of it: the histograms count the two hits, each phase once, the
    phases of a hit add up to no more than its arrival to first token, and nothing of the
    miss."""
    engine = Engine(model, num_pages=48, page_tokens=PAGE_TOKENS)
    namespace = namespace_for(model.config, model_name="m", block_tokens=PAGE_TOKENS)
    prompt = random_prompt(5 * PAGE_TOKENS + 1, 7)
    with (
        running_daemon(tmp_path) as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=5.0) as client,
    ):
        engine.connector = connector = StoreConnector(
            client, namespace, kv_pool=engine.kv_pool, page_tokens=PAGE_TOKENS,
            rope_tables=engine.rope_tables,
        )  # fmt: skip
        stop, port = serve_engine_metrics(engine, "127.0.0.1:0")
        try:
            engine.generate([Request("miss", prompt, SamplingParams(max_tokens=1))])
            assert connector.wait_for_saves(10.0)
            hits = [Request(f"hit{i}", prompt, SamplingParams(max_tokens=1)) for i in range(2)]
            for hit in hits:
                engine.generate([hit])
                assert hit.num_loaded_tokens == 5 * PAGE_TOKENS
            got = scrape(port)
        finally:
            stop()
            connector.close()
    name = "kvstore_engine_hit_phase_seconds"
    counts = {phase: got[f'{name}_count{{phase="{phase}"}}'] for phase in PHASES}
    assert counts == {**dict.fromkeys(PHASES, 2.0), "lease": 2.0}, counts
    sums = {phase: got[f'{name}_sum{{phase="{phase}"}}'] for phase in PHASES}
    parts = sum(seconds for phase, seconds in sums.items() if phase != "total")
    assert 0 < parts <= sums["total"] + 1e-6  # lease is 0: it came with the lookup
    assert sums["lease"] == 0.0 and sums["lookup"] > 0
    for hit in hits:
        assert hit.timeline is not None and hit.timeline.loaded


def test_an_address_in_use_is_named(model: LlamaModel) -> None:
    engine = Engine(model, num_pages=4, page_tokens=PAGE_TOKENS)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError, match=f"metrics.listen {listen}"):
            serve_engine_metrics(engine, listen)
