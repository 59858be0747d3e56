"""Prefill/decode disaggregation through the daemon: two stock vLLM OpenAI servers and
``kvstore pd-proxy``.

    python -m benchmarks.pd [--model qwen2|gemma3] [--prompts 50] [--answer-tokens 16]
                            [--json out.json]

Needs the vLLM environment (``make vllm-venv``; its python in ``KVSTORE_VLLM_PYTHON``) and
ShareGPT (``kvstore dataset fetch``); ``gemma3`` needs ``kvstore model fetch --name gemma3``.
One ``kvstore serve`` (a 1 GiB host tier), a prefill vLLM (``kv_producer``: its steps end
once their saves are committed) and a decode vLLM (``kv_consumer``) on it, each on half of
the CPUs (vLLM's processes spin a second after each message: sharing cores, one instance's
spin stalled the other's next request by up to a second), vLLM's own prefix cache off in
both, greedy decoding, float32, 32-token blocks. Prompts are the openings of
the first ShareGPT conversations of 300-1500 tokens (the trained model's tokenizer; for a
random checkpoint, the text's UTF-8 bytes as token ids).

Per prompt, nothing stored for it yet:

1. ``recompute``: the decode instance alone, a 1-token completion: its round trip (TTFT
   when it computes the prompt); then the answer of ``--answer-tokens`` (the reference);
2. ``prefill``: the prefill instance, a 1-token completion (what the proxy sends it): its
   round trip, which includes its step's wait for its saves (the hand-off);
3. ``load``: the decode instance with the prefill's ``kv_transfer_params``, a 1-token
   completion: its round trip (TTFT when it loads the prompt); the blocks it loaded (its
   reply's ``kvstore_levels``) against the prompt's usable full blocks;
4. through the proxy: the answer of ``--answer-tokens``, which must equal the reference.

The table gives medians per prompt-length bucket, the decode TTFT ratio (load /
recompute), and the hand-off's share: the prefill steps' waits for their saves (the
prefill's ``kvstore_engine_handoff_wait_seconds``) over the prompt's time from the prefill's
arrival to the decode's first token (prefill round trip + load round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.daemon import started_daemon, table
from kvstore.inference_adapter.bench.sharegpt import conversations, dataset_path
from kvstore.inference_adapter.vllm.proxy import PDProxy
from kvstore.inference_adapter.vllm.scheduler import HANDOFF_PARAM, LEVELS_PARAM

__all__ = [
    "BLOCK",
    "Completion",
    "PromptRun",
    "VllmServer",
    "complete",
    "connector_extra",
    "loaded_blocks",
    "proxy_for",
    "sharegpt_prompts",
    "vllm_pair",
]

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32  # vLLM's block size and the stored block's tokens
START_TIMEOUT_S = 600.0
WAITS = "kvstore_engine_handoff_wait_seconds"


def vllm_python() -> Path:
    """The vLLM environment's interpreter (``KVSTORE_VLLM_PYTHON``, relative to the checkout)."""
    return ROOT / os.environ.get("KVSTORE_VLLM_PYTHON", "build/vllm-venv/bin/python")


def connector_extra(address: str, model_name: str, **more: object) -> dict[str, object]:
    """``kv_connector_extra_config`` for a daemon at ``address``."""
    return {"address": address, "model_name": model_name, "retry_s": 0.2, **more}


@dataclass
class VllmServer:
    """A vLLM OpenAI server (``vllm.entrypoints.openai.api_server``) with the connector in
    ``role``, on ``port``; its output in ``log``."""

    model: Path
    port: int
    role: str
    extra: dict[str, object]
    log: Path
    kv_cache_mib: int = 512
    cores: tuple[int, ...] = ()  # run on these CPUs only (all: empty)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        transfer = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.inference_adapter.vllm",
            "kv_role": self.role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": self.extra,
        }
        command = [str(vllm_python()), "-P", "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                   "--skip-tokenizer-init", "--enforce-eager", "--no-enable-prefix-caching",
                   "--block-size", str(BLOCK), "--max-model-len", "4096", "--dtype", "float32",
                   "--kv-cache-memory-bytes", str(self.kv_cache_mib << 20), "--seed", "0",
                   "--kv-transfer-config", json.dumps(transfer)]  # fmt: skip
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO"}
        if self.cores:
            # vLLM's processes spin for a second after each message (shm_broadcast's
            # busy_loop_s): two instances sharing cores stall each other's next request by
            # up to that. On cores of its own, as on nodes of its own, one never waits for
            # the other.
            cpus = ",".join(map(str, self.cores))
            command = ["taskset", "-c", cpus, *command]
            env |= {"OMP_NUM_THREADS": str(len(self.cores)), "VLLM_CPU_OMP_THREADS_BIND": cpus}
        with self.log.open("ab") as out:  # cwd elsewhere: the checkout's folders shadow nothing
            # A session of its own: vLLM's engine core and worker are processes of their
            # own, which stop and kill reach as a group.
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=tempfile.gettempdir(), start_new_session=True,
            )  # fmt: skip

    def ready(self) -> bool:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM to the server and its engine processes; SIGKILL after 30 s."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
        self._signal(signal.SIGKILL)  # an engine process that outlived its server

    def kill(self) -> None:
        """SIGKILL to the server and its engine processes (a node lost)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def _signal(self, number: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, number)

    def metric(self, name: str) -> float:
        """The sum of ``name``'s samples on ``/metrics`` (every label set)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
        return sum(float(value) for value in pattern.findall(text))


@contextmanager
def vllm_pair(
    model: Path, prefill_extra: dict[str, object], decode_extra: dict[str, object], logs: Path,
    *, ports: tuple[int, int], kv_cache_mib: int = 512,
) -> Iterator[tuple[VllmServer, VllmServer]]:  # fmt: skip
    """A prefill (``kv_producer``) and a decode (``kv_consumer``) server, started side by
    side, each on half of this process's CPUs, and serving; stopped on exit.

    Raises:
        RuntimeError: One exited or did not serve within ``START_TIMEOUT_S`` (its log named).
    """
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)  # each instance on cores of its own, as on its own node
    prefill_cores = tuple(cores[:half])
    decode_cores = tuple(cores[half:] or cores)
    prefill = VllmServer(model, ports[0], "kv_producer", prefill_extra, logs / "prefill.log",
                         kv_cache_mib, prefill_cores)  # fmt: skip
    decode = VllmServer(model, ports[1], "kv_consumer", decode_extra, logs / "decode.log",
                        kv_cache_mib, decode_cores)  # fmt: skip
    servers = (prefill, decode)
    try:
        for server in servers:
            server.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(server.ready() for server in servers):
            for server in servers:
                if server.proc is not None and server.proc.poll() is not None:
                    raise RuntimeError(f"vLLM ({server.role}) exited; see {server.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not serve within {START_TIMEOUT_S:.0f} s; see {logs}")
            time.sleep(1.0)
        yield prefill, decode
    finally:
        for server in servers:
            server.stop()


@contextmanager
def proxy_for(prefill: VllmServer, decode: VllmServer) -> Iterator[PDProxy]:
    """``kvstore pd-proxy`` in a thread of this process, on a free port."""
    proxy = PDProxy(("127.0.0.1", 0), [f"http://127.0.0.1:{prefill.port}"],
                    [f"http://127.0.0.1:{decode.port}"])  # fmt: skip
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()


@dataclass(frozen=True, slots=True)
class Completion:
    tokens: list[int]
    params: dict[str, Any]
    seconds: float
    headers: dict[str, str]


def complete(
    port: int, model: Path, prompt: Sequence[int], max_tokens: int,
    params: dict[str, Any] | None = None,
) -> Completion:  # fmt: skip
    """A greedy completion of token ids at ``port``, ``max_tokens`` long (an end-of-text
    token does not stop it): its tokens, ``kv_transfer_params`` and round trip.

    Raises:
        RuntimeError: The server answered other than 200.
    """
    body: dict[str, Any] = {"model": str(model), "prompt": list(prompt), "max_tokens": max_tokens,
                            "temperature": 0.0, "return_token_ids": True,
                            "ignore_eos": True}  # fmt: skip
    if params is not None:
        body["kv_transfer_params"] = params
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    began = time.perf_counter()
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"content-type": "application/json"})  # fmt: skip
    reply = connection.getresponse()
    data = reply.read()
    seconds = time.perf_counter() - began
    if reply.status != 200:
        raise RuntimeError(f"port {port}: HTTP {reply.status}: {data[:300]!r}")
    answer = json.loads(data)
    return Completion(list(answer["choices"][0].get("token_ids") or []),
                      answer.get("kv_transfer_params") or {}, seconds,
                      {k.lower(): v for k, v in reply.getheaders()})  # fmt: skip


def loaded_blocks(answer: Completion) -> int:
    """Blocks an instance took from the store for a completion (its reply's levels, which
    count tokens; ``hbm`` is vLLM's own cache)."""
    levels = answer.params.get(LEVELS_PARAM, {})
    return int(sum(tokens for level, tokens in levels.items() if level != "hbm")) // BLOCK


def sharegpt_prompts(
    count: int, *, tokenizer: Path | None = None, vocab: int = 256,
    lengths: tuple[int, int] = (300, 1500),
) -> list[list[int]]:  # fmt: skip
    """The openings of the first ShareGPT conversations whose token count is in ``lengths``:
    tokenized by ``tokenizer`` (a ``tokenizer.json``; a leading ``<bos>`` 2), else their UTF-8
    bytes as ids (``+3``, below ``vocab``)."""
    encode = _bytes_encoder(vocab)
    if tokenizer is not None:
        from tokenizers import Tokenizer

        loaded = Tokenizer.from_file(str(tokenizer))

        def encode(text: str) -> list[int]:
            return [2, *loaded.encode(text, add_special_tokens=False).ids]

    prompts: list[list[int]] = []
    for conversation in conversations(dataset_path()):
        tokens = encode(conversation.exchanges[0].human)
        if lengths[0] <= len(tokens) <= lengths[1]:
            prompts.append(tokens)
            if len(prompts) == count:
                return prompts
    raise ValueError(f"ShareGPT has only {len(prompts)} openings of {lengths} tokens")


def _bytes_encoder(vocab: int) -> Any:
    def encode(text: str) -> list[int]:
        return [3 + byte % (vocab - 3) for byte in text.encode()]

    return encode


@dataclass
class PromptRun:
    """One prompt's run (see the module docstring)."""

    tokens: int
    usable_blocks: int
    loaded_blocks: int
    recompute_s: float
    prefill_s: float
    load_s: float
    same_answer: bool
    handoff_blocks: int


def run_prompt(
    prefill: VllmServer, decode: VllmServer, proxy: PDProxy, model: Path, prompt: list[int],
    answer_tokens: int,
) -> PromptRun:  # fmt: skip
    """Steps 1-4 of the module docstring for one prompt."""
    recompute = complete(decode.port, model, prompt, 1)
    reference = complete(decode.port, model, prompt, answer_tokens)
    prefilled = complete(prefill.port, model, prompt, 1)
    loaded = complete(decode.port, model, prompt, 1, prefilled.params)
    handed = complete(proxy.server_address[1], model, prompt, answer_tokens)
    return PromptRun(
        tokens=len(prompt),
        usable_blocks=(len(prompt) - 1) // BLOCK,
        loaded_blocks=loaded_blocks(loaded),
        recompute_s=recompute.seconds,
        prefill_s=prefilled.seconds,
        load_s=loaded.seconds,
        same_answer=handed.tokens == reference.tokens and len(reference.tokens) == answer_tokens,
        handoff_blocks=(prefilled.params.get(HANDOFF_PARAM) or {}).get("blocks", 0),
    )


def bucket_rows(runs: Sequence[PromptRun], waits_s: float) -> list[tuple[str, ...]]:
    """Medians per prompt-length bucket, and all prompts."""
    buckets = [("300-599", 300, 600), ("600-999", 600, 1000), ("1000-1500", 1000, 1501),
               ("all", 0, 1 << 30)]  # fmt: skip
    share = waits_s / max(1e-9, sum(r.prefill_s + r.load_s for r in runs))
    rows: list[tuple[str, ...]] = []
    for name, low, high in buckets:
        some = [r for r in runs if low <= r.tokens < high]
        if not some:
            continue
        recompute = statistics.median(r.recompute_s for r in some) * 1000
        load = statistics.median(r.load_s for r in some) * 1000
        prefill = statistics.median(r.prefill_s for r in some) * 1000
        loaded = sum(r.loaded_blocks for r in some) / max(1, sum(r.usable_blocks for r in some))
        rows.append((name, str(len(some)), f"{recompute:.1f}", f"{load:.1f}",
                     f"{load / recompute:.2f}", f"{prefill:.1f}", f"{prefill + load:.1f}",
                     f"{loaded:.3f}", str(sum(r.same_answer for r in some)),
                     f"{share:.3f}" if name == "all" else ""))  # fmt: skip
    return rows


HEADERS = ("prompt tokens", "prompts", "decode TTFT recompute ms", "decode TTFT load ms",
           "load / recompute", "prefill reply ms", "prefill + load ms", "blocks loaded",
           "same answer", "hand-off share")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pd", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model",
        choices=["qwen2", "gemma3"],
        default="qwen2",
        help="a random Qwen2 checkpoint, or trained Gemma 3 270M",
    )
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--ports", default="8100,8200", help="prefill,decode")
    parser.add_argument("--json", type=Path, help="write the runs as JSON here too")
    args = parser.parse_args(argv)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvstore-pd-") as scratch:
        return asyncio.run(_main(args, Path(scratch)))


async def _main(args: argparse.Namespace, scratch: Path) -> int:
    model, tokenizer, name = _model(args.model, scratch)
    prompts = sharegpt_prompts(args.prompts, tokenizer=tokenizer)
    ports = tuple(int(p) for p in args.ports.split(","))
    async with started_daemon(scratch, 1 << 30) as daemon:
        await daemon.serving()
        extra = connector_extra(daemon.address, name)
        runs, waits = await asyncio.to_thread(_run_all, model, extra, scratch, ports, prompts,
                                              args.answer_tokens)  # fmt: skip
    print(
        f"model {args.model}, {len(runs)} ShareGPT prompts, block {BLOCK} tokens, "
        f"{args.answer_tokens}-token answers, date {time.strftime('%Y-%m-%d')}"
    )
    print("\n".join(table(HEADERS, bucket_rows(runs, waits), numeric=HEADERS[1:])))
    if args.json is not None:
        args.json.write_text(json.dumps({"waits_s": waits, "runs": [asdict(r) for r in runs]}))
    return 0 if all(r.same_answer for r in runs) else 1


def _run_all(
    model: Path, extra: dict[str, object], scratch: Path, ports: tuple[int, ...],
    prompts: Sequence[list[int]], answer_tokens: int,
) -> tuple[list[PromptRun], float]:  # fmt: skip
    pair = vllm_pair(model, extra, extra, scratch, ports=(ports[0], ports[1]))
    with pair as (prefill, decode), proxy_for(prefill, decode) as proxy:
        complete(decode.port, model, [5] * (2 * BLOCK + 1), 1)  # warm both up
        complete(prefill.port, model, [6] * (2 * BLOCK + 1), 1)
        time.sleep(1.0)  # the warm-up's stats recorded before the count starts
        before = prefill.metric(f"{WAITS}_sum")
        runs = [run_prompt(prefill, decode, proxy, model, p, answer_tokens) for p in prompts]
        time.sleep(1.0)  # vLLM records the last step's stats with its next log tick
        return runs, prefill.metric(f"{WAITS}_sum") - before


def _model(name: str, scratch: Path) -> tuple[Path, Path | None, str]:
    """The checkpoint, its tokenizer (None for a random one) and the name the namespace uses."""
    if name == "gemma3":
        import torch

        from kvstore.inference_adapter.models import hf_checkpoint

        checkpoint = hf_checkpoint("gemma3", torch.float32)
        return checkpoint, checkpoint / "tokenizer.json", "gemma-3-270m"
    from kvstore.inference_adapter.bench.vllm_chat import write_model

    return write_model(scratch / "model", arch=name), None, f"random-{name}"


if __name__ == "__main__":
    raise SystemExit(main())
