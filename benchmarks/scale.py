"""The in-process store at scale: evicting puts, lookups during eviction, stats vs blocks held.

    python benchmarks/scale.py [--sizes 2000,20000] [--chain 16,512] [--puts 2000]
                               [--lookups 200] [--json FILE]

Each size is a host-only ``BlockStore`` whose tier holds exactly that many 4 KiB blocks,
filled with chains of ``--chain`` keys, then measured:

- put: ``--puts`` more blocks (new chains of the same length) into the full tier, each one
  evicting, against the same number of puts into a tier with room for them (the limit: the
  same code without eviction, measured in the same run). The ratio is their mean time per
  put; the worst single put is the event loop's longest stall.
- lookup during eviction: ``--lookups`` lookups of a held 512-key chain (p50, p99) while
  another task runs evicting puts, against the same lookups on the idle store.
- stats: ``store.stats()`` latency (p50 of 200 calls) with the tier full.

Everything runs on one uvloop event loop, as in the daemon, with no gRPC: the figures are
the store's own cost. The rows are the numbers of issue 12's first table (O(blocks)
eviction); there is no target yet: the table is the baseline those changes are measured by.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import uvloop
from daemon import percentiles_ms

from kvstore.blocks import BlockLayout
from kvstore.index import BlockMeta
from kvstore.policies import eviction_policy, write_policy
from kvstore.store import BlockStore, StoreTier
from kvstore.tiers.host import HostTier

LAYOUT = BlockLayout(num_layers=1, num_kv_heads=1, block_tokens=16, head_dim=64, dtype="float32")
BLOCK = LAYOUT.payload_bytes  # 4 KiB
NAMESPACE = b"s" * 32
ROOT = b"\0" * 32
META = BlockMeta(NAMESPACE, LAYOUT.block_tokens, LAYOUT)
PAYLOAD = os.urandom(BLOCK)


@dataclass(frozen=True, slots=True)
class Row:
    blocks: int
    chain: int
    put_us: float  # mean, evicting
    limit_put_us: float  # mean, with room
    ratio: float
    worst_put_ms: float
    lookup_p50_ms: float
    lookup_p99_ms: float
    idle_lookup_p50_ms: float
    idle_lookup_p99_ms: float
    stats_p50_ms: float


def store_of(blocks: int) -> BlockStore:
    tier = StoreTier(HostTier(blocks * BLOCK), None, write_policy("write_through", 1))
    return BlockStore(
        [tier],
        eviction=eviction_policy("lru"),
        high_watermark=1.0,
        low_watermark=1.0,
        maintenance_interval=3600.0,
    )


async def put_chains(store: BlockStore, blocks: int, chain: int, tag: bytes) -> list[list[bytes]]:
    """Puts ``blocks`` blocks as chains of ``chain`` keys; returns the chains' keys."""
    chains: list[list[bytes]] = []
    for start in range(0, blocks, chain):
        parent, keys = ROOT, []
        for index in range(start, min(start + chain, blocks)):
            key = tag + index.to_bytes(8, "big") + b"\0" * (32 - len(tag) - 8)
            await store.put(key, parent, META, PAYLOAD)
            keys.append(key)
            parent = key
        chains.append(keys)
    return chains


async def timed_puts(store: BlockStore, count: int, chain: int, tag: bytes) -> list[float]:
    seconds: list[float] = []
    for start in range(0, count, chain):
        parent = ROOT
        for index in range(start, min(start + chain, count)):
            key = tag + index.to_bytes(8, "big") + b"\0" * (32 - len(tag) - 8)
            began = time.perf_counter()
            await store.put(key, parent, META, PAYLOAD)
            seconds.append(time.perf_counter() - began)
            parent = key
    return seconds


async def lookup_latencies(store: BlockStore, keys: Sequence[bytes], calls: int) -> list[float]:
    """Each lookup's time from the moment it is asked for, through whatever else the loop
    runs first (a put evicting), to its answer: what a client's call sees of a stall."""
    seconds: list[float] = []
    for _ in range(calls):
        began = time.perf_counter()
        await asyncio.sleep(0)  # the request waits its turn on the loop
        await store.lookup(keys, NAMESPACE)
        seconds.append(time.perf_counter() - began)
    return seconds


async def bench(blocks: int, chain: int, puts: int, lookups: int) -> Row:
    async with store_of(blocks + puts) as roomy:  # the limit: the same puts, no eviction
        roomy.register_namespace(NAMESPACE, "t")
        await put_chains(roomy, blocks, chain, b"A")
        limit = await timed_puts(roomy, puts, chain, b"B")
    async with store_of(blocks) as full:
        full.register_namespace(NAMESPACE, "t")
        await put_chains(full, blocks, chain, b"A")
        evicting = await timed_puts(full, puts, chain, b"C")
        # The newest chain, 512 keys (or all of it), is held: look it up.
        probe = (await put_chains(full, min(512, blocks // 4), min(512, blocks // 4), b"P"))[0]
        idle = await lookup_latencies(full, probe, lookups)
        churn = asyncio.create_task(timed_puts(full, 10**9, chain, b"D"))
        try:
            busy = await lookup_latencies(full, probe, lookups)
        finally:
            churn.cancel()
            await asyncio.gather(churn, return_exceptions=True)
        stats = []
        for _ in range(200):
            began = time.perf_counter()
            full.stats()
            stats.append(time.perf_counter() - began)
    put_us, limit_us = statistics.fmean(evicting) * 1e6, statistics.fmean(limit) * 1e6
    (busy_p50, busy_p99), (idle_p50, idle_p99) = percentiles_ms(busy), percentiles_ms(idle)
    return Row(
        blocks=blocks,
        chain=chain,
        put_us=put_us,
        limit_put_us=limit_us,
        ratio=put_us / limit_us,
        worst_put_ms=max(evicting) * 1e3,
        lookup_p50_ms=busy_p50,
        lookup_p99_ms=busy_p99,
        idle_lookup_p50_ms=idle_p50,
        idle_lookup_p99_ms=idle_p99,
        stats_p50_ms=percentiles_ms(stats)[0],
    )


def table(rows: Sequence[Row]) -> str:
    header = (
        "| blocks | chain | evicting put us | put with room us (limit) | ratio | worst put ms "
        "| lookup p50/p99 ms while evicting | idle lookup p50/p99 ms | stats p50 ms |"
    )
    lines = [header, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.blocks} | {r.chain} | {r.put_us:.0f} | {r.limit_put_us:.0f} | "
            f"{r.ratio:.1f}x | {r.worst_put_ms:.1f} | {r.lookup_p50_ms:.2f} / "
            f"{r.lookup_p99_ms:.2f} | {r.idle_lookup_p50_ms:.2f} / {r.idle_lookup_p99_ms:.2f} | "
            f"{r.stats_p50_ms:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2000,20000", help="tier sizes in blocks")
    parser.add_argument("--chain", default="16,512", help="keys per chain")
    parser.add_argument("--puts", type=int, default=2000, help="timed puts per size")
    parser.add_argument("--lookups", type=int, default=200, help="timed lookups per size")
    parser.add_argument("--json", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    chains = [int(chain) for chain in args.chain.split(",")]

    async def run() -> list[Row]:
        rows = []
        for blocks in sizes:
            for chain in chains:
                rows.append(await bench(blocks, chain, args.puts, args.lookups))
                print(f"  {blocks} blocks, chains of {chain}: done", file=sys.stderr, flush=True)
        return rows

    rows = uvloop.run(run())
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(row) for row in rows], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
