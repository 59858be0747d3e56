"""Public kernel entry points: each runs its Triton kernel or its torch reference.

``KVSTORE_KERNELS`` (read at every call) picks the implementation:

- ``auto`` (default): Triton for CUDA tensors, the torch reference otherwise.
- ``triton``: always Triton. Off CUDA this needs the Triton interpreter
  (``TRITON_INTERPRET=1`` set before triton is first imported); the tests use it so.
- ``torch``: always the torch reference, on any device.

Entry points: ``prefill_attention``, ``decode_attention``, ``load_blocks``, ``save_blocks``.
Each has the signature and documentation of its ``*_triton`` function and looks its
implementation up in ``IMPLEMENTATIONS`` on every call. On the Triton side, prefill runs
``prefill_attention_fastest``: per shape, the paged kernel or SDPA over the gathered pages,
whichever this GPU runs faster (:mod:`kvstore.kernels.tuning`).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Literal, TypeVar, cast

import torch

from kvstore.kernels.attention import (
    prefill_attention_fastest,
    prefill_attention_reference,
    prefill_attention_triton,
)
from kvstore.kernels.copy import (
    load_blocks_reference,
    load_blocks_triton,
    save_blocks_reference,
    save_blocks_triton,
)
from kvstore.kernels.decode import decode_attention_reference, decode_attention_triton

KERNELS_ENV = "KVSTORE_KERNELS"
Backend = Literal["triton", "torch"]
_MODES = ("auto", "triton", "torch")
_F = TypeVar("_F", bound=Callable[..., object])


def kernel_backend(device: torch.device) -> Backend:
    """Which implementation runs for tensors on ``device``, per ``KVSTORE_KERNELS``.

    Raises:
        ValueError: ``KVSTORE_KERNELS`` holds something else than auto, triton or torch.
        RuntimeError: Triton is forced for non-CUDA tensors without the interpreter.
    """
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(_MODES)}, got {mode!r}")
    if mode == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if mode == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{KERNELS_ENV}=triton with {device.type} tensors needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 before triton is imported"
        )
    return "triton" if mode == "triton" else "torch"


# Entry point -> backend -> implementation; the entry points look here on every call.
IMPLEMENTATIONS: dict[str, dict[Backend, Callable[..., object]]] = {
    "prefill_attention": {
        "triton": prefill_attention_fastest,
        "torch": prefill_attention_reference,
    },
    "decode_attention": {"triton": decode_attention_triton, "torch": decode_attention_reference},
    "load_blocks": {"triton": load_blocks_triton, "torch": load_blocks_reference},
    "save_blocks": {"triton": save_blocks_triton, "torch": save_blocks_reference},
}


def _entry_point(name: str, triton_impl: _F) -> _F:
    """``name``, with ``triton_impl``'s signature, running the backend chosen for the device
    of its first argument (a tensor that is not one goes to the torch reference, whose
    checks name it)."""
    first = next(iter(inspect.signature(triton_impl).parameters))

    @functools.wraps(triton_impl)
    def run(*args: object, **kwargs: object) -> object:
        tensor = args[0] if args else kwargs.get(first)
        backend = kernel_backend(tensor.device) if isinstance(tensor, torch.Tensor) else "torch"
        return IMPLEMENTATIONS[name][backend](*args, **kwargs)

    run.__name__ = run.__qualname__ = name
    run.__module__ = __name__
    run.__doc__ = f"Dispatching entry point: {triton_impl.__name__} or its torch reference.\n\n"
    run.__doc__ += inspect.getdoc(triton_impl) or ""
    return cast(_F, run)


prefill_attention = _entry_point("prefill_attention", prefill_attention_triton)
decode_attention = _entry_point("decode_attention", decode_attention_triton)
load_blocks = _entry_point("load_blocks", load_blocks_triton)
save_blocks = _entry_point("save_blocks", save_blocks_triton)
