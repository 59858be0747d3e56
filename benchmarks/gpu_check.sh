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
# Then, most owed first, each step's output in OUT/STEP.txt:
#   1. kvstore bench hit --device cuda: a store hit's fixed cost and phases, 256 to 8K tokens,
#      against a copy_ of its bytes and a Health round trip (bench-hit.json);
#   2. kvstore bench gpu --model 1b: TTFT of a store hit and a miss against recomputing (prompts
#      2K-32K), load and save rates against the host link's (bench-gpu-1b.json);
#   3. python -m benchmarks.writers: saves on a machine with cores to spare (the 2-core VM
#      shares two vCPUs between the copy, its checksum and the daemon): put and get against
#      copy_, the daemon's CPU per GiB put, 1/2/4 writer processes (writers.json);
#   4. pytest -m gpu: the kernels at Llama-3-8B-like sizes against their torch references,
#      the client's CUDA tensors and pinned arena, and the vLLM connector's worker on CUDA
#      tensors in the packed and split (NHD, HND) layouts against a real daemon;
#   5. python -m benchmarks.kernels --device cuda: kernel throughput against copy_ and SDPA,
#      and the tuners' picks per shape (kernels.json, "chosen");
#   6. kvstore bench chat --device cuda --preset quick --workloads sharegpt --no-sweep, with
#      the HBM level: the engine's pool keeping none, one or all sessions' pages against host
#      loads (chat-hbm/chat.json, "hbm"; turns whose tokens differ from recompute's on the
#      device are counted in its "about", not fatal). Kernel tuning is off there
#      (KVSTORE_KERNEL_TUNING=0): each new shape of its turns would otherwise compile and time
#      every candidate inside a timed turn;
#   7. kvstore bench gpu --model 8b, then 1b with 16-token blocks (prompts 2K, 8K);
#   8. the layout unit tests again, on CUDA tensors (KVSTORE_TEST_DEVICE=cuda).
#
# Budget: 9 minutes on one H200 (GPU_CHECK_BUDGET_S, default 540, counted from the start):
# each step has a timeout of its cap or of what is left, whichever is less, and a step with
# under 30 s left is not started; a failed step does not stop the others, and the exit status
# says whether any failed or was cut. Caps, and expected times (the 2026-12-04 run: setup
# ~10 s, pytest -m gpu 65 s; the rest estimated): bench hit 120 s (~45), bench gpu 1b 180
# (~75), writers 90 (~30), pytest -m gpu 180 (~70), kernels 120 (~45), bench chat 150 (~90), bench gpu 8b 180
# (~90), 1b with 16-token blocks 120 (~45), layout 60 (~15); OUT/steps.txt records each
# step's exit status and seconds, for the next budget.
# GPU_CHECK_ALLOW_CPU=1 runs the same plumbing without CUDA on toy sizes (the gpu tests then
# skip; bench gpu runs its test model; bench hit 3 hits of 256 tokens; bench chat the smoke
# preset; no 8B and no 16-token rerun).
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

BUDGET=${GPU_CHECK_BUDGET_S:-540}
status=0
printf '| step | exit | seconds | cap s |\n|---|---:|---:|---:|\n' > "$OUT/steps.txt"

# step NAME CAP_S COMMAND...: runs COMMAND, its output to OUT/NAME.txt, under a timeout of
# CAP_S or what is left of BUDGET; a failure (124: timed out) sets status and goes on.
step() {
    local name=$1 cap=$2 left=$((BUDGET - SECONDS)) start=$SECONDS rc=0
    shift 2
    if [ "$left" -lt 30 ]; then
        echo "gpu_check: $name not run: ${left} s of the ${BUDGET} s budget left" \
            | tee "$OUT/$name.txt"
        echo "| $name | not run | 0 | $cap |" >> "$OUT/steps.txt"
        status=1
        return 0
    fi
    echo "gpu_check: $name ($((cap < left ? cap : left)) s at most)"
    timeout -k 10 "$((cap < left ? cap : left))" "$@" 2>&1 | tee "$OUT/$name.txt" || rc=$?
    echo "| $name | $rc | $((SECONDS - start)) | $cap |" >> "$OUT/steps.txt"
    [ "$rc" = 0 ] || status=1
}

if [ "$DEVICE" = cuda ]; then
    hit=(--device cuda)  # 256, 2K and 8K tokens; 20 cold hits, 40 warm; 1 and 4 at once
    gpu=1b gpu_args=(--model 1b)
    kernels=(--device cuda)
    writers=()  # 512 KiB and 8 MiB blocks, 256 MiB each; 1, 2 and 4 writers
    chat=quick
else
    hit=(--device cpu --tokens 256 --cold 3 --hits 3 --concurrent 1)
    gpu=test gpu_args=(--model test --dtype float32 --prompts 64,128 --block-tokens 16
        --page-tokens 16 --repeats 1)
    kernels=(--device cpu --size small --repeats 1)
    writers=(--sizes 64KiB --total 1MiB --writers 1,2 --writer-bytes 1MiB --writer-block 64KiB
        --rounds 1)
    chat=smoke
fi

step bench-hit 120 "$PY" -P -m kvstore bench hit "${hit[@]}" --json "$OUT/bench-hit.json"
step "bench-gpu-$gpu" 180 "$PY" -P -m kvstore bench gpu "${gpu_args[@]}" \
    --json "$OUT/bench-gpu-$gpu.json"
step writers 90 "$PY" -P -m benchmarks.writers ${writers[@]+"${writers[@]}"} \
    --json "$OUT/writers.json"
step gpu-tests 180 "$PY" -P -m pytest -p no:cacheprovider -m gpu -rs -q tests
step kernels 120 "$PY" -P -m benchmarks.kernels "${kernels[@]}" --json "$OUT/kernels.json"
step chat-hbm 150 env KVSTORE_KERNEL_TUNING=0 "$PY" -P -m kvstore bench chat --device "$DEVICE" \
    --preset "$chat" --workloads sharegpt --no-sweep --hbm --no-plots --out "$OUT/chat-hbm" \
    --dir "$BUILD/chat-scratch"
if [ "$DEVICE" = cuda ]; then
    step bench-gpu-8b 180 "$PY" -P -m kvstore bench gpu --model 8b \
        --json "$OUT/bench-gpu-8b.json"
    # One page per block against the default 256 tokens: what the block size costs the load.
    step bench-gpu-1b-16 120 "$PY" -P -m kvstore bench gpu --model 1b --block-tokens 16 \
        --prompts 2048,8192 --json "$OUT/bench-gpu-1b-16.json"
fi
step "layout-$DEVICE" 60 env KVSTORE_TEST_DEVICE="$DEVICE" "$PY" -P -m pytest \
    -p no:cacheprovider -q tests/inference_adapter/vllm/test_layout.py
cat "$OUT/steps.txt"
echo "gpu_check: exit $status in $SECONDS s; logs in $OUT"
exit $status
