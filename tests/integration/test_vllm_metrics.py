"""The connector's stats and Prometheus metrics as vLLM's loggers use them, in the vLLM
environment: hit phases observed on the scheduler's and the worker's side are merged with the
block counts, reduced to medians for vLLM's log line, and recorded in
``kvstore_engine_hit_phase_seconds{phase}`` per engine; so are a prefill step's waits for its
saves (``kvstore_engine_handoff_wait_seconds``).
"""

from __future__ import annotations

import json
import subprocess

from tests.support.vllm_env import require_vllm

VLLM_PYTHON = require_vllm(module_level=True)

PROBE = """
import json
from types import SimpleNamespace
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from kvstore.inference_adapter.vllm.connector import (
    HANDOFF_KEY, PHASES_KEY, KVStoreConnector, KVStoreConnectorStats,
)
config = SimpleNamespace(kv_transfer_config=None)
types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
metrics = KVStoreConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"], 1: ["1"]})
scheduler = KVStoreConnector.build_kv_connector_stats(
    {PHASES_KEY: [{"queue": 0.002, "lookup": 0.0004}]}
)
worker = KVStoreConnectorStats(
    data={"load_blocks": 3, PHASES_KEY: [{"first_layer": 0.001, "layers": 0.003}],
          HANDOFF_KEY: [0.004]}
)
merged = worker.aggregate(scheduler).aggregate(KVStoreConnectorStats(data={"load_blocks": 2}))
metrics.observe(merged.data, 1)
print(json.dumps({"reduced": merged.reduce(), "text": generate_latest(REGISTRY).decode()}))
"""


def test_hit_phases_reach_vllms_log_line_and_prometheus_per_engine() -> None:
    done = subprocess.run(
        [str(VLLM_PYTHON), "-P", "-c", PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["reduced"] == {
        "load_blocks": 5,
        "queue_p50_ms": 2.0,
        "lookup_p50_ms": 0.4,
        "first_layer_p50_ms": 1.0,
        "layers_p50_ms": 3.0,
        "handoff_wait_p50_ms": 4.0,
    }
    lines = report["text"].splitlines()
    name = "kvstore_engine_hit_phase_seconds"
    for phase in ("queue", "lookup", "first_layer", "layers"):
        assert f'{name}_count{{engine="1",phase="{phase}"}} 1.0' in lines, phase
        assert f'{name}_count{{engine="0",phase="{phase}"}} 0.0' in lines, phase
    assert f'{name}_count{{engine="1",phase="lease"}} 0.0' in lines
    waits = "kvstore_engine_handoff_wait_seconds"
    assert f'{waits}_count{{engine="1"}} 1.0' in lines
    assert f'{waits}_count{{engine="0"}} 0.0' in lines
