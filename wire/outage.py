"""Down, then tried again: the breaker of a peer that stops answering.

A peer (the daemon a vLLM connector links to, one Redis node of the tier) that fails is
*down*: its callers answer at once without touching it (``DaemonDown``, a miss), and only a
background attempt finds out when it answers again, none before ``retry_s`` has passed.
:class:`Outage` is that state for one peer, without I/O or a clock of its own, so that a
caller on a thread (under its lock) and one on an event loop keep it alike:

- ``fail(now)``: a failure; ``True`` when it starts an outage (the one to log);
- ``answered(now)``: the peer answered; how long the outage lasted, ``None`` when it was not
  down (so the end is logged once too);
- ``down``; ``due(now)``: whether a new attempt may start now; ``retry_now()`` makes it due
  at once (another connection to the same peer just answered);
- ``failures``: every failure counted.

The attempts themselves stay with the caller: a thread's timer for the connector's link,
a task on the daemon's loop for each Redis node.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Outage"]


@dataclass(slots=True)
class Outage:
    """One peer's outage state (see the module docstring)."""

    retry_s: float
    failures: int = 0
    since: float | None = None  # when the outage began; None while the peer answers
    next_try: float = 0.0

    def __post_init__(self) -> None:
        if not self.retry_s >= 0:
            raise ValueError(f"retry_s must be >= 0 seconds, got {self.retry_s}")

    @property
    def down(self) -> bool:
        return self.since is not None

    def fail(self, now: float) -> bool:
        """Counts a failure at ``now``: no new attempt before ``now + retry_s``. ``True`` when
        the peer was answering until now (an outage begins)."""
        self.failures += 1
        self.next_try = now + self.retry_s
        if self.since is not None:
            return False
        self.since = now
        return True

    def answered(self, now: float) -> float | None:
        """The peer answered at ``now``: seconds since the outage began, ``None`` when it
        was not down."""
        since, self.since = self.since, None
        self.next_try = 0.0
        return None if since is None else now - since

    def due(self, now: float) -> bool:
        """Whether an attempt may start at ``now``."""
        return now >= self.next_try

    def retry_now(self) -> None:
        """The next attempt may start at once."""
        self.next_try = 0.0
