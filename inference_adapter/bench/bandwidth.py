"""The copy limits a KV load or save is held against, measured on this machine.

On CUDA: host-to-device copies from page-locked (pinned) and from ordinary (pageable) host
memory, and device-to-host copies into pinned memory, each of one ``nbytes`` buffer. On the
CPU, where a load is a copy within host memory, the rate of one large tensor copy
(``memcpy``) stands for both directions. Each figure is the median of ``repeats`` timed
copies after one untimed one, in GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Limits", "copy_limits", "synchronize"]

NAMES = {
    "h2d_pinned_gbps": "pinned H2D",
    "h2d_pageable_gbps": "pageable H2D",
    "d2h_pinned_gbps": "pinned D2H",
    "memcpy_gbps": "memcpy",
}


@dataclass(frozen=True, slots=True)
class Limits:
    """Copy rates by name (GB/s), and which of them a load and a save are held against."""

    rates: dict[str, float]
    load: str  # the name of the rate a load's GB/s is divided by
    save: str
    copy_bytes: int
    repeats: int

    def describe(self) -> str:
        """One line: every rate, and how it was measured."""
        rates = ", ".join(f"{NAMES[name]} {rate:.1f} GB/s" for name, rate in self.rates.items())
        return f"{rates} ({self.copy_bytes >> 20} MiB copies, median of {self.repeats})"

    def as_dict(self) -> dict[str, object]:
        """The JSON form: the rates, the names of the load and save limits, the copy size."""
        return {
            **self.rates,
            "load_limit": self.load,
            "save_limit": self.save,
            "copy_bytes": self.copy_bytes,
            "repeats": self.repeats,
        }


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (every stream); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_limits(device: torch.device, nbytes: int, repeats: int = 5) -> Limits:
    """Measures the copy rates of ``device`` (module docstring) with ``nbytes`` buffers.

    Raises:
        ValueError: ``nbytes`` or ``repeats`` below 1.
    """
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes and repeats must be >= 1, got {nbytes}, {repeats}")
    if device.type != "cuda":
        source = torch.ones(nbytes, dtype=torch.uint8)
        target = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no page faults timed
        memcpy = _rate(lambda: target.copy_(source), device, nbytes, repeats)
        return Limits({"memcpy_gbps": memcpy}, "memcpy_gbps", "memcpy_gbps", nbytes, repeats)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    rates = {
        "h2d_pinned_gbps": _rate(
            lambda: on_device.copy_(pinned, non_blocking=True), device, nbytes, repeats
        ),
        "h2d_pageable_gbps": _rate(lambda: on_device.copy_(pageable), device, nbytes, repeats),
        "d2h_pinned_gbps": _rate(
            lambda: pinned.copy_(on_device, non_blocking=True), device, nbytes, repeats
        ),
    }
    return Limits(rates, "h2d_pinned_gbps", "d2h_pinned_gbps", nbytes, repeats)


def _rate(copy: Callable[[], object], device: torch.device, nbytes: int, repeats: int) -> float:
    """GB/s of ``copy``: the median of ``repeats`` timed runs after an untimed one."""
    times = []
    for run in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        copy()
        synchronize(device)
        if run:
            times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9
