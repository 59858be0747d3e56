"""The store connector with a real daemon and a real (tiny, random) model.

Each scenario runs chat turns through an engine whose connector talks to a ``kvstore serve``
child process, and compares the answers with an engine that recomputes every prompt and with
transformers' ``LlamaForCausalLM.generate`` on the same weights. Faults (a slow layer copy,
a stuck daemon put, a daemon killed between lookup and load) are injected by wrapping one
function each.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient, Namespace, block_keys
from kvstore.inference_adapter.connector import StoreConnector
from kvstore.inference_adapter.core import transfer
from kvstore.inference_adapter.engine import Engine
from kvstore.inference_adapter.interfaces import Request, SamplingParams
from kvstore.inference_adapter.model import LlamaModel, load_model
from kvstore.inference_adapter.sessions import ChatServer
from kvstore.inference_adapter.weights import LlamaConfig, namespace_for
from tests.inference_adapter.conftest import hf_model, tiny_config
from tests.support.daemon import Daemon, rpcs, running_daemon, scrape
from tests.support.net import free_port
from tests.support.waiting import wait_for

PAGE = 16
SAMPLING = SamplingParams(max_tokens=6)
MESSAGES = [
    torch.randint(0, 192, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (37, 21, 30, 18)
]


@dataclass
class TinyModels:
    """One set of random weights, as transformers and as the engine's model."""

    hf: Any  # LlamaForCausalLM
    engine: LlamaModel


def tiny_models(folder: Path, **overrides: object) -> TinyModels:
    reference = hf_model(tiny_config(**overrides))
    reference.save_pretrained(folder)
    return TinyModels(reference, load_model(folder))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return tiny_models(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("daemon")) as started:
        yield started


@pytest.fixture
def client(daemon: Daemon) -> Iterator[KVStoreClient]:
    with KVStoreClient(daemon.address, retries=0, timeout=5.0) as connected:
        yield connected


def store_engine(
    model: LlamaModel,
    client: KVStoreClient,
    tenant: str,
    block_tokens: int = PAGE,
    max_batch: int = 8,
    retain_pages: int = 0,
    **options: Any,
) -> tuple[Engine, StoreConnector]:
    """An engine with a store connector in its own tenant (tests share one daemon)."""
    engine = Engine(
        model, num_pages=64, page_tokens=PAGE, max_batch=max_batch, retain_pages=retain_pages
    )
    namespace = namespace_for(
        engine.config,
        model_name="tiny",
        block_tokens=block_tokens,
        dtype=model.dtype,
        tenant=tenant,
    )
    connector = StoreConnector(
        client,
        namespace,
        kv_pool=engine.kv_pool,
        page_tokens=PAGE,
        rope_tables=engine.rope_tables,
        **options,
    )
    engine.connector = connector
    return engine, connector


def recompute(model: LlamaModel, prompt: list[int], sampling: SamplingParams = SAMPLING) -> Request:
    request = Request("recompute", list(prompt), sampling)
    Engine(model, num_pages=64, page_tokens=PAGE).generate([request])
    return request


def hf_generate(models: TinyModels, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = models.hf.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return list(out[0, len(prompt) :].tolist())


def reference_blocks(models: TinyModels, tokens: list[int], namespace: Namespace) -> torch.Tensor:
    """The KV of ``tokens``' full blocks as transformers computes it (K after RoPE), in the
    store's layout ``[num_blocks, num_layers, 2, block_tokens, kv_heads, head_dim]``."""
    with torch.no_grad():
        cache = models.hf(torch.tensor([tokens]), use_cache=True).past_key_values
    bt, n = namespace.model.block_tokens, len(tokens) // namespace.model.block_tokens
    layers = []
    for layer in cache.layers:
        k = layer.keys[0, :, : n * bt].transpose(0, 1)
        v = layer.values[0, :, : n * bt].transpose(0, 1)
        kv = torch.stack((k, v))  # [2, seq, kv_heads, head_dim]
        layers.append(kv.unflatten(1, (n, bt)).transpose(0, 1))  # [n, 2, bt, heads, dim]
    return torch.stack(layers, dim=1)


def stored_blocks(client: KVStoreClient, namespace: Namespace, keys: list[bytes]) -> torch.Tensor:
    model = namespace.model
    payloads = client.get(namespace, keys)
    flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=getattr(torch, model.dtype))
    return flat.view(len(payloads), *model.layout().shape)


@pytest.fixture(params=["shm", "stream"])
def any_plane_client(request: pytest.FixtureRequest, daemon: Daemon) -> Iterator[KVStoreClient]:
    """A client on the shared-memory data plane, then one that streams KV over gRPC."""
    use_shm = request.param == "shm"
    with KVStoreClient(daemon.address, use_shm=use_shm, retries=0, timeout=5.0) as connected:
        assert connected.data_plane == request.param
        yield connected


def test_chat_through_the_store_answers_like_recompute_and_transformers(
    models: TinyModels, any_plane_client: KVStoreClient
) -> None:
    client = any_plane_client
    engine, connector = store_engine(models.engine, client, f"equivalence-{client.data_plane}")
    server = ChatServer(engine, connector=connector, sampling=SAMPLING)
    for index, message in enumerate(MESSAGES):
        turn = server.chat("alice", message)
        assert connector.wait_for_saves(10.0)
        request = turn.request
        assert turn.reply == recompute(models.engine, request.prompt).output
        assert turn.reply == hf_generate(models, request.prompt, SAMPLING.max_tokens)
        # Every turn after the first loads all but the tail of the previous context.
        held = (len(request.prompt) - len(message) - 1) // PAGE * PAGE
        expected = min(held, (len(request.prompt) - 1) // PAGE * PAGE)
        assert request.num_loaded_tokens == (expected if index else 0)
        assert request.num_computed_tokens == len(request.prompt) - request.num_loaded_tokens
        assert request.loaded_from == ({"host": expected // PAGE} if index else {})
    stats = connector.stats()
    assert stats.failed_loads == stats.lookup_errors == stats.dropped_saves == 0
    assert stats.saves.stored == stats.queued_saves > 0
    connector.close()


class PoolCopies(StoreConnector):
    """Keeps a copy of the pages a request computed (at its first save) and loaded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.computed: dict[str, torch.Tensor] = {}
        self.loaded: dict[str, torch.Tensor] = {}
        self._loaded_pages: dict[str, list[int]] = {}

    def start_load(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        super().start_load(request, pages, num_tokens)
        self._loaded_pages[request.request_id] = list(pages[: num_tokens // PAGE])

    def save(self, request: Request, pages: Sequence[int], num_tokens: int) -> None:
        if request.request_id not in self.computed:
            self.computed[request.request_id] = self.pool.kv_pool[:, :, pages].clone()
        super().save(request, pages, num_tokens)

    def request_finished(self, request: Request) -> None:
        if pages := self._loaded_pages.get(request.request_id):
            self.loaded[request.request_id] = self.pool.kv_pool[:, :, pages].clone()
        super().request_finished(request)


@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [(torch.float32, 16), (torch.float16, 16), (torch.bfloat16, 16), (torch.bfloat16, 80)],
)
def test_a_prefix_hit_puts_back_the_bits_the_engine_computed(
    models: TinyModels, client: KVStoreClient, dtype: torch.dtype, head_dim: int
) -> None:
    if head_dim == models.engine.config.head_dim:
        model = copy.deepcopy(models.engine).to(dtype)
    else:
        config = LlamaConfig.from_dict(tiny_config(head_dim=head_dim))
        model = LlamaModel.from_config(config, seed=2, dtype=dtype)
    engine = Engine(model, num_pages=64, page_tokens=PAGE)
    namespace = namespace_for(
        model.config,
        model_name="tiny",
        block_tokens=PAGE,
        dtype=dtype,
        tenant=f"bits-{dtype}-{head_dim}",
    )
    connector = PoolCopies(
        client, namespace, kv_pool=engine.kv_pool, page_tokens=PAGE, rope_tables=model.rope_tables
    )
    engine.connector = connector
    prompt = [token for message in MESSAGES for token in message]  # 106 tokens: 6 blocks
    first, second = (Request(name, list(prompt), SAMPLING) for name in ("first", "second"))
    engine.generate([first])
    assert connector.wait_for_saves(10.0)
    engine.generate([second])
    assert second.loaded_from == {"host": 6}
    computed, loaded = connector.computed["first"][:, :, :6], connector.loaded["second"]
    assert torch.equal(loaded.view(torch.uint8), computed.view(torch.uint8))  # every bit
    # The stored bytes are the pool's too, K after RoPE: [layers, 2, page, heads, dim] per page.
    stored = stored_blocks(client, namespace, block_keys(prompt, namespace))
    assert torch.equal(
        stored.permute(1, 2, 0, 3, 4, 5).view(torch.uint8), computed.view(torch.uint8)
    )
    assert second.output == first.output
    connector.close()


def test_the_pool_keeps_the_latest_sessions_and_older_ones_load_from_the_host_tier(
    models: TinyModels, tmp_path: Path
) -> None:
    """The HBM level over the store: 4 idle pages are retained, three sessions of 3 full
    pages each end their first turn. The last one's second turn maps its pages (it looks up
    only the blocks past them, loads nothing, and lets go at once of the lease its lookup
    took: a 2-minute lease would otherwise outlive the wait); the first two were evicted
    from the pool (least recently used), so theirs load from the host tier. Every answer is
    recompute's."""
    with (
        running_daemon(tmp_path, settings={"server": {"lease_ttl": "120s"}}) as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=5.0) as client,
    ):
        check_the_pool_keeps_the_latest_sessions(models, client)


def check_the_pool_keeps_the_latest_sessions(models: TinyModels, client: KVStoreClient) -> None:
    engine, connector = store_engine(models.engine, client, "hbm", retain_pages=4)
    first = [torch.randint(0, 192, (50,), generator=torch.Generator().manual_seed(70 + n))
             for n in range(3)]  # fmt: skip
    history = []
    for n, opening in enumerate(first):
        request = Request(f"s{n}t1", opening.tolist(), SAMPLING)
        engine.generate([request])
        assert connector.wait_for_saves(10.0)
        history.append(request.prompt + request.output)
    assert engine.allocator.num_resident_pages == 4 and engine.allocator.evicted_pages == 5
    turns = [Request(f"s{n}t2", history[n] + MESSAGES[3], SAMPLING) for n in (2, 0, 1)]

    def leases_let_go(request: Request, token: int) -> None:
        if len(request.output) == 1:  # the lookup leased the 3 blocks the pool holds
            wait_for(lambda: client.stats().active_leases == 0)

    engine.generate(turns[:1], on_token=leases_let_go)
    assert turns[0].loaded_from == {"hbm": 3} and turns[0].num_loaded_tokens == 0
    assert connector.stats().loaded_blocks == 0
    engine.generate(turns[1:])
    assert [turn.loaded_from for turn in turns[1:]] == [{"host": 3}] * 2
    assert [turn.num_resident_tokens for turn in turns] == [48, 0, 0]
    assert engine.prompt_tokens["hbm"] == 48
    assert engine.prompt_tokens["host"] == 2 * 3 * connector.block_tokens
    for turn in turns:
        assert turn.output == recompute(models.engine, turn.prompt).output
    connector.close()


def test_blocks_mapped_from_the_pool_are_not_offered_to_the_store_again(
    models: TinyModels, client: KVStoreClient
) -> None:
    """A prompt whose every full page is resident asks the store nothing; its blocks were
    offered when they were computed, so its saves offer only blocks past them (none here:
    the answer fills no new block)."""
    engine, connector = store_engine(models.engine, client, "hbm-saves", retain_pages=16)
    prompt = torch.randint(0, 192, (50,), generator=torch.Generator().manual_seed(80)).tolist()
    first = Request("first", prompt, SAMPLING)
    engine.generate([first])
    assert connector.wait_for_saves(10.0)
    offered = connector.stats().queued_saves
    assert offered == (len(prompt) + len(first.output) - 1) // connector.block_tokens
    again = Request("again", prompt, SAMPLING)  # the same prompt: a regenerated answer
    engine.generate([again])
    assert again.loaded_from == {"hbm": (len(prompt) - 1) // PAGE}
    assert connector.stats().lookups == 1  # the first request's only
    assert connector.stats().queued_saves == offered
    assert again.output == first.output
    connector.close()


def test_a_bf16_chat_through_the_store_answers_like_recompute(
    models: TinyModels, client: KVStoreClient
) -> None:
    model = copy.deepcopy(models.engine).to(torch.bfloat16)
    engine, connector = store_engine(model, client, "bf16-chat")
    server = ChatServer(engine, connector=connector, sampling=SamplingParams(max_tokens=12))
    for index, message in enumerate([*MESSAGES, MESSAGES[1], MESSAGES[3]]):  # 6 turns
        turn = server.chat("erin", message)
        assert connector.wait_for_saves(10.0)
        assert turn.dropped_tokens == 0  # within the window: every turn is exact
        assert turn.reply == recompute(model, turn.request.prompt, server.sampling).output
        assert bool(turn.request.num_loaded_tokens) == (index > 0)
    connector.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_of_several_pages_load_into_their_pages_bit_exact(
    models: TinyModels, any_plane_client: KVStoreClient, dtype: torch.dtype
) -> None:
    """Stored blocks of 3 pages (48 tokens): a chat's later turns load whole blocks into the
    engine's 16-token pages, answer like recompute, and every loaded page holds the bits the
    engine computed; the tokens past the last full block are computed."""
    model = copy.deepcopy(models.engine).to(dtype)
    tenant = f"three-pages-{dtype}-{any_plane_client.data_plane}"
    engine, connector = store_engine(model, any_plane_client, tenant, block_tokens=3 * PAGE)
    server = ChatServer(engine, connector=connector, sampling=SamplingParams(max_tokens=8))
    for index, message in enumerate(MESSAGES[:4]):
        turn = server.chat("frank", message)
        assert connector.wait_for_saves(10.0)
        assert turn.reply == recompute(model, turn.request.prompt, server.sampling).output
        loaded = turn.request.num_loaded_tokens
        assert loaded % (3 * PAGE) == 0 and (loaded > 0) == (index >= 2), loaded  # 45, 74 tokens
    assert connector.stats().loaded_blocks > 0 and connector.stats().failed_loads == 0
    connector.close()


def test_page_size_must_divide_the_block_size(models: TinyModels, client: KVStoreClient) -> None:
    engine = Engine(models.engine, num_pages=8, page_tokens=PAGE)
    namespace = namespace_for(engine.config, model_name="tiny", block_tokens=24)
    with pytest.raises(ValueError, match=r"page_tokens \(16\) must divide.*block_tokens \(24\)"):
        StoreConnector(
            client,
            namespace,
            kv_pool=engine.kv_pool,
            page_tokens=PAGE,
            rope_tables=engine.rope_tables,
        )
    other = namespace_for(engine.config, model_name="tiny", block_tokens=PAGE, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        StoreConnector(
            client, other, kv_pool=engine.kv_pool, page_tokens=PAGE, rope_tables=engine.rope_tables
        )


def test_a_store_hit_costs_the_same_calls_whatever_its_length(
    models: TinyModels, tmp_path: Path
) -> None:
    """One call at admission (the lookup leases what it finds in the arena) and a Release
    after: a hit of 3 blocks and one of 14 make the same calls to the daemon (its Prometheus
    counts, per method, which count the calls on the shm session's socket too)."""
    port = free_port()
    metrics = {"metrics": {"listen": f"127.0.0.1:{port}"}}
    with (
        running_daemon(tmp_path, host_capacity="64MiB", settings=metrics) as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=5.0) as client,
    ):
        engine, connector = store_engine(models.engine, client, "calls")
        calls = []
        for blocks in (3, 14):
            prompt = torch.randint(0, 192, (blocks * PAGE + 1,)).tolist()
            engine.generate([Request("save", prompt, SamplingParams(max_tokens=1))])
            assert connector.wait_for_saves(10.0)
            before = rpcs(scrape(port))
            hit = Request("hit", prompt, SamplingParams(max_tokens=1))
            engine.generate([hit])
            assert hit.num_loaded_tokens == blocks * PAGE
            # The loader's worker ends the lease after the last layer lands, so the engine
            # may finish first: wait for the Release, then take every call made.
            wait_for(lambda n=before["Release"]: rpcs(scrape(port))["Release"] > n, timeout=10.0)
            calls.append(rpcs(scrape(port)) - before)
        assert calls[0] == calls[1] == Counter(Lookup=1, Release=1), calls
        connector.close()


class CallLog:
    """Wraps a client's lookups and leases to note, in order, each call made (``find``: a
    lookup, which leases what it finds in the arena; ``lease``: an Acquire) and each lease
    that ended; ``leased`` is set once a lease is taken."""

    def __init__(self, client: KVStoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        self.leased = threading.Event()
        self.released = threading.Event()
        find, host_blocks, release = client.find, client.host_blocks, client.release

        def logged_find(*args: Any, **kwargs: Any) -> Any:
            self.calls.append("find")
            found = find(*args, **kwargs)
            if found.num_leased:
                self.leased.set()
            return found

        @contextlib.contextmanager
        def logged_lease(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with host_blocks(*args, **kwargs) as blocks:
                self.calls.append("lease")
                self.leased.set()
                yield blocks
            self.released.set()

        def logged_release(*args: Any, **kwargs: Any) -> Any:
            release(*args, **kwargs)
            self.released.set()

        monkeypatch.setattr(client, "find", logged_find)
        monkeypatch.setattr(client, "host_blocks", logged_lease)
        monkeypatch.setattr(client, "release", logged_release)

    def note(self, what: str) -> None:
        self.calls.append(what)


def test_a_queued_request_is_looked_up_and_leased_while_it_waits(
    models: TinyModels, client: KVStoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the batch full, the next request's lookup and lease run during the running
    one's decode steps: its admission makes no call, and it answers like recompute."""
    engine, connector = store_engine(models.engine, client, "queued", max_batch=1)
    hit_prompt = MESSAGES[0] + MESSAGES[1] + [7]  # 59 tokens: 3 blocks loadable
    engine.generate([Request("store", hit_prompt, SamplingParams(max_tokens=1))])
    assert connector.wait_for_saves(10.0)
    log = CallLog(client, monkeypatch)
    admit = connector.num_loadable_tokens

    def noted_admission(request: Request) -> int:
        log.note(f"admit {request.request_id}")
        return admit(request)

    monkeypatch.setattr(connector, "num_loadable_tokens", noted_admission)
    running = Request("running", MESSAGES[2], SamplingParams(max_tokens=4))
    queued = Request("queued", hit_prompt, SamplingParams(max_tokens=4))

    def on_token(request: Request, token: int) -> None:
        if request is running and len(request.output) == 2:  # a decode step after prepare
            assert log.leased.wait(10.0), "the queued request was not leased while it waited"

    engine.generate([running, queued], on_token=on_token)
    # The running one is a miss; the queued one is looked up (and leased) before admission.
    assert log.calls == ["admit running", "find", "find", "admit queued"]
    assert queued.num_loaded_tokens == 3 * PAGE and queued.loaded_from == {"host": 3}
    assert queued.output == recompute(models.engine, hit_prompt, queued.sampling).output
    assert connector.stats().refetches == 0
    connector.close()


def test_a_prepared_lookup_is_redone_at_admission_when_it_could_load_more(
    models: TinyModels, client: KVStoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks saved while a request waited are found at its admission."""
    engine, connector = store_engine(models.engine, client, "relookup")
    prompt = MESSAGES[0] + MESSAGES[1] + MESSAGES[2] + [7]  # 89 tokens: 5 blocks loadable
    engine.generate([Request("short", prompt[: 2 * PAGE + 1], SamplingParams(max_tokens=1))])
    assert connector.wait_for_saves(10.0)
    log = CallLog(client, monkeypatch)
    request = Request("waited", prompt, SamplingParams(max_tokens=2))
    connector.prepare(request)  # finds 2 blocks and leases them
    assert log.leased.wait(10.0)
    monkeypatch.undo()
    engine.generate([Request("longer", prompt[: 5 * PAGE + 1], SamplingParams(max_tokens=1))])
    assert connector.wait_for_saves(10.0)
    engine.generate([request])
    assert request.num_loaded_tokens == 5 * PAGE
    assert request.output == recompute(models.engine, prompt, request.sampling).output
    connector.close()


def test_a_lease_held_past_its_hold_is_let_go_and_fetched_again(
    models: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepared request not admitted within half the lease lets its blocks go (nothing
    stays pinned); its admission leases them again and loads them."""
    settings = {"server": {"lease_ttl": "1s"}}
    with (
        running_daemon(tmp_path, host_capacity="64MiB", settings=settings) as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=5.0) as client,
    ):
        engine, connector = store_engine(models.engine, client, "let-go")
        prompt = MESSAGES[0] + MESSAGES[1] + [7]
        engine.generate([Request("store", prompt, SamplingParams(max_tokens=1))])
        assert connector.wait_for_saves(10.0)
        log = CallLog(client, monkeypatch)
        request = Request("late", prompt, SamplingParams(max_tokens=2))
        connector.prepare(request)
        assert log.released.wait(10.0)  # let go after half of the 1 s lease
        engine.generate([request])
        assert log.calls == ["find", "lease"]  # the prepared lookup still served
        assert connector.stats().refetches == 1
        assert request.num_loaded_tokens == 3 * PAGE
        assert request.output == recompute(models.engine, prompt, request.sampling).output
        connector.close()


class Timeline:
    """When layer loads ended and layer computes ran. A load on the loader's thread of layer
    i + 1 waits (up to ``handshake_s``) for layer i's compute to start, and records whether
    it did: an engine that overlaps them lets it, one that waits for every layer first
    cannot. A layer the engine's own thread writes (it got there first) waits for nothing.
    Each compute takes ``compute_s`` at least, so that the loader can be ahead."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.handshake_s = self.compute_s = 0.0
        self.reset()

    def reset(self) -> None:
        self.loaded: dict[int, float] = {}
        self.computing: dict[int, tuple[float, float]] = {}
        self.started = [threading.Event() for _ in range(self.layers)]
        self.overlapped: dict[int, bool] = {}  # layers the loader's thread wrote

    def slow_load(self, real: Callable[..., None]) -> Callable[..., None]:
        def load(writer: transfer.LayerWriter, layer: int) -> None:
            if layer and threading.current_thread() is not threading.main_thread():
                self.overlapped[layer] = self.started[layer - 1].wait(self.handshake_s)
            real(writer, layer)
            self.loaded[layer] = time.perf_counter()

        return load

    def slow_layer(self, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run_layer(layer: int, *args: Any) -> torch.Tensor:
            start = time.perf_counter()
            self.started[layer].set()
            out = real(layer, *args)
            time.sleep(self.compute_s)
            self.computing[layer] = (start, time.perf_counter())
            return out

        return run_layer


def test_layer_loads_overlap_compute(
    tmp_path: Path, client: KVStoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = 4
    model = tiny_models(tmp_path, num_hidden_layers=layers).engine
    engine, connector = store_engine(model, client, "layerwise")
    prompt = MESSAGES[0] * 3  # 111 tokens: 6 blocks stored, 96 tokens loaded
    engine.generate([Request("store", prompt, SamplingParams(max_tokens=1))])
    assert connector.wait_for_saves(10.0)

    timeline = Timeline(layers)
    writes = timeline.slow_load(transfer.LayerWriter.write)
    monkeypatch.setattr(transfer.LayerWriter, "write", writes)
    monkeypatch.setattr(transfer, "WHOLE_LOAD_LAYER_BYTES", 0)  # layer by layer, however small
    monkeypatch.setattr(model, "run_layer", timeline.slow_layer(model.run_layer))

    def cached_prefill(name: str, handshake_s: float) -> Request:
        timeline.reset()
        timeline.handshake_s = handshake_s
        request = Request(name, [*prompt, 5], SamplingParams(max_tokens=1))
        engine.generate([request])
        assert request.num_loaded_tokens == 96
        return request

    # Within the connector's load timeout: an overlapping engine never makes a load wait it.
    timeline.compute_s = 0.05
    overlapped = cached_prefill("overlapped", handshake_s=connector.load_timeout_s / layers)
    for layer in range(layers):  # never computed before its KV is in the pool ...
        assert timeline.computing[layer][0] >= timeline.loaded[layer]
    # ... and layer i computes while the loader writes layer i + 1 (the engine's thread
    # writes those it gets to first, or while it waits for one the loader is writing).
    assert timeline.overlapped and all(timeline.overlapped.values()), timeline.overlapped

    wait = connector.wait_for_layer_load  # now: wait for every layer before layer 0

    def load_all_first(request: Request, layer: int) -> bool:
        return all(wait(request, earlier) for earlier in range(layers)) and wait(request, layer)

    monkeypatch.setattr(connector, "wait_for_layer_load", load_all_first)
    timeline.compute_s = 0.0
    sequential = cached_prefill("sequential", handshake_s=0.05)
    assert timeline.computing[0][0] >= max(timeline.loaded.values())  # the control's order ...
    assert not any(timeline.overlapped.values()), timeline.overlapped  # ... is seen
    # What overlap saves is measured by the benchmarks: timed comparisons flake here.
    assert overlapped.output == sequential.output
    connector.close()


def test_a_small_load_is_written_whole_by_one_thread(
    tmp_path: Path, client: KVStoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below ``WHOLE_LOAD_LAYER_BYTES`` a layer, the first thread to write (the engine's or
    the load's) writes every layer in one call; the engine then waits for it once, and
    answers as recompute does."""
    layers = 4
    model = tiny_models(tmp_path, num_hidden_layers=layers).engine
    engine, connector = store_engine(model, client, "whole")
    prompt = MESSAGES[0] * 3
    engine.generate([Request("store", prompt, SamplingParams(max_tokens=1))])
    assert connector.wait_for_saves(10.0)
    calls: list[tuple[str, str, list[int]]] = []  # (how, thread, layers)
    write, write_many = transfer.LayerWriter.write, transfer.LayerWriter.write_many

    def one(writer: transfer.LayerWriter, layer: int) -> None:
        calls.append(("write", threading.current_thread().name, [layer]))
        write(writer, layer)

    def many(writer: transfer.LayerWriter, chosen: Sequence[int]) -> None:
        calls.append(("write_many", threading.current_thread().name, list(chosen)))
        write_many(writer, chosen)

    monkeypatch.setattr(transfer.LayerWriter, "write", one)
    monkeypatch.setattr(transfer.LayerWriter, "write_many", many)
    for name in ("whole", "whole again"):
        calls.clear()
        request = Request(name, [*prompt, 5], SamplingParams(max_tokens=1))
        engine.generate([request])
        assert request.num_loaded_tokens == 96
        assert [(how, chosen) for how, _, chosen in calls] == [("write_many", [0, 1, 2, 3])]
        assert request.output == recompute(model, request.prompt, request.sampling).output
    connector.close()


def test_a_full_save_queue_drops_saves_and_stores_nothing_wrong(
    models: TinyModels, client: KVStoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, connector = store_engine(models.engine, client, "full-queue", save_queue_size=2)
    gate = threading.Event()
    put = client.put

    def stuck_put(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(30.0)
        return put(*args, **kwargs)

    monkeypatch.setattr(client, "put", stuck_put)
    server = ChatServer(engine, connector=connector, sampling=SAMPLING)
    turns = [server.chat("bob", message) for message in MESSAGES[:3]]
    # Every turn ran to the end while the daemon took no put at all.
    assert all(len(turn.reply) == SAMPLING.max_tokens for turn in turns)
    assert connector.dropped_saves > 0
    gate.set()
    assert connector.wait_for_saves(10.0)
    stats = connector.stats()
    assert stats.saves.stored == stats.queued_saves > 0
    for turn in turns:
        assert turn.reply == recompute(models.engine, turn.request.prompt).output
    # Whatever was stored reads back as the KV transformers computes for those tokens.
    tokens = server.session("bob").context
    keys = block_keys(tokens, connector.namespace)
    held = [key for key in keys if client.lookup(connector.namespace, [key])]
    assert held and client.lookup(connector.namespace, keys) >= 1
    expected = reference_blocks(models, tokens, connector.namespace)
    for index, key in enumerate(keys):
        if key in held:
            got = stored_blocks(client, connector.namespace, [key])[0]
            torch.testing.assert_close(got, expected[index], atol=1e-5, rtol=1e-5)
    connector.close()


def test_blocks_evicted_after_the_lookup_cost_only_their_own_recompute(
    models: TinyModels, any_plane_client: KVStoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks deleted right after the lookup: on the shm plane the lookup leased them, so the
    load gets them all; streamed (nothing leased), the daemon gives a leading part of what
    the lookup promised: it is loaded, the engine computes the rest, and the missing blocks
    are saved again."""
    client = any_plane_client
    engine, connector = store_engine(models.engine, client, f"short-{client.data_plane}")
    server = ChatServer(engine, connector=connector, sampling=SAMPLING)
    server.chat("dave", MESSAGES[0] + MESSAGES[1])  # 58 tokens: 3 full blocks
    assert connector.wait_for_saves(10.0)
    find = client.find

    def find_then_evict(namespace: Namespace, keys: Any) -> Any:
        found = find(namespace, keys)
        assert found.num_blocks >= 3
        assert client.delete(namespace, list(keys[1:])) >= 2  # all but the first block go
        return found

    monkeypatch.setattr(client, "find", find_then_evict)
    second = server.chat("dave", MESSAGES[2])
    monkeypatch.undo()
    request = second.request
    assert second.reply == recompute(models.engine, request.prompt).output
    stats = connector.stats()
    if client.data_plane == "shm":  # leased with the lookup: the delete waits for the lease
        assert (request.num_loaded_tokens, request.loaded_from) == (3 * PAGE, {"host": 3})
        assert (stats.short_loads, stats.failed_loads, stats.missing_blocks) == (0, 0, 0)
    else:
        assert (request.num_loaded_tokens, request.loaded_from) == (PAGE, {"host": 1})
        assert request.num_computed_tokens == len(request.prompt) - PAGE
        assert (stats.short_loads, stats.failed_loads) == (1, 0)
        assert stats.missing_blocks == stats.loaded_blocks - 1 >= 2  # planned, less one loaded
        assert connector.wait_for_saves(10.0)  # the recomputed blocks are stored again
        keys = block_keys(request.prompt, connector.namespace)
        assert client.lookup(connector.namespace, keys) == len(keys)
    connector.close()


def test_a_stopped_daemon_means_recompute_not_errors(
    tmp_path: Path, models: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        running_daemon(tmp_path / "daemon") as daemon,
        KVStoreClient(daemon.address, retries=0, timeout=2.0) as client,
    ):
        engine, connector = store_engine(models.engine, client, "stopped", load_timeout_s=5.0)
        server = ChatServer(engine, connector=connector, sampling=SAMPLING)
        server.chat("carol", MESSAGES[0])
        assert connector.wait_for_saves(10.0)

        # The daemon dies once the lookup leased the hit: the leased bytes stay mapped here and
        # nothing can change them any more, so the load completes, exactly.
        find = client.find

        def find_then_die(*args: Any, **kwargs: Any) -> Any:
            found = find(*args, **kwargs)
            daemon.kill()
            return found

        monkeypatch.setattr(client, "find", find_then_die)
        second = server.chat("carol", MESSAGES[1])
        monkeypatch.undo()
        assert connector.stats().failed_loads == 0
        assert second.request.num_loaded_tokens > 0 and second.request.loaded_from == {"host": 2}
        assert second.reply == recompute(models.engine, second.request.prompt).output

        # Down at admission: the lookup fails, is counted, and the turn is computed.
        third = server.chat("carol", MESSAGES[2])
        assert connector.stats().lookup_errors == 1
        assert third.request.num_computed_tokens == len(third.request.prompt)
        assert third.reply == recompute(models.engine, third.request.prompt).output
        connector.close(timeout=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_pages", [1, 3])
def test_on_cuda_a_pinned_arena_loads_by_kernel_and_answers_like_recompute(
    models: TinyModels, daemon: Daemon, block_pages: int
) -> None:
    """The GPU load path: the client registers the arena (mapped) and the loader reads it
    with one kernel per layer straight into the pool's pages; bf16 turns answer like
    recompute on CUDA, token for token."""
    model = copy.deepcopy(models.engine).to("cuda", torch.bfloat16)
    with KVStoreClient(daemon.address, retries=0, timeout=5.0, pin_arena=True) as client:
        tenant = f"cuda-{block_pages}"
        engine, connector = store_engine(model, client, tenant, block_tokens=block_pages * PAGE)
        server = ChatServer(engine, connector=connector, sampling=SamplingParams(max_tokens=8))
        for message in MESSAGES:
            turn = server.chat("gina", message)
            assert connector.wait_for_saves(10.0)
            assert turn.reply == recompute(model, turn.request.prompt, server.sampling).output
        stats = connector.stats()
        assert stats.loaded_blocks > 0 and stats.failed_loads == 0, stats
        keys = block_keys(turn.request.prompt, connector.namespace)[:1]
        with client.host_blocks(connector.namespace, keys) as blocks:
            assert len(blocks) == 1 and blocks.mapped is not None  # read where it lies
        connector.close()
