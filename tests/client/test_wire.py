"""Messages to and from the daemon, and the checks of its answers (no daemon needed)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from kvstore.client import ModelFingerprint, Namespace, ProtocolError, WriteStatus, wire
from kvstore.client.shm import Arena
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.servicer import _fingerprint
from kvstore.wire.chunks import encode_put

KEY = bytes(range(32))


async def stream(chunks: Sequence[pb.GetChunk]) -> AsyncIterator[pb.GetChunk]:
    for chunk in chunks:
        yield chunk


def chunk(index: int, data: bytes, last: bool) -> pb.GetChunk:
    return pb.GetChunk(index=index, data=data, last=last)


async def test_assemble_joins_chunks_into_blocks_and_copies_into_out() -> None:
    chunks = [chunk(0, b"ab", False), chunk(0, b"cd", True), chunk(1, b"efgh", True)]

    assert await wire.assemble(stream(chunks), 3, 4, None) == [b"abcd", b"efgh"]
    out = [torch.zeros(4, dtype=torch.uint8) for _ in range(3)]
    got = await wire.assemble(stream(chunks), 3, 4, out)
    assert [bytes(t.numpy()) for t in got] == [b"abcd", b"efgh"]
    assert await wire.assemble(stream([]), 3, 4, None) == []


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        ([chunk(1, b"abcd", True)], "expected block 0"),
        ([chunk(0, b"abc", True)], "3 bytes for block 0"),
        ([chunk(0, b"abcde", True)], "more than 4 bytes"),
        ([chunk(0, b"ab", False)], "ended inside block 0"),
        ([chunk(0, b"abcd", True), chunk(0, b"abcd", True)], "expected block 1"),
        ([chunk(i, b"abcd", True) for i in range(4)], "expected block 3"),  # more than asked
    ],
)
async def test_assemble_refuses_a_malformed_stream(chunks: list[pb.GetChunk], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        await wire.assemble(stream(chunks), 3, 4, None)


def test_put_chunks_carry_the_namespace_once_and_each_spec_on_its_first_chunk() -> None:
    specs = wire.block_specs([KEY, KEY[::-1]], bytes(32), 16)
    blocks = [b"a" * 10, torch.arange(5, dtype=torch.int16)]

    chunks = list(wire.put_chunks(b"N" * 32, specs, blocks, 4))

    assert [bytes(c.data) for c in chunks] == [b"aaaa", b"aaaa", b"aa", *_split(blocks[1], 4)]
    assert [c.namespace for c in chunks] == [b"N" * 32] + [b""] * 5
    assert [c.block is not None for c in chunks] == [True, False, False, True, False, False]
    assert chunks[3].block is not None and chunks[0].block is not None
    assert chunks[3].block.parent == KEY and chunks[0].block.parent == bytes(32)
    assert chunks[0].block.num_tokens == 16
    # On the wire, what the daemon's protobuf-based clients would send.
    message = pb.PutChunk.FromString(encode_put(chunks[0]))
    assert (message.namespace, message.block.key, message.data) == (b"N" * 32, KEY, b"aaaa")


def _split(tensor: torch.Tensor, step: int) -> list[bytes]:
    data = tensor.numpy().tobytes()
    return [data[i : i + step] for i in range(0, len(data), step)]


def test_the_fingerprint_message_is_what_the_daemon_reads_back() -> None:
    model = ModelFingerprint(
        "llama", 32, 8, 128, "bfloat16", 16, 500000.0, (("type", "llama3"), ("factor", 8.0))
    )

    assert _fingerprint(wire.fingerprint_message(model)) == model


def test_keys_must_be_32_bytes() -> None:
    assert wire.check_keys((KEY, KEY)) == [KEY, KEY]
    with pytest.raises(ValueError, match=r"keys\[1\] must be 32 bytes, got 31 bytes"):
        wire.check_keys([KEY, KEY[:31]])
    with pytest.raises(ValueError, match=r"parent\[0\] must be 32 bytes, got str"):
        wire.check_keys(["x" * 32], "parent")  # type: ignore[list-item]


def test_write_statuses_must_be_final_and_one_per_block() -> None:
    assert wire.write_statuses([pb.STORED, pb.DEDUP, pb.NO_SPACE, pb.EXPIRED], 4) == [
        WriteStatus.STORED,
        WriteStatus.DEDUP,
        WriteStatus.NO_SPACE,
        WriteStatus.EXPIRED,
    ]
    with pytest.raises(ProtocolError, match="expected 2"):
        wire.write_statuses([pb.STORED], 2)
    with pytest.raises(ProtocolError, match="not a final status"):
        wire.write_statuses([pb.RESERVED], 1)


def test_lookup_answers_are_runs_checked_against_their_count() -> None:
    runs = [pb.TierRun(tier="host", blocks=3), pb.TierRun(tier="ssd", blocks=2)]
    found = wire.lookup_result(pb.LookupResponse(num_blocks=5, runs=runs), 8)
    assert (found.num_blocks, found.runs) == (5, (("host", 3), ("ssd", 2)))
    assert found.tiers == ("host",) * 3 + ("ssd",) * 2
    old = wire.lookup_result(pb.LookupResponse(num_blocks=2, tiers=["host", "ssd"]), 2)
    assert old.runs == (("host", 1), ("ssd", 1))  # a daemon from before runs
    assert wire.lookup_result(pb.LookupResponse(num_blocks=0), 4).runs == ()
    with pytest.raises(ProtocolError, match="answered 6 blocks of 8 keys, with tiers for 5"):
        wire.lookup_result(pb.LookupResponse(num_blocks=6, runs=runs), 8)
    with pytest.raises(ProtocolError, match="answered 5 blocks of 4 keys"):
        wire.lookup_result(pb.LookupResponse(num_blocks=5, runs=runs), 4)


def test_slots_are_checked_against_the_arena_and_the_block_size() -> None:
    fd = os.memfd_create("arena")
    os.ftruncate(fd, 1 << 16)
    arena = Arena(fd, 1 << 16, b"a" * 16)
    try:
        good = pb.Slot(offset=4096, length=1024)
        assert wire.check_slots([good], 2, 1024, arena) == [(4096, 1024)]
        with pytest.raises(ProtocolError, match="not 1024"):
            wire.check_slots([pb.Slot(offset=0, length=512)], 1, 1024, arena)
        with pytest.raises(ProtocolError, match="outside"):
            wire.check_slots([pb.Slot(offset=1 << 16, length=1024)], 1, 1024, arena)
        with pytest.raises(ProtocolError, match="2 slots for 1 keys"):
            wire.check_slots([good, good], 1, 1024, arena)
        assert wire.check_checksums([7, 8], 2) == (7, 8)
        with pytest.raises(ProtocolError, match="1 checksums for 2 slots"):
            wire.check_checksums([7], 2)

        reply = pb.ReserveResponse(
            reservations=[
                pb.Reservation(status=pb.DEDUP),
                pb.Reservation(status=pb.RESERVED, slot=good),
                pb.Reservation(status=pb.NO_SPACE),
            ]
        )
        reserved, slots, done = wire.reservations(reply, 3, 1024, arena)
        assert (reserved, slots) == ([1], [(4096, 1024)])
        assert done == {0: WriteStatus.DEDUP, 2: WriteStatus.NO_SPACE}
        with pytest.raises(ProtocolError, match="3 answers for 2"):
            wire.reservations(reply, 2, 1024, arena)
    finally:
        arena.close()


def test_stats_and_server_info_become_plain_values() -> None:
    tier = pb.TierStats(name="host", usage_bytes=1, capacity_bytes=2, blocks=3, healthy=True)
    stats = wire.stats(pb.StatsResponse(tiers=[tier], blocks=3, lookups=7))
    assert stats.tiers[0].name == "host" and stats.tiers[0].healthy
    assert (stats.blocks, stats.lookups, stats.puts) == (3, 7, 0)
    info = wire.server_info(pb.HandshakeResponse(server_version="1", chunk_bytes=5))
    assert (info.server_version, info.chunk_bytes, info.shm_socket) == ("1", 5, "")


def test_namespaces_are_hashable_cache_keys() -> None:
    model = ModelFingerprint("m", 1, 1, 8, "float16", block_tokens=4)
    assert Namespace(model, "a") == Namespace(model, "a")
    assert len({Namespace(model, "a"), Namespace(model, "a"), Namespace(model, "b")}) == 2
