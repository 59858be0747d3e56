"""kvstore.tiers.collector: records and containers hidden from the cyclic collector, and the
start-up freeze."""

from __future__ import annotations

import gc
import sys
from collections import OrderedDict

import pytest

from kvstore.tiers import collector
from kvstore.tiers.allocator import ArenaAllocator
from kvstore.tiers.host import HostTier
from tests.support.young import biggest_young_dict

cpython = pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's collector")


class Record:
    __slots__ = ("count", "key")

    def __init__(self, key: bytes) -> None:
        self.key, self.count = key, 0


@cpython
def test_untracked_records_and_containers_leave_the_walk_but_are_still_freed() -> None:
    before = collector.tracked_entries()
    records = {i.to_bytes(8, "big"): Record(i.to_bytes(8, "big")) for i in range(2000)}
    order: OrderedDict[bytes, None] = OrderedDict((key, None) for key in records)
    assert gc.is_tracked(records) and gc.is_tracked(order)
    assert collector.tracked_entries() - before > 5000  # 2000 records, 4000 entries
    for record in records.values():
        collector.untrack(record)
    collector.untrack(records)
    collector.untrack(order)
    assert not gc.is_tracked(records) and not gc.is_tracked(order)
    assert collector.tracked_entries() - before < 100  # the test's own frames and names
    one = records[b"\0" * 8]
    assert sys.getrefcount(one) == 3  # the dict, this name, the call: reference counts work
    records[b"new"] = Record(b"new")  # a record put in tracks its dict again...
    assert gc.is_tracked(records)
    collector.untrack(records)  # ...so the owner untracks it after each insertion
    del records, order
    assert sys.getrefcount(one) == 2  # freed with the dict (only this name holds it now)
    collector.untrack(5)  # atoms and untracked objects are left as they are


@cpython
def test_allocator_slots_are_untracked() -> None:
    allocator = ArenaAllocator(1 << 20, page_bytes=4096)
    slots = [allocator.allocate(100) for _ in range(200)]
    assert all(slot is not None and not gc.is_tracked(slot) for slot in slots)
    assert not gc.is_tracked(allocator._live)


@cpython
async def test_no_collection_finds_a_per_block_map_of_the_host_tier_tracked() -> None:
    """A young collection can run at any allocation; none, here one per allocation, finds
    the host tier's or the allocator's map of 2,000 slots in its generation (it would walk
    them all: 10-20 ms at 200K blocks)."""
    async with HostTier(4096 * 2100) as host:
        with biggest_young_dict() as watch:
            for i in range(2000):
                key = i.to_bytes(8, "big")
                if i % 2:
                    assert await host.put(key, b"x" * 100)
                else:
                    assert host.reserve(key, 100) is not None
                    host.commit(key)
    assert watch.largest < 100


def test_insert_leaves_the_dict_untracked() -> None:
    records: dict[int, Record] = {}
    for i in range(100):
        collector.insert(records, i, Record(b"r"))
        assert not gc.is_tracked(records) or sys.implementation.name != "cpython"
    assert len(records) == 100 and records[5].key == b"r"


def test_freeze_moves_the_live_objects_out_of_full_collections() -> None:
    try:
        frozen = collector.freeze()
        assert frozen == gc.get_freeze_count() > 1000  # the modules at least
        assert len(gc.get_objects()) < 1000  # what the test made since
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
