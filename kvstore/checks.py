"""The daemon's request checks: key sizes, keys per call and the blocks clients write.

Each check raises from the :mod:`kvstore.errors` tree with a message that names the bad value
(``keys[3] must be 32 bytes, got 31``). Every lookup checks its whole key chain, so a request
that passes costs one plain pass over the keys: a message is built only for a bad key.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import InvalidBlockError, InvalidRequestError
from kvstore.wire.blocks import KEY_BYTES, BlockLayout, Spec

__all__ = [
    "MAX_KEYS",
    "check_count",
    "check_key",
    "check_keys",
    "check_spec",
]

MAX_KEYS = 1 << 16  # per call (a 1M-token prompt in 16-token blocks); 2 MiB of keys


def check_count(what: str, count: int) -> None:
    if count > MAX_KEYS:
        raise InvalidRequestError(f"{count} {what} in one call; at most {MAX_KEYS}")


def check_key(name: str, key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise InvalidBlockError(f"{name} must be {KEY_BYTES} bytes, got {len(key)}")


def check_keys(keys: Sequence[bytes]) -> None:
    check_count("keys", len(keys))
    for key in keys:
        if len(key) != KEY_BYTES:  # the first bad key: no earlier key equals it
            check_key(f"keys[{keys.index(key)}]", key)


def check_spec(name: str, spec: Spec, layout: BlockLayout) -> None:
    """Checks a block's key, parent and token count against ``layout``.

    Raises:
        InvalidBlockError: naming ``name``'s bad field and its value.
    """
    check_key(f"{name}.key", spec.key)
    check_key(f"{name}.parent", spec.parent)
    if spec.parent == spec.key:
        raise InvalidBlockError(f"{name}.parent is the block's own key: a block is not its parent")
    if spec.num_tokens != layout.block_tokens:
        raise InvalidBlockError(
            f"{name}.num_tokens must be {layout.block_tokens} (only full blocks are stored), "
            f"got {spec.num_tokens}"
        )
