# dtrec developer targets. Everything runs from a local virtual environment in .venv.
#
# Override on other platforms, e.g. a CUDA box:
#   make TORCH_SPEC='torch==2.13.0' FBGEMM_SPEC='fbgemm-gpu==1.8.0' test
# torch must be pinned: on a CPU machine an unpinned `torch` pulls the multi-GB CUDA build.

PYTHON      ?= python3
TORCH_SPEC  ?= torch==2.13.0
FBGEMM_SPEC ?= fbgemm-gpu-cpu==1.8.0
VENV        ?= .venv
NPROC       ?= 4
DEMO_ARGS   ?=
PYTEST_ARGS ?=

PIP   := $(VENV)/bin/pip
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.dtrec-installed

.PHONY: install demo test lint bench-deps bench-deps-install docs docs-deps-install gpu-check clean

install: $(STAMP)

# Re-run only when pyproject.toml changes; pip skips what is already satisfied.
# fbgemm is optional (dtrec falls back to its own kernels), so its failure only warns.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install '$(TORCH_SPEC)'
	$(PIP) install '$(FBGEMM_SPEC)' '$(TORCH_SPEC)' || \
		echo "warning: '$(FBGEMM_SPEC)' failed to install; dtrec will use its torch/Triton kernels"
	$(PIP) install -e '.[dev]' '$(TORCH_SPEC)'
	$(MAKE) bench-deps-install
	$(MAKE) docs-deps-install
	touch $@

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) examples/demo.py $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff, then the layering check (no import cycles, no import against the layer order).
lint: $(STAMP)
	$(VENV)/bin/ruff check dtrec tests benchmarks examples
	$(PY) -m pytest -q tests/test_layering.py

# TorchRec (comparison only: tests against it and benchmarks) must go in with --no-deps:
# its declared deps would replace torch/fbgemm with incompatible builds. Part of every
# install so the TorchRec comparison tests run in CI; a failure only warns (they skip).
bench-deps: $(STAMP)

bench-deps-install:
	$(PIP) install --no-deps torchrec==1.8.0 && \
		$(PIP) install tensordict pyre-extensions iopath matplotlib '$(TORCH_SPEC)' || \
		echo "warning: TorchRec (bench extra) failed to install; TorchRec comparison tests skip"

# The docs site (docs/, mkdocs.yml): MkDocs + Material + the API reference from the
# docstrings (mkdocstrings), built --strict (a broken link fails) into site/. Its tools
# are the `docs` extra, part of every install best effort: a failure only warns, and
# tests/test_docs_site.py (the same strict build, in the test suite) then skips.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-deps-install:
	$(PIP) install -e '.[docs]' '$(TORCH_SPEC)' || \
		echo "warning: the docs extra failed to install; make docs fails, the docs-site test skips"

# Every GPU measure in one command (docs/gpu_check.md): the CUDA test tier (pytest -m gpu
# tests/gpu), gpu_step.py, the kernel-level step profile (gpu_profile.py), a short CUDA
# soak (W=1 NCCL, W=4 gloo on the one GPU), kernels.py and offload.py at GPU sizes; each
# command under its own timeout, the whole under 570 s; every report into
# benchmarks/results/, merged into gpu_check_<card>_<date>.json. Halves:
# GPU_CHECK_ARGS=--skip-step (tier + soak), GPU_CHECK_ARGS=--skip-tests (the benchmarks).
# Uses $(VENV) when it exists, else $(PYTHON) as it is: a GPU image with torch + Triton
# needs no install (pip only if they do not import). No CUDA device: exits 2 with one line
# saying so. Without a GPU: DTREC_CUDA_TIER_DEVICE=cpu ... --smoke (tiny, on CPU).
GPU_CHECK_ARGS ?=
gpu-check:
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m benchmarks.gpu_check \
		--install '$(TORCH_SPEC)' $(GPU_CHECK_ARGS)

clean:
	rm -rf build dist site *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
