"""The vLLM KV connector: a stock vLLM server (V1 engine) caching its KV in kvstore.

``kv_connector_module_path: "kvstore.inference_adapter.vllm"`` with ``kv_connector:
"KVStoreConnector"`` selects it; see :mod:`.connector` for the whole configuration.

Only the connector itself imports vLLM, and only when first named (vLLM looks the class up
by name): ``layout``, ``settings``, ``scheduler``, ``link`` and ``worker`` import without it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVStoreConnector", "KVStoreConnectorStats", "KVStoreMetadata", "model_namespace"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.connector"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
