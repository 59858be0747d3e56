"""Chat sessions: truncation with position-shifted KV reuse, and look-ahead prefetch hints.

The scenarios run a real daemon and a tiny random model; ``plan_turn`` is also checked on
its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient, ModelFingerprint, Namespace, block_keys
from kvstore.inference_adapter.connector import StoreConnector
from kvstore.inference_adapter.interfaces import Request, ReusedBlock, SamplingParams
from kvstore.inference_adapter.loader import move_k
from kvstore.inference_adapter.sessions import ByteTokenizer, ChatServer, TurnPlan, plan_turn
from tests.inference_adapter.test_connector import (
    PAGE,
    TinyModels,
    client,
    daemon,
    models,
    store_engine,
    stored_blocks,
)
from tests.support.daemon import running_daemon
from tests.support.waiting import wait_for

__all__ = ["client", "daemon", "models"]  # fixtures shared with test_connector

NAMESPACE = Namespace(ModelFingerprint("m", 2, 2, 16, "float32", block_tokens=4))


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 192, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


# plan_turn ------------------------------------------------------------------------------


def small_plan(context: list[int], message: list[int], **options: Any) -> TurnPlan:
    """``plan_turn`` with 4-token blocks, one sink block and 4 tokens to generate."""
    settings: dict[str, Any] = {"max_tokens": 4, "sink_tokens": 4, "block_tokens": 4}
    return plan_turn(context, message, **{**settings, **options})


def test_a_turn_that_fits_is_the_whole_history() -> None:
    plan = small_plan([1] * 10, [2] * 5, window=20, namespace=NAMESPACE)
    assert plan.prompt == [1] * 10 + [2] * 5 and plan.reuse == () and plan.dropped_tokens == 0


def test_truncation_keeps_sinks_drops_whole_blocks_and_shifts_the_rest() -> None:
    context = list(range(1, 27))  # 26 tokens: blocks 0..5 and a 2-token tail
    message = [99] * 3
    plan = small_plan(context, message, window=24, namespace=NAMESPACE, truncate_fraction=0.0)
    # 29 tokens, 21 fit: drop 8 (two blocks after the sink block).
    assert plan.dropped_tokens == 8
    assert plan.prompt == [*context[:4], *context[12:], *message]
    keys = block_keys(context, NAMESPACE)
    assert plan.reuse == (
        ReusedBlock(keys[0], 0, 0),
        ReusedBlock(keys[3], 4, 12),
        ReusedBlock(keys[4], 8, 16),
        ReusedBlock(keys[5], 12, 20),
    )
    # From the first shifted block on, the new prompt's KV is approximate: salted keys.
    assert plan.salt is not None and plan.salt.from_block == 1
    salted, plain = (
        block_keys(plan.prompt, NAMESPACE, plan.salt),
        block_keys(plan.prompt, NAMESPACE),
    )
    assert salted[0] == plain[0] == keys[0]  # the sink block stays exact and shared
    assert not set(salted[1:]) & set(plain[1:])


def test_a_second_cut_of_a_salted_context_reads_its_salted_chain() -> None:
    context = list(range(1, 27))
    first = small_plan(context, [99] * 3, window=24, namespace=NAMESPACE, truncate_fraction=0.0)
    grown = [*first.prompt, *range(40, 52)]  # the reply and the next message
    options = {"window": 24, "namespace": NAMESPACE, "truncate_fraction": 0.0}
    second = small_plan(grown, [98] * 3, salt=first.salt, origin=b"s", **options)
    salted = block_keys(grown, NAMESPACE, first.salt)
    assert {block.key for block in second.reuse} <= set(salted)  # what the context was saved as
    assert second.salt is not None and second.salt != first.salt
    # Same session and context, same salt; another session, another salt.
    assert small_plan(grown, [98] * 3, salt=first.salt, origin=b"s", **options) == second
    other = small_plan(grown, [98] * 3, salt=first.salt, origin=b"t", **options)
    assert other.salt != second.salt


def test_a_turn_that_fits_keeps_the_sessions_salt() -> None:
    salt = small_plan(list(range(1, 27)), [9] * 3, window=24, namespace=NAMESPACE).salt
    assert small_plan([1] * 10, [2] * 5, window=64, namespace=NAMESPACE, salt=salt).salt == salt


def test_truncation_drops_at_least_the_fraction_asked() -> None:
    plan = small_plan(list(range(1, 27)), [9], window=28, truncate_fraction=0.5)
    # 2 tokens too many would need one block; half of the 20 droppable, in blocks, is two.
    assert plan.dropped_tokens == 8 and plan.reuse == ()


def test_a_message_too_long_for_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        small_plan([1] * 8, [2] * 30, window=24)


def test_byte_tokenizer_round_trips_text() -> None:
    tokenizer = ByteTokenizer(256)
    assert tokenizer.decode(tokenizer.encode("KV cache, déjà vu")) == "KV cache, déjà vu"
    assert max(ByteTokenizer(192).encode("ÿ")) < 192


# Truncation with a real daemon ------------------------------------------------------------


class SnapshotConnector(StoreConnector):
    """Copies the pages a request loaded when it finishes (the engine frees them after)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.loaded_pages: dict[str, list[int]] = {}
        self.snapshots: dict[str, torch.Tensor] = {}

    def start_load(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        super().start_load(request, pages, num_tokens)
        self.loaded_pages[request.request_id] = list(pages[: num_tokens // PAGE])

    def request_finished(self, request: Request) -> None:
        pages = self.loaded_pages.get(request.request_id)
        if pages:
            self.snapshots[request.request_id] = self.pool.kv_pool[:, :, pages].clone()
        super().request_finished(request)


def test_a_session_past_the_window_reuses_kept_kv_at_new_positions(
    models: TinyModels, client: KVStoreClient
) -> None:
    engine, plain = store_engine(models.engine, client, "truncation")
    plain.close()
    connector = SnapshotConnector(
        client,
        plain.namespace,
        kv_pool=engine.kv_pool,
        page_tokens=PAGE,
        rope_tables=engine.rope_tables,
    )
    server = ChatServer(
        engine,
        connector=connector,
        sampling=SamplingParams(max_tokens=6),
        context_window=128,
        sink_tokens=PAGE,
    )
    truncated = []
    for index, size in enumerate((37, 21, 30, 18, 33, 25, 40, 29)):
        turn = server.chat("dana", tokens(size, index))
        assert connector.wait_for_saves(10.0)
        assert len(turn.reply) == 6
        assert len(turn.request.prompt) + 6 - 1 <= 128
        if turn.dropped_tokens:
            truncated.append(turn)
    assert len(truncated) >= 2  # the session kept running past the window, twice

    for turn in truncated:
        request = turn.request
        assert request.num_loaded_tokens > PAGE  # more than the sinks came from the store
        snapshot = connector.snapshots[request.request_id]  # [layers, 2, pages, page, heads, dim]
        for index, block in enumerate(request.reuse[: request.num_loaded_tokens // PAGE]):
            assert block.position == index * PAGE
            stored = stored_blocks(client, connector.namespace, [block.key])[0]
            now = torch.arange(block.position, block.position + PAGE)[:, None]
            then = torch.arange(block.stored_at, block.stored_at + PAGE)[:, None]
            for layer in range(stored.size(0)):
                k = stored[layer, 0]  # [page, heads, dim], rotated to ``then``
                expected = move_k(k, then, now, engine.rope_tables)
                assert torch.equal(snapshot[layer, 0, index], expected)
                if block.stored_at != block.position:
                    assert not torch.equal(expected, k)  # K really was re-rotated
                else:
                    assert torch.equal(expected, k)  # a sink block: its own bits
                assert torch.equal(snapshot[layer, 1, index], stored[layer, 1])
        # The shifted blocks were re-saved under the session's salted chain: the next turn
        # is a prefix hit ...
        session = server.session("dana")
        assert request.salt is not None
    after = session.turns[-1].request
    assert after.num_loaded_tokens > 0
    # ... and an exact request of the same tokens finds only the sink block.
    namespace = connector.namespace
    exact = client.lookup(namespace, block_keys(session.context, namespace))
    assert exact == 1
    assert client.lookup(namespace, block_keys(session.context, namespace, session.salt)) > 1
    connector.close()


# Look-ahead prefetch with a host tier too small for every session -------------------------


@pytest.mark.parametrize("lookahead", [1, 0])
def test_queued_sessions_named_in_hints_are_found_in_the_host_tier(
    tmp_path: Path, models: TinyModels, lookahead: int
) -> None:
    # A block is 8 KiB; the host keeps about 10 of the 16 blocks four sessions store:
    # room for the running session and the next one, not for all. A hint may promote half
    # of it (one session's 4 blocks; the default quarter is 3 blocks of so small a tier).
    # The scheduler-aware policy keeps hinted blocks last: under plain LRU the running turn's
    # saves, landing after the hint's promotion, may push them out again (seen 1 run in 5
    # on a loaded machine: the next session's middle blocks back on the SSD).
    hints = {"eviction": {"hint_share": 0.5, "policy": "scheduler_aware"}}
    with (
        running_daemon(tmp_path, host_capacity="96KiB", settings=hints) as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=5.0) as client,
    ):
        engine, connector = store_engine(models.engine, client, "tiers")
        sampling = SamplingParams(max_tokens=6)
        server = ChatServer(engine, connector=connector, sampling=sampling, lookahead=lookahead)
        names = ["s0", "s1", "s2", "s3"]
        for index, name in enumerate(names):
            server.chat(name, tokens(70, index))
            assert connector.wait_for_saves(10.0)
        for index, name in enumerate(names):
            server.submit(name, tokens(20, 10 + index))
        loaded_from = []  # per turn, blocks by the tier lookup_tiers found them in
        namespace = connector.namespace
        for index, name in enumerate(names):
            if lookahead and index:
                # Hinted while the turn before ran; the daemon promotes in the background:
                # wait until every block it holds of this turn's prompt is in the host tier.
                plan = server.plan(server.session(name), tokens(20, 10 + index))
                keys = block_keys(plan.prompt, namespace, plan.salt)
                wait_for(lambda k=keys: set(client.lookup_tiers(namespace, k).tiers) == {"host"})
            loaded_from.append(server.run_next().request.loaded_from)
            assert connector.wait_for_saves(10.0)
        assert not server.num_queued
        # s0 ran first, unhinted: its blocks had been pushed down to the SSD tier.
        assert loaded_from[0] == {"ssd": 4}
        if lookahead:
            # Each later session was hinted while the one before ran: host hits only.
            assert loaded_from[1:] == [{"host": 4}] * 3
        else:
            # Without hints each was pushed down by the turns before it.
            assert loaded_from[1:] == [{"ssd": 4}] * 3
        assert connector.stats().prefetch_errors == 0
        connector.close()
