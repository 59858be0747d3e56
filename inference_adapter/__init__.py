"""Engine side: Llama-family model, paged KV pool, store connector, chat sessions.

The Hugging Face bridge (``kvstore.inference_adapter.hf_bridge``) is imported on its own: it
needs ``transformers``, which the engine does not.

Each name is imported with its own module on first use (PEP 562): the vLLM connector
(``kvstore.inference_adapter.vllm``) loads no engine, model or chat module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.inference_adapter.connector import ConnectorStats, StoreConnector
    from kvstore.inference_adapter.engine import Engine
    from kvstore.inference_adapter.interfaces import (
        KVConnector,
        NullConnector,
        Request,
        ReusedBlock,
        SamplingParams,
    )
    from kvstore.inference_adapter.model import LlamaModel, load_model
    from kvstore.inference_adapter.pages import PageAllocator
    from kvstore.inference_adapter.sessions import ByteTokenizer, ChatServer, ChatSession, plan_turn
    from kvstore.inference_adapter.weights import LlamaConfig, namespace_for, read_config

__all__ = [
    "ByteTokenizer",
    "ChatServer",
    "ChatSession",
    "ConnectorStats",
    "Engine",
    "KVConnector",
    "LlamaConfig",
    "LlamaModel",
    "NullConnector",
    "PageAllocator",
    "Request",
    "ReusedBlock",
    "SamplingParams",
    "StoreConnector",
    "load_model",
    "namespace_for",
    "plan_turn",
    "read_config",
]

# Where each name lives: a name is imported on first use, with its module only.
_HOMES = {
    "ConnectorStats": "kvstore.inference_adapter.connector",
    "StoreConnector": "kvstore.inference_adapter.connector",
    "namespace_for": "kvstore.inference_adapter.weights",
    "Engine": "kvstore.inference_adapter.engine",
    "KVConnector": "kvstore.inference_adapter.interfaces",
    "NullConnector": "kvstore.inference_adapter.interfaces",
    "Request": "kvstore.inference_adapter.interfaces",
    "ReusedBlock": "kvstore.inference_adapter.interfaces",
    "SamplingParams": "kvstore.inference_adapter.interfaces",
    "LlamaModel": "kvstore.inference_adapter.model",
    "load_model": "kvstore.inference_adapter.model",
    "PageAllocator": "kvstore.inference_adapter.pages",
    "ByteTokenizer": "kvstore.inference_adapter.sessions",
    "ChatServer": "kvstore.inference_adapter.sessions",
    "ChatSession": "kvstore.inference_adapter.sessions",
    "plan_turn": "kvstore.inference_adapter.sessions",
    "LlamaConfig": "kvstore.inference_adapter.weights",
    "read_config": "kvstore.inference_adapter.weights",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
