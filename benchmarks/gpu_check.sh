#!/usr/bin/env bash
# The checks that need CUDA, for a GPU machine that reaches no package index.
#
#   benchmarks/gpu_check.sh [OUT_DIR]
#
# Runs from the checkout and the machine's own python3 (which must hold torch with CUDA and
# triton); nothing is installed from the network. Python packages the machine lacks come
# from wheels carried in build/gpu-wheels (`make gpu-wheels` downloads them on a machine
# that reaches PyPI), installed into a venv that sees the system's site-packages. Then:
#
#   1. pytest -m gpu: the kernels at Llama-3-8B-like sizes against their torch references,
#      the client's CUDA tensors and pinned arena, and the vLLM connector's worker on CUDA
#      tensors in the packed and split (NHD, HND) layouts against a real daemon;
#   2. the layout unit tests again, on CUDA tensors (KVSTORE_TEST_DEVICE=cuda);
#   3. benchmarks/kernels.py --device cuda: kernel throughput against copy_ and SDPA.
#
# Budget: under 8 minutes on one H200 (pytest and the benchmark each have a timeout).
# GPU_CHECK_ALLOW_CPU=1 runs the same plumbing without CUDA (the gpu tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-check}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
DEVICE=cuda

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
        echo "gpu_check: $PYTHON has no CUDA-capable torch (GPU_CHECK_ALLOW_CPU=1 to dry-run)" >&2
        exit 2
    fi
    export TRITON_INTERPRET=1
    DEVICE=cpu
fi

# Python packages the checks need beyond torch and triton; when any is missing, a venv over
# the system packages takes them from the carried wheels.
NEEDED=(lz4 redis grpc_health platformdirs pytest_asyncio xxhash grpc google.protobuf uvloop aiofiles)
missing() {
    "$1" - "${NEEDED[@]}" <<'EOF'
import importlib.util, sys
names = {"grpc_health": "grpcio-health-checking", "pytest_asyncio": "pytest-asyncio",
         "grpc": "grpcio", "google.protobuf": "protobuf"}
def present(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(names.get(m, m) for m in sys.argv[1:] if not present(m)))
EOF
}
PY="$PYTHON"
MISSING=$(missing "$PY")
if [ -n "$MISSING" ]; then
    if [ ! -d build/gpu-wheels ]; then
        echo "gpu_check: $PYTHON lacks $MISSING and there is no build/gpu-wheels" \
            "(make gpu-wheels where PyPI is reachable, then carry build/gpu-wheels)" >&2
        exit 2
    fi
    VENV=build/gpu-venv
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV"
    PY="$VENV/bin/python"
    # --upgrade: the carried protobuf and grpcio also replace system ones older than the
    # generated code needs.
    "$PY" -m pip install -q --no-index --find-links build/gpu-wheels --upgrade \
        protobuf grpcio grpcio-health-checking $MISSING
fi

# The repository folders under the single import root `kvstore`, without pip install.
TREE=build/gpu-tree
rm -rf "$TREE" && mkdir -p "$TREE/kvstore"
ln -s "$PWD"/kvstore/*.py "$PWD"/kvstore/py.typed "$TREE/kvstore/"
for d in tiers client protos kernels inference_adapter; do ln -s "$PWD/$d" "$TREE/kvstore/$d"; done
export PYTHONPATH="$PWD/$TREE:$PWD"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else "")' | tee "$OUT/device.txt"

status=0
timeout 300 "$PY" -m pytest -p no:cacheprovider -m gpu -rs -q tests \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.txt" || status=1
KVSTORE_TEST_DEVICE=$DEVICE timeout 120 "$PY" -m pytest -p no:cacheprovider -q \
    tests/inference_adapter/vllm/test_layout.py 2>&1 | tee "$OUT/layout-cuda.txt" || status=1
if [ "$DEVICE" = cuda ]; then
    timeout 180 "$PY" benchmarks/kernels.py --device cuda --json "$OUT/kernels.json" \
        2>&1 | tee "$OUT/kernels.txt" || status=1
else
    timeout 180 "$PY" benchmarks/kernels.py --device cpu --size small --repeats 1 \
        2>&1 | tee "$OUT/kernels.txt" || status=1
fi
echo "gpu_check: exit $status; logs in $OUT"
exit $status
