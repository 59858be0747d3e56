"""Engine side: Llama-family model, paged KV pool, store connector, chat sessions."""

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
from kvstore.inference_adapter.weights import LlamaConfig, read_config

__all__ = [
    "Engine",
    "KVConnector",
    "LlamaConfig",
    "LlamaModel",
    "NullConnector",
    "PageAllocator",
    "Request",
    "ReusedBlock",
    "SamplingParams",
    "load_model",
    "read_config",
]
