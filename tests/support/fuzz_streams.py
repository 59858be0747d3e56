"""Random Put streams: chunk sequences planned with what the daemon must answer to them.

:func:`plan_put_stream` makes data before a block, short and long blocks, a second namespace
mid-stream, random checksums and garbage chunks, and says whether the stream is well formed
(the daemon must take it) and which blocks carry a wrong checksum (never STORED).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import xxhash

from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.blocks import ROOT_KEY
from tests.support.fuzz_world import BLOCK, World


@dataclass
class PlannedStream:
    chunks: list[bytes]
    story: list[str]  # what each step does, for the failure message
    well_formed: bool  # only complete blocks, one namespace, data inside blocks
    blocks: int
    wrong_checksum: list[bool]  # per block: a nonzero checksum that differs from the bytes


def plan_put_stream(rng: random.Random, world: World) -> PlannedStream:
    plan = _Planner(rng, world)
    blocks = rng.choice([0, 1, 1, 2, 3, 5])
    for b in range(blocks):
        plan.block(b)
    return plan.finish(blocks)


class _Planner:
    """One stream being planned: its chunks, its story and whether it stays well formed."""

    def __init__(self, rng: random.Random, world: World) -> None:
        self.rng, self.world = rng, world
        self.chunks: list[bytes] = []
        self.story: list[str] = []
        self.well_formed = True  # stays so for a stream the daemon must take (OK)
        self.wrong: list[bool] = []
        self.ns = self._namespace()
        self.size, self.block_tokens = world.layouts.get(self.ns, (BLOCK, 16))
        # Blocks up to the arena's size: only their first 64 KiB are sent.
        self.big = self.size > 1 << 16
        self.story.append(f"namespace {self.ns[:8].hex()}")
        self.first = self._opening()
        self.parent = ROOT_KEY

    def _namespace(self) -> bytes:
        rng, world = self.rng, self.world
        roll = rng.random()
        if roll < 0.6:
            return world.namespace
        if roll < 0.8 and world.namespaces:
            return rng.choice(world.namespaces)
        return rng.choice([world.other_namespace, world.unknown_namespace, b"", rng.randbytes(31)])

    def _opening(self) -> pb.PutChunk:
        """The namespace chunk: merged into the first block's first chunk, or sent alone."""
        rng = self.rng
        first = pb.PutChunk(namespace=self.ns)
        if rng.random() < 0.1:
            first.data = rng.randbytes(rng.randint(1, 64))
            self.story.append("data before any block")
            self.well_formed = False
        if first.data or rng.random() < 0.5:
            self.chunks.append(first.SerializeToString())
            first = pb.PutChunk()
        return first

    def block(self, b: int) -> None:
        """Block ``b``: its first chunk (with the namespace, if not sent yet), then the rest."""
        rng, world = self.rng, self.world
        fresh = [rng.randbytes(32)] * 4
        key = rng.choice(
            [*fresh, *world.keys, *world.reserved[-2:], rng.randbytes(rng.randint(0, 40))]
        )
        tokens = self.block_tokens if rng.random() < 0.85 else rng.choice([0, 1, 15, 17, 2**32 - 1])
        spec = pb.BlockSpec(key=key, parent=self.parent, num_tokens=tokens)
        if len(key) != 32 or tokens != self.block_tokens:
            self.well_formed = False
        if key == self.parent or key in world.keys or key in world.reserved:
            self.well_formed = False  # its parent chain may lead back to it: refused as a cycle
        checksum, pieces, sent = self._body()
        head = pb.PutChunk(block=spec, checksum=checksum)
        head.MergeFrom(self.first)
        self.first = pb.PutChunk()
        if pieces and rng.random() < 0.7:
            head.data = pieces.pop(0)
        self.chunks.append(head.SerializeToString())
        self.story.append(
            f"block {b} key {key[:4].hex()} tokens {tokens} {sent} of {self.size} bytes"
        )
        self._rest(pieces)
        self.parent = key if len(key) == 32 else self.parent

    def _body(self) -> tuple[int, list[bytes], int]:
        """A block's checksum, its bytes cut in pieces, and how many bytes those are."""
        rng = self.rng
        payload = rng.randbytes(min(self.size, 1 << 16))
        checksum = rng.choice([0, xxhash.xxh3_64_intdigest(payload), rng.randrange(1, 2**64)])
        self.wrong.append(checksum not in (0, xxhash.xxh3_64_intdigest(payload)))
        delta = 0 if rng.random() < 0.8 else rng.choice([-len(payload), -1, 1, 100])
        if delta or self.big:
            self.well_formed = False
        body = payload[: len(payload) + delta] + rng.randbytes(max(0, delta))
        sent = len(body)
        pieces = []
        while body:
            cut = rng.choice([len(body), rng.randint(1, len(body)), 1, 1000])
            pieces.append(body[:cut])
            body = body[cut:]
        return checksum, pieces, sent

    def _rest(self, pieces: list[bytes]) -> None:
        """The block's other pieces (rarely naming a namespace), maybe an empty or a garbage
        chunk after them."""
        rng, world, ns = self.rng, self.world, self.ns
        for piece in pieces:
            extra = pb.PutChunk(data=piece)
            if rng.random() < 0.05:
                extra.namespace = rng.choice([ns, world.other_namespace, world.unknown_namespace])
                self.story.append(f"namespace {extra.namespace[:8].hex()} mid-stream")
                self.well_formed = self.well_formed and extra.namespace == ns
            self.chunks.append(extra.SerializeToString())
        if rng.random() < 0.05:
            self.chunks.append(b"")
            self.story.append("an empty chunk")
        if rng.random() < 0.05:
            self.chunks.append(rng.randbytes(rng.randint(1, 40)))
            self.story.append("a garbage chunk")
            self.well_formed = False

    def finish(self, blocks: int) -> PlannedStream:
        if self.first.ByteSize():
            self.chunks.append(self.first.SerializeToString())
        if self.rng.random() < 0.05:
            self.chunks.append(pb.PutChunk(data=b"tail").SerializeToString())
            self.story.append("data after the last block")
            self.well_formed = False
        if self.ns not in (self.world.namespace, *self.world.namespaces):
            self.well_formed = False
        return PlannedStream(self.chunks, self.story, self.well_formed, blocks, self.wrong)
