"""The daemon benchmark's servers: child processes, and the raw gRPC server that is its limit.

    python benchmarks/raw_grpc.py unix:/path/to/raw.sock MAX_MESSAGE_BYTES

serves, until SIGTERM, a health service and three methods of plain bytes messages (no
protobuf, no kvstore): ``Sink`` (a stream of chunks in -> their total length), ``Source``
(pre-cut chunks of random bytes out) and ``Echo``. :class:`RawClient` calls them with the same
message-size limits; ``child`` and ``serving`` start a server process and wait for its health.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import struct
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

RAW_SERVICE = "kvstore.bench.Raw"
SOURCE_REQUEST = struct.Struct("<QQQ")  # blocks, block bytes, chunk bytes
TOTAL = struct.Struct("<Q")


@contextlib.asynccontextmanager
async def child(command: Sequence[str], log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """Runs ``command`` (output to ``log``); SIGTERM on exit, SIGKILL after 30 s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(
            *command, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env
        )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def serving(proc: asyncio.subprocess.Process, address: str, log: Path) -> None:
    """Waits until the health service at ``address`` answers SERVING (a minute at most).

    Raises:
        RuntimeError: The process exited or did not serve in time (its log's tail included).
    """
    deadline = time.monotonic() + 60
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and proc.returncode is None:
            with contextlib.suppress(grpc.RpcError):
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.05)
    tail = (await asyncio.to_thread(log.read_text, errors="replace"))[-4000:]
    raise RuntimeError(f"{address} did not serve:\n{tail}")


def raw_server_command(address: str, max_message_bytes: int) -> list[str]:
    """The command line of the raw server's child process."""
    return [sys.executable, "-P", __file__, address, str(max_message_bytes)]  # needs no neighbour


def message_limits(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def raw_handler() -> grpc.GenericRpcHandler:
    """Sink (a bytes stream in -> its length), Source (pre-cut chunks out) and Echo."""
    cut: dict[tuple[int, int], list[bytes]] = {}  # (block bytes, chunk bytes) -> chunks

    async def sink(requests: AsyncIterator[bytes], _context: object) -> bytes:
        total = 0
        async for chunk in requests:
            total += len(chunk)
        return TOTAL.pack(total)

    async def source(request: bytes, _context: object) -> AsyncIterator[bytes]:
        count, size, step = SOURCE_REQUEST.unpack(request)
        if (size, step) not in cut:
            data = os.urandom(size)
            cut[size, step] = [data[i : i + step] for i in range(0, size, step)]
        for _ in range(count):
            for chunk in cut[size, step]:
                yield chunk

    async def echo(request: bytes, _context: object) -> bytes:
        return request

    return grpc.method_handlers_generic_handler(
        RAW_SERVICE,
        {
            "Sink": grpc.stream_unary_rpc_method_handler(sink),
            "Source": grpc.unary_stream_rpc_method_handler(source),
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
        },
    )


async def serve_raw(address: str, max_message_bytes: int) -> None:
    """The raw server (and a health service) on ``address`` until SIGTERM."""
    server = grpc.aio.server(options=message_limits(max_message_bytes))
    server.add_generic_rpc_handlers([raw_handler()])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(address)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1)


class RawClient:
    """The raw server's calls (bytes in, bytes out), with the same message-size limits."""

    def __init__(self, address: str, max_message_bytes: int) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=message_limits(max_message_bytes))
        self.echo = self.channel.unary_unary(f"/{RAW_SERVICE}/Echo")
        self._sink = self.channel.stream_unary(f"/{RAW_SERVICE}/Sink")
        self._source = self.channel.unary_stream(f"/{RAW_SERVICE}/Source")

    async def put(self, sources: Sequence[memoryview], chunk_bytes: int) -> int:
        """Streams the sources to the sink in chunks (one ``bytes()`` each, as any sender of
        user memory needs); the bytes it received."""

        def chunks() -> Iterator[bytes]:
            for data in sources:
                for start in range(0, len(data), chunk_bytes):
                    yield bytes(data[start : start + chunk_bytes])

        reply = await self._sink(chunks())
        return int(TOTAL.unpack(reply)[0])

    async def get(self, targets: Sequence[memoryview], chunk_bytes: int) -> int:
        """Fills the targets (one block each) from the source's chunks; how many it filled."""
        size = len(targets[0])
        block = filled = 0
        async for chunk in self._source(SOURCE_REQUEST.pack(len(targets), size, chunk_bytes)):
            targets[block][filled : filled + len(chunk)] = chunk
            filled += len(chunk)
            if filled == size:
                block, filled = block + 1, 0
        return block


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The daemon benchmark's raw gRPC server.")
    parser.add_argument("address", help="where to listen, e.g. unix:/path/to/raw.sock")
    parser.add_argument("max_message_bytes", type=int, help="the daemon's message-size limit")
    args = parser.parse_args(argv)
    uvloop.run(serve_raw(args.address, args.max_message_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
