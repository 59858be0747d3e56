"""The scheduler side's plans, driven the way vLLM's scheduler drives them.

Requests are plain objects with the three fields the planner reads; the daemon is replaced
by a lookup function (the real daemon and vLLM are in tests/integration/test_vllm.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvstore.client import ROOT_KEY, ModelFingerprint, Namespace, block_keys
from kvstore.inference_adapter.vllm.scheduler import SchedulerSide

VLLM_BLOCK = 32


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    output: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output


def namespace(block_tokens: int) -> Namespace:
    model = ModelFingerprint("tiny", 4, 2, 64, "float32", block_tokens=block_tokens)
    return Namespace(model, "tenant-a")


def planner(held: int, block_tokens: int = 32, **options: bool) -> tuple[SchedulerSide, list]:
    asked: list[Sequence[bytes]] = []

    def lookup(keys: Sequence[bytes]) -> int:
        asked.append(keys)
        return min(held, len(keys))

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


def test_a_lookup_failure_is_a_miss() -> None:
    def down(keys: Sequence[bytes]) -> int:
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
        SchedulerSide(namespace(48), VLLM_BLOCK, lambda keys: 0)


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
