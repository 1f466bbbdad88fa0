# Two entry points, each working on a fresh machine with only python3, pip and make:
#   make demo   run the main job on CPU with default settings
#   make test   lint, type-check, check the import layers, test every package, and prove
#               each package builds and passes its tests on its own
# Both bootstrap .venv (CPU torch, every package editable, the dev tools) when needed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PACKAGES := afd-protocol afd-transport-nvshmem afd-transport-cam afd-models afd-vllm
PKG_DIRS := $(addprefix packages/,$(PACKAGES)) tools
EDITABLES := $(foreach d,$(PKG_DIRS),-e $(d)[test])
STAMP := $(VENV)/.afd-installed

.PHONY: demo test lint typecheck layers pytest standalone venv clean soak mutation

venv: $(STAMP)

$(STAMP): pyproject.toml $(foreach d,$(PKG_DIRS),$(d)/pyproject.toml)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=25.1"
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --group dev $(EDITABLES)
	@touch $(STAMP)

# The CPU tests also load the real NVSHMEM host library (unique-id creation needs no
# GPU) and compile the Triton kernels for sm_90 (ptxas ships in the triton wheel; the
# version the GPU host runs); both are large, so only `make test` installs them.
TEST_STAMP := $(VENV)/.afd-test-extras
$(TEST_STAMP): $(STAMP) Makefile
	$(PY) -m pip install --quiet "nvidia-nvshmem-cu13>=3.4" "triton==3.6.0"
	@touch $(TEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/afd run --device cpu

test: lint typecheck layers pytest standalone

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict packages/afd-protocol/src
	MYPYPATH=tools/gpu $(VENV)/bin/mypy $(foreach d,$(filter-out packages/afd-protocol,$(PKG_DIRS)),$(d)/src) tools/dev tools/gpu/summary.py tools/gpu/host_overheads.py tools/gpu/loopback_formats.py tools/gpu/profile_dispatch.py

layers: $(STAMP)
	$(VENV)/bin/lint-imports

pytest: $(TEST_STAMP)
	$(PY) -m pytest -q $(foreach d,$(PKG_DIRS),$(d)/tests)

standalone: $(STAMP)
	$(PY) tools/dev/standalone_check.py $(PKG_DIRS)

# 1,000 uneven requests through `afd run` in every mode (Poisson arrivals, chunked long
# prompts), every rank's memory and file descriptors sampled; `make test` runs a short one.
soak: $(STAMP)
	@mkdir -p build
	$(VENV)/bin/afd soak --json build/soak.json

# Mutation testing of the protocol core and the window endpoints (tens of minutes; not part
# of `make test`): prints the kill rate and every surviving mutant.
mutation:
	bash tools/dev/mutation.sh

clean:
	rm -rf $(VENV) build
