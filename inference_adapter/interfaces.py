"""The seam between the engine and the KV store: requests, and the connector protocol.

The engine (``engine.py``) owns the model, the paged KV pool and the step loop; a connector
(``connector.py``) moves KV between the pool and the kvstore daemon. The engine calls the
connector at fixed points, in this order, per request (the vLLM KV-connector shape):

1. admission: ``num_loadable_tokens(request)`` -> how many leading prompt tokens the store
   can provide (at most ``len(prompt) - 1`` so at least one token is computed to produce
   logits; the engine refuses anything outside ``0..len(prompt) - 1``);
2. the engine allocates pool pages for ``prompt + max_tokens - 1`` tokens; at the start of
   the prefill, and only when step 1 said more than 0, ``start_load(request, pages,
   num_tokens)`` begins filling pages ``pages[:num_tokens // page_tokens]`` in the background
   (each block's KV as computed at positions ``0..num_tokens-1``);
3. prefill, per layer ``i``: ``wait_for_layer_load(request, i)`` blocks until layer ``i`` of
   the loaded prefix is in the pool, then the engine computes layer ``i`` for the new tokens
   while the connector loads layer ``i + 1``. Layer 0's wait may lower
   ``request.num_loaded_tokens`` to a whole-page part of what was offered (the store had
   evicted the rest since the lookup): the engine then computes from there. A ``False``
   answer means the load failed or timed out: the engine recomputes the whole prompt into
   the same pages at once, so after answering ``False`` the connector must never write those
   pages again (never a wrong output). Decode steps never call the connector's load methods;
4. after prefill and after the request ends: ``save(request, pages, num_tokens)`` queues the
   full blocks of ``(prompt + output)[:num_tokens]`` that the store lacks, ``num_tokens``
   being how many leading tokens have KV in the pool (at the end ``len(prompt) +
   len(output) - 1``: the last sampled token's KV is never written). It never blocks the
   step (a full queue drops the save and counts it);
5. ``request_finished(request)``: drop per-request state.

Before step 1, while a request waits to be admitted (the batch or the pool is full), the
engine may call ``prepare(request)`` (more than once): the connector may look it up and take
its blocks' lease in the background then, so that step 1 makes no call and the fetch
overlaps the wait. A prepared request that never runs still gets ``request_finished``.

A connector needs the engine's pool, so it is bound after construction:
``engine.connector = StoreConnector(..., engine.kv_pool, ...)``.

A request may carry a ``reuse`` plan (chat truncation): block keys of KV computed at other
positions, to be loaded at the positions the plan gives, instead of the plain prefix match.
Such KV is approximate (it still reflects the tokens that were cut), and so is every token
computed on top of it: the request then carries a ``salt`` (:class:`~kvstore.client.KeySalt`)
under which the connector keys its blocks from the first approximate one on, so an exact
lookup of the same tokens never finds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.client import KeySalt
from kvstore.inference_adapter.core.timeline import HitTimeline


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens: greedy when ``temperature`` is 0."""

    max_tokens: int = 64
    temperature: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True, slots=True)
class ReusedBlock:
    """A stored block to load at a position other than the one it was computed at."""

    key: bytes  # the block's key in the store (from the chain it was saved under)
    position: int  # position of its first token in the new sequence
    stored_at: int  # position of its first token where it was computed (K is rotated there)


@dataclass(slots=True)
class Request:
    """One generation request; the engine fills the result fields."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None
    reuse: Sequence[ReusedBlock] = ()  # truncated chats: blocks to place at new positions
    salt: KeySalt | None = None  # keys the approximate part of prompt + output apart
    # Results, filled by the engine:
    output: list[int] = field(default_factory=list)
    num_loaded_tokens: int = 0  # prompt tokens whose KV came from the store
    num_resident_tokens: int = 0  # prompt tokens in pool pages kept from earlier (HBM)
    num_computed_tokens: int = 0  # prompt tokens prefilled by the model
    loaded_from: dict[str, int] = field(default_factory=dict)  # level (hbm, host, ...) -> blocks
    ttft_s: float = 0.0  # admission to first token
    finished: bool = False
    timeline: HitTimeline | None = None  # arrival to first token (the engine's, on submit)


class KVConnector(Protocol):
    """Moves KV between the engine's paged pool and the store; see the module docstring."""

    def prepare(self, request: Request) -> None: ...

    def num_loadable_tokens(self, request: Request) -> int: ...

    def start_load(self, request: Request, pages: Sequence[int], num_tokens: int) -> None: ...

    def wait_for_layer_load(self, request: Request, layer: int) -> bool: ...

    def save(self, request: Request, pages: Sequence[int], num_tokens: int) -> None: ...

    def request_finished(self, request: Request) -> None: ...


class NullConnector:
    """No store: every prompt is prefilled from scratch."""

    def prepare(self, request: Request) -> None:
        return None

    def num_loadable_tokens(self, request: Request) -> int:
        return 0

    def start_load(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        return None

    def wait_for_layer_load(self, request: Request, layer: int) -> bool:
        return True

    def save(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        return None

    def request_finished(self, request: Request) -> None:
        return None
