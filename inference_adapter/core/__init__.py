"""The engine-neutral connector core: what any engine's connector needs to move KV between
its paged pool and kvstore, and nothing of an engine.

- :mod:`~kvstore.inference_adapter.core.transfer`: an engine's attention layers as K/V page
  views (:class:`~kvstore.inference_adapter.core.transfer.LayerKV`), leased blocks written
  into them layer by layer (:class:`~kvstore.inference_adapter.core.transfer.LayerWriter`,
  one kernel per layer on CUDA) and the CUDA ordering of such a load against the engine's
  stream (:class:`~kvstore.inference_adapter.core.transfer.LayerSignals`);
- :mod:`~kvstore.inference_adapter.core.saver`: the bounded save queue that puts new blocks
  from device memory without the engine waiting
  (:class:`~kvstore.inference_adapter.core.saver.SaveQueue`).

Both connectors stand on it: our engine's (:mod:`kvstore.inference_adapter.connector`,
:mod:`kvstore.inference_adapter.loader`) and vLLM's (:mod:`kvstore.inference_adapter.vllm`).
It imports the client, torch and the one kernel it runs (``kernels/transfer.py``), never an
engine, a model or another kernel (``tests/inference_adapter/core/test_imports.py``).
"""
