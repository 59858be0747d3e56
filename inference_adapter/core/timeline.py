"""The timeline of a store hit, alike in every engine, and its phases as histograms.

A :class:`HitTimeline` follows one request from its arrival to its first token. The engine
marks ``arrived``, ``computed`` (the prompt's last layer is done) and ``first_token``; the
connector marks ``lookup_sent``, ``lookup_answered`` (the lookup's reply, which also carries
the lease on the shm plane), ``lease_answered`` (a second call, when one was needed: blocks
below host memory are promoted by an Acquire of their own), ``load_started`` and each layer
in the pool (``layer_ready``; on CUDA the host time its copy was queued; once the device has
run them, the load's CUDA events, ``device_events``, give the device's own times instead).
Every mark is ``time.perf_counter()``; an unset one is NaN.

:meth:`HitTimeline.phases` turns the marks into durations, each between two consecutive
marks that are set (``PHASES``):

- ``queue``: arrived -> lookup sent (waiting for the engine to look it up);
- ``lookup``: lookup sent -> answered (one round trip to the daemon);
- ``lease``: lookup answered -> lease answered (0 when the lookup leased);
- ``admit``: the lease in hand -> the load started (the engine's scheduling);
- ``first_layer``: load started -> layer 0 in the pool;
- ``layers``: layer 0 -> every layer in the pool (two threads may write them, so the last one
  in need not be the last layer);
- ``compute``: every layer in -> the prompt computed (what was not loaded);
- ``sample``: computed -> the first token;
- ``total``: arrived -> the first token (TTFT, queue included).

:class:`PhaseHistograms` sums phases of many hits into Prometheus buckets, thread-safe;
``kvstore_engine_hit_phase_seconds{phase}`` in both engines' metrics.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import HistogramMetricFamily

__all__ = ["BUCKETS", "PHASES", "DeviceEvent", "HitTimeline", "PhaseHistograms", "now"]

PHASES = (
    "queue",
    "lookup",
    "lease",
    "admit",
    "first_layer",
    "layers",
    "compute",
    "sample",
    "total",
)
# Upper bounds in seconds: a socket round trip (tens of microseconds) to a slow recompute.
BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1.0, 2.0, 5.0, 10.0, math.inf,
)  # fmt: skip
NAN = math.nan


def now() -> float:
    """The clock of every mark."""
    return time.perf_counter()


@dataclass(slots=True)
class HitTimeline:
    """The marks of one request (see the module docstring)."""

    num_layers: int
    arrived: float = field(default_factory=now)
    lookup_sent: float = NAN
    lookup_answered: float = NAN
    lease_answered: float = NAN
    load_started: float = NAN
    computed: float = NAN
    first_token: float = NAN
    layers: list[float] = field(default_factory=list)  # per layer: in the pool (NaN: not yet)
    # On CUDA: (an event recorded where the load began, one recorded after each layer)
    device_events: tuple[DeviceEvent, Sequence[DeviceEvent | None]] | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = [NAN] * self.num_layers

    def layer_ready(self, layer: int) -> None:
        """Layer ``layer`` of the load is in the pool (on CUDA: queued)."""
        self.layers[layer] = now()

    def _layer_marks(self) -> list[float]:
        """The layers' marks: the device's own once it has run every event (the load began
        on the device at ``load_started``), else the host's."""
        if self.device_events is None:
            return self.layers
        start, events = self.device_events
        if not all(event is not None and event.query() for event in events):
            return self.layers
        return [self.load_started + start.elapsed_time(e) / 1000 for e in events if e]

    @property
    def loaded(self) -> bool:
        """Whether any layer was loaded (a hit, not a miss)."""
        return not math.isnan(self.layers[0]) if self.layers else False

    def phases(self) -> dict[str, float]:
        """Seconds per phase whose two ends are marked (see the module docstring)."""
        layers = self._layer_marks()
        first = layers[0] if layers else NAN  # what the engine waits for first
        last = NAN if not layers or any(map(math.isnan, layers)) else max(layers)  # all in
        marks = {
            "queue": (self.arrived, self.lookup_sent),
            "lookup": (self.lookup_sent, self.lookup_answered),
            "lease": (self.lookup_answered, self.lease_answered),
            "admit": (_first_set(self.lease_answered, self.lookup_answered), self.load_started),
            "first_layer": (self.load_started, first),
            "layers": (first, last),
            "compute": (_first_set(last, self.load_started, self.lookup_answered), self.computed),
            "sample": (self.computed, self.first_token),
            "total": (self.arrived, self.first_token),
        }
        if math.isnan(self.lease_answered) and not math.isnan(self.load_started):
            marks["lease"] = (self.lookup_answered, self.lookup_answered)  # leased on lookup
        return {
            phase: max(0.0, end - start)
            for phase, (start, end) in marks.items()
            if not (math.isnan(start) or math.isnan(end))
        }


class DeviceEvent(Protocol):
    """A CUDA event as the timeline reads it (``torch.cuda.Event(enable_timing=True)``)."""

    def query(self) -> bool: ...

    def elapsed_time(self, end: DeviceEvent, /) -> float: ...


def _first_set(*marks: float) -> float:
    return next((mark for mark in marks if not math.isnan(mark)), NAN)


class PhaseHistograms:
    """Per phase, counts of durations in ``BUCKETS`` and their sum; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {phase: [0] * len(BUCKETS) for phase in PHASES}
        self._sums = dict.fromkeys(PHASES, 0.0)

    def observe(self, phases: Mapping[str, float]) -> None:
        """Adds one hit's phases (:meth:`HitTimeline.phases`); unknown names are ignored."""
        with self._lock:
            for phase, seconds in phases.items():
                counts = self._counts.get(phase)
                if counts is None:
                    continue
                counts[_bucket(seconds)] += 1
                self._sums[phase] += seconds

    def count(self, phase: str) -> int:
        """Durations observed for ``phase``."""
        with self._lock:
            return sum(self._counts[phase])

    def metric(self, name: str, documentation: str) -> HistogramMetricFamily:
        """The histograms as one Prometheus family with a ``phase`` label."""
        family = HistogramMetricFamily(name, documentation, labels=["phase"])
        with self._lock:
            for phase in PHASES:
                family.add_metric([phase], list(_cumulative(self._counts[phase])),
                                  self._sums[phase])  # fmt: skip
        return family


def _bucket(seconds: float) -> int:
    return next(index for index, bound in enumerate(BUCKETS) if seconds <= bound)


def _cumulative(counts: list[int]) -> Iterator[tuple[str, float]]:
    total = 0
    for bound, count in zip(BUCKETS, counts, strict=True):
        total += count
        yield ("+Inf" if math.isinf(bound) else repr(bound)), total
