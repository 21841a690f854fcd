# Two entry points on a fresh machine:  `make quickstart`  and  `make test`.
# Both create .venv and install what they need into it.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# C++ ops that DeepSpeed builds on first use are cached per virtualenv.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
# No GPU here: DeepSpeed's CPU accelerator. A machine with CUDA keeps its default.
ifeq ($(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu),)
export DS_ACCELERATOR ?= cpu
endif

.PHONY: quickstart test test-all install lint format clean gpu-check gpu-wheels cluster-deps harness-deps

quickstart: $(VENV)/.installed
	$(BIN)/allattn-pipe run configs/quickstart.yaml

# The tiers (tests/conftest.py): `make test` runs unit + integration, a few minutes on 2 cores,
# the loop to run while working; `make test-all` adds the system tier (Slurm, several
# processes, kill -9, the fuzz campaigns, the quickstart's figures, the docs build): about 25
# minutes, what CI runs. DURATIONS=N prints the N slowest tests.
# WORKERS test processes (pytest-xdist; 0: one process), each taking whole files, so that a
# file's module fixtures (the real Slurm cluster) are built once: most tests wait on a child
# process or a clock on one core, and two at a time keep both of CI's 2 cores busy. Files are
# handed out in collection order (tests/conftest.py puts the longest first), not xdist's
# most-tests-first, which once left the quickstart figures file (then 13 minutes) to run last, alone.
WORKERS ?= 2
FAST_TIERS := -m "not system" tests/test_architecture.py tests/unit tests/integration
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder \
	$(if $(DURATIONS),--durations=$(DURATIONS))
test: $(VENV)/.installed
	$(PYTEST) $(FAST_TIERS)

test-all: $(VENV)/.installed
	$(PYTEST)

install: $(VENV)/.installed

# The house rules (pyproject.toml: [tool.ruff], [tool.mypy]); CI runs `make lint` before the
# tests. Every check runs, then any finding fails the target. `make format` fixes what the
# tools can fix by themselves; the rest is by hand. pre-commit is optional: `pre-commit install`
# runs the same tools, from .venv, on each commit (.pre-commit-config.yaml).
lint: $(VENV)/.lint-installed
	@status=0; \
	$(BIN)/ruff check . || status=1; \
	$(BIN)/ruff format --check . || status=1; \
	$(BIN)/mypy || status=1; \
	exit $$status

format: $(VENV)/.lint-installed
	$(BIN)/ruff check --fix --exit-zero .   # what is left is listed, for a hand fix
	$(BIN)/ruff format .

# The pinned linters of the `lint` extra, beside what .installed put there.
$(VENV)/.lint-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[test,lint]"
	touch $@

# The GPU check (gpu/check.py): the CUDA tests and the GPU benchmarks, one report.
# It runs under the interpreter that has the machine's torch: the project's .venv where there
# is one, else $(PYTHON) (a GPU machine with its own CUDA torch and no network). Give the
# wheels of what that machine lacks with WHEELS=DIR. Without a GPU: a dry run, exit 0.
CHECK_PYTHON = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
# REFERENCE=DIR: a checkout of the authors' code (facebookresearch/adaptive-span), timed beside
# ours. One call runs the essentials (install, nan, the CUDA tests, the learning check, the
# step, the op alone) within 9 minutes on an H100/H200 (each part has its budget) and ends
# with the command of the second call for the rest: PARTS=a,b,... (or all) runs those parts.
gpu-check:
	$(CHECK_PYTHON) -m gpu.check $(if $(WHEELS),--wheels $(WHEELS)) \
	    $(if $(REFERENCE),--reference-code $(REFERENCE)) $(if $(PARTS),--parts $(PARTS)) \
	    --report gpu-check.md

# The wheels a GPU image with torch, click, pyyaml, numpy, sentencepiece, psutil, matplotlib
# and safetensors lacks (deepspeed built here, pydantic, mlflow-skinny + the sqlite store's
# needs, webdataset, ...), for CPython 3.12 manylinux x86_64, into gpu-wheels/ (git-ignored);
# fails over 60 MB (GPU_WHEELS=DIR for another folder). DRY_RUN=1 resolves and lists them
# (pip's metadata only), downloads and builds nothing.
GPU_WHEELS ?= gpu-wheels
gpu-wheels: $(VENV)/.installed
	$(BIN)/python -m gpu.wheels --dest $(GPU_WHEELS) $(if $(DRY_RUN),--dry-run)

# Debian's Slurm and munge for tests/system/cluster/test_cluster.py (a real two-node Slurm in network
# namespaces); as root. Without them those tests skip, naming what is missing.
cluster-deps:
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null

# lm-evaluation-harness (the `harness` extra) for tests/system/commands/test_lm_eval.py, which
# .ci/run installs; `make test` never needs it (the test is in the system tier).
harness-deps: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[harness]"

# torch: an interpreter that already has torch (a cluster's CUDA build) lends it to the venv;
# with an NVIDIA GPU and no torch, pip picks its default (CUDA) build; otherwise the CPU
# wheel 2.13.0. We never replace a torch that is already there.
$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "using the torch of $(PYTHON)"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	    $(PYTHON) -m venv $(VENV); \
	    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	        $(BIN)/pip install --quiet "torch>=2.4"; \
	    else \
	        $(BIN)/pip install --quiet torch==2.13.0; \
	    fi; \
	fi
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) runs
