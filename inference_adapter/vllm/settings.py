"""The connector's settings: ``kv_connector_extra_config`` read, checked and defaulted.

Every key is optional but ``address``; a wrong type, a bad value or an unknown key (a typo
would otherwise be ignored silently) raises ``ValueError`` naming the key and the value, so a
misconfigured ``vllm serve`` stops at start instead of serving without a cache.

Keys:

- ``address``: the daemon, ``unix:/run/kvstore/kvstore.sock`` or ``host:port``.
- ``tenant``: the tenant salt of every block key (default ``""``); the token must belong
  to it.
- ``token_env``: the name of the environment variable holding the daemon token (the token
  itself never sits in a command line); unset means no token.
- ``model_name``: names the weights alike on every node (default: vLLM's ``model``, which
  is a local path when the model was loaded from one: set it when nodes share a daemon).
- ``block_tokens``: tokens per stored block, a multiple of vLLM's ``block_size`` (default:
  ``block_size``).
- ``lookup_timeout_s`` (0.5): the deadline of the admission-time Lookup.
- ``load_timeout_s`` (10): how long a step waits for one layer before vLLM recomputes.
- ``save_queue_blocks`` (256): most blocks waiting to be put; more are dropped and counted.
  On CUDA the waiting blocks stay in device memory until they are copied to the daemon
  (256 blocks of 16 tokens of a Llama-3.1-8B-shaped model: 512 MiB); lower it when vLLM
  runs close to the device's memory.
- ``retry_s`` (2): after a failure, how long the connector answers "miss" before it tries
  the daemon again (sooner when another connector side in this process reached it).
- ``use_shm`` (true): map the daemon's arena when it runs on this host.
- ``handoff`` (true with ``kv_role: "kv_producer"``, else false): this instance is the
  prefill side of prefill/decode disaggregation: each step ends only once its saves are
  committed in the daemon (and in the tiers it writes at put, a shared Redis included), and a
  finished request's ``kv_transfer_params`` name the prompt blocks held for it, which the
  decode instance is handed (``kvstore pd-proxy``).
- ``handoff_timeout_s`` (30): with ``handoff``, the longest a step waits for its saves;
  past it the step ends anyway (counted: ``handoff_save_timeouts``) and the decode side
  recomputes what it does not find.
- ``pin_arena`` (true): on CUDA, register the mapped arena with CUDA, so that a load is one
  kernel per layer reading the arena over the host link; the daemon then keeps that arena's
  pages while the worker runs (see docs/ARCHITECTURE.md, departure 10).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ConnectorSettings"]


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` asked for; see the module docstring."""

    address: str
    tenant: str = ""
    token_env: str | None = None
    model_name: str | None = None
    block_tokens: int | None = None
    lookup_timeout_s: float = 0.5
    load_timeout_s: float = 10.0
    save_queue_blocks: int = 256
    retry_s: float = 2.0
    use_shm: bool = True
    pin_arena: bool = True
    handoff: bool | None = None  # None: the role decides (kv_producer)
    handoff_timeout_s: float = 30.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> ConnectorSettings:
        """Reads the settings from vLLM's ``kv_connector_extra_config``.

        Raises:
            ValueError: ``address`` is missing, a key is unknown, or a value has the wrong
                type or range (the message names the key and the value).
        """
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; "
                f"known: {sorted(cls.__dataclass_fields__)}"
            )
        if "address" not in extra:
            raise ValueError(
                'kv_connector_extra_config needs "address", e.g. "unix:/run/kvstore/kvstore.sock"'
            )
        settings = cls(
            address=_text(extra, "address"),
            tenant=_text(extra, "tenant", allow_empty=True, default=""),
            token_env=_optional_text(extra, "token_env"),
            model_name=_optional_text(extra, "model_name"),
            block_tokens=_optional_int(extra, "block_tokens"),
            lookup_timeout_s=_seconds(extra, "lookup_timeout_s", 0.5),
            load_timeout_s=_seconds(extra, "load_timeout_s", 10.0),
            save_queue_blocks=_optional_int(extra, "save_queue_blocks") or 256,
            retry_s=_seconds(extra, "retry_s", 2.0),
            use_shm=_flag(extra, "use_shm", True),
            pin_arena=_flag(extra, "pin_arena", True),
            handoff=None if extra.get("handoff") is None else _flag(extra, "handoff", False),
            handoff_timeout_s=_seconds(extra, "handoff_timeout_s", 30.0),
        )
        settings.token()  # a named variable that is unset fails now, not at first use
        return settings

    def hands_off(self, kv_role: str | None) -> bool:
        """Whether this instance is a prefill that hands its KV off: ``handoff``, or by
        default the ``kv_producer`` role."""
        return self.handoff if self.handoff is not None else kv_role == "kv_producer"

    def token(self) -> str | None:
        """The daemon token, read from the environment variable ``token_env``.

        Raises:
            ValueError: ``token_env`` names a variable that is unset or empty.
        """
        if self.token_env is None:
            return None
        value = os.environ.get(self.token_env, "")
        if not value:
            raise ValueError(
                f"kv_connector_extra_config token_env={self.token_env!r}: that environment "
                "variable is unset or empty in the vLLM process"
            )
        return value


def _text(
    extra: Mapping[str, object], key: str, *, allow_empty: bool = False, default: str | None = None
) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise ValueError(
            f"kv_connector_extra_config {key!r} must be a non-empty string, got {value!r}"
        )
    return value


def _optional_text(extra: Mapping[str, object], key: str) -> str | None:
    return None if extra.get(key) is None else _text(extra, key)


def _optional_int(extra: Mapping[str, object], key: str) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"kv_connector_extra_config {key!r} must be an integer >= 1, got {value!r}"
        )
    return value


def _seconds(extra: Mapping[str, object], key: str, default: float) -> float:
    value = extra.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"kv_connector_extra_config {key!r} must be seconds > 0, got {value!r}")
    return float(value)


def _flag(extra: Mapping[str, object], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config {key!r} must be true or false, got {value!r}")
    return value
