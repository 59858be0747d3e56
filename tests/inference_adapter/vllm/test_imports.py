"""The vLLM connector loads only what it uses: no engine, model, chat or attention module.

Each check imports in a fresh interpreter (``-P``: the checkout's root never shadows the
installed package) and reads ``sys.modules``. The connector module itself imports vLLM, so
it is loaded in the vLLM environment when there is one (``make test`` requires it); its
kvstore side loads here in every environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.vllm_env import require_vllm

ROOT = Path(__file__).resolve().parents[3]

# Our modules a vLLM server never runs: the demo engine and its model, chat, pages and
# connector, the GGUF and tokenizer readers, and every kernel but the KV transfer and RoPE.
UNUSED = {
    "kvstore.inference_adapter.connector",
    "kvstore.inference_adapter.demo",
    "kvstore.inference_adapter.engine",
    "kvstore.inference_adapter.gguf",
    "kvstore.inference_adapter.hf_bridge",
    "kvstore.inference_adapter.loader",
    "kvstore.inference_adapter.model",
    "kvstore.inference_adapter.models",
    "kvstore.inference_adapter.pages",
    "kvstore.inference_adapter.sampling",
    "kvstore.inference_adapter.sessions",
    "kvstore.inference_adapter.tokenizer",
    "kvstore.inference_adapter.bench",
    "kvstore.kernels.attention",
    "kvstore.kernels.copy",
    "kvstore.kernels.decode",
    "kvstore.kernels.dispatch",
    "kvstore.kernels.paged",
    # and the daemon's own modules
    "kvstore.server",
    "kvstore.service",
    "kvstore.store",
    "kvstore.tiers.host",
}

SIDE = ("layout", "link", "model", "scheduler", "settings", "worker")
KVSTORE_SIDE = [f"kvstore.inference_adapter.vllm.{name}" for name in SIDE]


def loaded(python: str | Path, code: str) -> set[str]:
    """The modules of ours loaded after ``code`` runs in a fresh ``python``."""
    report = "import json, sys; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([str(python), "-P", "-c", f"{code}\n{report}"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT / "tests")  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    names: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return {name for name in names if name.startswith("kvstore")}


def test_the_connectors_kvstore_side_loads_no_engine_model_or_kernel_it_does_not_use() -> None:
    modules = loaded(sys.executable, "\n".join(f"import {name}" for name in KVSTORE_SIDE))
    assert set(KVSTORE_SIDE) <= modules
    assert "kvstore.kernels.transfer" in modules  # what it does use is there
    assert modules & UNUSED == set()


def test_the_connector_as_vllm_loads_it_loads_no_engine_model_or_kernel_it_does_not_use() -> None:
    vllm_python = require_vllm()
    # As vLLM does: the module path named in the config, then the class by name.
    code = ("import importlib\n"
            "module = importlib.import_module('kvstore.inference_adapter.vllm')\n"
            "module.KVStoreConnector")  # fmt: skip
    modules = loaded(vllm_python, code)
    assert "kvstore.inference_adapter.vllm.connector" in modules
    assert modules & UNUSED == set()
