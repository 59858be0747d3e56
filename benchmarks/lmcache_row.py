"""LMCache's CPU backend storing and retrieving KV bytes in-process: scale.py's LMCache row.

    <lmcache venv>/bin/python benchmarks/lmcache_row.py [--mib 512] [--rounds 5] [--threads 1]

Runs in a venv of its own that holds ``lmcache`` and a CPU build of torch, not kvstore (see
``benchmarks/README.md``), and prints one JSON object: the bytes moved per round and the
median GB/s of ``LMCacheEngine.store`` and ``retrieve``.

The engine is LMCache's own (``LMCacheEngineBuilder``: the chunked token database, the
storage manager, the local CPU backend and its memory allocator), with no GPU: its
connector is the one piece this file adds, and it only copies: on a store, each chunk's
tokens out of a ``[2, layers, tokens, heads * head_dim]`` float16 KV tensor into LMCache's
memory object, and on a retrieve back into a second tensor of the same shape, as vLLM's
paged-memory connector does between GPU and CPU memory. Those copies run in one torch
thread (``--threads``), as kvstore's host tier copies in one thread: the row is about
LMCache's own path (its allocator, token hashing and storage manager), not torch's
parallel copy, which on 2 shared cores swings 2-3x with the other jobs. Each round stores
a new token sequence (so nothing is deduplicated), retrieves it, and clears it from the
cache, so that every round after the first (a warm-up) writes memory LMCache has used
before; the bytes retrieved are checked after the clock stops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

MIB = 1 << 20
GB = 1e9
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B-like: 128 KiB of float16 KV per token
CHUNK_TOKENS = 256  # LMCache's default chunk: 32 MiB of this model's KV
INSTANCE = "kvstore-bench"


def connector_class() -> type:
    """A ``GPUConnectorInterface`` for KV tensors in CPU memory: copies, nothing else."""
    import torch
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class CpuConnector(GPUConnectorInterface):  # type: ignore[misc, valid-type]
        def __init__(self, shape: tuple[int, int, int, int, int]) -> None:
            self.shape = shape  # (layers, 2, chunk tokens, heads, head_dim)

        @staticmethod
        def _tokens(kv: torch.Tensor, start: int, end: int) -> torch.Tensor:
            return kv[:, :, start:end]

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            memory_obj.tensor.copy_(self._tokens(kwargs["kvcaches"], start, end))

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            self._tokens(kwargs["kvcaches"], start, end).copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(memory_obj, start, end, **kw)

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(memory_obj, start, end, **kw)

        def get_shape(self, num_tokens: int) -> torch.Size:
            layers, _, _, heads, head_dim = self.shape
            return torch.Size([2, layers, num_tokens, heads * head_dim])

    return CpuConnector


def engine_of(cache_bytes: int) -> Any:
    """An LMCache engine with only its local CPU backend, ``cache_bytes`` big."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS,
        local_cpu=True,
        max_local_cpu_size=cache_bytes / (1 << 30),
        local_disk=None,
        max_local_disk_size=0,
        remote_url=None,
    )
    shape = (LAYERS, 2, CHUNK_TOKENS, KV_HEADS, HEAD_DIM)
    metadata = LMCacheMetadata(
        model_name="bench-llama",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=shape,
    )
    engine = LMCacheEngineBuilder.get_or_create(
        INSTANCE, config, metadata, connector_class()(shape), lambda *_: None,
        lambda obj, _src: obj,
    )  # fmt: skip
    engine.post_init()
    return engine


def bench(total_bytes: int, rounds: int, threads: int) -> dict[str, object]:
    import torch

    torch.set_num_threads(threads)
    token_bytes = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    tokens = max(CHUNK_TOKENS, total_bytes // token_bytes // CHUNK_TOKENS * CHUNK_TOKENS)
    moved = tokens * token_bytes
    engine = engine_of(2 * moved)
    shape = (2, LAYERS, tokens, KV_HEADS * HEAD_DIM)
    kv = torch.randn(shape, dtype=torch.float16)
    out = torch.ones_like(kv)
    store_s: list[float] = []
    retrieve_s: list[float] = []
    for turn in range(rounds + 1):  # the first round warms up
        ids = torch.randint(0, 1 << 30, (tokens,))
        began = time.perf_counter()
        engine.store(ids, kvcaches=kv)
        stored = time.perf_counter()
        found = engine.retrieve(ids, kvcaches=out)
        done = time.perf_counter()
        if int(found.sum()) != tokens or not torch.equal(out, kv):
            raise RuntimeError(f"LMCache retrieved {int(found.sum())} of {tokens} tokens")
        out.fill_(1)
        engine.clear(ids)  # the next round reuses the memory: faulted in, as kvstore's arena
        if turn:
            store_s.append(stored - began)
            retrieve_s.append(done - stored)
    return {
        "bytes": moved,
        "chunk_bytes": CHUNK_TOKENS * token_bytes,
        "rounds": rounds,
        "threads": threads,
        "store_gbps": moved / statistics.median(store_s) / GB,
        "retrieve_gbps": moved / statistics.median(retrieve_s) / GB,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB per round (default 512)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    logging.disable(logging.INFO)
    with contextlib.redirect_stdout(sys.stderr):  # LMCache prints banners
        import lmcache
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        try:
            row = bench(args.mib * MIB, args.rounds, args.threads)
        finally:
            LMCacheEngineBuilder.destroy(INSTANCE)
    print(json.dumps({"lmcache": getattr(lmcache, "__version__", "?"), **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
