"""The stress harness's universe: the model, the tenants, the chains and what each block holds.

Every block's bytes derive from its key and the tenant whose namespace holds it
(:func:`payload`), so any read can be checked on its own. Chains come from a small fixed
universe (:func:`chain_keys`) that different tasks and processes share, and :class:`Chooser`
picks among them, biased towards those a task wrote recently so that reads hit.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from typing import Any

import torch

from kvstore.client import ModelFingerprint, Namespace, block_keys

# 2 layers x (k, v) x 2 kv heads x 16 tokens x 32 head dim x fp16 = 8 KiB per block.
MODEL = ModelFingerprint("stress", 2, 2, 32, "float16", block_tokens=16)
LAYOUT = MODEL.layout()
BLOCK = LAYOUT.payload_bytes
TENANTS = ("alpha", "beta", "gamma")
TIERS = {"host", "ssd", "redis"}

# The chain universe: FAMILIES prompts of PREFIX_BLOCKS shared blocks, each with BRANCHES
# continuations of BRANCH_BLOCKS blocks: 5 * 2 + 5 * 5 * 4 = 110 distinct blocks per tenant,
# 330 for the three: more than the tiers hold together, so blocks also leave the bottom tier.
FAMILIES, BRANCHES, PREFIX_BLOCKS, BRANCH_BLOCKS = 5, 5, 2, 4
CHAIN_BLOCKS = PREFIX_BLOCKS + BRANCH_BLOCKS

ChainId = tuple[str, str, int, int]  # (namespace tenant, key tenant, family, branch)


def token_of(tenant: str) -> str:
    return f"stress-token-{tenant}"


def namespace_of(tenant: str) -> Namespace:
    return Namespace(MODEL, tenant)


_payloads: dict[tuple[str, bytes], bytes] = {}
_keys: dict[tuple[str, int, int], list[bytes]] = {}


def payload(tenant: str, key: bytes) -> bytes:
    """What a block of ``key`` must hold in ``tenant``'s namespace."""
    found = _payloads.get((tenant, key))
    if found is None:
        data = b"kvstore-stress\0" + tenant.encode() + b"\0" + key
        found = _payloads[(tenant, key)] = hashlib.shake_256(data).digest(BLOCK)
    return found


def chain_tokens(family: int, branch: int) -> list[int]:
    prefix = [100_000 * family + i for i in range(PREFIX_BLOCKS * MODEL.block_tokens)]
    rest = [
        100_000 * family + 1_000 * (branch + 1) + i
        for i in range(BRANCH_BLOCKS * MODEL.block_tokens)
    ]
    return prefix + rest


def chain_keys(key_tenant: str, family: int, branch: int) -> list[bytes]:
    """The full chain's keys, computed in ``key_tenant``'s namespace."""
    found = _keys.get((key_tenant, family, branch))
    if found is None:
        found = block_keys(chain_tokens(family, branch), namespace_of(key_tenant))
        assert len(found) == CHAIN_BLOCKS
        _keys[(key_tenant, family, branch)] = found
    return found


def identify(data: bytes) -> str:
    """What some wrong bytes are, if they are any block of the universe (a diagnosis)."""
    if data == bytes(len(data)):
        return "all zeros"
    for key_tenant in TENANTS:
        for family in range(FAMILIES):
            for branch in range(BRANCHES):
                for index, key in enumerate(chain_keys(key_tenant, family, branch)):
                    for tenant in TENANTS:
                        if payload(tenant, key)[:64] == data[:64]:
                            same = "whole block" if payload(tenant, key) == data else "prefix"
                            return (
                                f"{same} of tenant {tenant!r}'s block {key.hex()[:16]} "
                                f"(keys of {key_tenant!r}, family {family} branch {branch} "
                                f"index {index})"
                            )
    return "unknown bytes"


class Chooser:
    """Random chains of the universe, biased towards recently written ones (reads hit)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.recent: deque[tuple[str, int, int]] = deque(maxlen=64)

    def chain(self, tenant: str, *, read: bool) -> tuple[int, int, int]:
        """(family, branch, length) for ``tenant``."""
        rng = self.rng
        mine = [c for c in self.recent if c[0] == tenant] if read else []
        if mine and rng.random() < 0.7:
            _, family, branch = rng.choice(mine)
        else:
            family, branch = rng.randrange(FAMILIES), rng.randrange(BRANCHES)
        length = CHAIN_BLOCKS if rng.random() < 0.5 else rng.randint(1, CHAIN_BLOCKS)
        return family, branch, length

    def wrote(self, tenant: str, family: int, branch: int) -> None:
        self.recent.append((tenant, family, branch))


def pick(rng: random.Random, weights: dict[str, float]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def as_payload(rng: random.Random, data: bytes, *, tensors: bool = True) -> Any:
    """The same bytes as one of the payload types ``put`` takes (the store takes buffers;
    the client also tensors)."""
    kind = rng.randrange(4 if tensors else 3)
    if kind == 0:
        return data
    if kind == 1:
        return bytearray(data)
    if kind == 2:
        return memoryview(data)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.float16)
    return tensor.view(
        LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.block_tokens, LAYOUT.head_dim
    )


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()
