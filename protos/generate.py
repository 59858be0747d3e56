"""Generates the Python code for ``kvstore/v1/kvstore.proto`` (run by ``make protos``).

The generated modules import each other as ``kvstore.protos.kvstore.v1...``, so protoc runs
on a staging copy laid out under that import path. ``tests/protos/test_generated.py``
regenerates into a temporary folder and fails when the committed files are stale.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent / "kvstore" / "v1"
PROTO_NAME = "kvstore.proto"
OUTPUTS = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")
STAGED = Path("kvstore") / "protos" / "kvstore" / "v1"


def generate(out_dir: Path) -> list[Path]:
    """Writes the generated modules into ``out_dir``; returns their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as staging_name:
        staging = Path(staging_name)
        (staging / STAGED).mkdir(parents=True)
        shutil.copy(PROTO_DIR / PROTO_NAME, staging / STAGED / PROTO_NAME)
        include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{staging}",
            f"-I{include}",
            f"--python_out={staging}",
            f"--pyi_out={staging}",
            f"--grpc_python_out={staging}",
            str(STAGED / PROTO_NAME),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR / PROTO_NAME}")
        out_dir.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(staging / STAGED / name, out_dir / name)) for name in OUTPUTS]


if __name__ == "__main__":
    for path in generate(PROTO_DIR):
        sys.stdout.write(f"generated {path}\n")
