"""The pool's page bookkeeping: holders, resident pages shared by key, LRU eviction of idle
ones, checked against a plain model of what each page should be under random operations."""

from __future__ import annotations

import random

import pytest

from kvstore.inference_adapter.pages import PageAllocator


def key(n: int) -> bytes:
    return n.to_bytes(4, "big")


def test_without_retention_pages_are_free_again_at_their_last_holder() -> None:
    allocator = PageAllocator(4)
    pages = allocator.allocate(3)
    assert allocator.publish(pages, [key(0), key(1), key(2)]) == 0  # retention off
    allocator.free(pages)
    assert allocator.num_free_pages == 4 and allocator.num_resident_pages == 0
    assert allocator.share([key(0)]) == []
    with pytest.raises(ValueError, match=r"pages \[0\] are not allocated"):
        allocator.free([0])
    with pytest.raises(ValueError, match=r"retain_pages must be in 0\.\.4, got 5"):
        PageAllocator(4, retain_pages=5)


def test_published_pages_stay_resident_until_room_is_needed() -> None:
    allocator = PageAllocator(4, retain_pages=4)
    first = allocator.allocate(3)
    assert allocator.publish(first[:2], [key(0), key(1)]) == 2
    shared = allocator.share([key(0), key(1), key(2)])  # a second holder, while held
    assert shared == first[:2] and allocator.holders(first[0]) == 2
    allocator.free(first)
    allocator.free(shared)
    # two idle resident pages, two free ones: all four can be taken
    assert allocator.num_free_pages == 4 and allocator.num_resident_pages == 2
    assert allocator.share([key(0)]) == [first[0]]  # still there, mapped again
    allocator.free([first[0]])
    taken = allocator.allocate(3)  # needs one idle page: the least recently used, key(1)'s
    assert first[1] in taken and first[0] not in taken
    assert allocator.share([key(1)]) == [] and allocator.evicted_pages == 1
    assert allocator.share([key(0)]) == [first[0]]
    with pytest.raises(ValueError, match="page 99 is not held"):
        allocator.publish([99], [key(9)])


def test_a_key_already_resident_keeps_its_page() -> None:
    allocator = PageAllocator(4, retain_pages=4)
    a, b = allocator.allocate(1), allocator.allocate(1)
    assert allocator.publish(a, [key(0)]) == 1
    assert allocator.publish(b, [key(0)]) == 0  # computed twice: the second copy is private
    allocator.free(b)
    assert allocator.num_resident_pages == 1 and allocator.share([key(0)]) == a


def test_idle_pages_past_retain_pages_are_evicted_oldest_first() -> None:
    allocator = PageAllocator(8, retain_pages=2)
    for n in range(4):
        page = allocator.allocate(1)
        allocator.publish(page, [key(n)])
        allocator.free(page)
    assert allocator.num_resident_pages == 2 and allocator.evicted_pages == 2
    assert allocator.share([key(0)]) == [] and allocator.share([key(1)]) == []
    assert len(allocator.share([key(2), key(3)])) == 2


def test_protected_idle_pages_are_evicted_after_every_other_idle_page() -> None:
    """Scheduler-aware eviction: keys of queued requests go last, LRU among the rest; when
    only protected pages are idle, the least recently used of them goes."""
    allocator = PageAllocator(6, retain_pages=6)
    pages = {}
    for n in range(4):  # key(0) is the least recently used
        (pages[n],) = allocator.allocate(1)
        allocator.publish([pages[n]], [key(n)])
        allocator.free([pages[n]])
    allocator.protect([key(0), key(2)])
    taken = allocator.allocate(4)  # two free pages, then two idle ones: 1 and 3
    assert {pages[1], pages[3]} <= set(taken)
    assert allocator.share([key(1)]) == [] and allocator.share([key(3)]) == []
    assert allocator.share([key(0)]) == [pages[0]]
    allocator.free([pages[0]])  # idle again, now more recent than key(2)'s page
    assert allocator.allocate(1) == [pages[2]]  # only protected ones idle: LRU of them
    allocator.protect([])  # replaced: plain LRU again
    assert allocator.num_resident_pages == 1 and allocator.share([key(0)]) == [pages[0]]


def test_random_operations_never_share_a_page_rewritten_since_it_was_published() -> None:
    """Every allocation writes new contents into its pages (a stamp); a page ``share`` hands
    out for a key must hold contents published under that key, so a page reused while its
    key still pointed at it is caught. Holders, idle and free pages always add up."""
    rng = random.Random(7)
    allocator = PageAllocator(24, retain_pages=12)
    held: list[list[int]] = []  # what each live holder took
    contents: dict[int, int] = {}  # page -> stamp of its last allocation
    under: dict[bytes, set[int]] = {}  # key -> stamps published under it
    stamp = 0
    for step in range(5000):
        action = rng.random()
        if action < 0.35 and allocator.can_allocate(n := rng.randint(1, 5)):
            pages = allocator.allocate(n)
            for page in pages:
                stamp += 1
                contents[page] = stamp
            held.append(pages)
        elif action < 0.55:
            keys = [key(rng.randrange(40)) for _ in range(rng.randint(1, 4))]
            pages = allocator.share(keys)
            for k, page in zip(keys, pages, strict=False):
                assert contents[page] in under[k], (step, k, page)
            if pages:
                held.append(pages)
        elif action < 0.75 and held:
            pages = rng.choice(held)
            keys = [key(rng.randrange(40)) for _ in pages]
            allocator.publish(pages, keys)
            for k, page in zip(keys, pages, strict=True):
                under.setdefault(k, set()).add(contents[page])
        elif held:
            allocator.free(held.pop(rng.randrange(len(held))))
        holders = [page for pages in held for page in pages]
        for page in range(24):
            assert allocator.holders(page) == holders.count(page), (step, page)
        assert allocator.num_free_pages == 24 - len(set(holders))
    assert allocator.evicted_pages > 40 and allocator.shared_pages > 100
