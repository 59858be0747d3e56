"""The in-process run: tasks of :mod:`.store_ops` on a ``BlockStore``, then checks.

:func:`run_store_stress` builds a store of tiny host + SSD + Redis tiers, runs ``tasks``
asyncio tasks for the load time, checks that no lease or reservation is left, reads every
chain ever written back (by ``get`` and by ``acquire``), puts each whole at idle (all of it
must then be held) and reports as the daemon run does.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvstore.client import ROOT_KEY
from kvstore.policies import eviction_policy, write_policy
from kvstore.store import BlockStore, StoreTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.ssd import SsdTier
from kvstore.wire.blocks import Codec
from tests.support.leaves import tier_leaves
from tests.support.stress import checks
from tests.support.stress.content import BLOCK, TENANTS, chain_keys, payload
from tests.support.stress.store_ops import StoreRun
from tests.support.stress.tally import MAX_DETAILS, Tally


async def run_store_stress(
    workdir: Path,
    *,
    seconds: float,
    redis_url: str,
    tasks: int = 32,
    seed: int = 0,
    host_blocks: int = 32,
    ssd_blocks: int = 96,
    redis_blocks: int = 192,
    lease_ttl: float = 3.0,
    policy: str = "scheduler_aware",
) -> dict[str, Any]:
    """Runs ``tasks`` asyncio tasks against an in-process :class:`BlockStore`."""
    sizes = {"host_blocks": host_blocks, "ssd_blocks": ssd_blocks, "redis_blocks": redis_blocks}
    store = _store(Path(workdir), redis_url, lease_ttl=lease_ttl, policy=policy, **sizes)
    run = StoreRun(store, seed)
    problems: list[str] = []
    async with store:
        for tenant in TENANTS:
            store.register_namespace(run.digests[tenant], tenant)
        before = store.stats()
        started = time.monotonic()
        await asyncio.gather(*(run.loop(task, started + seconds) for task in range(tasks)))
        load_seconds = time.monotonic() - started
        idle = store.stats()
        if idle.active_leases or idle.active_reservations:
            problems.append(
                f"not idle after the tasks ended: {idle.active_leases} leases, "
                f"{idle.active_reservations} reservations active"
            )
        scan, held, read = await _read_back(run)
        await _put_whole(run, problems)
        after = store.stats()
        if after.active_leases:
            problems.append(f"{after.active_leases} leases active after the final scan")
        # The per-tier counts stats reads are kept incrementally: they must equal a recount.
        copies = Counter(tier for node in store.index.nodes() for tier in node.tiers)
        counted = {tier.name: tier.blocks for tier in after.tiers}
        if counted != {name: copies[name] for name in counted}:
            problems.append(f"stats counts {counted} blocks per tier, the index holds {copies}")
        # Every copy a local tier holds is a node's that lists it, and the other way round: a
        # copy written for a node deleted meanwhile would be an orphan no one frees.
        for name in ("host", "ssd"):
            stored = set(store.tier(name).tier.keys())
            listed = {node.id for node in store.index.nodes() if name in node.tiers}
            if stored != listed:
                problems.append(
                    f"{name}: {len(stored - listed)} copies no node lists (orphans), "
                    f"{len(listed - stored)} listed copies missing"
                )
        # The eviction order holds exactly each tier's leaves, kept by events: brute force.
        for name in counted:
            listed, leaves = set(store.policy.victims(name)), tier_leaves(store.index, name)
            if listed != leaves:
                problems.append(
                    f"{name}: the eviction order lists {len(listed - leaves)} blocks that are "
                    f"not leaves and misses {len(leaves - listed)} leaves"
                )
        for view in run.maps.values():
            view.close()
    total = run.tally.report()
    del total["written"]
    total["scan"] = {
        "chains": len(run.tally.written),
        "held": held,
        "read": read,
        "verified": scan.verified,
        "wrong": scan.wrong,
    }
    total["wrong"] += scan.wrong
    total["wrong_details"] += scan.wrong_details
    total["daemon"] = checks.counters(before, after)
    total["seconds"] = round(load_seconds, 1)
    total["tasks"] = tasks
    checks.rates(total, load_seconds)
    problems += checks.problems(total, seconds, check_tiers=("host", "ssd"))
    if total["daemon"]["corrupt_blocks"] or total["daemon"]["corrupt_writes"]:
        problems.append(f"corrupt copies or writes: {total['daemon']}")
    total["problems"] = problems
    return total


def _store(
    workdir: Path,
    redis_url: str,
    *,
    host_blocks: int,
    ssd_blocks: int,
    redis_blocks: int,
    lease_ttl: float,
    policy: str,
) -> BlockStore:
    """Host (write-through), SSD and Redis (write-back) tiers of a few dozen blocks each."""
    prefix = f"stress-store-{os.getpid()}-{random.getrandbits(32):08x}"
    tiers = [
        StoreTier(HostTier(host_blocks * BLOCK), None, write_policy("write_through", 1)),
        StoreTier(
            SsdTier(workdir / "store-ssd", ssd_blocks * (BLOCK + 1024), fsync=False),
            Codec.LZ4_SHUFFLE,
            write_policy("write_back", 2),
        ),
        StoreTier(
            RedisTier(redis_url, redis_blocks * (BLOCK + 1024), key_prefix=prefix, timeout_s=2.0),
            Codec.LZ4,
            write_policy("write_back", 2),
            shared=True,
        ),
    ]
    return BlockStore(
        tiers,
        eviction=eviction_policy(policy),
        high_watermark=0.9,
        low_watermark=0.75,
        lease_ttl=lease_ttl,
        maintenance_interval=0.5,
        hint_ttl=2.0,
    )


async def _read_back(run: StoreRun) -> tuple[Tally, int, int]:
    """The final scan: every chain ever written reads back exactly, by get and by acquire.
    Returns its tally, and how many blocks were held and read."""
    store, digests = run.store, run.digests
    scan = Tally()
    held = read = 0
    for tenant, key_tenant, family, branch in sorted(run.tally.written):
        keys = chain_keys(key_tenant, family, branch)
        held += (await store.lookup(keys, digests[tenant])).num_blocks
        blocks = []
        for key in keys:
            block = await store.get(key, digests[tenant])
            if block is None:
                break
            blocks.append(bytes(block.payload))
        read += len(blocks)
        scan.check("scan", "store", tenant, keys, blocks)
        acquired = await store.acquire(keys, digests[tenant], owner=tenant)
        view = run.arena(tenant)
        scan.check(
            "scan_acquire",
            "arena",
            tenant,
            keys,
            [view[s.offset : s.offset + s.length] for s in acquired.slots],
        )
        await store.release(acquired.lease.lease_id, owner=tenant)
    return scan, held, read


async def _put_whole(run: StoreRun, problems: list[str]) -> None:
    """Idle, a put of a whole chain must leave all of it held (see the daemon run's scan)."""
    store, digests = run.store, run.digests
    unheld = []
    for tenant, key_tenant, family, branch in sorted(run.tally.written):
        keys = chain_keys(key_tenant, family, branch)
        for _ in range(2):
            statuses = [
                await store.put(
                    key,
                    ROOT_KEY if i == 0 else keys[i - 1],
                    run.metas[tenant],
                    payload(tenant, key),
                )
                for i, key in enumerate(keys)
            ]
            found = (await store.lookup(keys, digests[tenant])).num_blocks
            if found == len(keys):
                break
        else:
            unheld.append(
                f"{tenant}'s chain (keys of {key_tenant}, family {family}, branch {branch}) "
                f"put whole at idle: {[s.name for s in statuses]}, but only {found} held"
            )
    if unheld:
        problems.append(
            f"{len(unheld)} chains not held after a whole put at idle:\n"
            + "\n".join(unheld[:MAX_DETAILS])
        )
