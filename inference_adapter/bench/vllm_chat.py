"""Multi-turn chats through vLLM's offline engine, with or without ``KVStoreConnector``.

Runs inside a Python environment that has vLLM (``python -m
kvstore.inference_adapter.bench.vllm_chat --help``) and prints one JSON object: per session,
per turn, the greedy output tokens, the prompt tokens vLLM took from a cache
(``num_cached_tokens``: kvstore's, and with ``--prefix-caching`` vLLM's own too), the same
by level as the connector reports them (``levels``: ``hbm`` for vLLM's own prefix cache,
``host``/``ssd``/``redis`` for the daemon's tiers), the time to first token and the decode
time (first token to last, vLLM's own timestamps). The tests and ``kvstore bench vllm``
compare such runs. Between turns the driver lets the connector's saves reach the daemon (a
user's think time is longer than a put), untimed, so that a turn's hits do not depend on how
fast the previous turn's background puts ran.

``--misses`` makes every request a miss while the prompts stay the chat's: between turns,
once the saves landed, the driver deletes from the daemon every block a session's context
(prompt and answer) has, so the connector looks up, finds nothing, computes and saves, turn
after turn (``forgotten_blocks`` counts the blocks deleted: what the misses saved). It needs
the connector's worker in this process (tensor parallel 1), whose namespace names the keys.

``write_model(folder, size)`` writes a random Llama checkpoint (``config.json`` and
safetensors, the weights kvstore's own engine draws for the same seed, scaled by ``gain``
so greedy tokens depend on the whole context) that both vLLM and kvstore's engine load.
Prompts are token ids: no tokenizer is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "MODEL_SIZES",
    "TRANSFORMERS_ARCHITECTURES",
    "ChatShape",
    "chat_turns",
    "run_chats",
    "write_model",
]

# name -> config.json fields of a Llama. "test" runs a turn in well under a second on a
# 2-core CPU; "bench" (63M parameters, 16 KiB of KV per token) prefills 2K tokens in about
# 3 s there and 4K in about 6 s.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "test": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
    },
    "bench": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8192,
    },
}


# architecture -> what its config.json adds to a Llama's, and the weights it has no use for.
# The same random decoder under another name: vLLM runs each through its own model code.
ARCHITECTURES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "llama": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, ()),
    "mistral": (
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
        (),
    ),
    # q, k and v projections with biases (o_proj has none), theta 1e6 as Qwen2's own.
    "qwen2": (
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": True,
         "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False},
        ("o_proj.bias",),
    ),
}  # fmt: skip
# architecture -> its transformers config class and what it sets beyond the sizes: decoders
# whose weights differ from a Llama's (fused projections, per-head norms, Gemma's norms and
# windows) are built by transformers itself, with random weights.
TRANSFORMERS_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"rope_theta": 1000000.0}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    # Sliding-window layers over a 128-token window, then a full one: the chats pass it.
    "gemma2": ("Gemma2Config", {"sliding_window": 128, "query_pre_attn_scalar": 64,
                                "tie_word_embeddings": True}),  # vLLM's Gemma 2 ties them
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 128, "query_pre_attn_scalar": 64,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2}),
}  # fmt: skip


def write_model(
    folder: Path, size: str = "test", *, seed: int = 0, gain: float = 4.0, arch: str = "llama"
) -> Path:
    """A random checkpoint in ``folder`` (float32, 8192 positions): a Llama, the same decoder
    as another architecture of :data:`ARCHITECTURES`, or one of
    :data:`TRANSFORMERS_ARCHITECTURES` built by transformers."""
    import torch
    from safetensors.torch import save_file

    if arch in TRANSFORMERS_ARCHITECTURES:
        return _write_transformers_model(folder, size, seed=seed, gain=gain, arch=arch)

    from kvstore.inference_adapter.model import LlamaModel
    from kvstore.inference_adapter.weights import LlamaConfig

    named, unused = ARCHITECTURES[arch]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **MODEL_SIZES[size],
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
    }
    folder.mkdir(parents=True, exist_ok=True)
    model = LlamaModel.from_config(
        LlamaConfig.from_dict({**config, "attention_bias": named.get("attention_bias", False)}),
        seed=seed,
    )
    config |= named
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(gain)
    weights = {
        (name if name == "lm_head.weight" else f"model.{name}"): tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not name.endswith(unused)
    }
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def _write_transformers_model(
    folder: Path, size: str, *, seed: int, gain: float, arch: str
) -> Path:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    name, extra = TRANSFORMERS_ARCHITECTURES[arch]
    settings = {"max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 1,
                "eos_token_id": 2, **MODEL_SIZES[size], **extra}  # fmt: skip
    config = getattr(transformers, name)(**settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" not in param_name:
                param.mul_(gain)  # sharper logits than the initializer's: answers differ
    model.save_pretrained(folder)
    return folder


@dataclass(frozen=True, slots=True)
class ChatShape:
    """Sessions of ``turns`` turns: a ``first_tokens`` opening message, then
    ``turn_tokens`` per user turn; each answer is ``answer_tokens`` long."""

    sessions: int = 1
    turns: int = 4
    first_tokens: int = 1024
    turn_tokens: int = 128
    answer_tokens: int = 16
    vocab: int = 1024
    seed: int = 0


def chat_turns(shape: ChatShape) -> list[list[list[int]]]:
    """Per session, per turn, the user's new tokens (ids 3 .. vocab - 1)."""
    rng = random.Random(shape.seed)
    sessions = []
    for _ in range(shape.sessions):
        turns = []
        for turn in range(shape.turns):
            n = shape.first_tokens if turn == 0 else shape.turn_tokens
            turns.append([rng.randrange(3, shape.vocab) for _ in range(n)])
        sessions.append(turns)
    return sessions


def engine(
    model: Path,
    connector: dict[str, Any] | None,
    *,
    block_size: int = 32,
    max_model_len: int = 8192,
    kv_cache_bytes: int = 512 << 20,
    tensor_parallel_size: int = 1,
    dtype: str = "float32",
    prefix_caching: bool = False,
    kv_role: str = "kv_both",
) -> Any:
    """vLLM's offline engine on ``model``; ``connector`` is ``kv_connector_extra_config``
    for KVStoreConnector, or ``None`` for none, in ``kv_role`` (``kv_consumer``: it loads
    and never saves). vLLM's prefix cache is off unless ``prefix_caching``."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if connector is not None:
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.inference_adapter.vllm",
            kv_role=kv_role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=connector,
        )
    return LLM(
        model=str(model),
        load_format="safetensors",
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=prefix_caching,
        kv_transfer_config=transfer,
        block_size=block_size,
        max_model_len=max_model_len,
        dtype=dtype,
        kv_cache_memory_bytes=kv_cache_bytes,
        disable_log_stats=False,
        seed=0,
        tensor_parallel_size=tensor_parallel_size,
    )


def run_chats(
    llm: Any,
    shape: ChatShape,
    after_turn: dict[int, list[str]] | None = None,
    users: list[list[list[int]]] | None = None,
    between_turns: Callable[[list[list[int]]], None] | None = None,
) -> list[list[dict[str, Any]]]:
    """Plays every session turn by turn (sessions interleaved per turn, one request each);
    after turn ``n`` (1-based), once its saves landed, ``between_turns`` gets each session's
    context (prompt and answer) and the shell commands ``after_turn[n]`` run, in order. The
    users' turns are ``users`` (per session, per turn, token ids; ``shape`` says only how
    long answers are) or else ``chat_turns(shape)``."""
    from vllm import SamplingParams

    from kvstore.inference_adapter.vllm.scheduler import LEVELS_PARAM

    params = SamplingParams(max_tokens=shape.answer_tokens, temperature=0.0, detokenize=False)
    users = users or chat_turns(shape)
    shape = replace(shape, sessions=len(users), turns=min(len(turns) for turns in users))
    histories: list[list[int]] = [[] for _ in users]
    results: list[list[dict[str, Any]]] = [[] for _ in users]
    for turn in range(shape.turns):
        for session, messages in enumerate(users):
            prompt = histories[session] + messages[turn]
            started = time.perf_counter()
            (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            tokens = list(output.outputs[0].token_ids)
            metrics = output.metrics
            ttft = getattr(metrics, "first_token_latency", 0.0) or elapsed
            results[session].append(
                {
                    "prompt_tokens": len(prompt),
                    "tokens": tokens,
                    "cached_tokens": int(output.num_cached_tokens or 0),
                    "levels": (output.kv_transfer_params or {}).get(LEVELS_PARAM, {}),
                    "ttft_s": ttft,
                    "decode_s": _decode_s(metrics) or max(0.0, elapsed - ttft),
                    "wall_s": elapsed,
                }
            )
            histories[session] = prompt + tokens
        _drain_saves()  # a user's think time: the turn's saves land before the next turn
        if between_turns is not None:
            between_turns(histories)
        for command in (after_turn or {}).get(turn + 1, []):
            subprocess.run(command, shell=True, check=True)
    return results


def _decode_s(metrics: Any) -> float:
    """First token to last by vLLM's timestamps (0 when it kept none)."""
    first = getattr(metrics, "first_token_ts", 0.0) or 0.0
    last = getattr(metrics, "last_token_ts", 0.0) or 0.0
    return last - first if 0 < first <= last else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--write-model", choices=sorted(MODEL_SIZES), help="write it first")
    parser.add_argument("--arch", choices=sorted({*ARCHITECTURES, *TRANSFORMERS_ARCHITECTURES}),
                        default="llama",
                        help="the architecture --write-model names")  # fmt: skip
    parser.add_argument("--connector", help="kv_connector_extra_config JSON; none when unset")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the model's and the KV cache's dtype")  # fmt: skip
    parser.add_argument("--prefix-caching", action="store_true",
                        help="vLLM's own prefix cache on (the HBM level)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    parser.add_argument("--prompts", type=Path,
                        help="the users' turns as JSON (per session, per turn, token ids), "
                             "instead of random ones: a real chat")  # fmt: skip
    parser.add_argument("--misses", action="store_true",
                        help="delete each turn's saved blocks before the next turn: every "
                             "request a miss (needs --connector)")  # fmt: skip
    parser.add_argument("--kv-role", choices=["kv_both", "kv_consumer"], default="kv_both",
                        help="the connector's role; kv_consumer loads and never saves")  # fmt: skip
    parser.add_argument("--baseline-first", action="store_true",
                        help="play the chats without a connector first, in the same process "
                             "(the report's 'baseline')")  # fmt: skip
    parser.add_argument(
        "--after-turn",
        action="append",
        default=[],
        metavar="N:COMMAND",
        help="run a shell command after turn N (fault injection: kill the daemon, ...)",
    )
    for name, default in asdict(ChatShape()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args(argv)
    if args.misses and (args.connector is None or args.tensor_parallel_size != 1):
        parser.error("--misses needs --connector and --tensor-parallel-size 1")
    if args.write_model:
        write_model(args.model, args.write_model, arch=args.arch)
    shape = ChatShape(**{name: getattr(args, name) for name in asdict(ChatShape())})
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    hooks: dict[int, list[str]] = {}
    for hook in args.after_turn:
        turn, _, command = hook.partition(":")
        hooks.setdefault(int(turn), []).append(command)
    users = json.loads(args.prompts.read_text()) if args.prompts else None
    connector = json.loads(args.connector) if args.connector else None
    report: dict[str, Any] = {}
    if args.baseline_first:  # one process, one import of vLLM, for both runs
        report["baseline"] = _play(args, None, shape, {}, users)
        _close_engine()
    report |= _play(args, connector, shape, hooks, users)
    text = json.dumps(report)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    sys.stdout.flush()
    return 0


def _play(
    args: argparse.Namespace,
    connector: dict[str, Any] | None,
    shape: ChatShape,
    hooks: dict[int, list[str]],
    users: list[list[list[int]]] | None,
) -> dict[str, Any]:
    """Start an engine as ``args`` say, play the chats, report."""
    started = time.perf_counter()
    llm = engine(
        args.model,
        connector,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_mib << 20,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        prefix_caching=args.prefix_caching,
        kv_role=args.kv_role,
    )
    start_s = time.perf_counter() - started
    forget = _Forget(connector) if connector is not None and args.misses else None
    sessions = run_chats(llm, shape, hooks, users, forget)
    report = {"engine_start_s": start_s, "sessions": sessions, "connector": _connector_stats(llm)}
    if forget is not None:
        report["forgotten_blocks"] = forget.blocks
    llm.llm_engine.engine_core.shutdown()
    return report


@dataclass(slots=True)
class _Forget:
    """``between_turns`` for ``--misses``: deletes every block of each context from the
    daemon the ``connector`` settings name, under the worker's namespace; ``blocks`` counts
    what was deleted."""

    connector: dict[str, Any]
    blocks: int = 0

    def __call__(self, contexts: list[list[int]]) -> None:
        from kvstore.client import KVStoreClient, block_keys, shard_keys

        worker = _worker_side()
        if worker is None:
            raise RuntimeError("--misses needs the connector's worker in this process")
        keys = [k for context in contexts for k in block_keys(context, worker.namespace)]
        token_env = self.connector.get("token_env")
        token = os.environ.get(token_env) if token_env else None
        with KVStoreClient(self.connector["address"], token=token) as client:
            self.blocks += client.delete(worker.namespace, shard_keys(keys, worker.rank))


def _close_engine() -> None:
    """Free the in-process engine's model and process groups, so another can start."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def _worker_side() -> Any:
    """The worker's connector side when vLLM runs in this process (else ``None``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "_worker", None)


def _drain_saves(timeout: float = 30.0) -> None:
    worker = _worker_side()
    if worker is not None:
        worker.wait_for_saves(timeout)


def _connector_stats(llm: Any) -> dict[str, int]:
    """The connector's counters (in-process engine only), for the tests: the worker's, and
    the scheduler's failed lookups."""
    try:
        worker = _worker_side()
        if worker is None:
            return {}
        worker.wait_for_saves(30.0)
        counts = dict(worker.counts + worker.save_counts())
        scheduler = _scheduler_side(llm)
        if scheduler is not None and scheduler.lookup_errors:
            counts["lookup_errors"] = scheduler.lookup_errors
        return counts
    except Exception:  # stats are a report, never a failure
        return {}


def _scheduler_side(llm: Any) -> Any:
    """The scheduler's connector side when the engine core runs in this process."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    connector = getattr(getattr(core, "scheduler", None), "connector", None)
    return getattr(connector, "_scheduler", None)


if __name__ == "__main__":
    sys.exit(main())
