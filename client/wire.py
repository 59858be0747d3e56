"""The client's values and their protobuf messages: conversions and checks of the daemon's answers.

Values the client returns (:class:`WriteStatus`, :class:`LookupResult`, :class:`ServerInfo`,
:class:`Stats`) are plain frozen dataclasses and enums, never protobuf messages. Everything the
daemon answers is checked here before the client acts on it: a slot outside the arena, a count
that does not match the request or a short streamed block raise :class:`ProtocolError`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

import numpy as np
import xxhash

from kvstore.client.errors import CorruptBlockError, ProtocolError
from kvstore.client.shm import (
    Bytes,
    Payload,
    Target,
    TargetT,
    as_bytes,
    buffer_bytes,
    is_tensor,
)
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.blocks import KEY_BYTES, BlockSpec
from kvstore.wire.chunks import GetChunk, PutChunk
from kvstore.wire.namespace import ModelFingerprint
from kvstore.wire.results import LookupResult, TierStats

if TYPE_CHECKING:
    import torch

__all__ = ["LookupResult", "ServerInfo", "Stats", "TierStats", "WriteStatus"]

DEFAULT_CHUNK_BYTES: Final = 1 << 20

Slots = list[tuple[int, int]]  # (offset, length) in the arena


class WriteStatus(enum.Enum):
    """What became of one block of a put."""

    STORED = "stored"  # committed and visible
    DEDUP = "dedup"  # already held (or being written by another client): nothing to do
    NO_SPACE = "no_space"  # no room now; the block is not stored
    EXPIRED = "expired"  # the reservation expired before the commit; not stored
    CHECKSUM_MISMATCH = "checksum_mismatch"  # the daemon found other bytes than were sent


_WRITE_STATUSES: Final[Mapping[int, WriteStatus]] = {
    pb.STORED: WriteStatus.STORED,
    pb.DEDUP: WriteStatus.DEDUP,
    pb.NO_SPACE: WriteStatus.NO_SPACE,
    pb.EXPIRED: WriteStatus.EXPIRED,
    pb.CHECKSUM_MISMATCH: WriteStatus.CHECKSUM_MISMATCH,
}


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The daemon's handshake."""

    server_version: str
    max_message_bytes: int
    chunk_bytes: int
    lease_seconds: float
    shm_socket: str  # empty when the daemon offers no shared memory (no host tier)
    instance_id: bytes
    max_block_bytes: int


@dataclass(frozen=True, slots=True)
class Stats:
    """The daemon's store statistics (tiers as in :class:`kvstore.results.TierStats`), plus
    its lookup counters."""

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
    lookups: int
    lookup_hit_blocks: int
    expired_leases: int = 0
    expired_reservations: int = 0
    uptime_seconds: float = 0.0
    version: str = ""


# Requests ---------------------------------------------------------------------------------


def check_keys(keys: Sequence[bytes], what: str = "keys") -> list[bytes]:
    """The keys as a list, each checked to be 32 bytes (``ValueError`` naming the index)."""
    checked = list(keys)
    for key in checked:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            index = next(i for i, k in enumerate(checked) if k is key)  # only for a bad key
            found = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
            raise ValueError(f"{what}[{index}] must be {KEY_BYTES} bytes, got {found}")
    return checked


def fingerprint_message(model: ModelFingerprint) -> pb.ModelFingerprint:
    layout = pb.Layout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        block_tokens=model.block_tokens,
        head_dim=model.head_dim,
        dtype=model.dtype,
    )
    scaling = [
        pb.RopeScaling(name=name, text=value)
        if isinstance(value, str)
        else pb.RopeScaling(name=name, number=value)
        for name, value in model.rope_scaling
    ]
    return pb.ModelFingerprint(
        model_name=model.model_name,
        layout=layout,
        rope_theta=model.rope_theta,
        rope_scaling=scaling,
    )


def block_specs(keys: Sequence[bytes], parent: bytes, num_tokens: int) -> list[pb.BlockSpec]:
    """One spec per key of a chain: each key's parent is the key before it."""
    parents = [parent, *keys[:-1]]
    return [
        pb.BlockSpec(key=k, parent=p, num_tokens=num_tokens)
        for k, p in zip(keys, parents, strict=True)
    ]


def put_chunks(
    namespace: bytes,
    specs: Sequence[pb.BlockSpec],
    blocks: Sequence[Payload],
    chunk_bytes: int,
    *,
    checksums: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> Iterator[PutChunk]:
    """The Put stream: namespace on the first chunk, a block's spec (and, with
    ``checksums``, its xxh3-64) on its first chunk. Each chunk's data is a view of the
    block, copied once, into the message (``kvstore.wire.chunks.encode_put``)."""
    chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
    for number, (spec, block) in enumerate(zip(specs, blocks, strict=True)):
        data = _host_bytes(block, stream).data.cast("B")
        for start in range(0, max(len(data), 1), chunk_bytes):
            first = start == 0
            yield PutChunk(
                data=data[start : start + chunk_bytes],
                namespace=namespace if first and number == 0 else b"",
                block=BlockSpec(spec.key, spec.parent, spec.num_tokens) if first else None,
                checksum=xxhash.xxh3_64_intdigest(data) if first and checksums else 0,
            )


# Answers ----------------------------------------------------------------------------------


def server_info(reply: pb.HandshakeResponse) -> ServerInfo:
    return ServerInfo(**{f.name: getattr(reply, f.name) for f in dataclasses.fields(ServerInfo)})


def stats(reply: pb.StatsResponse) -> Stats:
    tiers = tuple(
        TierStats(**{f.name: getattr(tier, f.name) for f in dataclasses.fields(TierStats)})
        for tier in reply.tiers
    )
    counters = {f.name: getattr(reply, f.name) for f in dataclasses.fields(Stats)[1:]}
    return Stats(tiers=tiers, **counters)


def lookup_result(reply: pb.LookupResponse, num_keys: int) -> LookupResult:
    """The lookup's answer (``ProtocolError`` when its runs do not add up to its count, or
    it claims more blocks than keys were asked for). A daemon from before runs sends one
    tier per block instead."""
    if reply.runs:
        runs = tuple((run.tier, run.blocks) for run in reply.runs)
        result = LookupResult(sum(count for _, count in runs), runs)
    else:
        result = LookupResult.of_tiers(reply.tiers)
    if result.num_blocks != reply.num_blocks or reply.num_blocks > num_keys:
        raise ProtocolError(
            f"lookup answered {reply.num_blocks} blocks of {num_keys} keys, with tiers "
            f"for {result.num_blocks}"
        )
    return result


def write_statuses(values: Sequence[int], count: int) -> list[WriteStatus]:
    """Final statuses, one per block (``ProtocolError`` on a wrong count or value)."""
    if len(values) != count:
        raise ProtocolError(f"expected {count} write statuses, got {len(values)}")
    unknown = [value for value in values if value not in _WRITE_STATUSES]
    if unknown:
        raise ProtocolError(f"write status {unknown[0]} is not a final status")
    return [_WRITE_STATUSES[value] for value in values]


class _Area(Protocol):
    size: int

    def check(self, offset: int, length: int) -> None: ...


def check_slots(slots: Sequence[pb.Slot], count: int, size: int, arena: _Area) -> Slots:
    """The leased slots as (offset, length), each ``size`` bytes inside the arena."""
    if len(slots) > count:
        raise ProtocolError(f"Acquire returned {len(slots)} slots for {count} keys")
    return check_pairs([(slot.offset, slot.length) for slot in slots], size, arena)


def check_pairs(pairs: Slots, size: int, arena: _Area) -> Slots:
    """``pairs`` (offset, length), once each is known to be ``size`` bytes inside the arena."""
    last = arena.size - size  # the highest offset a slot of ``size`` bytes may start at
    for offset, length in pairs:
        if length != size or not 0 <= offset <= last:
            _check_slot(pb.Slot(offset=max(0, offset), length=length), size, arena)  # raises
            raise ProtocolError(f"a slot at {offset} lies outside the arena")
    return pairs


def check_checksums(values: Sequence[int], count: int) -> tuple[int, ...]:
    """One checksum per leased slot (``ProtocolError`` otherwise)."""
    if len(values) != count:
        raise ProtocolError(f"Acquire returned {len(values)} checksums for {count} slots")
    return tuple(values)


def reservations(
    reply: pb.ReserveResponse, count: int, size: int, arena: _Area
) -> tuple[list[int], Slots, dict[int, WriteStatus]]:
    """(indices of reserved blocks, their slots, final statuses of the other blocks)."""
    if len(reply.reservations) != count:
        raise ProtocolError(f"Reserve returned {len(reply.reservations)} answers for {count}")
    reserved: list[int] = []
    slots: Slots = []
    done: dict[int, WriteStatus] = {}
    for index, answer in enumerate(reply.reservations):
        if answer.status == pb.RESERVED:
            reserved.append(index)
            slots.append(_check_slot(answer.slot, size, arena))
        else:
            done[index] = write_statuses([answer.status], 1)[0]
    return reserved, slots, done


def _check_slot(slot: pb.Slot, size: int, arena: _Area) -> tuple[int, int]:
    if slot.length != size:
        raise ProtocolError(f"slot at {slot.offset} holds {slot.length} bytes, not {size}")
    try:
        arena.check(slot.offset, slot.length)
    except ValueError as error:
        raise ProtocolError(str(error)) from None
    return slot.offset, slot.length


async def assemble(
    chunks: AsyncIterable[GetChunk | pb.GetChunk],
    count: int,
    size: int,
    out: Sequence[TargetT] | None,
    *,
    verify: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> list[bytes] | list[TargetT]:
    """The blocks of a Get stream, new bytes or copied into ``out`` (a CUDA tensor on
    ``stream``); checks their order, and with ``verify`` each block's bytes against the
    checksum the daemon sent with it."""
    blocks: list[bytes] = []
    parts: list[bytes | memoryview] = []
    target: memoryview | torch.Tensor | None = None
    digest = xxhash.xxh3_64()
    expected = 0
    done = filled = 0
    async for chunk in chunks:
        if chunk.index != done or done >= count:
            raise ProtocolError(f"Get sent a chunk of block {chunk.index}, expected block {done}")
        data = chunk.data  # read once: each read of a message's bytes field copies it
        length = len(data)
        if filled == 0:
            expected = chunk.checksum
        if verify:
            digest.update(data)
        if filled + length > size:
            raise ProtocolError(f"Get sent more than {size} bytes for block {done}")
        if out is None:
            parts.append(data)
        elif length:
            if target is None:
                target = _landing(out[done])
            _copy_chunk(target, filled, data, stream)
        filled += length
        if chunk.last:
            if filled != size:
                raise ProtocolError(f"Get sent {filled} bytes for block {done}, not {size}")
            if verify and digest.intdigest() != expected:
                raise CorruptBlockError(f"get: block {done} does not match its checksum")
            digest.reset()
            if out is None:
                blocks.append(b"".join(parts))
            parts, target, filled, done = [], None, 0, done + 1
    if filled or parts:
        raise ProtocolError(f"the Get stream ended inside block {done}")
    return blocks if out is None else list(out[:done])


def _host_bytes(block: Payload, stream: torch.cuda.Stream | None) -> Bytes:
    """A block's bytes in host memory: a view, or a copy of a tensor on a device."""
    if is_tensor(block):
        from kvstore.client import tensors

        return tensors.host_bytes(block, stream)
    return buffer_bytes(block)


def _landing(target: Target) -> memoryview | torch.Tensor:
    """Where a block's chunks land: a byte view of host memory, or the device tensor itself."""
    flat = as_bytes(target)
    return flat.data if isinstance(flat, np.ndarray) else flat


def _copy_chunk(
    target: memoryview | torch.Tensor,
    start: int,
    data: bytes | memoryview,
    stream: torch.cuda.Stream | None,
) -> None:
    # One memcpy on this thread for host memory: torch's copy_ splits a 1 MiB chunk over its
    # intra-op threads, which costs more than the copy when the daemon busies the other core.
    if isinstance(target, memoryview):
        target[start : start + len(data)] = data
    else:
        from kvstore.client import tensors

        chunk = tensors.over(np.frombuffer(data, dtype=np.uint8))
        with tensors.on_stream(stream):
            target[start : start + len(data)].copy_(chunk)
