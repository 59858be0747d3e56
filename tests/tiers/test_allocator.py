"""ArenaAllocator: slots never overlap, never exceed capacity, never fragment into failure.

Every scenario checks the live slots against an interval model: page-aligned, inside the
arena, pairwise disjoint, and ``used_bytes`` equal to their page-rounded sum.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.tiers.allocator import ArenaAllocator, Slot

PAGE = 4096
MIB = 1024 * 1024


def assert_consistent(alloc: ArenaAllocator, live: list[Slot]) -> None:
    spans = sorted((s.offset, s.offset + alloc.slot_bytes(s.length)) for s in live)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, f"overlap: {spans}"
    assert all(start % alloc.page_bytes == 0 for start, _ in spans)
    assert all(start >= 0 and end <= alloc.capacity_bytes for start, end in spans)
    assert alloc.used_bytes == sum(end - start for start, end in spans)
    assert alloc.used_bytes <= alloc.capacity_bytes
    assert alloc.num_live == len(live)


def fill(alloc: ArenaAllocator, length: int) -> list[Slot]:
    slots = []
    while (slot := alloc.allocate(length)) is not None:
        slots.append(slot)
    return slots


@pytest.mark.parametrize(
    ("capacity", "length"),
    [
        (64 * PAGE, 1),
        (64 * PAGE, 3 * PAGE),
        (100 * PAGE + 17, 7 * PAGE - 1),
        (10 * PAGE, 10 * PAGE),
    ],
)
def test_same_size_fills_exactly_floor_capacity_over_size(capacity: int, length: int) -> None:
    alloc = ArenaAllocator(capacity)
    slots = fill(alloc, length)
    assert len(slots) == capacity // alloc.slot_bytes(length)
    assert_consistent(alloc, slots)


@settings(max_examples=200, deadline=None)
@given(
    num_pages=st.integers(1, 200),
    data=st.data(),
    slab_pages=st.one_of(st.none(), st.integers(1, 64)),
)
def test_same_size_never_fails_below_the_maximum(
    num_pages: int, data: st.DataObject, slab_pages: int | None
) -> None:
    # A history of one size: fill, then any order of frees and allocations.
    slot_pages = data.draw(st.integers(1, num_pages), label="slot_pages")
    length = data.draw(st.integers((slot_pages - 1) * PAGE + 1, slot_pages * PAGE))
    slab_bytes = None if slab_pages is None else slab_pages * PAGE
    alloc = ArenaAllocator(
        num_pages * PAGE + data.draw(st.integers(0, PAGE - 1)), slab_bytes=slab_bytes
    )
    most = num_pages // slot_pages
    live = fill(alloc, length)
    assert len(live) == most
    for free_some in data.draw(st.lists(st.booleans(), max_size=60), label="ops"):
        if free_some and live:
            alloc.free(live.pop(data.draw(st.integers(0, len(live) - 1))))
        else:
            slot = alloc.allocate(length)
            assert (slot is None) == (len(live) == most)
            if slot is not None:
                live.append(slot)
        assert_consistent(alloc, live)
    assert len(fill(alloc, length)) == most - len(live)


def test_one_size_fills_again_after_another_size_empties() -> None:
    # The 1-page class sits at the start; 3-page slots stay aligned to 3 pages around it.
    alloc = ArenaAllocator(10 * PAGE, slab_bytes=2 * PAGE)
    small = [alloc.allocate(PAGE), alloc.allocate(PAGE)]
    big = fill(alloc, 3 * PAGE)
    assert len(big) == 2
    for slot in small:
        assert slot is not None
        alloc.free(slot)
    big += fill(alloc, 3 * PAGE)
    assert len(big) == 10 // 3
    assert_consistent(alloc, big)


def test_mixed_sizes_reuse_space_freed_by_another_size() -> None:
    alloc = ArenaAllocator(128 * MIB)
    small = fill(alloc, 2 * MIB)
    assert len(small) == 64
    assert alloc.allocate(32 * MIB) is None
    for slot in small[:16]:  # four whole 8 MiB slabs (1/16 of the arena): 32 MiB in a row
        alloc.free(slot)
    big = alloc.allocate(32 * MIB)
    assert big is not None
    for slot in small[16:]:
        alloc.free(slot)
    big_all = [big, *fill(alloc, 32 * MIB)]
    assert len(big_all) == 4
    assert_consistent(alloc, big_all)
    for slot in big_all:
        alloc.free(slot)
    assert len(fill(alloc, 2 * MIB)) == 64


def test_freeing_everything_coalesces_the_whole_arena() -> None:
    rng = random.Random(3)
    alloc = ArenaAllocator(256 * PAGE)
    live: list[Slot] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        elif (slot := alloc.allocate(rng.choice([1, PAGE + 1, 5 * PAGE, 40 * PAGE]))) is not None:
            live.append(slot)
    assert_consistent(alloc, live)
    for slot in live:
        alloc.free(slot)
    assert alloc.used_bytes == 0
    assert alloc.allocate(256 * PAGE) == Slot(0, 256 * PAGE)


class MixedSizes(RuleBasedStateMachine):
    """Random allocations and frees of mixed sizes against the interval model."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = ArenaAllocator(300 * PAGE + 123, slab_bytes=24 * PAGE)
        self.live: list[Slot] = []

    @rule(length=st.sampled_from([0, 1, PAGE, 3 * PAGE - 5, 9 * PAGE, 31 * PAGE, 300 * PAGE]))
    def allocate(self, length: int) -> None:
        slot = self.alloc.allocate(length)
        if slot is not None:
            assert slot.length == length
            self.live.append(slot)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.live) - 1))
        self.alloc.free(self.live.pop(index))

    @invariant()
    def consistent(self) -> None:
        assert_consistent(self.alloc, self.live)


TestMixedSizes = MixedSizes.TestCase
TestMixedSizes.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)


def test_zero_length_takes_one_page() -> None:
    alloc = ArenaAllocator(2 * PAGE)
    assert alloc.allocate(0) == Slot(0, 0)
    assert alloc.used_bytes == PAGE


def test_too_large_is_refused_as_a_value() -> None:
    alloc = ArenaAllocator(3 * PAGE + 100)
    assert alloc.allocate(3 * PAGE + 1) is None
    assert alloc.allocate(3 * PAGE) is not None


def test_double_free_and_foreign_slots_raise() -> None:
    alloc = ArenaAllocator(8 * PAGE)
    slot = alloc.allocate(PAGE)
    assert slot is not None
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(Slot(slot.offset, 2 * PAGE))
    alloc.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(Slot(7, 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes must be at least page_bytes .4096., got 0"),
        ({"capacity_bytes": PAGE - 1}, "got 4095"),
        ({"capacity_bytes": 8 * PAGE, "page_bytes": 1000}, "page_bytes .* got 1000"),
        ({"capacity_bytes": 8 * PAGE, "page_bytes": 0}, "page_bytes .* got 0"),
        ({"capacity_bytes": 8 * PAGE, "slab_bytes": -1}, "slab_bytes must be positive, got -1"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArenaAllocator(**kwargs)


def test_negative_length_raises() -> None:
    with pytest.raises(ValueError, match="got -1"):
        ArenaAllocator(8 * PAGE).allocate(-1)
