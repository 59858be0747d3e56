"""The loader's failure reports: a load the engine gave up on ends quietly."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest

from kvstore.client import Namespace
from kvstore.inference_adapter import Engine, LlamaModel
from kvstore.inference_adapter.loader import LayerLoad, PoolHandles
from kvstore.inference_adapter.weights import namespace_for
from tests.inference_adapter.test_engine import PAGE_TOKENS, model

__all__ = ["model"]  # the fixture


class Evicted:
    """A client whose blocks are gone by the time the load fetches them."""

    def host_blocks(self, namespace: Namespace, keys: Sequence[bytes]) -> Any:
        raise LookupError(f"{len(keys)} blocks evicted")


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_failed_load_warns_unless_the_engine_cancelled_it(
    model: LlamaModel, cancelled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(model, num_pages=4, page_tokens=PAGE_TOKENS)
    pool = PoolHandles(engine.kv_pool, PAGE_TOKENS, engine.rope_tables)
    space = namespace_for(model.config, model_name="m", block_tokens=PAGE_TOKENS)
    load = LayerLoad(Evicted(), space, pool, [b"k" * 32] * 3, None, hold_s=1.0)  # type: ignore[arg-type]
    if cancelled:
        load.cancel()
    with caplog.at_level(logging.DEBUG, logger="kvstore.inference_adapter.loader"):
        load.run()
    assert load.failed
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if cancelled:
        assert not warnings and "a cancelled load of 3 blocks ended" in caplog.text
    else:
        assert [r.getMessage() for r in warnings] == [
            "loading 3 blocks failed; the engine recomputes"
        ]
