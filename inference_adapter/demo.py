"""``kvstore chat``: a multi-turn chat with a real model, showing what the store saves per turn.

By default the model is SmolLM2-135M-Instruct (a trained Llama-architecture chat model, read
from its GGUF file with its own tokenizer and chat template; ``kvstore model fetch`` gets it
once). Each turn re-sends the whole conversation, as chat servers do; the engine's store
connector loads the part the daemon holds and computes only the rest. The reply streams as it
is generated; then a line says what the turn cost::

    turn 2: prompt 161 tokens | loaded 144 (host 9 blocks), computed 17 | TTFT 0.21 s with
    the store, 1.84 s recomputing (8.8x) | same reply

"recomputing" is a second engine, without the store, prefilling the same prompt
(``--no-recompute`` skips it); "same reply" compares the two replies token for token.

Interactive by default (type a message, an empty line or end of input ends the chat);
``--script`` runs a built-in conversation about this project, ``--script FILE`` one message per
line of FILE (``-``: standard input). ``--random`` swaps in a small randomly initialised model
and a byte tokenizer (no file needed; its replies are noise, so they are not printed).

The daemon is the one at ``--address``, or one this command starts on a temporary directory
(host arena, SSD tier) and stops at the end. Entry points: ``main(argv)``, and
``add_chat_parser`` for the ``kvstore`` command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from kvstore.client import KVStoreClient, KVStoreError
from kvstore.config import ConfigError
from kvstore.inference_adapter.connector import StoreConnector
from kvstore.inference_adapter.engine import Engine
from kvstore.inference_adapter.gguf import load_gguf_model
from kvstore.inference_adapter.hbm import load_hbm_config
from kvstore.inference_adapter.interfaces import Request, SamplingParams
from kvstore.inference_adapter.levels import by_level
from kvstore.inference_adapter.metrics import serve_engine_metrics
from kvstore.inference_adapter.model import LlamaModel
from kvstore.inference_adapter.models import SMOLLM2, model_path
from kvstore.inference_adapter.sessions import ByteTokenizer, ChatServer, Turn
from kvstore.inference_adapter.tokenizer import ChatTokenizer
from kvstore.inference_adapter.weights import LlamaConfig, namespace_for
from kvstore.kernels.rope import RopeConfig
from kvstore.launch import kvstore_command

__all__ = ["SCRIPT", "add_chat_parser", "main", "run_chat"]

SCRIPT = (
    "I run a chat service on a few GPUs. Every turn of a conversation re-sends the whole "
    "history, so the server computes the attention keys and values of the same text again "
    "and again. What could I do about that?",
    "Where should those keys and values be kept when GPU memory is full?",
    "How would the server know which stored blocks belong to a prompt?",
    "What happens when a conversation grows longer than the context window?",
    "Is it safe to share stored blocks between two customers?",
    "Summarise the idea in two sentences.",
)
WARM_UP_TOKENS = 96  # a short turn's prefill: the first timed turn pays no one-off costs
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ChatModel:
    """A model and the text side of it."""

    model: LlamaModel
    name: str  # names the weights in the store's namespace
    describe: str
    message_tokens: Callable[[str, bool], list[int]]  # (text, first turn) -> tokens to append
    decode: Callable[[Sequence[int]], str] | None  # None: the replies are not text
    stop_token_ids: tuple[int, ...]


def add_chat_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``chat`` command (its handler is ``args.run(args)``, as ``kvstore`` expects)."""
    chat = subparsers.add_parser(
        "chat", help="multi-turn chat with SmolLM2: TTFT with the store vs recomputing"
    )
    _add_arguments(chat)
    chat.set_defaults(run=run_chat)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the chat as its own command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="kvstore chat", description=__doc__.split("\n")[0])
    _add_arguments(parser)
    return run_chat(parser.parse_args(argv))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="a running daemon (default: start one in a temp dir)")
    parser.add_argument("--token", help="bearer token for --address")
    parser.add_argument(
        "--script",
        nargs="?",
        const="",
        metavar="FILE",
        help="run a scripted chat: the built-in one, or one message per line of FILE (- = stdin)",
    )
    parser.add_argument("--turns", type=int, help="stop after this many turns")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2 from the cache)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--max-tokens", type=int, default=96, help="most tokens per reply")
    parser.add_argument("--window", type=int, default=2048, help="context positions per chat")
    parser.add_argument("--sink-tokens", type=int, default=64, help="kept when a chat is cut")
    parser.add_argument("--page-tokens", type=int, default=16, help="tokens per page and block")
    parser.add_argument(
        "--hbm-pages",
        type=int,
        help="pool pages kept resident between turns (the HBM level; 0, the default: off); "
        "over --config's hbm.pages",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="a TOML file with an [hbm] table: pages, policy (lru or scheduler_aware)",
    )
    parser.add_argument(
        "--no-recompute", action="store_true", help="skip the engine that recomputes each turn"
    )
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve the engine's Prometheus metrics there (HBM hits, evictions, residency, "
        "prompt tokens by level) while the chat runs",
    )
    random = parser.add_argument_group("--random: a small random model, no file needed")
    random.add_argument("--random", action="store_true", help="random weights, byte tokens")
    random.add_argument("--layers", type=int, default=4)
    random.add_argument("--hidden", type=int, default=256)
    random.add_argument("--heads", type=int, default=4)
    random.add_argument("--kv-heads", type=int, default=2)
    random.add_argument("--seed", type=int, default=0)


def run_chat(args: argparse.Namespace) -> int:
    """The chat; returns 0 when both engines agreed on every turn (1 otherwise, 2 when the
    model file is missing or --config is unusable)."""
    torch.set_grad_enabled(False)
    try:
        hbm = load_hbm_config(args.config, pages=args.hbm_pages)
    except (ConfigError, OSError) as exc:
        print(f"kvstore chat: {exc}", file=sys.stderr)
        return 2
    try:
        chat = _random_model(args) if args.random else _gguf_model(args)
    except FileNotFoundError as exc:
        print(f"kvstore chat: {exc}", file=sys.stderr)
        return 2
    window = min(args.window, chat.model.config.max_position_embeddings)
    sampling = SamplingParams(max_tokens=args.max_tokens, stop_token_ids=chat.stop_token_ids)
    pages = window // args.page_tokens + 1
    store_engine = Engine(
        chat.model,
        num_pages=pages + hbm.pages,
        page_tokens=args.page_tokens,
        retain_pages=hbm.pages,
        hbm_policy=hbm.policy,
    )
    recompute = None
    if not args.no_recompute:
        recompute = Engine(chat.model, num_pages=pages, page_tokens=args.page_tokens)
    _warm_up([store_engine] + ([recompute] if recompute else []))
    namespace = namespace_for(
        chat.model.config,
        model_name=chat.name,
        block_tokens=args.page_tokens,
        dtype=chat.model.dtype,
    )
    messages = _messages(args)
    with (
        _daemon(args.address) as address,
        KVStoreClient(address, token=args.token, retries=1, timeout=10.0, pin_arena=True) as client,
        _engine_metrics(store_engine, args.metrics_listen),
    ):
        connector = StoreConnector(
            client,
            namespace,
            kv_pool=store_engine.kv_pool,
            page_tokens=args.page_tokens,
            rope_tables=store_engine.rope_tables,
        )
        try:
            server = ChatServer(
                store_engine,
                connector=connector,
                sampling=sampling,
                context_window=window,
                sink_tokens=args.sink_tokens,
            )
            print(f"kvstore chat: {chat.describe}; daemon {address} ({client.data_plane})")
            agreed = True
            before = Counter(store_engine.prompt_tokens)  # the warm-up's are not the chat's
            for index, text in enumerate(messages, start=1):
                first = not server.session("chat").turns
                tokens = chat.message_tokens(text, first)
                turn = _run_turn(server, chat, tokens)
                connector.wait_for_saves(30.0)  # so the next turn finds this one's blocks
                agreed &= _report(index, turn, recompute, sampling)
            levels = store_engine.prompt_tokens - before
            print(by_level(levels, computed=levels.pop("computed", 0)))
            stats = connector.stats()
            print(
                f"store: {stats.loaded_blocks} blocks loaded, {stats.saves.stored} saved, "
                f"{stats.dropped_saves} dropped, {stats.failed_loads} failed loads, "
                f"{stats.lookup_errors} failed lookups"
            )
        finally:
            connector.close()
    return 0 if agreed else 1


@contextlib.contextmanager
def _engine_metrics(engine: Engine, listen: str | None) -> Iterator[None]:
    if listen is None:
        yield
        return
    stop, port = serve_engine_metrics(engine, listen)
    print(f"kvstore chat: engine metrics on http://{listen.rpartition(':')[0]}:{port}/metrics")
    try:
        yield
    finally:
        stop()


def _run_turn(server: ChatServer, chat: ChatModel, message: list[int]) -> Turn:
    """One turn; the reply streams to stdout as it is generated (when it is text)."""
    decode = chat.decode
    if decode is None:
        return server.chat("chat", message)
    print("assistant: ", end="", flush=True)
    stream = _Stream(decode, chat.stop_token_ids)
    turn = server.chat("chat", message, on_token=lambda request, token: stream.add(token))
    print(flush=True)
    return turn


class _Stream:
    """Prints a reply's text as tokens arrive (whole characters only; stop tokens unshown)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: tuple[int, ...]) -> None:
        self._decode, self._stop = decode, stop
        self._tokens: list[int] = []
        self._shown = 0

    def add(self, token: int) -> None:
        if token in self._stop:
            return
        self._tokens.append(token)
        text = self._decode(self._tokens)
        if text.endswith("\ufffd"):
            return  # a character split across tokens: wait for the rest
        print(text[self._shown :], end="", flush=True)
        self._shown = len(text)


def _report(index: int, turn: Turn, recompute: Engine | None, sampling: SamplingParams) -> bool:
    """Prints the turn's line; True when recomputing gave the same reply (or was skipped)."""
    request = turn.request
    tiers = ", ".join(f"{tier} {n} blocks" for tier, n in sorted(request.loaded_from.items()))
    parts = [
        f"turn {index}: prompt {len(request.prompt)} tokens",
        f"loaded {request.num_loaded_tokens + request.num_resident_tokens}"
        f"{f' ({tiers})' if tiers else ''}, "
        f"computed {request.num_computed_tokens}",
    ]
    if turn.dropped_tokens:
        parts.append(f"cut {turn.dropped_tokens} old tokens (kept KV moved, approximate)")
    same = True
    ttft = f"TTFT {_seconds(request.ttft_s)} with the store"
    if recompute is not None:
        baseline = Request(f"recompute/{index}", list(request.prompt), sampling)
        recompute.generate([baseline])
        same = baseline.output == turn.reply
        speedup = baseline.ttft_s / request.ttft_s if request.ttft_s else 0.0
        ttft += f", {_seconds(baseline.ttft_s)} recomputing ({speedup:.1f}x)"
    parts.append(ttft)
    if recompute is not None:
        # After a cut the reused KV is approximate: a different reply is expected then.
        parts.append("same reply" if same else "REPLIES DIFFER")
    if index == 1 and not request.num_loaded_tokens:
        parts.append("nothing stored yet for a new chat: every token computed")
    print(f"  {' | '.join(parts)}", flush=True)
    return same or bool(turn.dropped_tokens)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


def _messages(args: argparse.Namespace) -> Iterable[str]:
    """The user's messages: the script, a file's lines, or what is typed."""
    if args.script is None:
        lines: Iterable[str] = _typed(sys.stdin)
    elif args.script == "":
        lines = SCRIPT
    elif args.script == "-":
        lines = sys.stdin
    else:
        lines = Path(args.script).read_text(encoding="utf-8").splitlines()
    messages = (line.strip() for line in lines if line.strip())
    for count, message in enumerate(messages, start=1):
        if args.turns is not None and count > args.turns:
            return
        yield message


def _typed(stream: TextIO) -> Iterator[str]:
    """Messages typed at a prompt; an empty line or end of input ends the chat."""
    while True:
        try:
            line = input("you: ") if stream.isatty() else stream.readline()
        except EOFError:
            return
        if not line.strip():
            return
        yield line.strip()


def _gguf_model(args: argparse.Namespace) -> ChatModel:
    path = args.model or model_path(SMOLLM2.name)
    model = load_gguf_model(path, dtype=DTYPES[args.dtype])
    tokenizer = ChatTokenizer.from_gguf(path)
    config = model.config
    return ChatModel(
        model=model,
        name=path.name,
        describe=(
            f"{path.name} ({config.num_hidden_layers} layers, {config.num_attention_heads}/"
            f"{config.num_key_value_heads} heads, {args.dtype})"
        ),
        message_tokens=lambda text, first: tokenizer.turn_tokens(text, first=first),
        decode=tokenizer.decode,
        stop_token_ids=tokenizer.stop_token_ids,
    )


def _random_model(args: argparse.Namespace) -> ChatModel:
    head_dim = args.hidden // args.heads
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=head_dim,
        vocab_size=256,
        rope=RopeConfig(head_dim, 10000.0),
        max_position_embeddings=max(args.window, 256),
    )
    tokenizer = ByteTokenizer(config.vocab_size)
    return ChatModel(
        model=LlamaModel.from_config(config, seed=args.seed, dtype=DTYPES[args.dtype]),
        name="kvstore-demo",
        describe=(
            f"random Llama {config.num_hidden_layers} layers x {config.hidden_size} hidden, "
            f"{config.num_attention_heads}/{config.num_key_value_heads} heads (replies are noise)"
        ),
        message_tokens=lambda text, first: tokenizer.encode(text),
        decode=None,
        stop_token_ids=(),
    )


def _warm_up(engines: Sequence[Engine]) -> None:
    """One short request per engine before the store is attached (nothing stored), so the
    first timed turn pays no first-call and first-allocation costs."""
    prompt = [token % 200 + 1 for token in range(WARM_UP_TOKENS)]
    for engine in engines:
        engine.generate([Request("warm-up", prompt, SamplingParams(max_tokens=4))])


@contextlib.contextmanager
def _daemon(address: str | None) -> Iterator[str]:
    """``address``, or a daemon started on a temporary directory (stopped on exit)."""
    if address:
        yield address
        return
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-chat-"))
    socket = workdir / "kvstore.sock"
    config = workdir / "kvstore.toml"
    # JSON strings are TOML basic strings: paths are quoted and escaped alike.
    config.write_text(
        '[host]\ncapacity = "512MiB"\n'
        f'[ssd]\ncapacity = "2GiB"\ndirectory = {json.dumps(str(workdir / "ssd"))}\n'
        f"fsync = false\n[server]\nlisten = [{json.dumps(f'unix:{socket}')}]\n"
    )
    log = (workdir / "daemon.log").open("wb")
    command = kvstore_command("serve", "--config", str(config))
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_until_serving(f"unix:{socket}", proc)
        yield f"unix:{socket}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_until_serving(address: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    socket = Path(address.removeprefix("unix:"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with status {proc.returncode}")
        if socket.exists():
            with contextlib.suppress(KVStoreError), KVStoreClient(address, retries=0) as client:
                if client.health():
                    return
        time.sleep(0.1)
    raise RuntimeError(f"the daemon did not serve within {timeout} s")


if __name__ == "__main__":
    sys.exit(main())
