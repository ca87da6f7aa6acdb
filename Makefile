# Two entry points: `make demo` (set up, then train the default model on the embedded corpus)
# and `make test` (set up, then the whole suite). Both work on a fresh clone with only Python + pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CORE := $(VENV)/.fivefold-core
DEV := $(VENV)/.fivefold-dev

.PHONY: setup demo test lint bench clean

# core: what the demo needs (torch, fivefold, matplotlib for the loss curve)
$(CORE): pyproject.toml
	@# --system-site-packages lets a torch the user already installed (a CUDA build) be kept.
	$(PYTHON) -m venv --system-site-packages $(VENV)
	@# Keep a torch the interpreter already has (a user's CUDA build); otherwise take 2.13.0,
	@# which resolves to the local CPU wheel where one is provided.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[plot]"
	touch $@

# dev: the test and lint tools and the HF reference implementation on top
$(DEV): $(CORE)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(DEV)

demo: $(CORE)
	$(VENV)/bin/fivefold demo

test: $(DEV)
	$(PY) -m pytest -q tests

lint: $(DEV)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: $(DEV)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
