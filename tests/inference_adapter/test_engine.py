"""The paged engine against Hugging Face, and its connector calls with a real in-test store.

``PrefixStore`` below is a working connector, not a mock: ``save`` copies pool pages out,
``wait_for_layer_load`` copies one layer of them back into the pages of a later request,
so a cached-prefix run attends over KV computed by an earlier run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from kvstore.inference_adapter import (
    Engine,
    LlamaConfig,
    LlamaModel,
    NullConnector,
    Request,
    SamplingParams,
    load_model,
)
from kvstore.inference_adapter.sessions import ChatServer
from tests.inference_adapter.conftest import hf_model, tiny_config

PAGE_TOKENS = 8
PROMPT_LENGTHS = (5, 17, 23, 40, 9)  # none a multiple of PAGE_TOKENS but 40
MAX_TOKENS = 12


def random_prompt(length: int, seed: int) -> list[int]:
    ids = torch.randint(0, 192, (length,), generator=torch.Generator().manual_seed(seed))
    return [int(token) for token in ids]


def greedy(request_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens))


@pytest.fixture(scope="module", params=["default", "llama3"])
def models(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LlamaModel, Any]:
    """(our model, transformers' model) with the same weights."""
    reference = hf_model(tiny_config(rope=request.param))
    reference.generation_config.eos_token_id = None  # random models stop nowhere in particular
    folder = tmp_path_factory.mktemp("tiny")
    reference.save_pretrained(folder)
    return load_model(folder), reference


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    """A tiny random model for the tests that need no reference."""
    return LlamaModel.from_config(LlamaConfig.from_dict(tiny_config()), seed=0)


def hf_greedy(reference: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    # An explicit mask: transformers would otherwise mask prompt tokens equal to pad_token_id.
    mask = torch.ones_like(ids)
    out = reference.generate(
        ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
    )
    return [int(token) for token in out[0, len(prompt) :]]


def test_prefill_logits_match_transformers(models: tuple[LlamaModel, Any]) -> None:
    model, reference = models
    prompt = random_prompt(37, seed=1)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    engine = Engine(model, num_pages=8, page_tokens=PAGE_TOKENS)
    torch.testing.assert_close(engine.prefill_logits(prompt), expected, atol=1e-4, rtol=0)
    assert engine.allocator.num_free_pages == 8


def test_greedy_batch_matches_transformers(models: tuple[LlamaModel, Any]) -> None:
    model, reference = models
    requests = [greedy(f"r{i}", random_prompt(n, seed=i)) for i, n in enumerate(PROMPT_LENGTHS)]
    # 16 pages of 8 tokens cannot hold all five at once, and max_batch caps them at 3.
    engine = Engine(model, num_pages=16, page_tokens=PAGE_TOKENS, max_batch=3)
    assert engine.generate(requests) is requests
    for request in requests:
        assert request.output == hf_greedy(reference, request.prompt, MAX_TOKENS)
        assert request.finished and request.ttft_s > 0
        assert request.num_computed_tokens == len(request.prompt)
        assert request.num_loaded_tokens == 0
    assert engine.allocator.num_free_pages == 16


class PrefixStore:
    """A connector keeping saved pool pages by the token prefix they end, per layer."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pages: dict[tuple[int, ...], torch.Tensor] = {}  # prefix -> [layers, 2, page, ...]
        self.loads: dict[str, tuple[Sequence[int], int]] = {}
        self.events: list[tuple[str, int, int]] = []  # (what, layer, tokens)
        self.saves: list[tuple[str, int]] = []
        self.fail_at_layer: int | None = None

    def prefixes(self, request: Request, num_tokens: int) -> list[tuple[int, ...]]:
        tokens, size = [*request.prompt, *request.output], self.engine.page_tokens
        return [tuple(tokens[: (i + 1) * size]) for i in range(num_tokens // size)]

    def prepare(self, request: Request) -> None:
        self.events.append(("prepare", -1, len(request.prompt)))

    def num_loadable_tokens(self, request: Request) -> int:
        found = 0
        for prefix in self.prefixes(request, len(request.prompt) - 1):
            if prefix not in self.pages:
                break
            found = len(prefix)
        return found

    def start_load(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        self.loads[request.request_id] = (pages, num_tokens)

    def wait_for_layer_load(self, request: Request, layer: int) -> bool:
        self.events.append(("wait", layer, 0))
        pages, num_tokens = self.loads[request.request_id]
        pool = self.engine.kv_pool
        for page, prefix in zip(pages, self.prefixes(request, num_tokens), strict=False):
            pool[layer, :, page] = self.pages[prefix][layer]
            if layer == self.fail_at_layer:  # a torn load: garbage, then a failure
                pool[layer, :, page] = torch.randn_like(pool[layer, :, page])
        return layer != self.fail_at_layer

    def save(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        self.saves.append((request.request_id, num_tokens))
        for page, prefix in zip(pages, self.prefixes(request, num_tokens), strict=False):
            self.pages[prefix] = self.engine.kv_pool[:, :, page].clone()

    def request_finished(self, request: Request) -> None:
        self.loads.pop(request.request_id, None)
        self.events.append(("finished", -1, 0))


@pytest.fixture
def store(model: LlamaModel) -> Iterator[PrefixStore]:
    """A PrefixStore on a fresh engine whose layers log their computes into its events."""
    engine = Engine(model, num_pages=32, page_tokens=PAGE_TOKENS)
    store = PrefixStore(engine)
    engine.connector = store

    def log_compute(layer: int) -> Any:
        return lambda module, args: store.events.append(("compute", layer, args[0].size(0)))

    hooks = [
        layer.register_forward_pre_hook(log_compute(i)) for i, layer in enumerate(model.layers)
    ]
    yield store
    for hook in hooks:
        hook.remove()


def second_turn(store: PrefixStore) -> tuple[Request, list[int]]:
    """Run a first turn through ``store``; return the second turn's request (first prompt,
    answer and 7 new tokens: 34 tokens, 24 of them in saved pages) and its expected output."""
    first = greedy("turn1", random_prompt(21, seed=11), max_tokens=6)
    store.engine.generate([first])
    assert store.saves == [("turn1", 21), ("turn1", 26)]  # prompt; all KV but the last token
    prompt = [*first.prompt, *first.output, *random_prompt(7, seed=12)]
    expected = Engine(store.engine.model, num_pages=8, page_tokens=PAGE_TOKENS)
    alone = expected.generate([greedy("alone", prompt)])[0].output
    store.events.clear()
    return greedy("turn2", prompt), alone


def test_cached_prefix_is_loaded_layer_by_layer_not_computed(store: PrefixStore) -> None:
    request, expected = second_turn(store)
    store.engine.generate([request])
    assert request.output == expected
    assert (request.num_loaded_tokens, request.num_computed_tokens) == (24, 10)
    prefill = store.events[:4]
    assert prefill == [("wait", 0, 0), ("compute", 0, 10), ("wait", 1, 0), ("compute", 1, 10)]
    assert ("wait", 0, 0) not in store.events[4:]  # decode steps do not wait
    assert store.events[-1] == ("finished", -1, 0)


def test_a_failed_layer_load_recomputes_the_whole_prompt(store: PrefixStore) -> None:
    request, expected = second_turn(store)
    store.fail_at_layer = 1
    store.engine.generate([request])
    assert request.output == expected
    assert (request.num_loaded_tokens, request.num_computed_tokens) == (0, 34)
    assert store.events[:6] == [
        ("wait", 0, 0),
        ("compute", 0, 10),
        ("wait", 1, 0),  # fails: nothing more is loaded, the prompt is computed whole
        ("compute", 0, 34),
        ("compute", 1, 34),
        ("compute", 0, 1),  # the first decode step
    ]


@pytest.mark.parametrize(("lowered_to", "error"), [(8, None), (12, "whole pages"), (32, "1..24")])
def test_a_load_lowered_at_layer_0_is_computed_from_there(
    store: PrefixStore, lowered_to: int, error: str | None
) -> None:
    request, expected = second_turn(store)
    wait = store.wait_for_layer_load

    def lowering_wait(req: Request, layer: int) -> bool:
        if layer == 0:
            req.num_loaded_tokens = lowered_to  # the store had only the first page left
        return wait(req, layer)

    store.wait_for_layer_load = lowering_wait  # type: ignore[method-assign]
    if error is not None:
        with pytest.raises(ValueError, match=error):
            store.engine.generate([request])
        return
    store.engine.generate([request])
    assert request.output == expected
    assert (request.num_loaded_tokens, request.num_computed_tokens) == (8, 26)
    assert store.events[:4] == [
        ("wait", 0, 0),
        ("compute", 0, 26),
        ("wait", 1, 0),
        ("compute", 1, 26),
    ]


def test_score_over_a_loaded_prefix_gives_the_logits_of_a_full_prefill(
    store: PrefixStore,
) -> None:
    request, _ = second_turn(store)
    logits = store.engine.score(request)
    assert (request.num_loaded_tokens, request.num_computed_tokens) == (24, 10)
    assert logits.shape == (10, store.engine.config.vocab_size)
    assert not request.output and request.finished
    assert store.saves[-1] == ("turn2", 34) and store.events[-1] == ("finished", -1, 0)
    full = store.engine.prefill_logits(request.prompt)  # from scratch, no connector
    torch.testing.assert_close(logits, full[24:], rtol=1e-4, atol=1e-4)
    assert store.engine.allocator.num_free_pages == store.engine.allocator.num_pages


def test_on_token_streams_every_token_in_order(model: LlamaModel) -> None:
    engine = Engine(model, num_pages=32, page_tokens=PAGE_TOKENS)
    requests = [greedy(f"r{n}", random_prompt(n, seed=n), max_tokens=5) for n in (7, 19, 30)]
    seen: dict[str, list[int]] = {}
    engine.generate(requests, on_token=lambda r, t: seen.setdefault(r.request_id, []).append(t))
    assert seen == {request.request_id: request.output for request in requests}
    assert all(len(tokens) == 5 for tokens in seen.values())


def test_stop_tokens_end_a_request_and_are_kept(model: LlamaModel) -> None:
    engine = Engine(model, num_pages=16, page_tokens=PAGE_TOKENS)
    prompt = random_prompt(13, seed=4)
    full = engine.generate([greedy("full", prompt)])[0].output
    stop = full[5]
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop, 191))
    stopped = engine.generate([Request("stopped", prompt, params)])[0]
    assert stopped.output == full[: full.index(stop) + 1]
    one = engine.generate([greedy("one", prompt, max_tokens=1)])[0]
    assert one.output == full[:1] and one.finished
    assert engine.allocator.num_free_pages == 16


def test_temperature_sampling_is_deterministic_per_seed(model: LlamaModel) -> None:
    engine = Engine(model, num_pages=32, page_tokens=PAGE_TOKENS)
    prompt = random_prompt(10, seed=5)

    def sampled(seed: int, company: int = 0) -> list[int]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=seed)
        others = [greedy(f"other{i}", random_prompt(6 + i, seed=i)) for i in range(company)]
        return engine.generate([Request("sampled", prompt, params), *others])[0].output

    first = sampled(seed=7)
    assert sampled(seed=7) == first
    assert sampled(seed=7, company=2) == first  # batch mates do not change its draws
    assert sampled(seed=8) != first
    assert first != engine.generate([greedy("greedy", prompt)])[0].output


def test_requests_that_can_never_run_are_refused_with_their_numbers(model: LlamaModel) -> None:
    engine = Engine(model, num_pages=4, page_tokens=PAGE_TOKENS)
    fits = greedy("fits", random_prompt(5, seed=0))
    too_long = greedy("big", random_prompt(30, seed=0), max_tokens=10)
    with pytest.raises(ValueError, match="'big': 30 prompt tokens \\+ 10 max_tokens need 5 pages "):
        engine.generate([fits, too_long])
    assert fits.output == [] and engine.allocator.num_free_pages == 4  # nothing ran
    past_context = greedy("far", random_prompt(250, seed=0), max_tokens=10)
    with pytest.raises(ValueError, match="need 259 positions, the model has 256"):
        engine.generate([past_context])
    with pytest.raises(ValueError, match="'empty': empty prompt"):
        engine.generate([greedy("empty", [])])
    with pytest.raises(ValueError, match=r"token ids must be in 0\.\.191"):
        engine.generate([greedy("oov", [1, 192])])


def test_a_connector_offering_the_whole_prompt_is_refused(model: LlamaModel) -> None:
    class Greedy(NullConnector):
        def num_loadable_tokens(self, request: Request) -> int:
            return len(request.prompt)

    engine = Engine(model, num_pages=4, page_tokens=PAGE_TOKENS, connector=Greedy())
    with pytest.raises(ValueError, match="offers 8 tokens of a 8-token prompt"):
        engine.generate([greedy("r", random_prompt(8, seed=0))])
    assert engine.allocator.num_free_pages == 4


def test_engine_exposes_what_a_connector_needs(model: LlamaModel) -> None:
    engine = Engine(model, num_pages=3, page_tokens=PAGE_TOKENS)
    config = engine.config
    shape = (config.num_hidden_layers, 2, 3, PAGE_TOKENS, config.num_key_value_heads, 16)
    assert engine.kv_pool.shape == shape and engine.kv_pool.dtype == model.dtype
    assert engine.rope_tables.max_positions == config.max_position_embeddings
    assert engine.rope_tables is model.rope_tables


# The pool as the HBM level (retain_pages) ------------------------------------------------


def chat_prompts(rng: random.Random, system: list[int], turns: int) -> list[list[int]]:
    """A user's new tokens per turn; the first turn starts with ``system``."""
    return [
        (system if turn == 0 else []) + [rng.randrange(192) for _ in range(rng.randint(3, 20))]
        for turn in range(turns)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_resident_history_is_mapped_not_loaded_and_answers_like_recompute(
    dtype: torch.dtype,
) -> None:
    model = LlamaModel.from_config(LlamaConfig.from_dict(tiny_config()), seed=0, dtype=dtype)
    engine = Engine(model, num_pages=32, page_tokens=PAGE_TOKENS, retain_pages=32)
    store = PrefixStore(engine)
    engine.connector = store
    recompute = Engine(model, num_pages=32, page_tokens=PAGE_TOKENS)
    history: list[int] = []
    for turn, new in enumerate(chat_prompts(random.Random(1), random_prompt(30, 2), 4)):
        prompt = history + new
        request, alone = greedy(f"t{turn}", prompt), greedy(f"r{turn}", prompt)
        engine.generate([request])
        recompute.generate([alone])
        assert request.output == alone.output, turn
        if turn:
            with_kv = len(history) - 1  # the last answer token was never fed back
            assert request.loaded_from == {"hbm": with_kv // PAGE_TOKENS}
            assert request.num_loaded_tokens == 0  # nothing from the store
            assert request.num_resident_tokens == with_kv // PAGE_TOKENS * PAGE_TOKENS
            assert request.num_computed_tokens == len(prompt) - request.num_resident_tokens
        history = prompt + request.output
    assert "wait" not in {what for what, _, _ in store.events}  # the store never loaded
    assert engine.allocator.shared_pages > 0


@pytest.mark.parametrize(
    ("lookahead", "policy"), [(0, "scheduler_aware"), (2, "scheduler_aware"), (2, "lru")]
)
def test_queued_sessions_keep_their_resident_history_when_the_pool_evicts(
    model: LlamaModel, lookahead: int, policy: str
) -> None:
    """Three sessions take turns, A's second turn queued behind B's and C's first ones; the
    pool keeps 8 idle pages, fewer than two sessions' 5 each. With the look-ahead the
    server names queued turns to the engine, whose pool evicts B's and C's pages before A's:
    A's second turn maps its whole history. Without it, or with the "lru" policy, plain LRU
    evicts A's oldest pages first, and A's turn maps nothing (the chain breaks at its first
    page). Replies equal recompute either way."""
    engine = Engine(model, num_pages=16, page_tokens=PAGE_TOKENS, retain_pages=8, hbm_policy=policy)
    sampling = SamplingParams(max_tokens=8)
    server = ChatServer(engine, sampling=sampling, lookahead=lookahead)
    recompute = Engine(model, num_pages=16, page_tokens=PAGE_TOKENS)
    messages = [("A", random_prompt(40, 11)), ("B", random_prompt(40, 12)),
                ("C", random_prompt(40, 13)), ("A", random_prompt(6, 14))]  # fmt: skip
    for session, message in messages:
        server.submit(session, message)
    turns = [server.run_next() for _ in messages]
    for turn in turns:
        alone = Request("alone", list(turn.request.prompt), sampling)
        recompute.generate([alone])
        assert turn.request.output == alone.output
    second = turns[-1].request
    history_pages = (len(second.prompt) - 6 - 1) // PAGE_TOKENS  # 47 tokens with KV: 5 pages
    if lookahead and policy == "scheduler_aware":
        assert second.loaded_from == {"hbm": history_pages} == {"hbm": 5}
    else:
        assert second.loaded_from == {} and second.num_resident_tokens == 0


def test_an_unknown_pool_policy_is_refused_by_name(model: LlamaModel) -> None:
    with pytest.raises(ValueError, match="hbm_policy must be one of lru, scheduler_aware; got 'x'"):
        Engine(model, num_pages=4, page_tokens=PAGE_TOKENS, hbm_policy="x")


def test_concurrent_sessions_with_one_system_prompt_hold_one_copy_of_its_pages(
    model: LlamaModel,
) -> None:
    engine = Engine(model, num_pages=32, page_tokens=PAGE_TOKENS, retain_pages=16)
    system = random_prompt(35, seed=3)  # 4 full pages
    engine.generate([greedy("first", system + random_prompt(6, seed=4), 6)])  # stays resident
    users = [greedy(f"u{n}", system + random_prompt(5 + n, seed=10 + n), 6) for n in range(3)]
    held: list[int] = []

    def count(request: Request, token: int) -> None:
        if request is users[-1] and len(request.output) == 1:  # all three are running
            held.append(engine.allocator.num_pages - engine.allocator.num_free_pages)

    engine.generate(users, on_token=count)
    system_pages = len(system) // PAGE_TOKENS
    own = sum(engine.num_pages_needed(user) - system_pages for user in users)
    assert held == [system_pages + own]  # one copy of the system prompt's pages, not three
    for user in users:
        assert user.loaded_from == {"hbm": system_pages}
        alone = greedy("alone", user.prompt, 6)
        Engine(model, num_pages=32, page_tokens=PAGE_TOKENS).generate([alone])
        assert user.output == alone.output


def test_a_small_pool_under_many_sessions_evicts_and_never_reads_a_reused_page(
    model: LlamaModel,
) -> None:
    """24 pages, 3 at a time, 8 sessions of 4 turns over 2 system prompts, turns in random
    order: resident pages are evicted and reused all the time. Every reply equals a
    recompute's, and every prompt's logits over its mapped pages equal a full prefill's."""
    rng = random.Random(5)
    engine = Engine(model, num_pages=24, page_tokens=PAGE_TOKENS, max_batch=3, retain_pages=16)
    recompute = Engine(model, num_pages=24, page_tokens=PAGE_TOKENS)
    systems = [random_prompt(19, seed=20), random_prompt(27, seed=21)]
    sessions = [chat_prompts(rng, systems[n % 2], 4) for n in range(8)]
    histories: list[list[int]] = [[] for _ in sessions]
    turn_of = [0] * len(sessions)
    hits = 0
    while any(turn < 4 for turn in turn_of):
        ready = [n for n, turn in enumerate(turn_of) if turn < 4]
        batch = rng.sample(ready, min(len(ready), rng.randint(1, 4)))
        requests = []
        for n in batch:
            prompt = histories[n] + sessions[n][turn_of[n]]
            requests.append(greedy(f"s{n}t{turn_of[n]}", prompt, max_tokens=rng.randint(1, 6)))
        engine.generate(requests)
        for n, request in zip(batch, requests, strict=True):
            alone = greedy("alone", request.prompt, request.sampling.max_tokens)
            recompute.generate([alone])
            assert request.output == alone.output, request.request_id
            hits += request.loaded_from.get("hbm", 0)
            histories[n] = request.prompt + request.output
            turn_of[n] += 1
        if rng.random() < 0.3:  # a scored prompt: logits over what it mapped
            n = rng.randrange(len(sessions))
            probe = greedy("probe", histories[n] + [1, 2, 3], 1)
            logits = engine.score(probe)
            full = recompute.prefill_logits(probe.prompt)[probe.num_resident_tokens :]
            torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)
    assert hits > 50 and engine.allocator.evicted_pages > 20
    assert engine.allocator.num_free_pages == 24  # nothing held after the last turn
