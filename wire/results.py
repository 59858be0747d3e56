"""The values a call answers, on both sides of the wire: put outcomes, lookups and statistics."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass


class PutStatus(enum.Enum):
    STORED = "stored"
    DEDUP = "dedup"  # the key is already held (or being written): no new space used
    NO_SPACE = "no_space"  # every tier is full of blocks that may not be evicted
    RESERVED = "reserved"  # shm write: arena space held; write the payload, then commit
    EXPIRED = "expired"  # commit of a reservation that expired (or never existed)
    CHECKSUM_MISMATCH = "checksum_mismatch"  # the written bytes differ from the writer's checksum


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How many leading blocks of a chain are held, and where: ``runs`` gives the highest
    tier holding each, in key order, a run per change of tier (``(("host", 30), ("ssd",
    2))``: 30 blocks on host, then 2 whose highest copy is on SSD). Runs are never empty and
    neighbours name different tiers; their blocks add up to ``num_blocks``."""

    num_blocks: int
    runs: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of_tiers(cls, tiers: Iterable[str]) -> LookupResult:
        """The result for these per-block tiers."""
        runs = tuple((tier, len(list(group))) for tier, group in itertools.groupby(tiers))
        return cls(sum(count for _, count in runs), runs)

    @property
    def tiers(self) -> tuple[str, ...]:
        """Per matched block, the highest tier holding it."""
        return tuple(itertools.chain.from_iterable(itertools.repeat(t, n) for t, n in self.runs))

    def below(self, tier: str) -> int:
        """Matched blocks whose highest copy is not in ``tier``."""
        return sum(count for name, count in self.runs if name != tier)


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    usage_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    evictions: int
    healthy: bool
    read_bytes: int = 0  # payload bytes of the reads (hits) the tier served
    written_bytes: int = 0  # bytes written into the tier (after its compression)
    failed_writes: int = 0  # block writes the tier did not take (full, or not answering)


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    namespace: bytes
    blocks: int  # committed blocks
    size: int  # their payload bytes
    tiers: tuple[tuple[str, int], ...]  # (tier, blocks it holds a copy of), top tier first


# The store's counters, declared once: each only grows. ``StoreStats`` carries them, the Stats
# reply and the client's ``Stats`` by the same names, Prometheus as ``kvstore_<name>_total``.
COUNTERS: tuple[str, ...] = (
    "gets", "misses", "puts", "dedup_puts", "promotions", "demotions", "dropped_saves",
    "corrupt_blocks", "corrupt_writes", "expired_leases", "expired_reservations",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    blocks: int
    puts: int
    dedup_puts: int
    gets: int
    misses: int
    promotions: int
    demotions: int
    dropped_saves: int
    corrupt_blocks: int
    corrupt_writes: int
    active_leases: int
    active_reservations: int
    expired_leases: int = 0  # ended by their TTL: a client that never released
    expired_reservations: int = 0  # ended uncommitted: the TTL ran out or the writer went away
