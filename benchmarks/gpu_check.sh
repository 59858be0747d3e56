#!/usr/bin/env bash
# The checks that need CUDA, for a GPU machine that reaches no package index.
#
#   benchmarks/gpu_check.sh [OUT_DIR]          # from anywhere; default OUT_DIR build/gpu-check
#
# Runs on the machine's own python3 (torch with CUDA, triton) and installs neither the
# project nor anything from the network:
#
# - Python packages beyond torch and triton come from build/gpu-wheels (`make gpu-wheels`
#   downloads them, at requirements.lock's versions for Python 3.12, where PyPI is reachable):
#   installed with --no-deps into build/gpu-site, which goes on PYTHONPATH ahead of the
#   machine's own packages. Without build/gpu-wheels the python must already hold them.
# - The project is a link tree, build/gpu-tree: the repository folders under the import root
#   `kvstore`, beside `benchmarks`. It is the only part of the checkout on
#   sys.path: every Python here runs with -P, and so does every daemon a test starts
#   (kvstore.launch), so the checkout root, the working directory, never is: there, its
#   `kvstore/` folder (without the subpackages that live in other folders) would shadow the
#   tree, and `kernels/` an installed package of that name.
#
# Then:
#   1. pytest -m gpu: the kernels at Llama-3-8B-like sizes against their torch references,
#      the client's CUDA tensors and pinned arena, and the vLLM connector's worker on CUDA
#      tensors in the packed and split (NHD, HND) layouts against a real daemon;
#   2. the layout unit tests again, on CUDA tensors (KVSTORE_TEST_DEVICE=cuda);
#   3. python -m benchmarks.kernels --device cuda: kernel throughput against copy_ and SDPA;
#   4. kvstore bench gpu, 1B-like then 8B-like (prompts 2K-32K): TTFT of a store hit against
#      recomputing, load and save rates against the host link's (bench-gpu-*.json).
#
# Budget: under 9 minutes on one H200 (each step has a timeout; a failed step does not stop
# the others, and the exit status says whether any failed).
# GPU_CHECK_ALLOW_CPU=1 runs the same plumbing without CUDA (the gpu tests then skip).
# GPU_WHEELS (default build/gpu-wheels) and GPU_CHECK_BUILD (the tree's and the packages'
# folder, default build) move them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-check}
WHEELS=${GPU_WHEELS:-build/gpu-wheels}
BUILD=$(mkdir -p "${GPU_CHECK_BUILD:-build}" && cd "${GPU_CHECK_BUILD:-build}" && pwd)
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=cuda

if ! "$PY" -P -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
        echo "gpu_check: $PY has no CUDA-capable torch (GPU_CHECK_ALLOW_CPU=1 to dry-run)" >&2
        exit 2
    fi
    export TRITON_INTERPRET=1
    DEVICE=cpu
fi

SITE=
if [ -d "$WHEELS" ]; then
    SITE=$BUILD/gpu-site
    rm -rf "$SITE"
    "$PY" -P -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --target "$SITE" "$WHEELS"/*.whl
fi

TREE=$BUILD/gpu-tree
rm -rf "$TREE" && mkdir -p "$TREE/kvstore"
ln -s "$PWD"/kvstore/*.py "$PWD"/kvstore/py.typed "$TREE/kvstore/"
for d in wire tiers client protos kernels inference_adapter; do ln -s "$PWD/$d" "$TREE/kvstore/$d"; done
ln -s "$PWD/benchmarks" "$TREE/"
export PYTHONPATH="$TREE${SITE:+:$SITE}"

# Every module the checks import, from where it will come: a missing one fails here, by name.
"$PY" -P - <<'EOF' | tee "$OUT/device.txt"
import importlib, sys
import torch
names = ["kvstore.inference_adapter", "kvstore.tiers", "lz4", "redis", "grpc", "grpc_health",
         "google.protobuf", "platformdirs", "pytest", "pytest_asyncio", "pytest_timeout",
         "hypothesis", "xxhash", "uvloop", "aiofiles", "gguf", "yaml", "prometheus_client"]
missing = []
for name in names:
    try:
        print(f"{name}: {importlib.import_module(name).__file__}")
    except ImportError as error:
        missing.append(f"{name} ({error})")
cuda = torch.cuda.is_available()
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", cuda,
      torch.cuda.get_device_name() if cuda else "")
if missing:
    sys.exit("gpu_check: cannot import " + ", ".join(missing)
             + " (make gpu-wheels where PyPI is reachable, then carry build/gpu-wheels)")
EOF

status=0
timeout 300 "$PY" -P -m pytest -p no:cacheprovider -m gpu -rs -q tests 2>&1 \
    | tee "$OUT/gpu-tests.txt" || status=1
KVSTORE_TEST_DEVICE=$DEVICE timeout 120 "$PY" -P -m pytest -p no:cacheprovider -q \
    tests/inference_adapter/vllm/test_layout.py 2>&1 | tee "$OUT/layout-$DEVICE.txt" || status=1
if [ "$DEVICE" = cuda ]; then
    timeout 240 "$PY" -P -m benchmarks.kernels --device cuda 2>&1 | tee "$OUT/kernels.txt" \
        || status=1
    for model in 1b 8b; do
        timeout 200 "$PY" -P -m kvstore bench gpu --model "$model" \
            --json "$OUT/bench-gpu-$model.json" 2>&1 | tee "$OUT/bench-gpu-$model.txt" || status=1
    done
    # One page per block against the default 256 tokens: what the block size costs the load.
    timeout 150 "$PY" -P -m kvstore bench gpu --model 1b --block-tokens 16 --prompts 2048,8192 \
        --json "$OUT/bench-gpu-1b-16.json" 2>&1 | tee "$OUT/bench-gpu-1b-16.txt" || status=1
else
    timeout 180 "$PY" -P -m benchmarks.kernels --device cpu --size small --repeats 1 \
        2>&1 | tee "$OUT/kernels.txt" || status=1
    timeout 180 "$PY" -P -m kvstore bench gpu --model test --dtype float32 --prompts 64,128 \
        --block-tokens 16 --page-tokens 16 --repeats 1 --json "$OUT/bench-gpu-test.json" \
        2>&1 | tee "$OUT/bench-gpu-test.txt" || status=1
fi
echo "gpu_check: exit $status; logs in $OUT"
exit $status
