"""The committed generated code matches what the pinned generator makes from the .proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvstore.protos.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", REPO / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = module.generate(tmp_path)
    assert [path.name for path in fresh] == list(module.OUTPUTS)
    committed = REPO / "protos" / "kvstore" / "v1"
    stale = [p.name for p in fresh if p.read_bytes() != (committed / p.name).read_bytes()]
    assert stale == [], f"regenerate with `make protos`: {stale} differ from kvstore.proto"


def test_service_has_the_control_plane() -> None:
    methods = set(kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods_by_name)
    assert methods == {
        "Handshake", "RegisterNamespace", "Lookup", "Acquire", "Release", "Reserve",
        "Commit", "Abort", "Get", "Put", "Prefetch", "Delete", "Stats",
        "Namespaces", "Evict", "Flush",
    }  # fmt: skip
    assert hasattr(kvstore_pb2_grpc, "KVStoreStub")
