# radixkv: `make demo` runs the main job, `make test` runs the test suite.
# Both set everything up on a fresh machine: a .venv, torch (the CPU build 2.13.0 when no
# torch is present), then radixkv with its dev extra.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.radixkv-installed

.PHONY: all setup demo test bench soak clean

all: test

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[dev,dynamo]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m radixkv demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(PY) benchmarks/bench_allocator.py

# Long reliability run: a mixed workload with worker churn for MINUTES, then 1,000 kill cycles.
MINUTES ?= 10
soak: $(STAMP)
	$(PY) benchmarks/soak.py --minutes $(MINUTES)
	RADIXKV_KILL_CYCLES=1000 $(PY) -m pytest -q -s -p no:cacheprovider tests/reliability/test_kill_cycles.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
