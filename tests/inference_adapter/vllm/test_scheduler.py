"""The scheduler side's plans, driven the way vLLM's scheduler drives them.

Requests are plain objects with the three fields the planner reads; the daemon is replaced
by a lookup function, but for the prefetch hint's effect (the real daemon and vLLM are in
tests/integration/test_vllm.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvstore.client import (
    ROOT_KEY,
    KVStoreClient,
    LookupResult,
    ModelFingerprint,
    Namespace,
    SharedLease,
    WriteStatus,
    block_keys,
)
from kvstore.inference_adapter.vllm.scheduler import (
    HANDOFF_PARAM,
    LEVELS_PARAM,
    Match,
    SchedulerSide,
)
from tests.support.daemon import running_daemon
from tests.support.waiting import wait_for

VLLM_BLOCK = 32


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    output: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, object] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output


def namespace(block_tokens: int) -> Namespace:
    model = ModelFingerprint("tiny", 4, 2, 64, "float32", block_tokens=block_tokens)
    return Namespace(model, "tenant-a")


def planner(held: int, block_tokens: int = 32, **options: bool) -> tuple[SchedulerSide, list]:
    asked: list[Sequence[bytes]] = []

    def lookup(keys: Sequence[bytes]) -> Match:
        asked.append(keys)
        return Match(LookupResult.of_tiers(["host"] * min(held, len(keys))))

    return SchedulerSide(namespace(block_tokens), VLLM_BLOCK, lookup, **options), asked


def test_a_hit_leaves_the_last_prompt_token_to_vllm_and_skips_what_vllm_computed() -> None:
    side, asked = planner(held=100)
    request = FakeRequest("r1", list(range(1, 321)))  # exactly 10 blocks
    # Held 10 blocks, but the 10th holds the last prompt token: 9 usable.
    assert side.matched_tokens(request, 0) == 9 * 32
    assert asked[-1] == tuple(block_keys(request.prompt_token_ids[: 9 * 32], side.namespace))
    assert side.matched_tokens(request, 2 * 32) == 7 * 32  # vLLM's own hit is respected
    side.allocated(request, list(range(100, 111)), 7 * 32)
    (load,) = side.plan_step().loads
    assert load.first_block == 2 and len(load.keys) == 7
    assert load.block_ids == tuple(range(102, 109)) and load.skip_before == 2
    assert side.plan_step().loads == ()  # a load is sent once


def test_a_finished_request_says_which_level_each_prompt_token_came_from() -> None:
    """vLLM's own prefix hit is the HBM level; loaded blocks count under the tier that held
    them at lookup, the first one only for its tokens past vLLM's hit; computed tokens are
    in no level."""
    tiers = ["host"] * 3 + ["ssd"] * 2 + ["redis"] * 4

    def lookup(keys: Sequence[bytes]) -> Match:
        return Match(LookupResult.of_tiers(tiers[: len(keys)]))

    side = SchedulerSide(namespace(32), VLLM_BLOCK, lookup)
    request = FakeRequest("r", list(range(1, 8 * 32 + 11)))  # 8 usable blocks of 9 held
    assert side.matched_tokens(request, 48) == 8 * 32 - 48  # vLLM holds 1.5 blocks
    side.allocated(request, list(range(20)), 8 * 32 - 48)
    levels = side.finished("r")
    assert levels == {"hbm": 48, "host": 3 * 32 - 48, "ssd": 2 * 32, "redis": 3 * 32}
    assert sum(levels.values()) == 8 * 32
    # A request vLLM takes nothing from reports only its own hit, or nothing.
    assert side.matched_tokens(FakeRequest("s", list(range(1, 100))), 64) == 3 * 32 - 64
    side.allocated(FakeRequest("s", list(range(1, 100))), list(range(7)), 0)
    assert side.finished("s") == {"hbm": 64}
    assert side.finished("unknown") == {}


def test_a_lookup_failure_is_a_miss() -> None:
    def down(keys: Sequence[bytes]) -> Match:
        raise ConnectionError("daemon down")

    side = SchedulerSide(namespace(32), VLLM_BLOCK, down)
    assert side.matched_tokens(FakeRequest("r", list(range(200))), 0) == 0
    assert side.lookup_errors == 1


def test_vllms_own_hit_is_not_loaded_again_nor_saved_again() -> None:
    side, asked = planner(held=2)
    assert side.matched_tokens(FakeRequest("short", list(range(32))), 0) == 0  # one block only
    assert asked == []  # no full block but the last: nothing to ask
    cached = FakeRequest("cached", list(range(1, 101)))
    assert side.matched_tokens(cached, 96) == 0  # vLLM computed all 3 usable blocks itself
    assert len(asked) == 1  # asked anyway: which of them the daemon holds
    side.scheduled("cached", [0, 1, 2, 3], computed=100, replace=True)
    (save,) = side.plan_step().saves
    assert save.first_block == 2 and len(save.keys) == 1  # the daemon held blocks 0 and 1


def test_saves_follow_the_kv_a_step_computes_in_order_and_once() -> None:
    side, _ = planner(held=0)
    request = FakeRequest("r", list(range(1, 101)))  # 100 tokens: 3 full blocks
    assert side.matched_tokens(request, 0) == 0
    side.allocated(request, [7, 8, 9, 10], 0)
    side.scheduled("r", [7, 8, 9, 10], computed=64, replace=True)  # chunked prefill
    (first,) = side.plan_step().saves
    keys = block_keys(request.prompt_token_ids, side.namespace)
    assert first.keys == tuple(keys[:2]) and first.parent == ROOT_KEY
    assert first.block_ids == (7, 8) and first.first_block == 0
    side.scheduled("r", None, computed=100, replace=False)
    (second,) = side.plan_step().saves
    assert second.keys == (keys[2],) and second.parent == keys[1] and second.block_ids == (9,)
    assert side.plan_step().saves == ()
    # Decode: block 3 fills with output tokens; saved once their KV exists (computed).
    request.output = list(range(500, 529))  # 129 tokens
    side.scheduled("r", [11], computed=128, replace=False)
    (third,) = side.plan_step().saves
    assert third.keys == (block_keys(request.all_token_ids, side.namespace)[3],)
    assert third.block_ids == (10,)
    side.finished("r")
    assert side.plan_step() == type(side.plan_step())()


def test_blocks_found_at_lookup_are_not_saved_again() -> None:
    side, _ = planner(held=5)
    request = FakeRequest("r", list(range(1, 8 * 32 + 2)))
    assert side.matched_tokens(request, 0) == 5 * 32
    side.allocated(request, list(range(9)), 5 * 32)
    side.scheduled("r", list(range(9)), computed=len(request.prompt_token_ids), replace=True)
    plan = side.plan_step()
    (save,) = plan.saves
    assert save.first_block == 5 and len(save.keys) == 3 and save.block_ids == (5, 6, 7)


@pytest.mark.parametrize("per_block", [2, 4])
def test_stored_blocks_span_several_vllm_blocks(per_block: int) -> None:
    block_tokens = VLLM_BLOCK * per_block
    side, _ = planner(held=100, block_tokens=block_tokens)
    request = FakeRequest("r", list(range(1, 3 * block_tokens + 2)))
    vllm_blocks = list(range(50, 50 + 3 * per_block + 1))
    assert side.matched_tokens(request, VLLM_BLOCK) == 3 * block_tokens - VLLM_BLOCK
    side.allocated(request, vllm_blocks, 3 * block_tokens - VLLM_BLOCK)
    (load,) = side.plan_step().loads
    assert load.first_block == 0 and len(load.keys) == 3
    assert load.block_ids == tuple(vllm_blocks[: 3 * per_block])
    assert load.skip_before == 1  # vLLM's own first block is not overwritten


def test_block_tokens_must_be_a_multiple_of_vllms_block_size() -> None:
    with pytest.raises(ValueError, match="block_tokens 48 must be a multiple of vLLM's"):
        SchedulerSide(namespace(48), VLLM_BLOCK, lambda keys: Match(LookupResult(0)))


def test_roles_turn_loads_and_saves_off() -> None:
    consumer, asked = planner(held=100, save=False)
    request = FakeRequest("r", list(range(1, 200)))
    assert consumer.matched_tokens(request, 0) == 6 * 32
    consumer.scheduled("r", list(range(7)), computed=199, replace=True)
    assert consumer.plan_step().saves == ()
    producer, asked = planner(held=2, load=False)
    assert producer.matched_tokens(request, 0) == 0 and len(asked) == 1
    producer.scheduled("r", list(range(7)), computed=199, replace=True)
    assert producer.plan_step().loads == ()
    assert len(producer.plan_step().saves) == 0  # planned once, in the step before
    producer2, _ = planner(held=2, load=False)
    producer2.matched_tokens(request, 0)
    producer2.scheduled("r", list(range(7)), computed=199, replace=True)
    (save,) = producer2.plan_step().saves
    assert save.first_block == 2 and len(save.keys) == 4  # blocks 2..5: 0, 1 are held


def test_a_prefill_names_the_prompt_blocks_it_holds_and_a_decode_counts_what_it_finds() -> None:
    """The producer's params name the prompt's full blocks held or saved (here 2 found + 4
    saved of a 192-token prompt: 6); the decode side, handed them, counts the blocks it
    finds of those it can use (5: one prompt token is always computed)."""
    producer, _ = planner(held=2, load=False, handoff=True)
    prompt = list(range(1, 193))
    request = FakeRequest("r", prompt)
    producer.matched_tokens(request, 0)
    producer.scheduled("r", list(range(7)), computed=192, replace=True)
    producer.plan_step()
    params = producer.params("r")
    assert params == {HANDOFF_PARAM: {"blocks": 6, "block_tokens": 32}}
    assert producer.params("r") is None  # forgotten
    plain, _ = planner(held=2, load=False)  # without the hand-off: no such param
    plain.matched_tokens(FakeRequest("p", prompt), 0)
    assert plain.params("p") is None

    for held, short in ((6, 0), (3, 1)):
        consumer, _ = planner(held=held, save=False)
        handed = FakeRequest("d", prompt, kv_transfer_params=params)
        assert consumer.matched_tokens(handed, 0) == min(held, 5) * 32
        assert consumer.counts == {
            "handoff_requests": 1,
            "handoff_named_blocks": 5,
            "handoff_found_blocks": min(held, 5),
            **({"handoff_short": 1} if short else {}),
        }
        consumer.matched_tokens(handed, 0)  # vLLM asks again (the request waited): one hand-off
        assert consumer.counts["handoff_requests"] == 1
        consumer.allocated(handed, list(range(7)), min(held, 5) * 32)
        assert consumer.params("d") == {LEVELS_PARAM: {"host": min(held, 5) * 32}}


def test_a_hand_off_of_other_blocks_or_a_failed_lookup_is_counted_and_recomputed() -> None:
    prompt = list(range(1, 193))  # 5 usable blocks
    consumer, _ = planner(held=6, save=False)
    other = {HANDOFF_PARAM: {"blocks": 3, "block_tokens": 64}}  # a prefill set up otherwise
    assert consumer.matched_tokens(FakeRequest("d", prompt, kv_transfer_params=other), 0) == 160
    assert consumer.counts == {"handoff_requests": 1, "handoff_mismatched": 1}

    def down(keys: Sequence[bytes]) -> Match:
        raise ConnectionError("daemon restarted")

    gone = SchedulerSide(namespace(32), VLLM_BLOCK, down, save=False)
    params = {HANDOFF_PARAM: {"blocks": 6, "block_tokens": 32}}
    assert gone.matched_tokens(FakeRequest("d", prompt, kv_transfer_params=params), 0) == 0
    assert gone.counts == {"handoff_requests": 1, "handoff_named_blocks": 5,
                           "handoff_found_blocks": 0, "handoff_short": 1}  # fmt: skip


def test_a_preempted_request_gets_its_new_blocks_and_keeps_what_it_saved() -> None:
    side, _ = planner(held=0)
    request = FakeRequest("r", list(range(1, 130)))
    side.matched_tokens(request, 0)
    side.scheduled("r", [1, 2, 3, 4, 5], computed=129, replace=True)
    assert len(side.plan_step().saves[0].keys) == 4
    request.output = list(range(600, 640))
    side.scheduled("r", [20, 21, 22, 23, 24, 25], computed=160, replace=True)  # resumed
    (save,) = side.plan_step().saves
    assert save.first_block == 4 and save.block_ids == (24,)


# Prefetch hints -------------------------------------------------------------------------


def hinting(tiers: list[str], **options: bool) -> tuple[SchedulerSide, list]:
    hints: list[tuple[str, Sequence[bytes]]] = []

    def lookup(keys: Sequence[bytes]) -> Match:
        return Match(LookupResult.of_tiers(tiers[: len(keys)]))

    def prefetch(request_id: str, keys: Sequence[bytes]) -> None:
        hints.append((request_id, keys))

    side = SchedulerSide(namespace(32), VLLM_BLOCK, lookup, prefetch=prefetch, **options)
    return side, hints


def test_blocks_held_below_host_memory_are_hinted_once_per_request() -> None:
    side, hints = hinting(["host", "ssd", "ssd", "redis"])
    request = FakeRequest("r", list(range(1, 200)))  # 6 usable blocks, 4 held
    assert side.matched_tokens(request, 0) == 4 * 32
    assert hints == [("r", tuple(block_keys(request.prompt_token_ids[:128], side.namespace)))]
    side.matched_tokens(request, 0)  # asked again while it waits: no second hint
    assert len(hints) == 1
    side.matched_tokens(FakeRequest("other", list(range(1, 200))), 0)
    assert [request_id for request_id, _ in hints] == ["r", "other"]


def test_no_hint_when_the_usable_blocks_are_in_host_memory_or_nothing_loads() -> None:
    side, hints = hinting(["host", "host", "ssd"])
    side.matched_tokens(FakeRequest("r", list(range(1, 60))), 0)  # 1 usable block, in host
    side.matched_tokens(FakeRequest("s", list(range(1, 40))), 0)  # no usable block
    producer, producer_hints = hinting(["ssd"] * 4, load=False)
    producer.matched_tokens(FakeRequest("p", list(range(1, 200))), 0)
    assert hints == [] and producer_hints == []


def test_a_hint_moves_a_waiting_requests_blocks_up_to_the_host_tier(tmp_path: Path) -> None:
    # A block is 16 KiB (4 layers x K,V x 32 tokens x 2 heads x 8 dims x fp32); the host
    # tier keeps about 16, so the first request's 8 blocks are pushed to SSD by 24 later ones.
    model = ModelFingerprint("tiny", 4, 2, 8, "float32", block_tokens=32)
    names = Namespace(model, "tenant-a")
    settings = {"eviction": {"hint_share": 0.75}}
    with (
        running_daemon(tmp_path, host_capacity="256KiB", settings=settings) as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=5.0) as client,
    ):
        prompts = [list(range(1000 * n, 1000 * n + 8 * 32 + 1)) for n in range(4)]
        for prompt in prompts:
            keys = block_keys(prompt[: 8 * 32], names)
            blocks = [torch.full((model.layout().payload_bytes // 4,), float(i)) for i in range(8)]
            assert client.put(names, keys, blocks) == [WriteStatus.STORED] * 8
        keys = block_keys(prompts[0][: 8 * 32], names)
        assert set(client.lookup_tiers(names, keys).tiers) == {"ssd"}

        def prefetch(request_id: str, keys: Sequence[bytes]) -> None:
            client.prefetch(request_id, names, [keys])

        side = SchedulerSide(
            names, VLLM_BLOCK, lambda k: Match(client.lookup_tiers(names, k)), prefetch=prefetch
        )
        assert side.matched_tokens(FakeRequest("waiting", prompts[0]), 0) == 8 * 32
        wait_for(lambda: set(client.lookup_tiers(names, keys).tiers) == {"host"}, timeout=10.0)


def test_a_lookup_lease_goes_to_the_load_or_ends_once() -> None:
    """The leases a lookup took (one per TP rank) pass to the step's load when vLLM admits
    the request (from the first block it loads on), and end otherwise: asked again (vLLM
    had no room), admitted with nothing to load, or finished before admission. Never
    both, never twice."""
    ended: list[int] = []
    taken = iter(range(1, 1000))

    def lookup(keys: Sequence[bytes]) -> Match:
        offsets = tuple(range(0, 8 * len(keys), 8))
        lease = SharedLease(next(taken), b"arena", offsets, float("inf"))
        return Match(LookupResult.of_tiers(["host"] * len(keys)), (lease, None))

    side = SchedulerSide(
        namespace(32), VLLM_BLOCK, lookup, release=lambda ls: ended.extend(x.lease_id for x in ls)
    )
    asked = FakeRequest("asked", list(range(4 * 32 + 1)))
    assert side.matched_tokens(asked, 0) == 4 * 32
    # No room yet: asked again, vLLM's own prefix cache now holding the first block.
    assert side.matched_tokens(asked, 32) == 3 * 32
    assert ended == [1]
    side.allocated(asked, list(range(10, 15)), 3 * 32)
    assert ended == [1]
    (load,) = side.plan_step().loads
    lease, none = load.leases
    assert none is None and lease is not None and lease.lease_id == 2
    assert (load.first_block, len(load.keys), lease.offsets) == (1, 3, (8, 16, 24))
    side.finished("asked")
    assert ended == [1]  # the load's now

    nothing = FakeRequest("nothing", list(range(100, 100 + 2 * 32 + 1)))
    side.matched_tokens(nothing, 0)
    side.allocated(nothing, [20, 21], 0)  # vLLM's own prefix cache had it all
    assert ended == [1, 3]
    gone = FakeRequest("gone", list(range(200, 200 + 2 * 32 + 1)))
    side.matched_tokens(gone, 0)
    side.finished("gone")
    assert ended == [1, 3, 4]
    assert not side.plan_step().loads
