"""Tier policies: how blocks move down (write policies) and which go first (eviction).

Both are chosen by name in config and looked up in a registry dict.

Write policy of a lower tier (how blocks reach it from the tiers above):

- ``write_through``: copied at put time; re-admitted on demotion if it was dropped meanwhile;
- ``write_back``: copied when the block is evicted from the tier above;
- ``write_through_selective``: copied once the block has ``selective_hits`` hits; a block
  evicted before that is dropped, not copied (only reused blocks reach slow tiers).

Eviction policy primitives (synchronous; the tier manager calls them):

- ``inserted(tier, key, first=...)`` when a block becomes an eviction candidate of a tier
  (a *leaf* there: the tier holds it and none of its children), ``removed(tier, key)`` when
  it stops being one; ``first`` asks for it to go before every other candidate (a parent
  whose last child there just left, used no later than that child);
- ``accessed(key)`` on every hit;
- ``protect(keys, until)`` when a prefetch hint names blocks a queued session will need;
  ``protected(key)`` tells the manager such a block may move down but must not be dropped;
- ``victims(tier)`` -> keys in the order they should go, lazily: the manager stops at the
  first key it can evict, and may change the order between keys (an eviction awaits I/O), so
  a policy reads its order in growing snapshots (``in_snapshots``) rather than copying all of
  it per victim. The manager skips keys it may not evict (leased, busy, protected), so a
  policy only orders. Every primitive is O(1) (amortised); a scan costs the keys it passes.

Prefetch hints promote within a :class:`HintBudget`: at most a share of the top tier per
hint and per second, so that hints naming more than the tier holds cannot thrash it.

Policies (``EVICTION_POLICIES``): ``lru``; ``scheduler_aware`` (CachedAttention): LRU, except
that blocks of sessions in the engine's look-ahead queue go last, and never leave the store,
until their session's turn reads them or the protection expires.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from kvstore.tiers import collector


@dataclass(frozen=True, slots=True)
class WritePolicy:
    """When a lower tier receives a block."""

    name: str
    on_put: bool
    on_demote: bool
    min_hits: int | None = None

    def admits_demotion(self, hits: int) -> bool:
        """Whether a block evicted from the tier above is copied into this tier."""
        return self.on_demote or (self.min_hits is not None and hits >= self.min_hits)

    def admits_on_hit(self, hits: int) -> bool:
        """Whether a block that just reached ``hits`` hits is copied into this tier now."""
        return self.min_hits is not None and hits >= self.min_hits


WRITE_POLICIES: dict[str, Callable[[int], WritePolicy]] = {
    "write_through": lambda _hits: WritePolicy("write_through", on_put=True, on_demote=True),
    "write_back": lambda _hits: WritePolicy("write_back", on_put=False, on_demote=True),
    "write_through_selective": lambda hits: WritePolicy(
        "write_through_selective", on_put=False, on_demote=False, min_hits=hits
    ),
}


def write_policy(name: str, selective_hits: int) -> WritePolicy:
    """The write policy registered under ``name``.

    Raises:
        ValueError: an unknown name (config validation normally catches it first).
    """
    try:
        return WRITE_POLICIES[name](selective_hits)
    except KeyError:
        raise ValueError(
            f"unknown write policy {name!r}; known: {sorted(WRITE_POLICIES)}"
        ) from None


class EvictionPolicy(Protocol):
    """Orders eviction candidates per tier. See the module docstring."""

    def inserted(self, tier: str, key: bytes, *, first: bool = False) -> None: ...

    def removed(self, tier: str, key: bytes) -> None: ...

    def accessed(self, key: bytes) -> None: ...

    def protect(self, keys: Iterable[bytes], until: float) -> None: ...

    def protected(self, key: bytes) -> bool: ...

    def victims(self, tier: str) -> Iterator[bytes]: ...


FIRST_SNAPSHOT = 64  # keys read at once when a scan starts; each further read doubles it


def in_snapshots(order: OrderedDict[bytes, None]) -> Iterator[bytes]:
    """``order``'s keys, first to last, read in snapshots of its first 64, 128, 256, ... keys
    (each yielding the keys the earlier ones did not), so the caller may change ``order``
    between keys. A scan that stops after ``d`` keys costs O(d), one that runs to the end
    O(len(order)); a key in ``order`` when the last snapshot is taken is never missed."""
    seen: set[bytes] = set()
    size = FIRST_SNAPSHOT
    while True:
        keys = list(itertools.islice(order, size))
        fresh = [key for key in keys if key not in seen]
        yield from fresh
        if len(keys) < size:
            return  # that snapshot was the whole order
        seen.update(fresh)
        size *= 2


class LruPolicy:
    """Least recently used first, per tier."""

    def __init__(self) -> None:
        self._order: dict[str, OrderedDict[bytes, None]] = {}

    def inserted(self, tier: str, key: bytes, *, first: bool = False) -> None:
        order = self._order.get(tier)
        if order is None:
            order = self._order[tier] = OrderedDict()
            collector.untrack(order)  # bytes only: nothing for the garbage collector to walk
        order[key] = None
        order.move_to_end(key, last=not first)

    def removed(self, tier: str, key: bytes) -> None:
        self._order.get(tier, OrderedDict()).pop(key, None)

    def accessed(self, key: bytes) -> None:
        for order in self._order.values():
            if key in order:
                order.move_to_end(key)

    def protect(self, keys: Iterable[bytes], until: float) -> None:
        return None  # plain LRU ignores look-ahead hints

    def protected(self, key: bytes) -> bool:
        return False

    def victims(self, tier: str) -> Iterator[bytes]:
        return in_snapshots(self._order.get(tier, OrderedDict()))


class SchedulerAwarePolicy(LruPolicy):
    """LRU, but blocks named in look-ahead hints go last and are never dropped."""

    def __init__(self) -> None:
        super().__init__()
        self._protected: dict[bytes, float] = {}  # key -> monotonic deadline

    def accessed(self, key: bytes) -> None:
        super().accessed(key)
        self._protected.pop(key, None)  # its session's turn came: plain LRU from now on

    def protect(self, keys: Iterable[bytes], until: float) -> None:
        for key in keys:
            self._protected[key] = max(until, self._protected.get(key, 0.0))

    def protected(self, key: bytes) -> bool:
        deadline = self._protected.get(key)
        if deadline is None:
            return False
        if deadline < time.monotonic():
            del self._protected[key]
            return False
        return True

    def victims(self, tier: str) -> Iterator[bytes]:
        hinted: list[bytes] = []  # protected keys go after every other one
        for key in super().victims(tier):
            if self.protected(key):
                hinted.append(key)
            else:
                yield key
        yield from hinted


class HintBudget:
    """Bytes prefetch hints may promote: at most ``per_hint`` per hint, and ``per_second``
    a second over all hints (a token bucket holding at most one second's worth)."""

    def __init__(self, per_hint: int, per_second: int) -> None:
        self.per_hint, self.per_second = per_hint, per_second
        self._tokens = float(per_second)
        self._at = time.monotonic()

    def grant(self, now: float | None = None) -> int:
        """Bytes the next hint may promote; it returns what it did not use with ``spent``."""
        now = time.monotonic() if now is None else now
        self._tokens = min(
            self.per_second, self._tokens + max(0.0, now - self._at) * self.per_second
        )
        self._at = now
        return int(min(self.per_hint, self._tokens))

    def spent(self, granted: int, used: int) -> None:
        self._tokens -= min(used, granted)


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "scheduler_aware": SchedulerAwarePolicy,
}


def eviction_policy(name: str) -> EvictionPolicy:
    """A new eviction policy registered under ``name``.

    Raises:
        ValueError: an unknown name.
    """
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}"
        ) from None
