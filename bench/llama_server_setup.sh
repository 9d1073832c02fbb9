#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for the peer benchmark (bench/peers.py, bench/cpu_speed.py).
#
# Why this shape: the llama.cpp sources come from the `llama-cpp-python` sdist on PyPI (the
# only registry of C++ sources this workplace reaches), pinned by version; only the server
# target is built, Release, CPU only, into the git-ignored bench/out/. This is a benchmark
# set-up step: the server never builds or runs llama.cpp. Idempotent: an existing binary is
# kept unless FORCE=1.
#
# Usage: bench/llama_server_setup.sh            (or: make bench-peers-setup)
# Env:   LLAMA_CPP_PYTHON_VERSION (default below), PYTHON (default .venv/bin/python),
#        JOBS (default nproc), FORCE=1 to rebuild,
#        TARGETS (default "llama-server"; e.g. "llama-server llama-quantize"): each target's
#        binary is copied into bench/out/llama.cpp/bin/. The logits comparison
#        (tests/test_gguf_vs_llamacpp.py) needs only llama-server: /completion with n_probs.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-$(nproc)}"
OUT="$ROOT/bench/out/llama.cpp"
SRC="$OUT/src-$VERSION"
BUILD="$OUT/build-$VERSION"
BIN="$OUT/bin/llama-server"
TARGETS="${TARGETS:-llama-server}"

missing=0
for t in $TARGETS; do [ -x "$OUT/bin/$t" ] || missing=1; done
if [ "$missing" = 0 ] && [ "${FORCE:-0}" != 1 ]; then
  echo "already built in $OUT/bin: $TARGETS ($("$BIN" --version 2>&1 | head -1))"
  exit 0
fi

mkdir -p "$OUT/dl" "$OUT/bin"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
  "$PYTHON" -m pip download -q --no-binary :all: --no-deps -d "$OUT/dl" \
    "llama-cpp-python==$VERSION"
  rm -rf "$SRC" "$OUT/unpack"
  mkdir -p "$OUT/unpack"
  tar -xzf "$OUT/dl/llama_cpp_python-$VERSION.tar.gz" -C "$OUT/unpack"
  mv "$OUT/unpack/llama_cpp_python-$VERSION" "$SRC"
  rmdir "$OUT/unpack"
fi

# cmake: the system's if present, else PyPI's wheel (ships a static binary).
CMAKE="$(command -v cmake || true)"
if [ -z "$CMAKE" ]; then
  "$PYTHON" -m pip install -q cmake
  CMAKE="$(dirname "$PYTHON")/cmake"
fi
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi

# GGML_NATIVE: tune for this CPU, as a llama.cpp user on this machine would.
# No CURL (model download), no tests/examples beyond the server, CPU backend only.
# Without AMX: on the Xeon VM the benchmarks run on (amx_int8 in its flags), -march=native
# compiles ggml's AMX path, and every model with a Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K matrix
# crashed at warm-up (SIGSEGV in ggml_backend_amx_mul_mat; `--no-repack`, which skips the
# AMX and repacked buffers, ran). GCC's explicit -mno-* flags win over -march=native, so the
# AVX-512 (VNNI, BF16) kernels and the repacked layouts stay.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"$CMAKE" -S "$SRC/vendor/llama.cpp" -B "$BUILD" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF
# shellcheck disable=SC2086  # TARGETS is a space-separated list on purpose
"$CMAKE" --build "$BUILD" --target $TARGETS -j "$JOBS"

for t in $TARGETS; do
  # copy then rename: a running copy of the old binary keeps its file
  cp "$(find "$BUILD" -type f -name "$t" -perm -u+x | head -1)" "$OUT/bin/$t.new"
  mv -f "$OUT/bin/$t.new" "$OUT/bin/$t"
  echo "built $OUT/bin/$t"
done
"$BIN" --version 2>&1 | head -1 || true
