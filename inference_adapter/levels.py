"""The hierarchy's levels, in the order a prompt's KV is looked for: the engine's own page
pool (``hbm``: our engine's resident pages, vLLM's prefix cache), then the daemon's tiers.
Engines and benches report prompt tokens by level with :func:`by_level`."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["LEVELS", "by_level"]

LEVELS = ("hbm", "host", "ssd", "redis")


def by_level(tokens: Mapping[str, int], computed: int) -> str:
    """``"prompt tokens by level: hbm 448 (54%), computed 384 (46%)"``: the levels that
    served any tokens, in hierarchy order, then the computed tokens, with their shares."""
    counts = [(level, tokens.get(level, 0)) for level in LEVELS] + [("computed", computed)]
    total = sum(n for _, n in counts) or 1
    return "prompt tokens by level: " + ", ".join(
        f"{level} {n} ({n / total:.0%})" for level, n in counts if n
    )
