"""The block key function: golden vectors, stability, prefix sharing, isolation, bad input."""

from __future__ import annotations

import array
import hashlib
import os
import random
import struct
import subprocess
import sys
import time

import pytest
import torch

from kvstore.client import ROOT_KEY, KeySalt, ModelFingerprint, Namespace, block_keys, shard_keys

GOLDEN_MODEL = ModelFingerprint(
    "golden-model",
    num_layers=2,
    num_kv_heads=1,
    head_dim=8,
    dtype="float16",
    block_tokens=4,
    rope_theta=500000.0,
    rope_scaling=(("factor", 8.0), ("rope_type", "llama3")),
)
GOLDEN = Namespace(GOLDEN_MODEL, tenant="tenant-a")
GOLDEN_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]
GOLDEN_ROOT = "f00b645ffb15c9664584369a452c45d41b23b9dca411342b133bcab40cceaf35"
# Fingerprint v3 (token-major layers); v2 (stored K after RoPE) was e58d4cac..., v1 edbb5ace...
GOLDEN_NAMESPACE = "530726ed51ddcbae5240f77ae3058d7cf04ae5b4add3e61a71073a5d65fca23a"
GOLDEN_KEYS = [
    "654bbfd127f7232fa5a4e1e528069c76356d270b13ff563e9eab7fac3a7b15a1",
    "d494589396066e689523639e3ab0eee8ae6ad1bc85d3a9218e37ae6732575b88",
]
GOLDEN_SALT = KeySalt(b"session-1", from_block=1)
GOLDEN_SALTED_KEYS = [
    GOLDEN_KEYS[0],  # before from_block: the plain chain's key
    "15e89df0214deeb9ee42780ecf253c01df1c231b72dd0b8c16d624e33cddb2fd",
]

LLAMA = ModelFingerprint("llama-test", num_layers=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")


def small(**changes: object) -> Namespace:
    fields: dict[str, object] = {
        "model_name": "m",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float16",
        "block_tokens": 4,
    }
    tenant = str(changes.pop("tenant", ""))
    fields.update(changes)
    return Namespace(ModelFingerprint(**fields), tenant)


def test_golden_vector_follows_the_chain_formula() -> None:
    keys = block_keys(GOLDEN_TOKENS, GOLDEN)

    assert ROOT_KEY.hex() == GOLDEN_ROOT
    assert GOLDEN.digest().hex() == GOLDEN_NAMESPACE
    assert [key.hex() for key in keys] == GOLDEN_KEYS
    # h_i = SHA-256(h_{i-1} || namespace digest || tokens_i as uint32 LE), by hand
    h0 = hashlib.sha256(ROOT_KEY + GOLDEN.digest() + struct.pack("<4I", 1, 2, 3, 4)).digest()
    h1 = hashlib.sha256(h0 + GOLDEN.digest() + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert keys == [h0, h1]


def test_golden_salted_chain_hashes_the_salt_once_at_its_first_block() -> None:
    keys = block_keys(GOLDEN_TOKENS, GOLDEN, GOLDEN_SALT)

    assert [key.hex() for key in keys] == GOLDEN_SALTED_KEYS
    salt = hashlib.sha256(b"kvstore/key-salt/v1\0session-1").digest()
    assert GOLDEN_SALT.digest() == salt
    h1 = hashlib.sha256(keys[0] + GOLDEN.digest() + salt + struct.pack("<4I", 5, 6, 7, 8))
    assert keys[1] == h1.digest()


def test_a_salt_changes_every_key_from_its_block_on_and_none_before() -> None:
    ns = small()
    tokens = list(range(100, 124))  # 6 blocks
    plain = block_keys(tokens, ns)
    for from_block in range(7):
        salted = block_keys(tokens, ns, KeySalt(b"s", from_block))
        assert salted[:from_block] == plain[:from_block]
        assert not set(salted[from_block:]) & set(plain)
    other = block_keys(tokens, ns, KeySalt(b"t", 2))
    assert not set(other[2:]) & set(block_keys(tokens, ns, KeySalt(b"s", 2))[2:])


@pytest.mark.parametrize(
    ("salt", "from_block", "message"),
    [
        (b"", 0, "non-empty bytes"),
        ("s", 0, "non-empty bytes"),
        (b"s", -1, ">= 0"),
        (b"s", 1.0, "int"),
    ],
)
def test_bad_salts_are_refused_by_name(salt: object, from_block: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeySalt(salt, from_block)  # type: ignore[arg-type]


def test_keys_do_not_depend_on_the_interpreter_hash_seed() -> None:
    script = (
        "from kvstore.client import ModelFingerprint, Namespace, block_keys\n"
        "m = ModelFingerprint('golden-model', num_layers=2, num_kv_heads=1, head_dim=8,"
        " dtype='float16', block_tokens=4, rope_theta=500000.0,"
        " rope_scaling=(('rope_type', 'llama3'), ('factor', 8)))\n"
        "print(','.join(k.hex() for k in block_keys(range(1, 10), Namespace(m, 'tenant-a'))))\n"
    )
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-P", "-c", script],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip().split(",") == GOLDEN_KEYS


def test_only_full_blocks_get_keys() -> None:
    ns = small()

    assert block_keys([], ns) == []
    assert block_keys([7, 7, 7], ns) == []
    assert len(block_keys(range(11), ns)) == 2
    assert block_keys(range(11), ns) == block_keys(range(8), ns)


def test_shared_prefix_shares_leading_keys_and_divergence_changes_all_later() -> None:
    ns = small()
    base = list(range(100, 120))  # 5 blocks
    diverged = [*base[:9], 999, *base[10:]]  # differs inside block 2

    a, b = block_keys(base, ns), block_keys(diverged, ns)

    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "tenant-b"},
        {"model_name": "m2"},
        {"dtype": "bfloat16"},
        {"num_layers": 3},
        {"num_kv_heads": 1},
        {"head_dim": 16},
        {"rope_theta": 500000.0},
        {"rope_scaling": (("factor", 8.0),)},
        {"tp_size": 2},
    ],
)
def test_every_namespace_field_separates_keys(change: dict[str, object]) -> None:
    tokens = list(range(64))

    assert not set(block_keys(tokens, small())) & set(block_keys(tokens, small(**change)))


def test_block_size_separates_keys() -> None:
    tokens = list(range(64))

    assert not set(block_keys(tokens, small(block_tokens=4))) & set(
        block_keys(tokens, small(block_tokens=8))
    )


def test_empty_tenant_is_the_default_and_tenants_differ() -> None:
    model = small().model

    assert Namespace(model).digest() == Namespace(model, "").digest()
    assert Namespace(model, "a").digest() != Namespace(model, "b").digest()
    assert Namespace(model, "ab").digest() != Namespace(model, "a").digest()


def test_fingerprint_encoding_is_canonical() -> None:
    a = small(rope_scaling=(("factor", 8), ("rope_type", "llama3"))).model
    b = small(rope_scaling=(("rope_type", "llama3"), ("factor", 8.0))).model
    as_string = small(rope_scaling=(("factor", "8.0"), ("rope_type", "llama3"))).model
    nearby = small(rope_theta=10000.000000000002).model

    assert a == b
    assert a.digest() == b.digest()
    assert a.digest() != as_string.digest()
    assert nearby.digest() != small().model.digest()


def test_list_tuple_array_and_tensor_inputs_agree() -> None:
    ns = small(block_tokens=16)
    rng = random.Random(0)
    tokens = [rng.randrange(2**32) for _ in range(70)]
    expected = block_keys(tokens, ns)

    assert len(expected) == 4
    assert block_keys(tuple(tokens), ns) == expected
    assert block_keys(array.array("Q", tokens), ns) == expected
    assert block_keys(torch.tensor(tokens, dtype=torch.int64), ns) == expected
    small_ids = [token % 30000 for token in tokens]
    small_expected = block_keys(small_ids, ns)
    assert block_keys(torch.tensor(small_ids, dtype=torch.int32), ns) == small_expected
    assert block_keys(torch.tensor(small_ids)[::1].contiguous(), ns) == small_expected


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, 2, -1, 4], r"token 2 is -1, outside \[0, 2\*\*32\)"),
        ([1, 2**32], r"token 1 is 4294967296, outside"),
        ([1, 2, 3.0], r"token 2 is 3.0, not an integer"),
        ([1, "2"], r"token 1 is '2', not an integer"),
        (torch.tensor([5, 6, -7]), r"token 2 is -7, outside"),
        (torch.tensor([1.0, 2.0]), r"tokens must be integers, got dtype torch.float32"),
        (torch.zeros(2, 4, dtype=torch.int64), r"tokens must be 1-D, got shape \(2, 4\)"),
    ],
)
def test_bad_tokens_raise_naming_index_and_value(tokens: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        block_keys(tokens, small())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_name": ""}, "model_name must be a non-empty str, got ''"),
        ({"num_layers": 0}, "num_layers must be a positive int, got 0"),
        ({"num_kv_heads": -2}, "num_kv_heads must be a positive int, got -2"),
        ({"head_dim": 64.0}, r"head_dim must be a positive int, got 64\.0"),
        ({"block_tokens": True}, "block_tokens must be a positive int, got True"),
        ({"dtype": "int8"}, "dtype must be one of .*, got 'int8'"),
        ({"rope_theta": 0.0}, r"rope_theta must be positive, got 0\.0"),
        ({"rope_theta": float("nan")}, "rope_theta must be a finite number, got nan"),
        ({"rope_scaling": (("factor", float("inf")),)}, r"rope_scaling\['factor'\] must be"),
        ({"rope_scaling": (("a", 1.0), ("a", 2.0))}, "rope_scaling keys must be distinct"),
        ({"rope_scaling": {"factor": 8.0}}, r"rope_scaling must hold \(name, value\) pairs"),
        ({"tp_size": 0}, "tp_size must be a positive int, got 0"),
    ],
)
def test_bad_fingerprint_fields_raise_naming_them(change: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        small(**change)


def test_from_hf_config_reads_a_llama3_config() -> None:
    config: dict[str, object] = {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }

    model = ModelFingerprint.from_hf_config(
        config, model_name="meta-llama/Llama-3.1-8B", dtype="bfloat16"
    )

    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (32, 8, 128)
    assert model.rope_scaling[0] == ("factor", 8.0)
    assert ("original_max_position_embeddings", 8192.0) in model.rope_scaling
    assert model.layout().payload_bytes == 32 * 2 * 8 * 256 * 128 * 2


def test_a_long_prompt_is_keyed_in_well_under_ten_milliseconds() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(128256) for _ in range(128 * 1024)]
    ns = Namespace(LLAMA)
    block_keys(tokens, ns)

    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        keys = block_keys(tokens, ns)
        best = min(best, time.perf_counter() - start)

    assert len(keys) == 512
    assert best < 0.010


def test_fingerprint_reads_old_and_new_hf_rope_spellings() -> None:
    base = {
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "hidden_size": 4096,
    }
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = {**base, "rope_theta": 500000.0, "rope_scaling": llama3}
    new = {**base, "rope_parameters": {**llama3, "rope_theta": 500000.0}}
    make = ModelFingerprint.from_hf_config
    a = make(old, model_name="llama-3-8b", dtype="bfloat16")
    b = make(new, model_name="llama-3-8b", dtype="bfloat16")
    assert a == b and a.rope_theta == 500000.0 and dict(a.rope_scaling)["factor"] == 8.0
    plain_old = make({**base, "rope_theta": 10000.0}, model_name="m", dtype="float16")
    plain_new = make(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        model_name="m",
        dtype="float16",
    )
    assert plain_old.digest() == plain_new.digest() and plain_new.rope_scaling == ()


def test_each_tensor_parallel_rank_has_keys_of_its_own() -> None:
    """Rank 0 keeps the chain's keys (the golden vector holds for it); every other rank's
    keys are its own, the same on every call, and the root stays the root."""
    keys = block_keys(list(range(64)), small(tp_size=2))
    assert shard_keys(keys, 0) == keys
    ranks = [shard_keys([ROOT_KEY, *keys], rank) for rank in range(4)]
    assert all(chain[0] == ROOT_KEY for chain in ranks)
    assert len({key for chain in ranks for key in chain[1:]}) == 4 * len(keys)
    assert shard_keys(keys, 3) == ranks[3][1:]
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        shard_keys(keys, -1)
