# `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# The pinned CPU build of torch; GPU users: see docs/gpu.md ("Installing").
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lintrans-installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
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
