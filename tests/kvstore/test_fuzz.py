"""Fuzzing every RPC of a real daemon: garbage bytes, random field values, random Put streams.

One ``kvstore serve`` process (tests/support/daemon.py, tokens on) takes, for each of the 13
methods of ``kvstore.v1.KVStore``:

1. garbage bytes, sent through raw channel methods (no serializers, so the bytes reach the
   daemon's own parser as they are): random strings and crafted ones (truncated and
   over-long varints, every wire type on every field, a length prefix claiming 2^31 bytes,
   groups nested past the parser's limit, bad UTF-8, a message over max_message_bytes);
2. well-formed messages whose fields hold random values from a generator that walks each
   request's descriptor (edge integers, NaN and infinities, long, unicode and NUL strings,
   repeated fields of 0..N entries, nested messages), mixed with a registered namespace,
   stored keys, a real shm session and granted lease ids, so that deeper code runs;
3. Put streams of random chunk sequences (data before a block, short and long blocks, a
   second namespace mid-stream, random checksums, garbage chunks);

and every answer must be one of ``ALLOWED``: an error outside the daemon's error tree would
be INTERNAL, a hang DEADLINE_EXCEEDED (which ends the phase at once). Requests without the
good token must be UNAUTHENTICATED, whatever their bytes. The shm session socket gets garbage
hello lines too (a refusal line or a closed connection). Afterwards the daemon must still
run, answer its health check, store and return blocks bit-exact and have logged no traceback.

The tests share one daemon and run in file order (the last one checks it); requests are
sent one at a time, so a seed replays the same requests. Cases that once found a daemon bug
keep a test of their own, some on daemons of their own: hello lines that ``json`` cannot
decode, a Reserve far past the session's window, parent cycles (refused now; they used to
freeze Delete and pin the arena).

Each failure names what was sent (method, seed and case, a hex prefix of the bytes). With
``-s`` the statuses counted per phase and RPC are printed. ``KVSTORE_FUZZ_SEED`` and
``KVSTORE_FUZZ_ROUNDS`` change the seed and the number of random requests per RPC.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client.wire import fingerprint_message
from kvstore.protos.kvstore.v1 import kvstore_pb2 as pb
from kvstore.protos.kvstore.v1 import kvstore_pb2_grpc
from kvstore.wire.blocks import ROOT_KEY
from tests.support.daemon import running_daemon

# The helpers' asserts report as the tests' own do: rewritten, so registered before the import.
FUZZ_MODULES = ("calls", "fields", "garbage", "shm", "streams", "world")
pytest.register_assert_rewrite(*(f"tests.support.fuzz_{name}" for name in FUZZ_MODULES))

from tests.support.fuzz_calls import Verdicts, call, described, open_channels, put_one, show  # noqa: E402
from tests.support.fuzz_fields import (  # noqa: E402
    FieldFuzzer,
    broken_promise,
    learn,
    learn_layout,
    random_layout_request,
)
from tests.support.fuzz_garbage import garbage_for  # noqa: E402
from tests.support.fuzz_shm import (  # noqa: E402
    check_shm_answer,
    hello,
    hello_exchange,
    shm_garbage,
    shm_session,
)
from tests.support.fuzz_streams import plan_put_stream  # noqa: E402
from tests.support.fuzz_world import (  # noqa: E402
    AUTH,
    BLOCK,
    MAX_MESSAGE,
    METHODS,
    MODEL,
    OTHER_AUTH,
    OTHER_TENANT,
    ROUNDS,
    SEED,
    SUMMARY,
    TENANT,
    TOKENS,
    Code,
    World,
    block_chunks,
    make_world,
    print_summary,
)

# -- the daemon and what the fuzzers know about it (tests/support/fuzz_world.py) -------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    rng = random.Random(SEED)
    with running_daemon(tmp_path_factory.mktemp("fuzz"), tokens=TOKENS) as daemon:
        yield make_world(daemon, rng)


# -- 1. garbage bytes (tests/support/fuzz_garbage.py) ----------------------------------------------


async def test_garbage_bytes_to_every_rpc(world: World) -> None:
    rng = random.Random(f"{SEED}/garbage")
    verdicts = Verdicts("garbage bytes")
    async with open_channels(world.daemon.address) as channels:
        for method in METHODS:
            for name, data in garbage_for(method, rng):
                reply = await call(channels, method, data)
                verdicts.record(method.name, reply, f"garbage {name!r} (seed {SEED}): {show(data)}")
    verdicts.check(world.daemon)


async def test_garbage_without_a_good_token_is_unauthenticated(world: World) -> None:
    """The interceptor refuses before anything is parsed: UNAUTHENTICATED, and only that."""
    rng = random.Random(f"{SEED}/unauthenticated")
    verdicts = Verdicts("no good token")
    credentials = {
        "no token": None,
        "an unknown token": (("authorization", "Bearer nope"),),
        "another scheme": (("authorization", "Basic good"),),
        "an empty bearer": (("authorization", "Bearer "),),
    }
    async with open_channels(world.daemon.address) as channels:
        for method in METHODS:
            for who, metadata in credentials.items():
                for i in range(3):
                    data = rng.randbytes(rng.randint(0, 64)) if i else b""
                    sent: bytes | list[bytes] = [data] if method.client_streaming else data
                    reply = await call(channels, method, sent, metadata=metadata)
                    verdicts.record(
                        method.name,
                        reply,
                        f"{who}, garbage #{i}: {show(sent)}",
                        allowed=frozenset({Code.UNAUTHENTICATED}),
                    )
    verdicts.check(world.daemon)


# -- 2. random field values (tests/support/fuzz_fields.py) -----------------------------------------


async def test_random_field_values_to_every_rpc(world: World) -> None:
    rng = random.Random(f"{SEED}/fields")
    fuzzer = FieldFuzzer(rng, world)
    verdicts = Verdicts("random fields")
    unary = [m for m in METHODS if not m.client_streaming]
    put = next(m for m in METHODS if m.client_streaming)
    with shm_session(world.daemon) as (session, arena):
        world.session = session
        async with open_channels(world.daemon.address) as channels:
            for i in range(ROUNDS):
                for method in unary:
                    cls = getattr(pb, method.input_type.name)
                    request = fuzzer.message(cls)
                    if method.name == "Reserve" and rng.random() < 0.5:
                        request.namespace, request.session = world.namespace, session
                    data = request.SerializeToString()
                    assert len(data) < MAX_MESSAGE, f"the generator made {len(data)} bytes"
                    reply = await call(channels, method, data)
                    case = f"#{i} (seed {SEED}) {described(request)} = {show(data)}"
                    verdicts.record(method.name, reply, case)
                    if problem := broken_promise(request, reply):
                        verdicts.fail(f"{method.name} answered OK with {problem}: {case}")
                    learn(world, request, reply, arena, rng)
                chunks = [fuzzer.message(pb.PutChunk) for _ in range(rng.randint(1, 3))]
                data_chunks = [chunk.SerializeToString() for chunk in chunks]
                reply = await call(channels, put, data_chunks)
                case = f"#{i} (seed {SEED}) [{'; '.join(described(c) for c in chunks)}]"
                verdicts.record(put.name, reply, case)
            # Layouts: zeros, huge numbers, dtype garbage. Never a crash or a MemoryError.
            register = next(m for m in METHODS if m.name == "RegisterNamespace")
            for i in range(ROUNDS):
                request = random_layout_request(rng)
                reply = await call(channels, register, request.SerializeToString())
                verdicts.record(
                    "RegisterNamespace(layouts)", reply, f"#{i} (seed {SEED}) {described(request)}"
                )
                learn_layout(world, request, reply)
            # The limits of one call: MAX_KEYS keys, and one past it.
            lookup = next(m for m in METHODS if m.name == "Lookup")
            for count in (2**16, 2**16 + 1):
                request = pb.LookupRequest(namespace=world.namespace, keys=[b"\7" * 32] * count)
                reply = await call(channels, lookup, request.SerializeToString())
                verdicts.record("Lookup", reply, f"{count} keys of 32 bytes")
        world.session = b""
    verdicts.check(world.daemon)


# -- 3. random Put streams (tests/support/fuzz_streams.py) -----------------------------------------


async def test_random_put_streams(world: World) -> None:
    rng = random.Random(f"{SEED}/put-streams")
    verdicts = Verdicts("put streams")
    put = next(m for m in METHODS if m.client_streaming)
    async with open_channels(world.daemon.address) as channels:
        for i in range(ROUNDS + ROUNDS // 2):
            plan = plan_put_stream(rng, world)
            reply = await call(channels, put, plan.chunks)
            case = f"stream #{i} (seed {SEED}) {plan.story}: {show(plan.chunks)}"
            verdicts.record("Put(streams)", reply, case)
            if reply.code != Code.OK:
                if plan.well_formed and reply.code == Code.INVALID_ARGUMENT:
                    verdicts.fail(f"a well-formed stream was refused: {reply.details!r}: {case}")
                continue
            statuses = list(pb.PutResponse.FromString(reply.messages[0]).statuses)
            if len(statuses) != plan.blocks:
                verdicts.fail(f"{len(statuses)} statuses for {plan.blocks} blocks: {case}")
            for b, (status, wrong) in enumerate(zip(statuses, plan.wrong_checksum, strict=False)):
                if wrong and status == pb.STORED:
                    verdicts.fail(f"block {b} with a wrong checksum was STORED: {case}")
    verdicts.check(world.daemon)


async def test_a_reserve_past_the_window_does_not_stall_the_daemon(world: World) -> None:
    """A valid Reserve of many more blocks than the session's window holds: NO_SPACE for the
    rest, while the daemon keeps answering other calls (here: its health check)."""
    rng = random.Random(f"{SEED}/reserve-many")
    count = 20_000  # a window of 1024 blocks of 4 KiB
    blocks = [
        pb.BlockSpec(key=rng.randbytes(32), parent=ROOT_KEY, num_tokens=16) for _ in range(count)
    ]
    with shm_session(world.daemon, staging_bytes=4 << 20) as (session, _arena):
        request = pb.ReserveRequest(namespace=world.namespace, blocks=blocks, session=session)
        async with grpc.aio.insecure_channel(world.daemon.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            reserve = stub.Reserve(request, metadata=AUTH, timeout=120)
            await asyncio.sleep(0.5)
            started = time.monotonic()
            try:
                await health.Check(health_pb2.HealthCheckRequest(), timeout=3)
            except grpc.aio.AioRpcError as error:
                waited = time.monotonic() - started
                pytest.fail(
                    f"health check {error.code().name} after {waited:.1f} s while a Reserve "
                    f"of {count} blocks ran (a 4 MiB window)"
                )
            finally:
                reply = await reserve
                keys = [spec.key for spec in blocks]
                await stub.Abort(
                    pb.AbortRequest(namespace=world.namespace, keys=keys, session=session),
                    metadata=AUTH,
                    timeout=60,
                )
            statuses = Counter(pb.WriteStatus.Name(r.status) for r in reply.reservations)
            SUMMARY["big reserve"]["Reserve"].update(statuses)
            assert sum(statuses.values()) == count


CYCLE_A, CYCLE_B = b"\xaa" * 32, b"\xbb" * 32


@pytest.mark.parametrize(
    "links",
    [
        pytest.param([(CYCLE_A, CYCLE_A)], id="its-own-parent"),
        pytest.param([(CYCLE_A, CYCLE_B), (CYCLE_B, CYCLE_A)], id="each-others-parent"),
    ],
)
def test_a_parent_cycle_does_not_freeze_delete(
    tmp_path: Path, links: list[tuple[bytes, bytes]]
) -> None:
    with running_daemon(tmp_path, tokens=TOKENS) as daemon:
        try:
            with grpc.insecure_channel(daemon.address) as channel:
                stub = kvstore_pb2_grpc.KVStoreStub(channel)
                request = pb.RegisterNamespaceRequest(
                    model=fingerprint_message(MODEL), tenant=TENANT
                )
                ns = stub.RegisterNamespace(request, metadata=AUTH).namespace
                written = [put_one(stub, ns, key, parent, AUTH) for key, parent in links]
                sent = ", ".join(f"{k.hex()[:4]} <- parent {p.hex()[:4]}" for k, p in links)
                try:
                    deleted = stub.Delete(
                        pb.DeleteRequest(namespace=ns, keys=[CYCLE_A]), metadata=AUTH, timeout=5
                    )
                except grpc.RpcError as error:
                    assert isinstance(error, grpc.Call)
                    pytest.fail(
                        f"Delete of {CYCLE_A.hex()[:4]} answered {error.code().name} after Puts "
                        f"of {sent} ({written}): the daemon froze",
                        pytrace=False,
                    )
                assert deleted.num_blocks <= len(links)
                health = health_pb2_grpc.HealthStub(channel)
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                found = stub.Lookup(
                    pb.LookupRequest(namespace=ns, keys=[CYCLE_A]), metadata=AUTH, timeout=5
                )
                assert found.num_blocks == 0, f"{CYCLE_A.hex()[:4]} is still held after Delete"
            assert "Traceback" not in daemon.log(tail=10**7), daemon.log()
        finally:
            daemon.kill()  # a frozen daemon would not answer SIGTERM: no 30 s wait


def test_blocks_that_are_their_own_parents_do_not_pin_the_arena(tmp_path: Path) -> None:
    """One tenant's self-parented blocks must not keep another tenant out of the host tier."""
    rng = random.Random(f"{SEED}/self-parents")
    with (
        running_daemon(tmp_path, tokens=TOKENS, host_capacity="1MiB") as daemon,
        grpc.insecure_channel(daemon.address) as channel,
    ):
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        model = fingerprint_message(MODEL)
        ns_a = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model=model, tenant=TENANT), metadata=AUTH
        ).namespace
        ns_b = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model=model, tenant=OTHER_TENANT), metadata=OTHER_AUTH
        ).namespace
        capacity = (1 << 20) // BLOCK
        selfish: Counter[str] = Counter()
        for _ in range(capacity + 16):
            key = rng.randbytes(32)
            selfish[put_one(stub, ns_a, key, key, AUTH)] += 1
        others = Counter(
            put_one(stub, ns_b, rng.randbytes(32), ROOT_KEY, OTHER_AUTH) for _ in range(16)
        )
        assert others == {"STORED": 16}, (
            f"tenant-b's Puts got {dict(others)} after tenant-a's {dict(selfish)} Puts of "
            f"blocks that are their own parents, into a host tier of {capacity} blocks"
        )


# -- the shm session socket (tests/support/fuzz_shm.py) --------------------------------------------


def test_garbage_on_the_shm_session_socket(world: World) -> None:
    rng = random.Random(f"{SEED}/shm")
    verdicts = Verdicts("shm socket")
    for name, data, opens in shm_garbage(rng):
        answer, fds = hello_exchange(world.daemon, data)
        code = "closed" if not answer else "session" if fds else "refused"
        SUMMARY["shm socket"]["hello"][code] += 1
        problem = check_shm_answer(name, data, answer, fds, opens)
        if problem:
            verdicts.fail(problem)
    verdicts.check(world.daemon)
    answer, fds = hello_exchange(world.daemon, hello())
    assert fds == 2 and json.loads(answer)["ok"], f"no session after the garbage: {answer!r}"


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b'{"version": 1, "staging_bytes": ' + b"9" * 5000 + b"}\n", id="int-digits"),
        pytest.param(b"[" * 30000 + b"]" * 30000 + b"\n", id="nesting"),
    ],
)
def test_shm_hello_that_json_cannot_decode_is_refused(tmp_path: Path, line: bytes) -> None:
    """On a daemon of its own, so that a traceback here does not fail the checks above."""
    with running_daemon(tmp_path, tokens=TOKENS) as daemon:
        answer, fds = hello_exchange(daemon, line)
        problem = check_shm_answer("undecodable", line, answer, fds, opens=False)
        answer_after, fds_after = hello_exchange(daemon, hello())
        for _ in range(20):  # an unhandled task exception is logged once the task is collected
            if "Traceback" in daemon.log(tail=10**7):
                break
            time.sleep(0.05)
        log = daemon.log(tail=10**7)
        assert daemon.running, f"the daemon died:\n{log}"
        assert fds_after == 2, f"no session after the undecodable hello: {answer_after!r}"
        assert problem is None, problem  # a refusal line, or the connection closed
        assert "Traceback" not in log, f"the daemon logged a traceback for {show(line)}:\n{log}"


# -- 4. the daemon afterwards ----------------------------------------------------------------------


async def test_the_daemon_still_serves_after_the_fuzzing(world: World) -> None:
    daemon = world.daemon
    assert daemon.running, f"the daemon died:\n{daemon.log()}"
    async with grpc.aio.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        rng = random.Random(f"{SEED}/after")
        keys = [rng.randbytes(32) for _ in range(3)]
        payloads = [rng.randbytes(BLOCK) for _ in keys]
        put = await stub.Put(
            block_chunks(world.namespace, keys, payloads), metadata=AUTH, timeout=10
        )
        assert list(put.statuses) == [pb.STORED] * 3
        got: dict[int, bytearray] = defaultdict(bytearray)
        request = pb.GetRequest(namespace=world.namespace, keys=keys)
        async for chunk in stub.Get(request, metadata=AUTH, timeout=10):
            got[chunk.index] += chunk.data
        assert [bytes(got[i]) for i in range(3)] == payloads, "Get returned other bytes than Put"
        stats = await stub.Stats(pb.StatsRequest(), metadata=AUTH, timeout=10)
        assert stats.blocks >= 3 and stats.puts >= 3
    log = daemon.log(tail=10**7)
    assert "Traceback" not in log, f"the daemon logged a traceback:\n{log[-20000:]}"
    assert "failed on a bug" not in log, f"the daemon logged a bug:\n{log[-20000:]}"
    print_summary()
