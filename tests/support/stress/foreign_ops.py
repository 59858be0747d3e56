"""A worker's ops across tenants: another tenant's keys, and another tenant's namespace.

``op_probe`` asks another tenant's keys in the worker's own namespace (a miss, or the
tenant's own content); ``op_foreign_ns`` calls on another tenant's namespace digest with the
worker's token, through the client or a raw stub, and must be refused (PERMISSION_DENIED).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from typing import Any

import grpc

from kvstore.client import DeadlineExceededError, PermissionDeniedError
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from tests.support.stress.content import TENANTS, Chooser, chain_keys, namespace_of, token_of
from tests.support.stress.worker_ops import WorkerState

Metadata = tuple[tuple[str, str], ...]


class ForeignOps(WorkerState):
    """Probes of another tenant's keys and calls on another tenant's namespace."""

    async def op_probe(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        """Another tenant's keys asked in this tenant's namespace: a miss, or this tenant's
        own content (when it stored those keys itself, see ``foreign_put``)."""
        other = rng.choice([t for t in TENANTS if t != tenant])
        family, branch, length = chooser.chain(other, read=True)
        keys = chain_keys(other, family, branch)[:length]
        blocks = await self.clients[(tenant, plane)].get(namespace_of(tenant), keys)
        self.tally.events["probe_hits" if blocks else "probe_misses"] += 1
        self.tally.check("probe", plane, tenant, keys, [bytes(b) for b in blocks])

    async def op_foreign_ns(
        self, rng: random.Random, chooser: Chooser, task: int, tenant: str, plane: str
    ) -> None:
        """Calls on another tenant's namespace digest with this tenant's token: refused."""
        other = rng.choice([t for t in TENANTS if t != tenant])
        family, branch, length = chooser.chain(other, read=True)
        keys = chain_keys(other, family, branch)[:length]
        digest = namespace_of(other).digest()
        method = rng.choice(["client", "Lookup", "Get", "Acquire", "Delete", "Prefetch"])
        if method == "client":
            await self._foreign_client_get(tenant, other, plane, keys)
            return
        assert self.channel is not None
        stub = kvstore_pb2_grpc.KVStoreStub(self.channel)  # type: ignore[no-untyped-call]
        metadata = (("authorization", f"Bearer {token_of(tenant)}"),)
        ask = getattr(self, f"_foreign_{method.lower()}")
        try:
            answered = await ask(stub, digest, keys, metadata, tenant)
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.PERMISSION_DENIED:
                self.tally.events["foreign_ns_refused"] += 1
                return
            if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceededError(str(error)) from error
            self.tally.fail("foreign_ns", f"{method} on another tenant's namespace: {error.code()}")
            return
        self.tally.fail("foreign_ns", f"{method} on {other}'s namespace by {tenant}: {answered}")

    async def _foreign_client_get(
        self, tenant: str, other: str, plane: str, keys: Sequence[bytes]
    ) -> None:
        try:
            blocks = await self.clients[(tenant, plane)].get(namespace_of(other), keys)
        except PermissionDeniedError:
            self.tally.events["foreign_ns_refused"] += 1
            return
        for index, block in enumerate(blocks):
            self.tally.mark_wrong("foreign_ns", plane, tenant, keys[index], index, bytes(block))
        self.tally.fail("foreign_ns", f"{tenant} registered/read {other}'s namespace")

    # Each raw call: (stub, digest, keys, metadata, tenant) -> what the daemon answered.

    async def _foreign_lookup(
        self, stub: Any, digest: bytes, keys: Sequence[bytes], metadata: Metadata, tenant: str
    ) -> str:
        reply = await stub.Lookup(
            pb.LookupRequest(namespace=digest, keys=keys), metadata=metadata, timeout=10
        )
        return f"{reply.num_blocks} blocks held"

    async def _foreign_get(
        self, stub: Any, digest: bytes, keys: Sequence[bytes], metadata: Metadata, tenant: str
    ) -> str:
        call = stub.Get(pb.GetRequest(namespace=digest, keys=keys), metadata=metadata, timeout=10)
        chunks = [chunk async for chunk in call]
        if chunks:
            self.tally.mark_wrong("foreign_ns", "stream", tenant, keys[0], 0, "Get data")
        return f"{len(chunks)} chunks"

    async def _foreign_acquire(
        self, stub: Any, digest: bytes, keys: Sequence[bytes], metadata: Metadata, tenant: str
    ) -> str:
        lease_id = random.getrandbits(62) | 1
        acquired = await stub.Acquire(
            pb.AcquireRequest(namespace=digest, keys=keys, lease_id=lease_id),
            metadata=metadata,
            timeout=10,
        )
        answered = f"{len(acquired.slots)} slots"
        with contextlib.suppress(grpc.RpcError):
            await stub.Release(pb.ReleaseRequest(lease_id=lease_id), metadata=metadata, timeout=10)
        if acquired.slots:
            self.tally.mark_wrong("foreign_ns", "shm", tenant, keys[0], 0, "Acquire slots")
        return answered

    async def _foreign_delete(
        self, stub: Any, digest: bytes, keys: Sequence[bytes], metadata: Metadata, tenant: str
    ) -> str:
        deleted = await stub.Delete(
            pb.DeleteRequest(namespace=digest, keys=keys[-1:]), metadata=metadata, timeout=10
        )
        return f"{deleted.num_blocks} deleted"

    async def _foreign_prefetch(
        self, stub: Any, digest: bytes, keys: Sequence[bytes], metadata: Metadata, tenant: str
    ) -> str:
        queued = await stub.Prefetch(
            pb.PrefetchRequest(
                session_id="intruder", namespace=digest, chains=[pb.KeyChain(keys=keys)]
            ),
            metadata=metadata,
            timeout=10,
        )
        return f"{queued.num_blocks} queued"
