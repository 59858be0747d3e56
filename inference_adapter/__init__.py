"""Engine side: Llama-family model, paged KV pool, store connector, chat sessions.

The Hugging Face bridge (``kvstore.inference_adapter.hf_bridge``) is imported on its own: it
needs ``transformers``, which the engine does not.
"""

from kvstore.inference_adapter.connector import ConnectorStats, StoreConnector, namespace_for
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
from kvstore.inference_adapter.weights import LlamaConfig, read_config

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
