"""The daemon run's final scan, once the workers are gone.

Every chain ever written must read back exactly, on both data planes with ``verify`` and
through a view; then a whole put of each chain at idle must leave all of it held (a DEDUP for
a block that no read can find is a write that never became visible).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore.client import AsyncKVStoreClient, CorruptBlockError
from tests.support.stress.content import TENANTS, chain_keys, namespace_of, payload, token_of
from tests.support.stress.tally import MAX_DETAILS, Tally

Clients = dict[tuple[str, str], AsyncKVStoreClient]


def scan(address: str, written: set[tuple[Any, ...]]) -> dict[str, Any]:
    """Reads back every chain ever written, on both planes with verify, and a view."""
    tally = Tally()
    found: dict[str, Any] = {"chains": len(written), "held": 0, "read": 0, "short": 0}
    unheld: list[str] = []
    found["unheld_after_put"] = 0
    leases = asyncio.run(_scan(address, written, tally, found, unheld))
    return {
        **found,
        "verified": tally.verified,
        "wrong": tally.wrong,
        "wrong_details": tally.wrong_details,
        "leases_after": leases,
        "unheld_details": unheld,
    }


async def _scan(
    address: str,
    written: set[tuple[Any, ...]],
    tally: Tally,
    found: dict[str, Any],
    unheld: list[str],
) -> int:
    """The scan's two passes; the leases still active after them."""
    clients: Clients = {}
    for tenant in TENANTS:
        for plane in ("shm", "stream"):
            clients[(tenant, plane)] = AsyncKVStoreClient(
                address, token=token_of(tenant), use_shm=plane == "shm", verify=True
            )
            await clients[(tenant, plane)].connect()
    try:
        await _read_back(clients, written, tally, found)
        await _put_whole(clients, written, found, unheld)
        stats = await clients[(TENANTS[0], "shm")].stats()
        return stats.active_leases
    finally:
        for client in clients.values():
            await client.aclose()


async def _read_back(
    clients: Clients, written: set[tuple[Any, ...]], tally: Tally, found: dict[str, Any]
) -> None:
    for number, (tenant, key_tenant, family, branch) in enumerate(sorted(written)):
        keys = chain_keys(key_tenant, family, branch)
        namespace = namespace_of(tenant)
        shm, stream = clients[(tenant, "shm")], clients[(tenant, "stream")]
        try:
            held = await shm.lookup(namespace, keys)
            blocks = [bytes(b) for b in await shm.get(namespace, keys)]
            tally.check("scan", "shm", tenant, keys, blocks)
            found["held"] += held
            found["read"] += len(blocks)
            found["short"] += len(blocks) < held
            client = stream if number % 2 else shm
            async with client.view(namespace, keys) as views:
                tally.check("scan_view", "view", tenant, keys, [bytes(v) for v in views])
            blocks = [bytes(b) for b in await stream.get(namespace, keys)]
            tally.check("scan", "stream", tenant, keys, blocks)
        except CorruptBlockError as error:
            tally.mark_wrong("scan", "verify", tenant, b"", -1, f"CorruptBlockError {error}")


async def _put_whole(
    clients: Clients, written: set[tuple[Any, ...]], found: dict[str, Any], unheld: list[str]
) -> None:
    """Idle, a put of a whole chain must leave all of it held: a block answered DEDUP that
    no read can find (twice in a row) is a write that never became visible."""
    for number, (tenant, key_tenant, family, branch) in enumerate(sorted(written)):
        keys = chain_keys(key_tenant, family, branch)
        client = clients[(tenant, "shm" if number % 2 else "stream")]
        blocks = [payload(tenant, key) for key in keys]
        for _ in range(2):
            statuses = await client.put(namespace_of(tenant), keys, blocks)
            held = await client.lookup(namespace_of(tenant), keys)
            if held == len(keys):
                break
        else:
            found["unheld_after_put"] += 1
            if len(unheld) < MAX_DETAILS:
                unheld.append(
                    f"{tenant}'s chain (keys of {key_tenant}, family {family}, branch "
                    f"{branch}) put whole at idle: statuses {[s.name for s in statuses]}, "
                    f"but only {held} leading blocks held (block {keys[held].hex()[:16]})"
                )
