"""A paged inference engine: one model, one KV pool, requests run to completion.

``Engine.generate(requests)`` loops until every request is done:

1. admission, while a batch slot and enough pages are free: with ``retain_pages``, map the
   prompt's leading pages still resident in the pool (``PageAllocator.share``: the HBM
   level, no copy, counted as ``loaded_from["hbm"]``); unless they cover every full page
   but the last token's, ask the connector how many leading prompt tokens it can load
   (``num_loadable_tokens``: when that is more than the resident pages hold, the load
   replaces them); take pages for the rest of the prompt plus ``max_tokens``
   (``PageAllocator.allocate``). The request next in line when there is
   no room is handed to ``prepare`` before each step, so the connector can fetch its KV
   while it waits;
2. prefill of the admitted request, new tokens only: ``start_load`` the prefix, then before
   each layer ``wait_for_layer_load(request, layer)``, and that layer attends over the
   loaded prefix and the new tokens causally. A ``False`` answer drops the prefix and
   prefills the whole prompt again. (With nothing to load, neither is called.) The first
   token is sampled; ``save(request, pages, len(prompt))`` offers the prompt's KV;
3. decode: one token for every running sequence per step (``decode_attention``);
4. a sequence that sampled a stop token or reached ``max_tokens`` ends: ``save`` offers all
   its KV (``tokens = prompt + output``; all but the last token, which was never fed back),
   then ``request_finished``, then its pages are freed. With ``retain_pages``, the full
   pages of exact KV (a request without a ``reuse`` plan or ``salt``) are published under
   their prefix keys after the prefill and at the end, so the pages stay resident for the
   next turn or another session with the same prefix (up to ``retain_pages`` idle pages,
   least recently used evicted first, but the pages of requests still waiting in
   ``generate`` and of the prompts given to ``protect`` (a chat server's queued turns) only
   when no other idle page is left: scheduler-aware eviction).

``generate(requests, on_token=...)`` calls ``on_token(request, token)`` as each token is
sampled (a chat streams its reply with it). ``score(request)`` runs one request's admission,
load and prefill like ``generate`` and returns the logits of the prompt tokens it computed,
sampling nothing (perplexity over a reused prefix); ``prefill_logits`` does the same from
scratch without the connector.

The connector sees the pool through ``kv_pool``, ``page_tokens`` and ``rope_tables``; it can
be set after construction (``engine.connector = ...``) since it usually needs them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from kvstore.client import block_keys
from kvstore.inference_adapter.core.timeline import HitTimeline, PhaseHistograms, now
from kvstore.inference_adapter.hbm import HBM_POLICIES
from kvstore.inference_adapter.interfaces import (
    KVConnector,
    NullConnector,
    Request,
    SamplingParams,
)
from kvstore.inference_adapter.model import LlamaModel
from kvstore.inference_adapter.pages import (
    PageAllocator,
    decode_batch,
    pages_for,
    prefill_batch,
)
from kvstore.inference_adapter.sampling import new_generator, sample
from kvstore.inference_adapter.weights import LlamaConfig, namespace_for
from kvstore.kernels.rope import RopeTables

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Sequence:
    """A request while it holds pages."""

    request: Request
    pages: list[int]
    admitted_at: float  # time.perf_counter() at admission
    generator: torch.Generator | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.request.prompt) + len(self.request.output)

    @property
    def is_finished(self) -> bool:
        """Whether it reached max_tokens or sampled a stop token."""
        output, sampling = self.request.output, self.request.sampling
        return len(output) >= sampling.max_tokens or output[-1] in sampling.stop_token_ids


class Engine:
    """Runs requests on ``model`` with a paged KV pool of ``num_pages`` pages."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        num_pages: int,
        page_tokens: int,
        connector: KVConnector | None = None,
        max_batch: int = 8,
        retain_pages: int = 0,
        hbm_policy: str = "scheduler_aware",
    ) -> None:
        if hbm_policy not in HBM_POLICIES:
            raise ValueError(
                f"hbm_policy must be one of {', '.join(HBM_POLICIES)}; got {hbm_policy!r}"
            )
        if page_tokens < 1 or max_batch < 1:
            raise ValueError(
                f"page_tokens and max_batch must be >= 1, got {page_tokens}, {max_batch}"
            )
        self.model = model
        self.page_tokens = page_tokens
        self.max_batch = max_batch
        self.connector: KVConnector = connector or NullConnector()
        self.allocator = PageAllocator(num_pages, retain_pages=retain_pages)
        self.hbm_policy = hbm_policy  # "lru": protect() names nothing
        # Keys of the pool's resident pages: the store's prefix-hash chain, in a namespace of
        # this pool's own (one model, one page size).
        self._page_space = namespace_for(
            model.config, model_name="kvstore-engine-pool", block_tokens=page_tokens
        )
        # [num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]
        self.kv_pool = model.new_kv_pool(num_pages, page_tokens)
        self._queued: list[bytes] = []  # keys of pages to evict last (protect)
        # Prompt tokens by where their KV came from: hbm, host, ssd, redis, computed.
        self.prompt_tokens: Counter[str] = Counter()
        self.hit_phases = PhaseHistograms()  # every store hit's timeline, by phase

    @property
    def config(self) -> LlamaConfig:
        """The model's architecture."""
        return self.model.config

    @property
    def rope_tables(self) -> RopeTables:
        """cos/sin for positions ``0 .. max_position_embeddings - 1``, as the model uses them."""
        return self.model.rope_tables

    @torch.inference_mode()
    def generate(
        self,
        requests: list[Request],
        on_token: Callable[[Request, int], None] | None = None,
    ) -> list[Request]:
        """Run ``requests`` to completion, at most ``max_batch`` at a time, and fill their
        result fields.

        Args:
            requests: What to run.
            on_token: Called with each request and token as it is sampled (on this thread,
                between steps).

        Returns:
            ``requests``, in the order given.

        Raises:
            ValueError: A request can never run here (empty prompt, unknown token ids, more
                positions than the model has, more pages than the pool has); nothing runs.
        """
        for request in requests:
            self.check_request(request)
            if request.timeline is None:  # it arrives now
                request.timeline = HitTimeline(self.config.num_hidden_layers)
        waiting = deque(requests)
        running: list[Sequence] = []
        queued = {r.request_id: self._exact_keys(r, len(r.prompt) - 1) for r in requests}
        self._protect_waiting(queued)
        try:
            while waiting or running:
                while waiting and self.can_admit(waiting[0], len(running)):
                    running.append(self._admit(waiting.popleft()))
                    queued.pop(running[-1].request.request_id, None)
                    self._protect_waiting(queued)
                    self._prefill(running[-1])
                    _emit(on_token, running[-1:])
                    self._retire_finished(running)
                if waiting:  # the next one waits for room: its fetch overlaps the wait
                    self.connector.prepare(waiting[0])
                self._decode(running)
                _emit(on_token, running)
                self._retire_finished(running)
        finally:
            for seq in running:  # only after an error: give the pages back
                self.allocator.free(seq.pages)
            if waiting:  # only after an error: the next one may hold a lease
                self.connector.request_finished(waiting[0])
        return requests

    def check_request(self, request: Request) -> None:
        """Raise ValueError naming the numbers when ``request`` could never run."""
        prompt, max_tokens = request.prompt, request.sampling.max_tokens
        name, config = f"request {request.request_id!r}", self.config
        if not prompt:
            raise ValueError(f"{name}: empty prompt")
        if min(prompt) < 0 or max(prompt) >= config.vocab_size:
            raise ValueError(f"{name}: token ids must be in 0..{config.vocab_size - 1}")
        num_positions = len(prompt) + max_tokens - 1
        if num_positions > config.max_position_embeddings:
            raise ValueError(
                f"{name}: {len(prompt)} prompt tokens + {max_tokens} max_tokens need "
                f"{num_positions} positions, the model has {config.max_position_embeddings}"
            )
        num_pages = self.num_pages_needed(request)
        if num_pages > self.allocator.num_pages:
            raise ValueError(
                f"{name}: {len(prompt)} prompt tokens + {max_tokens} max_tokens need "
                f"{num_pages} pages of {self.page_tokens} tokens, the pool has "
                f"{self.allocator.num_pages}"
            )

    def num_pages_needed(self, request: Request) -> int:
        """Pages for the KV of the prompt and all outputs but the last (never fed back)."""
        num_tokens = len(request.prompt) + request.sampling.max_tokens - 1
        return pages_for(num_tokens, self.page_tokens)

    def can_admit(self, request: Request, num_running: int) -> bool:
        """Whether a batch slot and the pages ``request`` needs are free now."""
        free_pages = self.allocator.can_allocate(self.num_pages_needed(request))
        return num_running < self.max_batch and free_pages

    def _admit(self, request: Request) -> Sequence:
        admitted_at = time.perf_counter()
        request.loaded_from = {}
        shared = self.allocator.share(self._exact_keys(request, len(request.prompt) - 1))
        num_loadable = 0
        if not shared or len(shared) < (len(request.prompt) - 1) // self.page_tokens:
            num_loadable = self.connector.num_loadable_tokens(request)
            if not 0 <= num_loadable < len(request.prompt):
                self.allocator.free(shared)
                raise ValueError(
                    f"request {request.request_id!r}: the connector offers {num_loadable} "
                    f"tokens of a {len(request.prompt)}-token prompt "
                    f"(0..{len(request.prompt) - 1} allowed)"
                )
            if num_loadable > len(shared) * self.page_tokens:
                self.allocator.free(shared)  # one load for the whole prefix
                shared = []
            elif num_loadable:  # the pool holds all of it: the lease taken for it goes now
                self.connector.start_load(request, shared, 0)
                num_loadable = 0
        pages = shared + self.allocator.allocate(self.num_pages_needed(request) - len(shared))
        generator = new_generator(request.sampling, self.model.device)
        request.output, request.finished, request.num_loaded_tokens = [], False, num_loadable
        request.num_resident_tokens = len(shared) * self.page_tokens
        if shared:
            request.loaded_from = {"hbm": len(shared)}
        return Sequence(request, pages, admitted_at, generator)

    def protect(self, prompts: Iterable[SequenceOf[int]]) -> None:
        """Scheduler-aware eviction from the pool: the resident pages of these prompts (turns
        queued to run next) are evicted only after every other idle page. Replaces the
        prompts given before; :meth:`generate` adds its own requests while they wait."""
        if not self.allocator.retain_pages or self.hbm_policy == "lru":
            return
        self._queued = [k for p in prompts for k in block_keys(list(p)[:-1], self._page_space)]
        self.allocator.protect(self._queued)

    def _protect_waiting(self, waiting: dict[str, list[bytes]]) -> None:
        """Protects the pages of ``protect``'s prompts and of requests not yet admitted."""
        if self.allocator.retain_pages and self.hbm_policy != "lru":
            self.allocator.protect([*self._queued, *itertools.chain(*waiting.values())])

    def _exact_keys(self, request: Request, num_tokens: int) -> list[bytes]:
        """Keys of the full pages of ``(prompt + output)[:num_tokens]`` when their KV is
        what a prefill of those tokens gives (no reuse plan, no salt); else none."""
        if not self.allocator.retain_pages or request.reuse or request.salt is not None:
            return []
        tokens = (request.prompt + request.output)[:num_tokens]
        return block_keys(tokens, self._page_space)

    def _publish(self, seq: Sequence, num_tokens: int) -> None:
        """The full pages of the sequence's first ``num_tokens`` tokens become resident."""
        keys = self._exact_keys(seq.request, num_tokens)
        self.allocator.publish(seq.pages[: len(keys)], keys)

    def _prefill(self, seq: Sequence) -> None:
        request = seq.request
        hidden = self._prefill_hidden(seq)
        computed = now()
        logits = self.model.compute_logits(hidden[-1:])  # [1, vocab_size]
        request.output += sample(logits, [request.sampling], [seq.generator])
        request.ttft_s = time.perf_counter() - seq.admitted_at
        self._observe_hit(request, computed)
        self.connector.save(request, seq.pages, len(request.prompt))
        self._publish(seq, len(request.prompt))

    def _observe_hit(self, request: Request, computed: float) -> None:
        """The timeline of a prompt the store loaded, into ``hit_phases``."""
        timeline = request.timeline
        if timeline is None or not request.num_loaded_tokens:
            return
        timeline.computed, timeline.first_token = computed, now()
        self.hit_phases.observe(timeline.phases())

    def _prefill_hidden(self, seq: Sequence) -> torch.Tensor:
        """Loads what the connector offered and computes the rest of the prompt: last-layer
        states of the computed tokens ``[num_computed_tokens, hidden]``. Counts the prompt's
        tokens by level in ``prompt_tokens``."""
        hidden = self._prompt_states(seq)
        self._count_levels(seq.request)
        return hidden

    def _count_levels(self, request: Request) -> None:
        counts = self.prompt_tokens
        counts["hbm"] += request.num_resident_tokens
        stored = {level: n for level, n in request.loaded_from.items() if level != "hbm"}
        if request.num_loaded_tokens and stored:
            per_block = request.num_loaded_tokens // sum(stored.values())
            for level, blocks in stored.items():
                counts[level] += blocks * per_block
        counts["computed"] += request.num_computed_tokens

    def _prompt_states(self, seq: Sequence) -> torch.Tensor:
        request = seq.request
        resident = request.num_resident_tokens
        if resident:  # in shared pages: nothing to load, nothing to wait for
            hidden = self._forward_prompt(seq, resident, loading=False)
            assert hidden is not None  # only a load fails
            request.num_computed_tokens = len(request.prompt) - resident
            return hidden
        if request.num_loaded_tokens:
            self.connector.start_load(request, seq.pages, request.num_loaded_tokens)
        hidden = self._forward_prompt(seq, request.num_loaded_tokens)
        while hidden is None:  # a layer's load failed: recompute all (a start of 0 never fails)
            logger.warning("request %s: loading its prefix failed, recomputing", request.request_id)
            request.num_loaded_tokens = 0
            hidden = self._forward_prompt(seq, 0)
        request.num_computed_tokens = len(request.prompt) - request.num_loaded_tokens
        return hidden

    def _forward_prompt(
        self, seq: Sequence, start: int, *, loading: bool = True
    ) -> torch.Tensor | None:
        """Last-layer states of the prompt after its first ``start`` tokens (loaded by the
        connector, which may lower ``request.num_loaded_tokens`` when layer 0 is in: the
        daemon gave only a leading part; or, not ``loading``, in resident pages); None when
        a layer's load failed."""
        request, model = seq.request, self.model
        loading = loading and start > 0
        if loading:
            if not self.connector.wait_for_layer_load(request, 0):
                return None
            start = self._loaded_prefix(request, start)
        new_tokens = request.prompt[start:]
        batch = prefill_batch(seq.pages, start, len(new_tokens), self.page_tokens, model.device)
        hidden = model.embed(torch.tensor(new_tokens, device=model.device))
        for layer in range(self.config.num_hidden_layers):
            if loading and layer and not self.connector.wait_for_layer_load(request, layer):
                return None
            hidden = model.run_layer(layer, hidden, batch, self.kv_pool)
        return hidden

    def _loaded_prefix(self, request: Request, offered: int) -> int:
        """The tokens loaded after layer 0's wait: ``offered``, or a whole-page part of it."""
        loaded = request.num_loaded_tokens
        if not 0 < loaded <= offered or loaded % self.page_tokens:
            raise ValueError(
                f"request {request.request_id!r}: the connector lowered a load of {offered} "
                f"tokens to {loaded} (1..{offered} in whole pages of {self.page_tokens} allowed)"
            )
        return loaded

    def _decode(self, running: SequenceOf[Sequence]) -> None:
        if not running:
            return
        model = self.model
        batch = decode_batch(
            [seq.pages for seq in running],
            [seq.num_tokens for seq in running],
            self.page_tokens,
            model.device,
        )
        last = torch.tensor([seq.request.output[-1] for seq in running], device=model.device)
        logits = model.compute_logits(model(last, batch, self.kv_pool))  # [batch, vocab_size]
        params = [seq.request.sampling for seq in running]
        tokens = sample(logits, params, [seq.generator for seq in running])
        for seq, token in zip(running, tokens, strict=True):
            seq.request.output.append(token)

    def _retire_finished(self, running: list[Sequence]) -> None:
        for seq in [seq for seq in running if seq.is_finished]:
            running.remove(seq)
            request = seq.request
            request.finished = True
            # The last sampled token was never fed back, so its KV is not in the pool.
            self.connector.save(request, seq.pages, seq.num_tokens - 1)
            self.connector.request_finished(request)
            self._publish(seq, seq.num_tokens - 1)
            self.allocator.free(seq.pages)

    @torch.inference_mode()
    def score(self, request: Request) -> torch.Tensor:
        """Logits of the prompt tokens ``request`` computes, through the connector.

        Admission, load and prefill run as in ``generate``; nothing is sampled. The prompt's
        KV is offered to ``save`` and the request finishes. ``request.num_loaded_tokens`` says
        where the computed tokens start; ``ttft_s`` is admission to the last logits.

        Returns:
            ``[len(prompt) - num_loaded_tokens, vocab_size]``: row ``i`` predicts prompt token
            ``num_loaded_tokens + i + 1`` (the last row, the token after the prompt).

        Raises:
            ValueError: As ``generate``, or no pages are free now.
        """
        self.check_request(request)
        if not self.can_admit(request, 0):
            raise ValueError(f"request {request.request_id!r}: no pages free to score it")
        seq = self._admit(request)
        try:
            logits = self.model.compute_logits(self._prefill_hidden(seq))
            request.ttft_s = time.perf_counter() - seq.admitted_at
            self.connector.save(request, seq.pages, len(request.prompt))
            self._publish(seq, len(request.prompt))
            request.finished = True
            self.connector.request_finished(request)
        finally:
            self.allocator.free(seq.pages)
        return logits

    @torch.inference_mode()
    def prefill_logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits ``[len(tokens), vocab_size]`` of a prompt prefilled from scratch in this
        engine's pool, without the connector (benchmarks and tests).

        Raises:
            ValueError: As ``generate`` for a request of these tokens, or no pages free.
        """
        request = Request("prefill_logits", list(tokens), SamplingParams(max_tokens=1))
        self.check_request(request)
        pages = self.allocator.allocate(pages_for(len(tokens), self.page_tokens))
        try:
            device = self.model.device
            batch = prefill_batch(pages, 0, len(tokens), self.page_tokens, device)
            hidden = self.model(torch.tensor(tokens, device=device), batch, self.kv_pool)
            return self.model.compute_logits(hidden)
        finally:
            self.allocator.free(pages)


def _emit(on_token: Callable[[Request, int], None] | None, running: SequenceOf[Sequence]) -> None:
    """Reports each running request's newest token."""
    if on_token is not None:
        for seq in running:
            on_token(seq.request, seq.request.output[-1])
