"""The scheduler side: what to load for a new request, what to save after each step.

vLLM's scheduler calls, per request: ``matched_tokens`` (Lookup of the prompt's block keys,
under a deadline) when it considers admitting it, which also hints the daemon (``prefetch``,
sent in the background, once a request) to promote the blocks it found below the host tier:
a request vLLM cannot admit yet waits in its queue while they move up, and the worker's
lease at the step that loads finds them in host memory, ``allocated`` once its blocks exist, and
every step ``plan_step``, whose :class:`StepPlan` travels to the worker as the step's
connector metadata. ``finished`` forgets the request and returns where its prompt's KV
came from: ``hbm`` (vLLM's own prefix cache, the tokens it had computed when it asked), and
the daemon's tiers (``host``, ``ssd``, ``redis``, the highest copy of each loaded block at
lookup), in tokens; the connector hands them to vLLM's output (``kv_transfer_params``).

Prefill/decode disaggregation: a prefill instance (``handoff``, the default of
``kv_producer``) ends each step only once its saves are committed (the worker's side), so
when a request's reply leaves vLLM its KV is readable; ``params`` adds to the reply's
``kv_transfer_params`` the hand-off (``HANDOFF_PARAM``: how many of the prompt's leading
blocks the daemon holds for it). A proxy passes those params on with the decode request;
the decode instance's ``matched_tokens`` counts what it finds of the named blocks
(``counts``: ``handoff_requests``, ``handoff_named_blocks``, ``handoff_found_blocks``,
``handoff_short``): fewer found (a producer gone, a daemon restarted, a shared tier
unreachable) is recomputed at once, not waited for, since a committed hand-off never comes
later.

- Loads: only whole stored blocks, only past what vLLM computed itself
  (``num_computed_tokens``, its own prefix cache), never the prompt's last token (vLLM must
  compute one token to sample). Blocks are loaded during the step's forward pass, layer by
  layer, so the answer is never "asynchronous".
- Saves: each step, the full stored blocks whose KV exists once the step has run (tokens
  ``< num_computed_tokens + num_scheduled_tokens`` that vLLM knows the ids of), minus those
  found at lookup or saved before. Decode steps complete blocks too, so a chat's answer is
  saved as it grows. The worker copies them out of vLLM's blocks during the step itself, so
  vLLM may free a finished request's blocks at once.

Nothing here talks to vLLM types: requests are read through ``request_id``,
``prompt_token_ids`` and ``all_token_ids``; the connector adapts the rest.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstore.client import (
    ROOT_KEY,
    Found,
    LookupResult,
    Namespace,
    SharedLease,
    block_keys,
    shard_keys,
)
from kvstore.inference_adapter.core.timeline import HitTimeline, PhaseHistograms, now

__all__ = [
    "HANDOFF_PARAM",
    "LEVELS_PARAM",
    "LoadSpec",
    "Match",
    "SaveSpec",
    "SchedulerSide",
    "StepPlan",
    "held_by_every_rank",
]

log = logging.getLogger(__name__)

# The key of vLLM's ``kv_transfer_params`` on a finished request's output that holds its
# prompt tokens by level (``{"hbm": 64, "host": 256}``).
LEVELS_PARAM = "kvstore_levels"
# The key of the hand-off in a prefill's ``kv_transfer_params`` (``{"blocks": 12,
# "block_tokens": 16}``: the prompt's leading blocks committed), passed on to the decode.
HANDOFF_PARAM = "kvstore_handoff"


class TrackedRequest(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True, slots=True)
class Match:
    """What the store holds of a prompt: the lookup (the shortest of every TP rank's) and,
    per rank, the lease its lookup took of the leading blocks in host memory (None: none)."""

    found: LookupResult
    leases: tuple[SharedLease | None, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Stored blocks to write into a request's vLLM blocks this step."""

    request_id: str
    keys: tuple[bytes, ...]
    first_block: int  # index in the sequence of keys[0] (its tokens start there * block_tokens)
    block_ids: tuple[int, ...]  # vLLM blocks, per_block of them per key, in order
    skip_before: int  # vLLM blocks of the sequence below this index vLLM computed itself
    # Per TP rank, the scheduler's lease of these blocks (offsets from keys[0] on), the
    # worker's to read and end; a rank without one leases them itself.
    leases: tuple[SharedLease | None, ...] = ()


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Stored blocks to copy out of a request's vLLM blocks this step."""

    request_id: str
    keys: tuple[bytes, ...]
    parent: bytes  # the key before keys[0] (ROOT_KEY for block 0)
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's loads and saves: the connector metadata's content."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


@dataclass(slots=True)
class _Tracked:
    request: TrackedRequest
    keys: list[bytes] = field(default_factory=list)  # keys of the full blocks seen so far
    block_ids: list[int] = field(default_factory=list)  # the request's vLLM blocks, in order
    next_save: int = 0  # stored blocks below this index are held or handed to a save
    computed: int = 0  # tokens with KV once the last planned step has run
    hinted: bool = False  # a prefetch hint was sent for its blocks below the host tier
    levels: dict[str, int] = field(default_factory=dict)  # level -> prompt tokens from it


@dataclass(frozen=True, slots=True)
class _Match:
    keys: tuple[bytes, ...]
    held: int  # leading stored blocks the daemon holds
    num_computed: int  # vLLM's own prefix hit when it asked
    tiers: tuple[str, ...] = ()  # per held block, its highest tier at lookup
    leases: tuple[SharedLease | None, ...] = ()  # per rank, what its lookup leased


class SchedulerSide:
    """Per-request load and save planning; see the module docstring.

    Args:
        namespace: The model and tenant (its ``block_tokens`` is the stored block size).
        vllm_block_size: vLLM's ``block_size``; divides ``block_tokens``.
        lookup: ``keys -> Match`` (leading blocks held, in which tiers, and the leases the
            lookup took of those in host memory); raises when the daemon cannot answer.
        release: Ends leases no load takes (a request matched again, or not admitted);
            must not block.
        prefetch: ``(request_id, keys)``: hints that the request loads these blocks soon;
            must not block (the connector sends it from a thread of its own).
        load: Plan loads (kv_both, kv_consumer).
        save: Plan saves (kv_both, kv_producer).
        handoff: Name the committed prompt blocks in each finished request's params (a
            prefill instance whose worker commits each step's saves before it ends).
    """

    def __init__(
        self,
        namespace: Namespace,
        vllm_block_size: int,
        lookup: Callable[[Sequence[bytes]], Match],
        *,
        release: Callable[[Sequence[SharedLease]], None] | None = None,
        prefetch: Callable[[str, Sequence[bytes]], None] | None = None,
        load: bool = True,
        save: bool = True,
        handoff: bool = False,
    ) -> None:
        self.namespace = namespace
        self.block_tokens = namespace.model.block_tokens
        if self.block_tokens % vllm_block_size:
            raise ValueError(
                f"block_tokens {self.block_tokens} must be a multiple of vLLM's block_size "
                f"{vllm_block_size}"
            )
        self.per_block = self.block_tokens // vllm_block_size
        self.vllm_block_size = vllm_block_size
        self._lookup = lookup
        self._release = release
        self._prefetch = prefetch
        self._load = load
        self._save = save
        self._handoff = handoff and save
        self.counts = Counter[str]()  # the hand-offs a decode instance received
        self._tracked: dict[str, _Tracked] = {}
        self._matches: dict[str, _Match] = {}
        self._loads: list[LoadSpec] = []
        self._arrived: dict[str, float] = {}  # request -> when vLLM first asked about it
        self.lookup_errors = 0
        self.phases = PhaseHistograms()  # the scheduler's part of each hit: queue, lookup
        self.observed: list[dict[str, float]] = []  # phases observed since taken

    def matched_tokens(self, request: TrackedRequest, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` the daemon can provide (0 on any failure).

        The lookup also runs when vLLM's own prefix cache covers the usable blocks: the
        blocks the daemon holds are then not saved again.
        """
        tracked = self._track(request)
        tracked.levels = {"hbm": num_computed_tokens} if num_computed_tokens else {}
        asked_before = request.request_id in self._arrived
        timeline = HitTimeline(0, arrived=self._arrived.setdefault(request.request_id, now()))
        self._drop_match(request.request_id)  # asked again: its earlier lease goes
        prompt = list(request.prompt_token_ids or ())
        usable = (len(prompt) - 1) // self.block_tokens  # one prompt token is always computed
        if usable <= 0:
            return 0
        if len(tracked.keys) < usable:
            tracked.keys = block_keys(prompt[: usable * self.block_tokens], self.namespace)
        keys = tuple(tracked.keys[:usable])
        timeline.lookup_sent = now()
        try:
            match = self._lookup(keys)
        except Exception as error:
            self.lookup_errors += 1
            log.debug("lookup of request %s failed: %s", request.request_id, error)
            if not asked_before:
                self._count_handoff(getattr(request, "kv_transfer_params", None), usable, 0)
            return 0
        timeline.lookup_answered = now()
        phases = timeline.phases()
        if asked_before:  # it waited in vLLM's queue since: its arrival was counted then
            del phases["queue"]
        self._observe(phases)
        found = match.found
        held = min(found.num_blocks, usable)
        if not asked_before:  # counted at its first lookup, however often vLLM asks again
            self._count_handoff(getattr(request, "kv_transfer_params", None), usable, held)
        tracked.next_save = max(tracked.next_save, held)  # held blocks are never saved again
        if not self._load or not held:
            self._end_leases(match.leases)
            return 0
        if self._prefetch is not None and not tracked.hinted and _below_host(found, held):
            tracked.hinted = True
            self._prefetch(request.request_id, keys[:held])
        self._matches[request.request_id] = _Match(
            keys, held, num_computed_tokens, found.tiers[:held], match.leases
        )
        return max(0, held * self.block_tokens - num_computed_tokens)

    def allocated(self, request: TrackedRequest, block_ids: Sequence[int], external: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's) and will take ``external``
        tokens from the connector."""
        tracked = self._track(request)
        match = self._matches.pop(request.request_id, None)
        if match is not None and external <= 0:
            self._end_leases(match.leases)
        if external <= 0 or match is None:
            return
        first = match.num_computed // self.block_tokens
        held = (match.num_computed + external) // self.block_tokens
        tracked.next_save = max(tracked.next_save, held)
        for index in range(first, held):  # the first may be partly vLLM's own
            tier = match.tiers[index] if index < len(match.tiers) else "host"
            start = max(index * self.block_tokens, match.num_computed)
            tokens = (index + 1) * self.block_tokens - start
            tracked.levels[tier] = tracked.levels.get(tier, 0) + tokens
        per = self.per_block
        self._loads.append(
            LoadSpec(
                request_id=request.request_id,
                keys=match.keys[first:held],
                first_block=first,
                block_ids=tuple(block_ids[first * per : held * per]),
                skip_before=match.num_computed // self.vllm_block_size,
                leases=tuple(_from(lease, first) for lease in match.leases),
            )
        )

    def scheduled(
        self,
        request_id: str,
        block_ids: Sequence[int] | None,
        *,
        computed: int,
        replace: bool,
    ) -> None:
        """The step schedules ``request_id``: its KV reaches ``computed`` tokens, with
        ``block_ids`` added to its blocks (or replacing them after a preemption)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        if replace:
            tracked.block_ids = list(block_ids or ())  # blocks saved before stay saved
        elif block_ids:
            tracked.block_ids.extend(block_ids)
        tracked.computed = computed

    def plan_step(self) -> StepPlan:
        """The loads allocated since the last step, and the saves this step makes possible."""
        loads, self._loads = tuple(self._loads), []
        saves = tuple(spec for t in self._tracked.values() if (spec := self._save_spec(t)))
        return StepPlan(loads=loads, saves=saves)

    def finished(self, request_id: str) -> dict[str, int]:
        """Forgets the request (a lease its lookup took that no load took ends); returns its
        prompt tokens by level (none computed)."""
        tracked = self._tracked.pop(request_id, None)
        self._drop_match(request_id)
        self._arrived.pop(request_id, None)
        return tracked.levels if tracked is not None else {}

    def params(self, request_id: str) -> dict[str, Any] | None:
        """The finished request's ``kv_transfer_params``: its levels (``LEVELS_PARAM``) and,
        with ``handoff``, the prompt's leading blocks committed (``HANDOFF_PARAM``); it is
        forgotten (:meth:`finished`)."""
        tracked = self._tracked.get(request_id)
        params: dict[str, Any] = {}
        if tracked is not None and self._handoff:
            prompt = len(tracked.request.prompt_token_ids or ())
            blocks = min(tracked.next_save, prompt // self.block_tokens)
            params[HANDOFF_PARAM] = {"blocks": blocks, "block_tokens": self.block_tokens}
        levels = self.finished(request_id)
        if levels:
            params[LEVELS_PARAM] = levels
        return params or None

    def _count_handoff(self, params: Mapping[str, Any] | None, usable: int, held: int) -> None:
        """Counts what a decode request found of the blocks its prefill named."""
        handoff = (params or {}).get(HANDOFF_PARAM)
        if not isinstance(handoff, Mapping):
            return
        self.counts["handoff_requests"] += 1
        blocks, tokens = handoff.get("blocks"), handoff.get("block_tokens")
        if tokens != self.block_tokens or not isinstance(blocks, int):
            self.counts["handoff_mismatched"] += 1
            log.warning(
                "a hand-off of %r blocks of %r tokens, where this instance stores blocks of "
                "%d: the prefill instance is configured otherwise; recomputing",
                blocks, tokens, self.block_tokens,
            )  # fmt: skip
            return
        named = min(blocks, usable)
        self.counts["handoff_named_blocks"] += named
        self.counts["handoff_found_blocks"] += min(held, named)
        if held < named:
            self.counts["handoff_short"] += 1
            log.info("a hand-off named %d blocks; the daemon holds %d: the rest is recomputed",
                     named, held)  # fmt: skip

    def take_observed(self) -> list[dict[str, float]]:
        """The hit phases observed since the last call (for vLLM's connector stats)."""
        observed, self.observed = self.observed, []
        return observed

    def _observe(self, phases: dict[str, float]) -> None:
        self.phases.observe(phases)
        self.observed.append(phases)

    def _drop_match(self, request_id: str) -> None:
        match = self._matches.pop(request_id, None)
        if match is not None:
            self._end_leases(match.leases)

    def _end_leases(self, leases: Sequence[SharedLease | None]) -> None:
        held = [lease for lease in leases if lease is not None]
        if held and self._release is not None:
            self._release(held)

    def _track(self, request: TrackedRequest) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._tracked[request.request_id] = _Tracked(request)
        return tracked

    def _save_spec(self, tracked: _Tracked) -> SaveSpec | None:
        if not self._save:
            return None
        tokens = tracked.request.all_token_ids
        full = min(
            min(tracked.computed, len(tokens)) // self.block_tokens,
            len(tracked.block_ids) // self.per_block,
        )
        if full <= tracked.next_save:
            return None
        if len(tracked.keys) < full:
            tracked.keys = block_keys(list(tokens[: full * self.block_tokens]), self.namespace)
        first, per = tracked.next_save, self.per_block
        tracked.next_save = full
        return SaveSpec(
            request_id=tracked.request.request_id,
            keys=tuple(tracked.keys[first:full]),
            parent=tracked.keys[first - 1] if first else ROOT_KEY,
            first_block=first,
            block_ids=tuple(tracked.block_ids[first * per : full * per]),
        )


def _below_host(found: LookupResult, held: int) -> bool:
    """Whether one of the first ``held`` blocks found has its highest copy below host memory."""
    return any(tier != "host" for tier in found.tiers[:held])


def _from(lease: SharedLease | None, first: int) -> SharedLease | None:
    """``lease`` of a chain's blocks, as a lease of its blocks from index ``first`` on."""
    if lease is None or not first:
        return lease
    return SharedLease(lease.lease_id, lease.arena_id, lease.offsets[first:], lease.alive_until)


def held_by_every_rank(
    find: Callable[[Sequence[bytes]], Found],
    keys: Sequence[bytes],
    tp_size: int,
    release: Callable[[Sequence[SharedLease]], None] | None = None,
) -> Match:
    """What every tensor-parallel rank holds of ``keys``: each rank's share looked up (and
    its leading blocks in host memory leased) under its keys (``shard_keys``), the shortest
    answer kept (a block is loadable only when every rank can load its heads of it). When
    a rank's lookup fails, the leases the others took are given to ``release``."""
    found: list[Found] = []
    try:
        for rank in range(tp_size):
            found.append(find(shard_keys(keys, rank)))
    except Exception:
        taken = [lease for each in found if (lease := each.shared()) is not None]
        if taken and release is not None:
            release(taken)
        raise
    shortest = min(found, key=lambda each: each.num_blocks)
    return Match(shortest.result, tuple(each.shared() for each in found))
