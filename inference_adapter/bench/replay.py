"""Replaying a workload through a chat server, one turn at a time, in arrival order.

A :class:`Replayer` owns one mode's :class:`~kvstore.inference_adapter.sessions.ChatServer`
(recompute: no connector; kvstore: a ``StoreConnector``); on several nodes, the replayer of
each shares the sessions and the ideal store with the others. ``run(i)`` keeps the server's
queue filled ``lookahead`` turns ahead (so the prefetch hints name the turns that come
next), runs turn ``i`` and returns a :class:`TurnRecord`:

1. the turn runs (``ChatServer.run_next``): TTFT is the engine's admission-to-first-token
   time; queueing before admission is not part of it;
2. the scripted tail of the answer joins the session's context; in kvstore mode an untimed
   one-token request over that context saves the tail's KV, as a server that saves KV
   during decode would, and the replay waits for every queued save (so each turn sees the
   same store state whatever the machine's speed);
3. the record says how many prompt tokens an unbounded store would have held
   (:class:`IdealStore`), how many the store loaded and from which tier, and where the time
   went on the engine thread (:class:`TimedConnector`: lookup, waiting for layer loads).

:func:`check_same_outputs` fails loudly when two modes generated different tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.client import Namespace, block_keys
from kvstore.inference_adapter.bench.workloads import Workload
from kvstore.inference_adapter.connector import StoreConnector
from kvstore.inference_adapter.engine import Engine
from kvstore.inference_adapter.interfaces import KVConnector, Request, SamplingParams
from kvstore.inference_adapter.sessions import ChatServer, ChatSession

__all__ = [
    "BenchmarkError",
    "IdealStore",
    "Replayer",
    "TimedConnector",
    "TurnRecord",
    "check_same_outputs",
]

SAVE_DRAIN_TIMEOUT_S = 120.0


class BenchmarkError(RuntimeError):
    """The bench cannot vouch for its numbers (different outputs, truncation, lost saves)."""


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """What one turn cost and what the store gave it."""

    session_id: str
    index: int
    warmup: bool
    history_tokens: int  # context before the turn
    prompt_tokens: int
    reusable_tokens: int  # prompt tokens an unbounded store would have loaded
    loaded_tokens: int  # not computed: loaded from the store or resident in the pool (HBM)
    tier_tokens: dict[str, int]  # level (hbm, host, ssd, redis) -> tokens found there
    ttft_s: float
    decode_s: float  # the turn's time after its first token
    decode_tokens: int  # tokens generated after the first
    lookup_s: float  # engine thread, in num_loadable_tokens
    load_wait_s: float  # engine thread, blocked in wait_for_layer_load
    logical_blocks: int  # full blocks of the turn's whole KV (prompt and answer)
    output: tuple[int, ...]


class IdealStore:
    """The block keys an unbounded store would hold: every full block saved so far."""

    def __init__(self, namespace: Namespace, block_tokens: int) -> None:
        self.namespace = namespace
        self.block_tokens = block_tokens
        self._keys: set[bytes] = set()

    def loadable_tokens(self, prompt: Sequence[int]) -> int:
        """Leading prompt tokens it holds, leaving at least one token to compute."""
        held = 0
        for key in block_keys(prompt, self.namespace):
            if key not in self._keys:
                break
            held += 1
        return min(held, (len(prompt) - 1) // self.block_tokens) * self.block_tokens

    def add(self, tokens: Sequence[int]) -> None:
        self._keys.update(block_keys(tokens, self.namespace))


@dataclass(slots=True)
class _Timings:
    lookup_s: float = 0.0
    load_wait_s: float = 0.0


class TimedConnector:
    """A ``KVConnector`` that times the calls the engine thread waits on, per request."""

    def __init__(self, inner: KVConnector) -> None:
        self.inner = inner
        self._timings: dict[str, _Timings] = {}

    def take(self, request_id: str) -> _Timings:
        """The request's timings, forgotten afterwards."""
        return self._timings.pop(request_id, _Timings())

    def prepare(self, request: Request) -> None:
        self.inner.prepare(request)

    def num_loadable_tokens(self, request: Request) -> int:
        start = time.perf_counter()
        try:
            return self.inner.num_loadable_tokens(request)
        finally:
            self._of(request).lookup_s += time.perf_counter() - start

    def start_load(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        self.inner.start_load(request, pages, num_tokens)

    def wait_for_layer_load(self, request: Request, layer: int) -> bool:
        start = time.perf_counter()
        try:
            return self.inner.wait_for_layer_load(request, layer)
        finally:
            self._of(request).load_wait_s += time.perf_counter() - start

    def save(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        self.inner.save(request, pages, num_tokens)

    def request_finished(self, request: Request) -> None:
        self.inner.request_finished(request)

    def _of(self, request: Request) -> _Timings:
        return self._timings.setdefault(request.request_id, _Timings())


class Replayer:
    """One mode of the bench over one workload; see the module docstring.

    Args:
        workload: The turns, in arrival order.
        engine: The engine (its connector is replaced when ``connector`` is given).
        namespace: The keys the ideal store counts in (the connector's, in kvstore mode).
        generated: Tokens the model samples per turn.
        connector: The store connector; None replays the recompute mode.
        lookahead: Queued turns named in each prefetch hint (kvstore mode).
        sessions: The sessions (their contexts), shared with the replayers of other nodes
            that run the same sessions' other turns; None: this replayer's own.
        ideal: The ideal store, likewise shared between nodes; None: this replayer's own.
    """

    def __init__(
        self,
        workload: Workload,
        engine: Engine,
        *,
        namespace: Namespace,
        generated: int,
        connector: StoreConnector | None = None,
        lookahead: int = 0,
        sessions: dict[str, ChatSession] | None = None,
        ideal: IdealStore | None = None,
    ) -> None:
        self.turns = workload.turns
        self.connector = connector
        self.lookahead = lookahead if connector is not None else 0
        sampling = SamplingParams(max_tokens=generated)
        self.server = ChatServer(
            engine, connector=connector, sampling=sampling, lookahead=self.lookahead
        )
        if sessions is not None:
            self.server.sessions = sessions
        self.timer: TimedConnector | None = None
        if connector is not None:
            self.timer = TimedConnector(connector)
            engine.connector = self.timer
        self.ideal = ideal if ideal is not None else IdealStore(namespace, engine.page_tokens)
        self._submitted = 0

    def run(self, i: int) -> TurnRecord:
        """Runs turn ``i`` (the turns before it must have run, in order)."""
        spec = self.turns[i]
        while self._submitted < min(i + 1 + self.lookahead, len(self.turns)):
            queued = self.turns[self._submitted]
            self.server.submit(queued.session_id, queued.message)
            self._submitted += 1
        session = self.server.session(spec.session_id)
        history = len(session.context)
        reusable = self.ideal.loadable_tokens([*session.context, *spec.message])
        start = time.perf_counter()
        turn = self.server.run_next()
        wall_s = time.perf_counter() - start
        request = turn.request
        if turn.dropped_tokens or request.session_id != spec.session_id:
            raise BenchmarkError(f"turn {i} ({spec.session_id}) was truncated or reordered")
        session.context.extend(spec.tail)
        self._save_tail(session.context, request.request_id)
        self.ideal.add(session.context)
        timings = self.timer.take(request.request_id) if self.timer else _Timings()
        block_tokens = self.ideal.block_tokens
        return TurnRecord(
            session_id=spec.session_id,
            index=spec.index,
            warmup=spec.warmup,
            history_tokens=history,
            prompt_tokens=len(request.prompt),
            reusable_tokens=reusable,
            loaded_tokens=request.num_loaded_tokens + request.num_resident_tokens,
            tier_tokens={tier: n * block_tokens for tier, n in request.loaded_from.items()},
            ttft_s=request.ttft_s,
            decode_s=max(wall_s - request.ttft_s, 0.0),
            decode_tokens=len(request.output) - 1,
            lookup_s=timings.lookup_s,
            load_wait_s=timings.load_wait_s,
            logical_blocks=len(session.context) // block_tokens,
            output=tuple(request.output),
        )

    def _save_tail(self, context: list[int], request_id: str) -> None:
        """kvstore mode: stores the KV of the whole context (the tail included) and waits
        until every save reached the daemon."""
        if self.connector is None:
            return
        completion = Request(f"{request_id}/tail", list(context), SamplingParams(max_tokens=1))
        self.server.engine.generate([completion])
        if self.timer is not None:
            self.timer.take(completion.request_id)
        if not self.connector.wait_for_saves(SAVE_DRAIN_TIMEOUT_S):
            raise BenchmarkError(f"saves still queued after {SAVE_DRAIN_TIMEOUT_S:.0f} s")


def check_same_outputs(
    mode: str, records: Sequence[TurnRecord], reference: Sequence[TurnRecord]
) -> None:
    """Raises BenchmarkError at the first turn where ``mode`` generated other tokens than
    the recompute reference."""
    for i, (got, expected) in enumerate(zip(records, reference, strict=True)):
        if got.output != expected.output:
            raise BenchmarkError(
                f"{mode} generated other tokens than recompute at turn {i} "
                f"({got.session_id} turn {got.index}, {got.prompt_tokens}-token prompt, "
                f"{got.loaded_tokens} loaded): {list(got.output)} != {list(expected.output)}"
            )
