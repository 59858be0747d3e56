"""The connector core loads no engine: importing it in a fresh interpreter (``-P``, so the
checkout's root never shadows the installed package) brings the client, torch and the one
kernel it runs, and none of the engine, model, chat, vLLM or other kernel modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CORE = ["kvstore.inference_adapter.core.saver", "kvstore.inference_adapter.core.transfer"]
# Every module of ours the core may load: itself, the client and the wire layer below it,
# the package roots on the way, and the KV transfer kernel with what it imports.
ALLOWED_PREFIXES = (
    "kvstore.inference_adapter.core",
    "kvstore.client",
    "kvstore.wire",
    "kvstore.protos",
    "kvstore.kernels.transfer",
)
ALLOWED = {"kvstore", "kvstore.inference_adapter", "kvstore.kernels"}


def loaded(code: str) -> set[str]:
    report = "import json, sys; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-P", "-c", f"{code}\n{report}"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT / "tests")  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    names: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return {name for name in names if name == "kvstore" or name.startswith("kvstore.")}


def foreign(modules: set[str]) -> set[str]:
    return {m for m in modules if m not in ALLOWED and not m.startswith(ALLOWED_PREFIXES)}


def test_the_core_loads_no_engine_model_vllm_or_other_kernel_module() -> None:
    modules = loaded("\n".join(f"import {name}" for name in CORE))
    assert set(CORE) <= modules
    assert "kvstore.kernels.transfer" in modules  # what it does use is there
    assert foreign(modules) == set()


def test_the_check_sees_an_engine_module() -> None:
    modules = loaded(
        "import kvstore.inference_adapter.core.saver\nimport kvstore.inference_adapter.loader"
    )
    assert "kvstore.inference_adapter.loader" in foreign(modules)
