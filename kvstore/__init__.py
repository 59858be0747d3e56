"""kvstore: a tiered KV-cache storage daemon for LLM inference.

The daemon keeps attention KV blocks in a hierarchy of tiers (pinned host memory, local SSD,
Redis shared between nodes) and hands them back to inference engines faster than recomputing
them. Subpackages: ``kvstore.wire`` (what the daemon and its clients share), ``kvstore.tiers``
(byte stores with capacity), ``kvstore.client`` (keys and the client), ``kvstore.kernels``
(Triton kernels), ``kvstore.inference_adapter`` (engine side).
"""

__version__ = "0.1.0"
