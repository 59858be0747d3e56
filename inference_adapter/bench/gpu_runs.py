"""The measurements of ``kvstore bench gpu`` for one prompt length (:class:`GpuBench`).

``GpuBench.row(tokens, limits)`` runs the phases the command's docstring describes
(:mod:`.gpu`): a warm-up, recompute and misses in turns, the save run, the hits, the
protocol-only loads, and returns the row's figures as a JSON-ready dict; then it deletes the
row's blocks, so that every row starts on an empty store (a miss's blocks go as soon as its
saves drained). A run that cannot be vouched for (a miss or the save run loaded, saves lost,
a hit that loaded less) raises ``BenchmarkError``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvstore.client import KVStoreClient, block_keys
from kvstore.inference_adapter.bench.bandwidth import Limits, synchronize
from kvstore.inference_adapter.bench.gpu_models import TappedModel
from kvstore.inference_adapter.bench.replay import BenchmarkError
from kvstore.inference_adapter.connector import StoreConnector
from kvstore.inference_adapter.engine import Engine
from kvstore.inference_adapter.interfaces import Request, SamplingParams
from kvstore.inference_adapter.pages import pages_for
from kvstore.inference_adapter.weights import namespace_for

__all__ = ["GpuBench", "Run", "TimedConnector"]

PHASES = ("lookup", "start_load", "layer_waits")  # TimedConnector.phases, in call order
SAVE_TIMEOUT_S = 300.0
LOAD_TIMEOUT_S = 60.0


class TimedConnector(StoreConnector):
    """A ``StoreConnector`` that notes when the first ``save`` since ``save_started = None``
    began, and adds up the engine thread's seconds in each protocol call (``phases``: the
    lookup, ``start_load``, the waits for layers) until ``phases`` is cleared."""

    save_started: float | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.phases: dict[str, float] = defaultdict(float)

    def num_loadable_tokens(self, request: Request) -> int:
        start = time.perf_counter()
        try:
            return super().num_loadable_tokens(request)
        finally:
            self.phases["lookup"] += time.perf_counter() - start

    def start_load(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        start = time.perf_counter()
        try:
            super().start_load(request, pages, num_tokens)
        finally:
            self.phases["start_load"] += time.perf_counter() - start

    def wait_for_layer_load(self, request: Request, layer: int) -> bool:
        start = time.perf_counter()
        try:
            return super().wait_for_layer_load(request, layer)
        finally:
            self.phases["layer_waits"] += time.perf_counter() - start

    def save(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        if self.save_started is None:
            self.save_started = time.perf_counter()
        super().save(request, pages, num_tokens)


@dataclass(frozen=True, slots=True)
class Run:
    """One request through an engine."""

    ttft_s: float
    output: tuple[int, ...]
    loaded_tokens: int
    logits: torch.Tensor  # [vocab_size] of the last prompt token
    decode_s: float  # from the first token to the last
    phases: dict[str, float] = field(default_factory=dict)  # TimedConnector.phases, seconds

    @property
    def token(self) -> int:
        """The first token, sampled from ``logits``."""
        return self.output[0]

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first (0 for a run of one token)."""
        return (len(self.output) - 1) / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(slots=True)
class _Tap:
    """``Engine.generate``'s ``on_token``: keeps the first token's logits and the time the
    last token came."""

    model: TappedModel
    logits: torch.Tensor | None = None  # [vocab_size]
    last_at: float = 0.0

    def __call__(self, request: Request, token: int) -> None:
        if self.logits is None:
            self.logits = self.model.last_logits
        self.last_at = time.perf_counter()


class GpuBench:
    """The model, the daemon's client and the sizes; ``row(tokens)`` measures one prompt."""

    def __init__(self, model: TappedModel, client: KVStoreClient, args: argparse.Namespace) -> None:
        self.model, self.client = model, client
        self.block_tokens, self.page_tokens = args.block_tokens, args.page_tokens
        self.repeats, self.decode_tokens = args.repeats, args.decode_tokens
        self.namespace = namespace_for(
            model.config, model_name=f"bench-gpu-{args.model}", block_tokens=args.block_tokens
        )
        self.block_bytes = self.namespace.model.layout().payload_bytes

    def row(self, tokens: int, limits: Limits) -> dict[str, object]:
        """Every figure of one prompt length; see the module docstring."""
        vocab, warm_up = self.model.config.vocab_size, 2 * self.block_tokens + 1
        generator = torch.Generator().manual_seed(tokens)
        ids: list[int] = torch.randint(0, vocab, (tokens + warm_up,), generator=generator).tolist()
        # the misses' prompts, one a run: tokens the store has never seen
        fresh = torch.randint(0, vocab, (self.repeats + 1, tokens), generator=generator).tolist()
        prompt = ids[:tokens]
        row: dict[str, object] = {
            "prompt_tokens": tokens,
            "kv_bytes": tokens * self.block_bytes // self.block_tokens,
        }
        off, engine = self._engine(tokens), self._engine(tokens)
        try:
            connector = TimedConnector(
                self.client,
                self.namespace,
                kv_pool=engine.kv_pool,
                page_tokens=engine.page_tokens,
                rope_tables=engine.rope_tables,
                save_queue_size=(tokens + self.decode_tokens) // self.block_tokens + 1,
                load_timeout_s=LOAD_TIMEOUT_S,
            )
        except ValueError as error:
            recompute, _ = self._recompute_and_miss(off, None, prompt, fresh)
            return {**row, **_recompute_figures(recompute), "skipped": str(error)}
        engine.connector = connector
        with contextlib.closing(connector):
            self._warm_up(engine, connector, ids[tokens:])
            recompute, misses = self._recompute_and_miss(off, (engine, connector), prompt, fresh)
            row |= _recompute_figures(recompute) | _miss_figures(misses, recompute)
            row.update(self._with_store(engine, connector, prompt, recompute, limits))
        for tokens_saved in (prompt, ids[tokens:]):  # the next row starts on an empty store
            self.client.delete(self.namespace, block_keys(tokens_saved, self.namespace))
        del off, engine, connector
        _free(self.model.device)
        return row

    def _engine(self, tokens: int) -> Engine:
        num_pages = pages_for(tokens + self.decode_tokens - 1, self.page_tokens) + 1
        return Engine(self.model, num_pages=num_pages, page_tokens=self.page_tokens, max_batch=1)

    def _run(self, engine: Engine, prompt: list[int], name: str, max_tokens: int = 1) -> Run:
        request = Request(name, prompt, SamplingParams(max_tokens=max_tokens))
        tap = _Tap(self.model)
        synchronize(self.model.device)
        started = time.perf_counter()
        engine.generate([request], tap)
        assert tap.logits is not None
        return Run(
            request.ttft_s,
            tuple(request.output),
            request.num_loaded_tokens,
            tap.logits,
            decode_s=tap.last_at - started - request.ttft_s,
        )

    def _recompute_and_miss(
        self,
        off: Engine,
        store: tuple[Engine, TimedConnector] | None,
        prompt: list[int],
        fresh: list[list[int]],
    ) -> tuple[list[Run], list[Run]]:
        """Recompute runs of ``prompt`` on ``off`` (no connector) and, given ``store``,
        misses of the ``fresh`` prompts through its connector, one of each in turn so that a
        shared machine's drift weighs on both alike; the first pair warms up, untimed."""
        recompute, misses = [], []
        for i, miss_prompt in enumerate(fresh):
            recompute.append(self._run(off, prompt, f"recompute-{i}", self.decode_tokens))
            if store is not None:
                misses.append(self._miss(*store, miss_prompt, i))
        return recompute[1:], misses[1:]

    def _miss(self, engine: Engine, connector: TimedConnector, prompt: list[int], i: int) -> Run:
        """A run of a prompt the store lacks, which must load nothing and save its blocks;
        once they are saved (untimed) they are deleted, so that the store stays as it was."""
        stored_before = connector.stats().saves.stored
        connector.phases.clear()
        run = self._run(engine, prompt, f"miss-{i}", self.decode_tokens)
        run = replace(run, phases=dict(connector.phases))
        if run.loaded_tokens:
            raise BenchmarkError(f"{len(prompt)} tokens, miss {i}: loaded {run.loaded_tokens}")
        if not connector.wait_for_saves(SAVE_TIMEOUT_S):
            raise BenchmarkError(f"{len(prompt)} tokens, miss {i}: the saves did not drain")
        saved = connector.stats().saves.stored - stored_before
        if saved < len(prompt) // self.block_tokens:
            raise BenchmarkError(f"{len(prompt)} tokens, miss {i}: {saved} blocks saved")
        context = prompt + list(run.output[:-1])  # the last token's KV was never computed
        self.client.delete(self.namespace, block_keys(context, self.namespace))
        return run

    def _with_store(
        self,
        engine: Engine,
        connector: TimedConnector,
        prompt: list[int],
        recomputed: list[Run],
        limits: Limits,
    ) -> dict[str, object]:
        """The save run (the first of ``prompt``), the hits and the loads, against its
        recompute runs."""
        bt, tokens, recompute = self.block_tokens, len(prompt), recomputed[0]
        recompute_s = statistics.median(r.ttft_s for r in recomputed)
        stored_before = connector.stats().saves.stored
        connector.save_started = None
        first = self._run(engine, prompt, "save-run")
        if first.loaded_tokens:
            raise BenchmarkError(f"{tokens} tokens: the save run loaded {first.loaded_tokens}")
        if not connector.wait_for_saves(SAVE_TIMEOUT_S) or connector.save_started is None:
            raise BenchmarkError(f"{tokens} tokens: the saves did not drain")
        save_s = time.perf_counter() - connector.save_started
        saved = connector.stats().saves.stored - stored_before
        if saved != tokens // bt:
            raise BenchmarkError(f"{tokens} tokens: {saved} of {tokens // bt} blocks saved")
        hits = [self._hit(engine, connector, prompt, i) for i in range(self.repeats + 1)][1:]
        loads = [self._load(engine, connector, prompt, i) for i in range(self.repeats)]
        load_s = statistics.median(load for _, load in loads)
        load_bytes = hits[0].loaded_tokens * self.block_bytes // bt
        tokens_seen = {recompute.token, first.token, *(hit.token for hit in hits)}
        top = recompute.logits.float().topk(2).values
        load_gbps, save_gbps = load_bytes / load_s / 1e9, saved * self.block_bytes / save_s / 1e9
        hit_s = statistics.median(hit.ttft_s for hit in hits)
        phases = {
            f"hit_{name}_ms": _ms(statistics.median(hit.phases.get(name, 0.0) for hit in hits))
            for name in PHASES
        }
        phases["hit_rest_ms"] = _ms(
            statistics.median(hit.ttft_s - sum(hit.phases.values()) for hit in hits)
        )
        return {
            **phases,
            "ttft_hit_ms": _ms(hit_s),
            "ttft_hit_ms_all": [_ms(hit.ttft_s) for hit in hits],
            "hit_vs_recompute": hit_s / recompute_s,
            "ttft_save_run_ms": _ms(first.ttft_s),
            "save_overhead": first.ttft_s / recompute_s - 1,
            "loaded_tokens": hits[0].loaded_tokens,
            "loaded_blocks_per_hit": hits[0].loaded_tokens // bt,
            "load_bytes": load_bytes,
            "lookup_ms": _ms(statistics.median(lookup for lookup, _ in loads)),
            "load_ms": _ms(load_s),
            "load_ms_all": [_ms(load) for _, load in loads],
            "load_gbps": load_gbps,
            "load_vs_limit": load_gbps / limits.rates[limits.load],
            "saved_blocks": saved,
            "save_bytes": saved * self.block_bytes,
            "save_ms": _ms(save_s),
            "save_gbps": save_gbps,
            "save_vs_limit": save_gbps / limits.rates[limits.save],
            "first_token": recompute.token,
            "same_tokens": len(tokens_seen) == 1,
            "logit_margin": float(top[0] - top[1]),
            "logit_max_diff": max(_diff(hit.logits, recompute.logits) for hit in hits),
        }

    def _warm_up(self, engine: Engine, connector: TimedConnector, prompt: list[int]) -> None:
        """A miss and a hit of a short prompt of its own: first-call costs (threads, streams,
        kernel compiles, the arena's mapping) out of the timings."""
        for name in ("warm-up-miss", "warm-up-hit"):
            self._run(engine, prompt, name)
            connector.wait_for_saves(SAVE_TIMEOUT_S)

    def _hit(self, engine: Engine, connector: TimedConnector, prompt: list[int], i: int) -> Run:
        """A run that must load every whole block of the prompt but the one holding its last
        token (the connector leaves at least one token to compute)."""
        expected = (len(prompt) - 1) // self.block_tokens * self.block_tokens
        loaded_before = connector.stats().loaded_blocks
        connector.phases.clear()
        run = self._run(engine, prompt, f"hit-{i}")
        run = replace(run, phases=dict(connector.phases))
        blocks = connector.stats().loaded_blocks - loaded_before
        if run.loaded_tokens != expected or blocks * self.block_tokens != expected:
            raise BenchmarkError(
                f"{len(prompt)} tokens, hit {i}: loaded {run.loaded_tokens} tokens "
                f"({blocks} blocks started), expected {expected}"
            )
        return run

    def _load(
        self, engine: Engine, connector: StoreConnector, prompt: list[int], i: int
    ) -> tuple[float, float]:
        """The connector protocol alone: (lookup seconds, load seconds)."""
        request = Request(f"load-{i}", prompt, SamplingParams(max_tokens=1))
        device, start = self.model.device, time.perf_counter()
        offered = request.num_loaded_tokens = connector.num_loadable_tokens(request)
        lookup_s = time.perf_counter() - start
        pages = engine.allocator.allocate(engine.num_pages_needed(request))
        try:
            synchronize(device)
            start = time.perf_counter()
            connector.start_load(request, pages, offered)
            layers = range(self.model.config.num_hidden_layers)
            loaded = all(connector.wait_for_layer_load(request, layer) for layer in layers)
            synchronize(device)
            load_s = time.perf_counter() - start
        finally:
            connector.request_finished(request)
            engine.allocator.free(pages)
        if not offered or not loaded or request.num_loaded_tokens != offered:
            raise BenchmarkError(
                f"{len(prompt)} tokens, load {i}: {request.num_loaded_tokens} of {offered} "
                f"tokens loaded{'' if loaded else ' (failed)'}"
            )
        return lookup_s, load_s


def _recompute_figures(runs: list[Run]) -> dict[str, object]:
    return {
        "ttft_recompute_ms": _ms(statistics.median(run.ttft_s for run in runs)),
        "ttft_recompute_ms_all": [_ms(run.ttft_s) for run in runs],
        "decode_tok_s_recompute": statistics.median(run.decode_tok_s for run in runs),
    }


def _miss_figures(misses: list[Run], recomputed: list[Run]) -> dict[str, object]:
    """The misses' medians (TTFT, the engine thread's time in the lookup, decode tokens per
    second), and over recompute's: TTFT (and less one, the overhead), decode tokens per
    second."""
    ttft_s = statistics.median(run.ttft_s for run in misses)
    tok_s = statistics.median(run.decode_tok_s for run in misses)
    ratio = ttft_s / statistics.median(run.ttft_s for run in recomputed)
    return {
        "ttft_miss_ms": _ms(ttft_s),
        "ttft_miss_ms_all": [_ms(run.ttft_s) for run in misses],
        "miss_lookup_ms": _ms(statistics.median(run.phases.get("lookup", 0.0) for run in misses)),
        "decode_tok_s_miss": tok_s,
        "miss_vs_recompute": ratio,
        "miss_overhead": ratio - 1,
        "miss_tok_s_vs_recompute": tok_s / statistics.median(r.decode_tok_s for r in recomputed),
    }


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _free(device: torch.device) -> None:
    """Gives the memory of dropped engines back (their pools are most of it)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
