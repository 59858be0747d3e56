"""Multi-turn chat sessions over an engine: history, truncation, look-ahead hints.

Each turn re-sends the session's context (every earlier message and reply) plus the new
message; the connector turns the stored part of that prefill into a load. Primitives:

- :class:`ByteTokenizer`: a deterministic stand-in tokenizer (UTF-8 bytes modulo the
  vocabulary) for demos and tests with random models.
- :func:`plan_turn`: the next prompt of a session. When context + message + ``max_tokens``
  would pass the context window, it keeps the first ``sink_tokens`` (attention sinks),
  drops the oldest whole blocks after them (at least what is needed, and at least
  ``truncate_fraction`` of the droppable history, so truncation is rare) and keeps the rest.
  The kept blocks' stored KV is reused at their *new* positions through ``Request.reuse``
  (the connector re-rotates K by the shift) instead of being recomputed. The KV of kept
  tokens still reflects the dropped ones they once attended to: the CachedAttention
  approximation, not an exact recompute of the shorter text. So from the first kept block
  on, the turn's KV is keyed under a :class:`~kvstore.client.KeySalt` that names the session
  and the context it was cut from (``TurnPlan.salt``, carried by the session into its later
  turns): only this session finds it, and an exact prefill of the same tokens never loads it.
- :class:`ChatServer`: sessions and a FIFO of queued turns. As each turn starts it sends
  the daemon a prefetch hint for the queued turns that just entered the look-ahead (the
  next ``lookahead``; each is named once), after the turn's own blocks are leased, so their
  blocks move from SSD to the host tier while this turn computes.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.client import KeySalt, Namespace, block_keys
from kvstore.inference_adapter.connector import StoreConnector
from kvstore.inference_adapter.engine import Engine
from kvstore.inference_adapter.interfaces import Request, ReusedBlock, SamplingParams

__all__ = ["ByteTokenizer", "ChatServer", "ChatSession", "Turn", "TurnPlan", "plan_turn"]


class ByteTokenizer:
    """Text -> its UTF-8 bytes, each taken modulo ``vocab_size``; lossless when it is >= 256."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [byte % self.vocab_size for byte in text.encode("utf-8")]

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(token % 256 for token in tokens).decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """The prompt of one turn and how it was cut."""

    prompt: list[int]
    reuse: tuple[ReusedBlock, ...] = ()  # stored blocks placed at new positions
    dropped_tokens: int = 0  # history tokens cut from the context for this turn
    salt: KeySalt | None = None  # keys the prompt's approximate blocks (None: all exact)


def plan_turn(
    context: Sequence[int],
    message: Sequence[int],
    *,
    window: int,
    max_tokens: int,
    sink_tokens: int,
    block_tokens: int,
    namespace: Namespace | None = None,
    truncate_fraction: float = 0.5,
    salt: KeySalt | None = None,
    origin: bytes = b"",
) -> TurnPlan:
    """The next prompt of a session whose model has ``window`` positions.

    Args:
        context: The session's tokens so far (messages and replies).
        message: The new message's tokens.
        window: Positions the model may use (prompt + ``max_tokens`` - 1 must fit).
        max_tokens: The turn's generation budget.
        sink_tokens: Leading tokens always kept; a multiple of ``block_tokens``.
        block_tokens: Tokens per stored block (the engine's page size); history is dropped
            in whole blocks.
        namespace: The keys the context's blocks were stored under; None: no reuse plan.
        truncate_fraction: Drop at least this share of the droppable history at once.
        salt: The salt the context's KV is keyed under (``TurnPlan.salt`` of the turn that
            made it); None when it is all exact.
        origin: Names the session in the salt of a truncated turn.

    Returns:
        The prompt, and on truncation the reuse plan (sinks at their old positions, kept
        blocks shifted down) and the new salt; without truncation ``salt`` is kept.

    Raises:
        ValueError: The message does not fit even after dropping all droppable history.
    """
    bt = block_tokens
    limit = window - max_tokens + 1  # the longest prompt that fits
    full = [*context, *message]
    if len(full) <= limit:
        return TurnPlan(full, salt=salt)
    sink = min(sink_tokens, len(context) // bt * bt)
    droppable = (len(context) - sink) // bt * bt
    needed = math.ceil((len(full) - limit) / bt) * bt
    drop = max(needed, int(truncate_fraction * droppable) // bt * bt)
    if needed > droppable:
        raise ValueError(
            f"a {len(message)}-token message does not fit a {window}-position window with "
            f"{max_tokens} max_tokens and {sink} sink tokens"
        )
    drop = min(drop, droppable)
    prompt = [*context[:sink], *context[sink + drop :], *message]
    if namespace is None:
        return TurnPlan(prompt, (), drop)
    keys = block_keys(context, namespace, salt)  # the chain the context's KV was saved under
    first_kept = (sink + drop) // bt
    reuse = [ReusedBlock(keys[b], b * bt, b * bt) for b in range(sink // bt)]
    reuse += [
        ReusedBlock(keys[b], (b - drop // bt) * bt, b * bt) for b in range(first_kept, len(keys))
    ]
    return TurnPlan(prompt, tuple(reuse), drop, _salt_after_cut(salt, origin, keys, sink // bt))


def _salt_after_cut(
    salt: KeySalt | None, origin: bytes, keys: Sequence[bytes], first_moved: int
) -> KeySalt:
    """The salt of a prompt cut from a context keyed ``keys``: it names the session and that
    context, and covers every block from the first one whose KV is not exact."""
    from_block = first_moved if salt is None else min(salt.from_block, first_moved)
    context = keys[-1] if keys else b""
    return KeySalt(hashlib.sha256(b"%s\0%s" % (origin, context)).digest(), from_block)


@dataclass(slots=True)
class Turn:
    """One message and its reply, with the request that produced it."""

    message: list[int]
    request: Request
    dropped_tokens: int = 0

    @property
    def reply(self) -> list[int]:
        return self.request.output


@dataclass(slots=True)
class ChatSession:
    """A conversation: its context (what the model sees next) and its turns."""

    session_id: str
    context: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    salt: KeySalt | None = None  # the context's KV is keyed under it (after a truncation)


class ChatServer:
    """Runs chat turns on an engine, one at a time, in the order they were submitted.

    Args:
        engine: The engine; its connector is set to ``connector`` when one is given.
        connector: The store connector (``None``: no store, no reuse, no hints).
        sampling: How every turn generates.
        context_window: Positions a session may use; the model's
            ``max_position_embeddings`` when None.
        sink_tokens: Leading tokens kept on truncation (a multiple of the page size).
        truncate_fraction: See :func:`plan_turn`.
        lookahead: Queued sessions named in each prefetch hint.

    Raises:
        ValueError: ``sink_tokens`` is not a multiple of the page size, or the window is
            larger than the model's.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        connector: StoreConnector | None = None,
        sampling: SamplingParams | None = None,
        context_window: int | None = None,
        sink_tokens: int = 0,
        truncate_fraction: float = 0.5,
        lookahead: int = 2,
    ) -> None:
        max_positions = engine.config.max_position_embeddings
        self.window = context_window or max_positions
        if self.window > max_positions:
            raise ValueError(f"context_window {self.window} > the model's {max_positions}")
        if sink_tokens % engine.page_tokens:
            raise ValueError(
                f"sink_tokens ({sink_tokens}) must be a multiple of page_tokens "
                f"({engine.page_tokens})"
            )
        if connector is not None:
            engine.connector = connector
        self.engine = engine
        self.connector = connector
        self.sampling = sampling or SamplingParams()
        self.sink_tokens = sink_tokens
        self.truncate_fraction = truncate_fraction
        self.lookahead = lookahead
        self.sessions: dict[str, ChatSession] = {}
        self._queue: deque[tuple[ChatSession, list[int]]] = deque()
        self._hinted = 0  # the first this many queued turns were named in hints
        self._ids = itertools.count()

    def session(self, session_id: str) -> ChatSession:
        """The session of that id, created empty on first use."""
        return self.sessions.setdefault(session_id, ChatSession(session_id))

    def submit(self, session_id: str, message: Sequence[int]) -> None:
        """Queues a turn; it runs on a later ``run_next``."""
        self._queue.append((self.session(session_id), list(message)))

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def run_next(self, on_token: Callable[[Request, int], None] | None = None) -> Turn:
        """Runs the oldest queued turn (after hinting the ones behind it) and returns it;
        ``on_token`` sees its reply's tokens as they are sampled (``Engine.generate``).

        Raises:
            IndexError: Nothing is queued.
        """
        session, message = self._queue.popleft()
        self._hinted = max(0, self._hinted - 1)  # the turns hinted at the queue's head
        self._hint_queued()
        self._protect_queued()
        plan = self.plan(session, message)
        request = Request(
            f"{session.session_id}/{next(self._ids)}",
            plan.prompt,
            self.sampling,
            session_id=session.session_id,
            reuse=plan.reuse,
            salt=plan.salt,
        )
        self.engine.generate([request], on_token)
        session.context = [*plan.prompt, *request.output]
        session.salt = plan.salt
        turn = Turn(message, request, plan.dropped_tokens)
        session.turns.append(turn)
        return turn

    def chat(
        self,
        session_id: str,
        message: Sequence[int],
        on_token: Callable[[Request, int], None] | None = None,
    ) -> Turn:
        """Queues a turn, runs every queued turn up to it, and returns it (``on_token``: as
        ``run_next``, for this turn only)."""
        self.submit(session_id, message)
        for _ in range(len(self._queue) - 1):
            self.run_next()
        return self.run_next(on_token)

    def plan(self, session: ChatSession, message: Sequence[int]) -> TurnPlan:
        """The prompt ``message`` would get in ``session`` now (see :func:`plan_turn`)."""
        return plan_turn(
            session.context,
            message,
            window=self.window,
            max_tokens=self.sampling.max_tokens,
            sink_tokens=self.sink_tokens,
            block_tokens=self.engine.page_tokens,
            namespace=self.connector.namespace if self.connector is not None else None,
            truncate_fraction=self.truncate_fraction,
            salt=session.salt,
            origin=session.session_id.encode(),
        )

    def _protect_queued(self) -> None:
        """The engine's pool evicts the resident history of the next ``lookahead`` queued
        turns last (scheduler-aware, as the daemon's tiers with the hints)."""
        if self.engine.allocator.retain_pages:
            queued = itertools.islice(self._queue, 0, max(self.lookahead, 0))
            plans = [self.plan(session, message) for session, message in queued]
            self.engine.protect(p.prompt for p in plans if not p.reuse and p.salt is None)

    def _hint_queued(self) -> None:
        """Tells the daemon which sessions run after this turn, with the keys they will look
        up; sent once this turn's own blocks are leased, so they cannot evict them. Each
        queued turn is named once, as it enters the look-ahead (naming the whole look-ahead
        on every turn re-promoted what the turns between had pushed out)."""
        if self.connector is None or self.lookahead <= 0:
            return
        start, self._hinted = self._hinted, min(len(self._queue), self.lookahead)
        for session, message in itertools.islice(self._queue, start, self.lookahead):
            plan = self.plan(session, message)
            keys = [block.key for block in plan.reuse] or block_keys(
                plan.prompt, self.connector.namespace, plan.salt
            )
            if keys:
                self.connector.prefetch_after_next_load(session.session_id, [keys])
