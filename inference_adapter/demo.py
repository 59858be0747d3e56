"""``kvstore chat``: a scripted multi-turn chat that shows what the store saves per turn.

A randomly initialised Llama (sizes from the flags; no weights are downloaded) answers a
scripted conversation twice per turn: through an engine whose connector talks to a kvstore
daemon, and through an engine that recomputes every prompt (``NullConnector``). Per turn it
prints the prompt length, the tokens loaded from the store and the tier they came from, the
tokens computed, both times to first token and whether both engines answered alike.

The daemon is the one at ``--address``, or one this command starts on a temporary directory
(small host arena, SSD tier) and stops at the end. Tokens are UTF-8 bytes
(:class:`~kvstore.inference_adapter.sessions.ByteTokenizer`); replies of a random model are
noise, so they are not printed. Entry points: ``main(argv)``, and ``add_chat_parser`` for the
``kvstore`` command.
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
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from kvstore.client import KVStoreClient, KVStoreError
from kvstore.inference_adapter.connector import StoreConnector, namespace_for
from kvstore.inference_adapter.engine import Engine
from kvstore.inference_adapter.interfaces import Request, SamplingParams
from kvstore.inference_adapter.model import LlamaModel
from kvstore.inference_adapter.sessions import ByteTokenizer, ChatServer, Turn
from kvstore.inference_adapter.weights import LlamaConfig
from kvstore.kernels import RopeConfig

__all__ = ["add_chat_parser", "main", "run_chat", "script"]

NOTE = (
    "Note {n}: a block holds the attention keys and values of a run of tokens for every layer; "
    "it is named by a hash chained over the tokens before it, so equal prefixes share blocks; "
    "keys are stored before rotary embedding so that they can be placed at new positions when "
    "a long conversation is cut."
)
QUESTIONS = (
    "Why are keys stored before the rotary embedding?",
    "What happens when the host tier is full?",
    "How does the engine overlap loading with computing?",
    "Summarise the design in two sentences.",
)


def script(notes: int) -> list[str]:
    """The user's messages: a document of ``notes`` notes to read, then questions on it."""
    document = " ".join(NOTE.format(n=n) for n in range(1, notes + 1))
    return [f"You are a storage engineer. Read these design notes. {document}", *QUESTIONS]


def add_chat_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``chat`` command (its handler is ``args.run(args)``, as ``kvstore`` expects)."""
    chat = subparsers.add_parser("chat", help="scripted multi-turn chat demo on a random model")
    _add_arguments(chat)
    chat.set_defaults(run=run_chat)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo as its own command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="kvstore chat", description=__doc__.split("\n")[0])
    _add_arguments(parser)
    return run_chat(parser.parse_args(argv))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="a running daemon (default: start one in a temp dir)")
    parser.add_argument("--token", help="bearer token for --address")
    parser.add_argument("--turns", type=int, default=1 + len(QUESTIONS), help="turns to run")
    parser.add_argument("--notes", type=int, default=6, help="notes in the first message")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--page-tokens", type=int, default=64, help="tokens per page and block")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)


def run_chat(args: argparse.Namespace) -> int:
    """The demo; prints one line per turn and a summary. Returns 0 when both engines agreed."""
    torch.set_grad_enabled(False)
    model = LlamaModel.from_config(_model_config(args), seed=args.seed)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    tokenizer = ByteTokenizer(model.config.vocab_size)
    store_engine = Engine(model, num_pages=_pages_needed(args), page_tokens=args.page_tokens)
    recompute_engine = Engine(model, num_pages=_pages_needed(args), page_tokens=args.page_tokens)
    namespace = namespace_for(
        model.config, model_name="kvstore-demo", block_tokens=args.page_tokens
    )
    _warm_up(store_engine, recompute_engine, min(512, args.max_positions // 2))
    with (
        _daemon(args.address) as address,
        KVStoreClient(address, token=args.token, retries=1, timeout=5.0) as client,
    ):
        connector = StoreConnector(
            client,
            namespace,
            kv_pool=store_engine.kv_pool,
            page_tokens=args.page_tokens,
            rope_tables=store_engine.rope_tables,
        )
        try:
            server = ChatServer(store_engine, connector=connector, sampling=sampling)
            print(
                f"kvstore chat: {_describe(model.config)}, daemon {address} ({client.data_plane})"
            )
            agreed = all(
                _run_turn(server, connector, recompute_engine, index, tokenizer.encode(text))
                for index, text in enumerate(script(args.notes)[: args.turns], start=1)
            )
            connector.wait_for_saves(10.0)
            print(f"connector: {connector.stats()}")
        finally:
            connector.close()
    return 0 if agreed else 1


def _run_turn(
    server: ChatServer,
    connector: StoreConnector,
    recompute: Engine,
    index: int,
    message: list[int],
) -> bool:
    turn = server.chat("demo", message)
    connector.wait_for_saves(10.0)  # so the next turn finds this one's blocks
    baseline = Request(f"recompute/{index}", list(turn.request.prompt), server.sampling)
    recompute.generate([baseline])
    same = baseline.output == turn.reply
    print(_turn_line(index, turn, baseline, same))
    return same


def _turn_line(index: int, turn: Turn, baseline: Request, same: bool) -> str:
    request = turn.request
    tiers = ", ".join(f"{tier} {n} blocks" for tier, n in sorted(request.loaded_from.items()))
    speedup = baseline.ttft_s / request.ttft_s if request.ttft_s else 0.0
    return (
        f"turn {index}: prompt {len(request.prompt)} tokens | loaded {request.num_loaded_tokens}"
        f"{f' ({tiers})' if tiers else ''}, computed {request.num_computed_tokens} | "
        f"TTFT {request.ttft_s * 1e3:.1f} ms with the store, {baseline.ttft_s * 1e3:.1f} ms "
        f"recomputing ({speedup:.1f}x) | {'same reply' if same else 'REPLIES DIFFER'}"
    )


def _warm_up(store: Engine, recompute: Engine, num_tokens: int) -> None:
    """One request per engine before the store is attached (nothing stored), so neither
    engine's first timed turn pays first-call and first-allocation costs."""
    prompt = [token % 256 for token in range(1, num_tokens)]
    for engine in (store, recompute):
        engine.generate([Request("warm-up", prompt, SamplingParams(max_tokens=2))])


def _model_config(args: argparse.Namespace) -> LlamaConfig:
    head_dim = args.hidden // args.heads
    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=head_dim,
        vocab_size=256,
        rope=RopeConfig(head_dim, 10000.0),
        max_position_embeddings=args.max_positions,
    )


def _pages_needed(args: argparse.Namespace) -> int:
    pages: int = args.max_positions // args.page_tokens + 1
    return pages


def _describe(config: LlamaConfig) -> str:
    return (
        f"random Llama {config.num_hidden_layers} layers x {config.hidden_size} hidden, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads"
    )


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
        '[host]\ncapacity = "256MiB"\n'
        f'[ssd]\ncapacity = "1GiB"\ndirectory = {json.dumps(str(workdir / "ssd"))}\n'
        f"fsync = false\n[server]\nlisten = [{json.dumps(f'unix:{socket}')}]\n"
    )
    log = (workdir / "daemon.log").open("wb")
    command = [sys.executable, "-m", "kvstore", "serve", "--config", str(config)]
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
