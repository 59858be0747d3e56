"""Client side of kvstore: the block key function now; the gRPC and shared-memory client next.

Keys are computed here, never in the daemon, so every engine and every node agrees on them:
``block_keys(tokens, Namespace(ModelFingerprint(...), tenant))`` -> one key per full block.
"""

from kvstore.client.keys import ROOT_KEY, ModelFingerprint, Namespace, block_keys

__all__ = ["ROOT_KEY", "ModelFingerprint", "Namespace", "block_keys"]
