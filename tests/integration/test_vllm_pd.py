"""Prefill/decode disaggregation through two stock vLLM OpenAI servers (CPU) and
``kvstore pd-proxy``: trained Gemma 3 270M on one daemon, a random Qwen2 on two daemons
sharing a Redis tier.

Each test starts its own pair (one test a pair: pytest's workers split a module's tests),
one pair on the machine at a time (``machine_lock``: a trained model's pair holds ~4.4 GB):
a prefill vLLM (``kv_producer``: its steps end once their saves are committed) and a decode
vLLM (``kv_consumer``), their own prefix caches off, greedy, float32, 32-token blocks; the
harness is ``benchmarks.pd``. For each of 50 ShareGPT openings, sent one after another with
no pause between the proxy's prefill and its decode: the decode instance alone first
computes the answer (nothing is stored for the prompt yet: the reference, a single vLLM's),
then the proxy's run must load at least 95% of the prompt's usable blocks (none recomputed
through a race) and give the same tokens. Then the faults: the daemon restarted between
prefill and decode, Redis hung on the decode side, the prefill killed while its saves wait
for a stopped daemon; each time the decode instance recomputes and answers the same, never
with another request's KV.

Without vLLM the module is skipped, unless ``KVSTORE_REQUIRE_VLLM=1`` (``make test``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.inference_adapter.bench.vllm_chat import write_model
from kvstore.inference_adapter.models import hf_checkpoint
from kvstore.inference_adapter.vllm.proxy import PDProxy
from tests.conftest import RedisServer
from tests.support.benchmarks import benchmark
from tests.support.daemon import Daemon, running_daemon
from tests.support.files import fetched
from tests.support.machine_lock import machine_lock
from tests.support.net import free_port
from tests.support.vllm_env import require_vllm

VLLM_PYTHON = require_vllm(module_level=True)
pd = benchmark("pd")  # the harness: servers, the proxy, completions, ShareGPT prompts
BLOCK: int = pd.BLOCK

pytestmark = pytest.mark.timeout(1800)  # a pair may wait for another suite's to end

ANSWER = 4  # tokens of each answer compared (the first comes from the prompt's KV)
PROMPTS = 50
LENGTHS = (300, 900)  # ShareGPT openings of these many tokens
GEMMA_LENGTHS = (100, 300)  # shorter for the trained model: each is computed twice


class Pair:
    """A running prefill/decode pair, its proxy and the model it serves."""

    def __init__(self, model: Path, prefill: Any, decode: Any, proxy: PDProxy):
        self.model, self.prefill, self.decode, self.proxy = model, prefill, decode, proxy

    def errors(self) -> str:
        """The servers' error lines and tracebacks (for a failure's message)."""
        lines = []
        for server in (self.prefill, self.decode):
            text = server.log.read_text(errors="replace").splitlines()
            marked = [line for line in text if "ERROR" in line or "Traceback" in line]
            lines += [f"{server.role}: {line}" for line in marked[-40:]]
        return "\n".join(lines)

    def through_proxy(self, prompt: list[int]) -> Any:
        return pd.complete(self.proxy.server_address[1], self.model, prompt, ANSWER)

    def alone(
        self, port: int, prompt: list[int], tokens: int = ANSWER,
        params: dict[str, Any] | None = None,
    ) -> Any:  # fmt: skip
        """One instance asked directly (``params``: the hand-off it is given)."""
        return pd.complete(port, self.model, prompt, tokens, params)


@contextlib.contextmanager
def running_pair(
    model: Path, prefill_daemon: Daemon, decode_daemon: Daemon, name: str, logs: Path,
    kv_cache_mib: int = 512,
) -> Iterator[Pair]:  # fmt: skip
    prefill_extra = pd.connector_extra(prefill_daemon.address, name)
    decode_extra = pd.connector_extra(decode_daemon.address, name)
    ports = (free_port(), free_port())
    with (
        pd.vllm_pair(model, prefill_extra, decode_extra, logs, ports=ports,
                  kv_cache_mib=kv_cache_mib) as (prefill, decode),
        pd.proxy_for(prefill, decode) as proxy,
    ):  # fmt: skip
        yield Pair(model, prefill, decode, proxy)


def first_blocks_differ(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts whose first block no earlier prompt shares: a reference computed by the
    decode instance then finds nothing of an earlier prompt stored."""
    seen: set[tuple[int, ...]] = set()
    kept = []
    for prompt in prompts:
        if tuple(prompt[:BLOCK]) not in seen:
            seen.add(tuple(prompt[:BLOCK]))
            kept.append(prompt)
    return kept


def check_handoffs(pair: Pair, prompts: list[list[int]]) -> None:
    """Each prompt: the decode instance's answer alone (the reference), then the proxy's run:
    >= 95% of the usable blocks loaded, the same tokens."""
    for number, prompt in enumerate(prompts):
        reference = pair.alone(pair.decode.port, prompt)
        assert pd.loaded_blocks(reference) == 0, number  # computed: nothing was stored for it
        handed = pair.through_proxy(prompt)
        usable = (len(prompt) - 1) // BLOCK
        named = handed.headers["x-kvstore-handoff"]
        assert named == f"blocks={len(prompt) // BLOCK}", f"{number}: {named}\n{pair.errors()}"
        assert pd.loaded_blocks(handed) >= 0.95 * usable, (number, pd.loaded_blocks(handed), usable)
        assert handed.tokens == reference.tokens and len(reference.tokens) == ANSWER, number
    assert pair.proxy.counts == {"requests": len(prompts), "handoffs": len(prompts)}


# One daemon, a trained model (one test: the pair starts once, whichever worker runs it) ---


def test_a_trained_model_decodes_from_its_prefills_kv_on_one_daemon(tmp_path: Path) -> None:
    checkpoint = fetched(lambda: hf_checkpoint("gemma3", torch.float32))
    prompts = pd.sharegpt_prompts(2 * PROMPTS, tokenizer=checkpoint / "tokenizer.json",
                                  lengths=GEMMA_LENGTHS)  # fmt: skip
    prompts = first_blocks_differ(prompts)
    with (
        machine_lock("vllm-pair"),  # one pair of vLLM servers on the machine at a time
        running_daemon(tmp_path / "daemon", host_capacity="256MiB", ssd_capacity=None) as daemon,
        running_pair(checkpoint, daemon, daemon, "gemma-3-270m", tmp_path) as pair,
    ):
        check_handoffs(pair, prompts[:PROMPTS])
        check_a_restart_between(pair, daemon, prompts[PROMPTS])


def check_a_restart_between(pair: Pair, daemon: Daemon, prompt: list[int]) -> None:
    """The daemon killed and restarted between the prefill and the decode: the blocks the
    hand-off names are gone, and the decode computes the prompt."""
    reference = pair.alone(pair.decode.port, prompt)
    prefilled = pair.alone(pair.prefill.port, prompt, tokens=1)
    daemon.kill()  # SIGKILL: its host tier, with the prefill's blocks, is gone
    daemon.start()
    handed = pair.alone(pair.decode.port, prompt, params=prefilled.params)
    assert pd.loaded_blocks(handed) == 0
    assert handed.tokens == reference.tokens


# Two daemons sharing Redis, a random non-Llama ------------------------------------------


@pytest.fixture
def shared_redis(redis_server: RedisServer) -> Iterator[RedisServer]:
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis_server.flushall()
    yield redis_server
    if redis_server.proc is not None:
        redis_server.proc.send_signal(signal.SIGCONT)  # a failed test may leave it stopped


def test_a_decode_node_loads_through_redis_what_a_prefill_node_saved(
    tmp_path: Path, shared_redis: RedisServer
) -> None:
    """Two daemons sharing Redis, which a block reaches before its save returns
    (``write_through``): the decode node finds the prefill node's blocks there."""
    redis = {"enabled": True, "url": shared_redis.url, "write_policy": "write_through",
             "timeout": "1s"}  # fmt: skip
    node = {"host_capacity": "256MiB", "ssd_capacity": None, "settings": {"redis": redis}}
    model = write_model(tmp_path / "model", arch="qwen2")
    prompts = first_blocks_differ(pd.sharegpt_prompts(2 * PROMPTS, vocab=1024, lengths=LENGTHS))
    with (
        machine_lock("vllm-pair"),
        running_daemon(tmp_path / "node-a", **node) as prefill_node,
        running_daemon(tmp_path / "node-b", **node) as decode_node,
        running_pair(model, prefill_node, decode_node, "random-qwen2", tmp_path,
                     kv_cache_mib=256) as pair,
    ):  # fmt: skip
        check_handoffs(pair, prompts[:PROMPTS])
        with KVStoreClient(decode_node.address) as client:  # it held none of them before
            tiers = {tier.name: tier for tier in client.stats().tiers}
            assert tiers["redis"].hits > 0
        check_redis_hung_on_the_decode_side(pair, shared_redis, prompts[PROMPTS])
        check_a_prefill_killed_while_its_saves_wait(pair, prefill_node, prompts[PROMPTS + 1])


def check_redis_hung_on_the_decode_side(pair: Pair, redis: RedisServer, prompt: list[int]) -> None:
    """Redis stopped (a hung peer) after the prefill: the decode node's lookup gives up
    (``lookup_timeout_s``) and the decode computes the prompt."""
    reference = pair.alone(pair.decode.port, prompt)
    prefilled = pair.alone(pair.prefill.port, prompt, tokens=1)
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        handed = pair.alone(pair.decode.port, prompt, params=prefilled.params)
    finally:
        redis.proc.send_signal(signal.SIGCONT)
    assert pd.loaded_blocks(handed) == 0
    assert handed.tokens == reference.tokens


def check_a_prefill_killed_while_its_saves_wait(
    pair: Pair, prefill_node: Daemon, prompt: list[int]
) -> None:
    """The prefill node's daemon is stopped, so the prefill's step waits for its saves; the
    prefill vLLM (its server and engine processes) is killed meanwhile. The proxy's decode
    computes the prompt itself, and no block of it is visible anywhere afterwards: a
    reservation never committed is never read."""
    reference = pair.alone(pair.decode.port, prompt)
    assert prefill_node.proc is not None
    answers: list[Any] = []
    prefill_node.proc.send_signal(signal.SIGSTOP)
    try:
        sender = threading.Thread(target=lambda: answers.append(pair.through_proxy(prompt)))
        sender.start()
        time.sleep(3.0)  # the prefill computes and waits on its saves (else it dies sooner)
        pair.prefill.kill()
    finally:
        prefill_node.proc.send_signal(signal.SIGCONT)
    sender.join(120)
    (handed,) = answers
    assert handed.headers["x-kvstore-handoff"] == "none"  # the proxy's prefill failed
    assert pd.loaded_blocks(handed) == 0 and handed.tokens == reference.tokens
    assert pair.proxy.counts["prefill_failures"] == 1
    again = pair.alone(pair.decode.port, prompt)  # once the prefill node's daemon ran on
    assert pd.loaded_blocks(again) == 0 and again.tokens == reference.tokens
