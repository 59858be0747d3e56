"""Picking the next token of each sequence in a step.

Greedy (argmax) when a request's temperature is 0; otherwise one draw from
``softmax(logits / temperature)`` with the request's own generator, seeded from
``SamplingParams.seed`` (or at random without one). A generator per request, rather than
one per batch, keeps a seeded request's tokens the same whatever else runs beside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.inference_adapter.interfaces import SamplingParams


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The generator a request samples with; None when it decodes greedily."""
    if params.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits``.

    Args:
        logits: ``[batch, vocab_size]``.
        params: Each row's sampling parameters.
        generators: Each row's generator from ``new_generator``.

    Returns:
        ``batch`` token ids.
    """
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if row_params.temperature > 0:
            probs = torch.softmax(logits[row].float() / row_params.temperature, dim=-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
