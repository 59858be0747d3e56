"""Choices made on the device itself: the first call of a shape times each candidate and keeps
the fastest for every later call of that shape.

A kernel's launch settings (tile sizes, warps, pipeline stages) and, for prefill, the path
itself (our paged kernel, or SDPA over a gathered dense copy) depend on the GPU; a table
tuned on one card is a guess on the next. A :class:`Tuner` holds, per shape key, the name of
the candidate that ran fastest here:

- only for CUDA tensors: elsewhere (the interpreter, the tests' CPU runs) the first candidate,
  the default, runs untimed;
- the first call of a key runs every candidate once (compiling it), then times each
  ``TIMED_RUNS`` times with CUDA events, and keeps the median's fastest; a candidate that
  fails to compile or launch (too much shared memory on this card) is left out, and the
  choice is logged once per key, with both times;
- ``KVSTORE_KERNEL_TUNING=0`` turns the timing off: every call runs the default.

Keys bucket the sizes that vary from call to call (batch, context) to powers of two, so a
serving engine pays the timing once per bucket, not once per request. Candidates must be
safe to run repeatedly on the same arguments (they write only their outputs).
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

TUNING_ENV = "KVSTORE_KERNEL_TUNING"
TIMED_RUNS = 5

Measure = Callable[[Callable[[], object], torch.device], float]
T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """A kernel's launch settings; a zero leaves the kernel's own default. ``block_n``: key
    tiles of attention, rows of a copy; ``block_m``: rows of a prefill tile; ``heads``: query
    heads of one GQA group that share a prefill tile (and its K/V reads)."""

    block_n: int = 0
    num_warps: int = 0
    num_stages: int = 0
    block_m: int = 0
    heads: int = 0

    def options(self) -> dict[str, int]:
        """The launch keywords Triton takes (``num_warps``, ``num_stages``) that are set."""
        named = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return {name: value for name, value in named.items() if value}

    def __str__(self) -> str:
        named = {"m": self.block_m, "n": self.block_n, "heads": self.heads,
                 "warps": self.num_warps, "stages": self.num_stages}  # fmt: skip
        return " ".join(f"{name}={value}" for name, value in named.items() if value) or "default"


def bucket(size: int) -> int:
    """``size`` rounded up to a power of two (0 stays 0): one key for similar shapes."""
    return 0 if size <= 0 else 1 << (size - 1).bit_length()


def cuda_seconds(run: Callable[[], object], device: torch.device) -> float:
    """Median seconds of ``TIMED_RUNS`` calls of ``run`` on ``device``'s current stream."""
    stream = torch.cuda.current_stream(device)
    times = []
    for _ in range(TIMED_RUNS):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return statistics.median(times)


class Tuner:
    """The fastest of named candidates per shape key, on the device; see the module doc.

    Args:
        name: What is tuned, for the log line (``decode_attention``).
        measure: Seconds one candidate takes (default: CUDA events); the tests pass a clock.
    """

    def __init__(self, name: str, measure: Measure = cuda_seconds) -> None:
        self.name = name
        self._measure = measure
        self._chosen: dict[Hashable, str] = {}

    def run(
        self,
        key: Hashable,
        candidates: Mapping[str, Callable[[], T]],
        device: torch.device,
    ) -> T:
        """Runs the candidate chosen for ``key`` (choosing it first if need be); its result.

        Raises:
            ValueError: No candidates.
            Exception: Whatever the default candidate raises, when every candidate failed.
        """
        if not candidates:
            raise ValueError(f"{self.name}: no candidates to run")
        return candidates[self.choose(key, candidates, device)]()

    def choose(
        self,
        key: Hashable,
        candidates: Mapping[str, Callable[[], T]],
        device: torch.device,
    ) -> str:
        """The name of the candidate for ``key``: the first off CUDA or with tuning off, else
        the fastest measured (measured now, on the first call of ``key``)."""
        default = next(iter(candidates))
        if device.type != "cuda" or not tuning_enabled() or len(candidates) == 1:
            return default
        chosen = self._chosen.get(key)
        if chosen is not None and chosen in candidates:
            return chosen
        times: dict[str, float] = {}
        for name, candidate in candidates.items():
            try:
                candidate()  # compiles it, and warms the caches
                times[name] = self._measure(candidate, device)
            except Exception as error:  # a launch this card cannot run (shared memory)
                log.debug("%s %s: candidate %s failed: %r", self.name, key, name, error)
        if not times:
            return default  # let the default raise what is wrong
        chosen = min(times, key=times.__getitem__)
        self._chosen[key] = chosen
        log.info(
            "%s %s: %s, %.3f ms (the default %s: %s)",
            self.name,
            key,
            chosen,
            times[chosen] * 1e3,
            default,
            f"{times[default] * 1e3:.3f} ms" if default in times else "failed",
        )
        return chosen

    def chosen(self) -> dict[Hashable, str]:
        """What was chosen so far, per key (for logs and benchmarks)."""
        return dict(self._chosen)


def tuning_enabled() -> bool:
    """Whether choices are timed (``KVSTORE_KERNEL_TUNING``, read at every call; default on)."""
    value = os.environ.get(TUNING_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")
