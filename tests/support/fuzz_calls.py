"""How the fuzz test sends its requests, and judges the answers.

:func:`call` sends raw bytes (no serializers: the daemon's own parser gets them as they are)
to one RPC over :class:`Channels` and returns a :class:`Reply`; :class:`Verdicts` counts a
phase's statuses into ``SUMMARY`` and keeps every answer outside the allowed set;
:func:`show` and :func:`described` say what was sent; :func:`put_one` puts one block.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import text_format
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message

from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from tests.support.daemon import Daemon
from tests.support.fuzz_world import (
    ALLOWED,
    AUTH,
    BLOCK,
    CALL_SECONDS,
    SEED,
    SERVICE,
    SUMMARY,
    Code,
)


def show(data: bytes | Sequence[bytes]) -> str:
    """A short, reproducible description of what was sent."""
    if isinstance(data, bytes | bytearray):
        more = "…" if len(data) > 48 else ""
        return f"{len(data)} bytes {bytes(data[:48]).hex()}{more}"
    parts = [show(chunk) for chunk in data[:4]]
    if len(data) > 4:
        parts.append(f"… {len(data) - 4} more")
    return f"a stream of {len(data)} chunks [{'; '.join(parts)}]"


def described(message: Message) -> str:
    text = text_format.MessageToString(message, as_one_line=True, as_utf8=False)
    return text if len(text) <= 300 else text[:300] + "…"


Metadata = tuple[tuple[str, str], ...] | None


@dataclass
class Reply:
    code: grpc.StatusCode
    details: str
    messages: list[bytes]


@dataclass
class Channels:
    """An asyncio channel, and a sync one for the client-streaming Put.

    The asyncio client may report INTERNAL "Internal error from Core" in place of the status
    a server sent when it ends a client stream before the client has sent every chunk (a
    write fails after the status came: grpc/grpc#36066, fix proposed in grpc/grpc#43486);
    the sync client reports the server's status. A Put that the daemon refuses at its first
    chunk is exactly that, so Puts go through the sync client, in a thread.
    """

    aio: grpc.aio.Channel
    sync: grpc.Channel


@contextlib.asynccontextmanager
async def open_channels(address: str) -> AsyncIterator[Channels]:
    with grpc.insecure_channel(address) as sync:
        async with grpc.aio.insecure_channel(address) as aio:
            yield Channels(aio, sync)


def _stream_unary(
    channel: grpc.Channel, path: str, chunks: list[bytes], metadata: Metadata
) -> Reply:
    try:
        reply = channel.stream_unary(path)(iter(chunks), metadata=metadata, timeout=CALL_SECONDS)
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        return Reply(error.code(), error.details() or "", [])
    return Reply(Code.OK, "", [reply])


async def call(
    channels: Channels,
    method: MethodDescriptor,
    data: bytes | Sequence[bytes],
    metadata: Metadata = AUTH,
) -> Reply:
    """Sends raw bytes (a list of chunks for Put) to ``method``; the status and raw replies."""
    path = f"/{SERVICE}/{method.name}"
    if method.client_streaming:
        assert not isinstance(data, bytes)
        return await asyncio.to_thread(_stream_unary, channels.sync, path, list(data), metadata)
    assert isinstance(data, bytes)
    try:
        if method.server_streaming:
            stream = channels.aio.unary_stream(path)(data, metadata=metadata, timeout=CALL_SECONDS)
            return Reply(Code.OK, "", [chunk async for chunk in stream])
        reply = await channels.aio.unary_unary(path)(data, metadata=metadata, timeout=CALL_SECONDS)
        return Reply(Code.OK, "", [reply])
    except grpc.aio.AioRpcError as error:
        return Reply(error.code(), error.details() or "", [])


class Verdicts:
    """Counts the statuses of one phase and keeps every answer outside the allowed set."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.failures: list[str] = []

    def record(
        self, method: str, reply: Reply, case: str, allowed: frozenset[Code] = ALLOWED
    ) -> None:
        SUMMARY[self.phase][method][reply.code.name] += 1
        if reply.code not in allowed:
            self.failures.append(
                f"{method} answered {reply.code.name} ({reply.details!r}) to {case}"
            )
        if reply.code == Code.DEADLINE_EXCEEDED:  # a hang: what follows would only time out
            shown = "\n  ".join(self.failures[-20:])
            pytest.fail(
                f"{self.phase}: the daemon did not answer within {CALL_SECONDS:g} s; "
                f"failures so far, the last one the hang:\n  {shown}",
                pytrace=False,
            )

    def fail(self, problem: str) -> None:
        self.failures.append(problem)

    def check(self, daemon: Daemon) -> None:
        shown = "\n  ".join(self.failures[:20])
        more = f"\n  … and {len(self.failures) - 20} more" if len(self.failures) > 20 else ""
        assert not self.failures, (
            f"{self.phase}: {len(self.failures)} bad answers (seed {SEED}):\n  {shown}{more}\n"
            f"daemon log tail:\n{daemon.log()}"
        )
        assert daemon.running, f"the daemon died during {self.phase}:\n{daemon.log()}"


def put_one(
    stub: kvstore_pb2_grpc.KVStoreStub, ns: bytes, key: bytes, parent: bytes, metadata: Metadata
) -> str:
    """One block through the Put stream: its WriteStatus name, or the status code's name."""
    chunk = pb.PutChunk(
        namespace=ns, block=pb.BlockSpec(key=key, parent=parent, num_tokens=16), data=bytes(BLOCK)
    )
    try:
        reply = stub.Put(iter([chunk]), metadata=metadata, timeout=10)
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        assert error.code() == Code.INVALID_ARGUMENT, f"Put of {key.hex()[:8]}: {error}"
        return "INVALID_ARGUMENT"  # refusing a parent cycle is right too
    return pb.WriteStatus.Name(reply.statuses[0])
