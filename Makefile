# `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# The pinned torch. TORCH_INDEX names the index to take it from, e.g. https://download.pytorch.org/whl/cpu
# for the CPU build where the default index serves a CUDA one (plain PyPI on Linux does); GPU users: see
# docs/gpu.md ("Installing").
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lintrans-installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(PY) -m pip install --quiet -e ".[dev]"
	# the fused CPU kernels (C++/OpenMP); without a compiler the PyTorch path runs instead
	$(PY) -m lintrans.ops.native || echo "lintrans: native kernels not built; the PyTorch path will run"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m lintrans demo

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
