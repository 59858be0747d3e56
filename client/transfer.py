"""The two data planes' protocols, each for one namespace digest and one key chain.

shm (the daemon's arena is mapped here):

- reads: ``acquire`` -> (lease, slots) -> copy or view the slots -> ``release`` (always, also
  when the copy fails); the lease keeps the daemon from reusing the slots meanwhile;
- writes: ``put_shm``: Reserve -> copy the payloads into the reserved slots -> Commit; Abort
  when anything fails before the commit (no half-written block is ever committed) or the
  commit itself fails (the daemon ignores the abort of keys it did commit; a pending
  reservation would otherwise answer DEDUP to the next put until it expires).

stream (remote clients, or ``use_shm=False``): ``get_stream`` and ``put_stream``, the payloads
in chunks of the handshake's ``chunk_bytes``.

Acquire, Reserve, Commit and Put are never retried; the Get stream is (it only reads).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeVar

import torch

from kvstore.client import wire
from kvstore.client.connection import Connection
from kvstore.client.errors import KVStoreError
from kvstore.client.shm import Arena, Payload
from kvstore.client.wire import Slots, WriteStatus
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb

__all__ = ["acquire", "get_stream", "put_shm", "put_stream", "release"]

log = logging.getLogger(__name__)

TargetT = TypeVar("TargetT", bytearray, memoryview, torch.Tensor)


async def acquire(
    conn: Connection, digest: bytes, keys: list[bytes], size: int
) -> tuple[int, Slots, Arena] | None:
    """Leases the leading held blocks.

    Returns:
        (lease id, their slots, the arena they lie in), or ``None`` on the stream plane.
    """
    arena = await conn.fresh_arena()
    if arena is None:
        return None
    request = pb.AcquireRequest(namespace=digest, keys=keys)

    async def undo(reply: pb.AcquireResponse) -> None:
        await release(conn, reply.lease_id, quietly=True)

    reply = await conn.unary_undone_on_cancel("Acquire", request, pb.AcquireResponse, undo)
    try:
        conn.check_fresh(arena, "Acquire", reply.arena_device, reply.arena_inode)
        return reply.lease_id, wire.check_slots(reply.slots, len(keys), size, arena), arena
    except BaseException:
        await release(conn, reply.lease_id, quietly=True)
        raise


async def release(conn: Connection, lease_id: int, *, quietly: bool = False) -> None:
    """Ends a lease; ``quietly`` logs a failure instead of raising it (the lease expires)."""
    try:
        await conn.unary("Release", pb.ReleaseRequest(lease_id=lease_id), pb.ReleaseResponse)
    except KVStoreError as error:
        if not quietly:
            raise
        log.warning("could not release lease %d: %s", lease_id, error)


async def get_stream(
    conn: Connection, digest: bytes, keys: list[bytes], size: int, out: Sequence[TargetT] | None
) -> list[bytes] | list[TargetT]:
    """The leading held blocks through the Get stream (retried whole: it only reads)."""
    request = pb.GetRequest(namespace=digest, keys=keys)

    async def collect() -> list[bytes] | list[TargetT]:
        call = conn.stub.Get(request, metadata=conn.metadata, timeout=conn.timeout)
        return await wire.assemble(call, len(keys), size, out)

    return await conn.retrying("Get", collect, idempotent=True)


async def put_shm(
    conn: Connection,
    digest: bytes,
    specs: list[pb.BlockSpec],
    blocks: Sequence[Payload],
    size: int,
    arena: Arena,
) -> list[WriteStatus]:
    """Reserve -> write -> Commit; one final status per block of ``size`` bytes."""
    request = pb.ReserveRequest(namespace=digest, blocks=specs)

    async def undo(reply: pb.ReserveResponse) -> None:
        held = [
            spec.key
            for spec, r in zip(specs, reply.reservations, strict=False)
            if r.status == pb.RESERVED
        ]
        await _abort(conn, digest, held)

    reply = await conn.unary_undone_on_cancel("Reserve", request, pb.ReserveResponse, undo)
    reserved, slots, statuses = wire.reservations(reply, len(specs), size, arena)
    if reserved:
        keys = [specs[index].key for index in reserved]
        try:
            conn.check_fresh(arena, "Reserve", reply.arena_device, reply.arena_inode)
            await arena.copy_in(slots, [blocks[index] for index in reserved])
        except BaseException:
            await _abort(conn, digest, keys)
            raise
        commit = pb.CommitRequest(namespace=digest, keys=keys)
        try:
            committed = await conn.unary("Commit", commit, pb.CommitResponse)
        except BaseException:
            await _abort(conn, digest, keys)  # ignored for keys the commit did store
            raise
        statuses.update(
            zip(reserved, wire.write_statuses(committed.statuses, len(keys)), strict=True)
        )
    return [statuses[index] for index in range(len(specs))]


async def put_stream(
    conn: Connection, digest: bytes, specs: list[pb.BlockSpec], blocks: Sequence[Payload]
) -> list[WriteStatus]:
    """The Put stream; one final status per block."""
    chunks = wire.put_chunks(digest, specs, blocks, conn.info.chunk_bytes)
    reply = await conn.unary("Put", chunks, pb.PutResponse)
    return wire.write_statuses(reply.statuses, len(specs))


async def _abort(conn: Connection, digest: bytes, keys: list[bytes]) -> None:
    try:
        await conn.unary("Abort", pb.AbortRequest(namespace=digest, keys=keys), pb.AbortResponse)
    except KVStoreError as error:  # the reservations expire on their own
        log.warning("could not abort %d reservations: %s", len(keys), error)
