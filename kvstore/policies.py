"""Tier policies: how blocks move down (write policies) and which go first (eviction).

Both are chosen by name in config and looked up in a registry dict.

Write policy of a lower tier (how blocks reach it from the tiers above):

- ``write_through``: copied at put time; re-admitted on demotion if it was dropped meanwhile;
- ``write_back``: copied when the block is evicted from the tier above;
- ``write_through_selective``: copied once the block has ``selective_hits`` hits; a block
  evicted before that is dropped, not copied (only reused blocks reach slow tiers).

Eviction policy primitives (synchronous; the tier manager calls them):

- ``inserted(tier, key)`` when a tier gains a copy, ``removed(tier, key)`` when it loses one;
- ``accessed(key)`` on every hit;
- ``victims(tier)`` -> keys in the order they should go. The manager skips keys it may not
  evict (leased, busy, or a parent whose children are still there), so a policy only orders.

``EVICTION_POLICIES`` is the seam for the scheduler-aware policy (protect and prefetch the
sessions in the engine's look-ahead queue).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol


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

    def inserted(self, tier: str, key: bytes) -> None: ...

    def removed(self, tier: str, key: bytes) -> None: ...

    def accessed(self, key: bytes) -> None: ...

    def victims(self, tier: str) -> Iterator[bytes]: ...


class LruPolicy:
    """Least recently used first, per tier."""

    def __init__(self) -> None:
        self._order: dict[str, OrderedDict[bytes, None]] = {}

    def inserted(self, tier: str, key: bytes) -> None:
        order = self._order.setdefault(tier, OrderedDict())
        order[key] = None
        order.move_to_end(key)

    def removed(self, tier: str, key: bytes) -> None:
        self._order.get(tier, OrderedDict()).pop(key, None)

    def accessed(self, key: bytes) -> None:
        for order in self._order.values():
            if key in order:
                order.move_to_end(key)

    def victims(self, tier: str) -> Iterator[bytes]:
        # A snapshot: the caller mutates the order while it evicts.
        return iter(list(self._order.get(tier, OrderedDict())))


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LruPolicy}


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
