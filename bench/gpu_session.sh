#!/usr/bin/env bash
# The GPU figures (segments at no cost, fused kernels) in one session on a CUDA machine
# (H200 through MLX's CUDA backend).
#
# Runs after MLX's CUDA backend is installed (`pip install mlx-cuda-13` or wheels carried in;
# PYTHONPATH must hold the installed wheels and the repo).
# The device image also lacks llguidance, which `segserve.server.runtime` (so bench/common.py and the
# engine tests) imports: carry its wheel too (`pip download llguidance` for cp312
# manylinux_2_28 into an ignored folder, then `pip install --target $HOME/site` there).
# Each stage writes its log / JSON under $OUT (default bench/out/gpu) and has its own time
# limit, so a slow stage never loses the results of the others.
#
#   bash bench/gpu_session.sh tests kernels zero_cost_wide zero_cost_narrow
#
# Stages:
#   tests             GPU tests (TESTS_K: a pytest -k filter, e.g. "wide or replay"): the
#                     fused kernel (differential vs SDPA, narrow and wide), the engine on the
#                     fused route, admission price vs measured peak (test_gpu_integration;
#                     the device has no embedded-model wheel, so test_admission_peak is not run).
#                     With the paired wide path's cases the fused-kernel file alone needs ~9
#                     minutes on a fresh machine (NVRTC compiles per variant; 388 passed in
#                     543 s): run it alone, or split it with TESTS_K.
#   kernels           bench/kernels_gpu.py --prefill at 8K/32K, 1 and 4 segments: stock SDPA,
#                     composed, fused narrow and fused wide per layer call (L = 1, 8, 256).
#   kernels_wide      prefill chunks only (L = 256) at 8K/32K, 1 and 4 segments: stock SDPA against
#                     the wide path paired (default, 64 / 32 keys per update) and unpaired.
#   breakdown         bench/gpu_peak_breakdown.py at 8K/32K/128K: one follow-up turn phase by
#                     phase (tail, chunks, seals, decode), pacing variants and stock (~160 s).
#   zero_cost_wide    bench/zero_cost.py --backend gpu at 8K/32K/128K (the defaults: wide
#                     prefill path, prefill calls paced to 2; ~200 s).
#   zero_cost_narrow  the same at 8K/32K with the wide path off (SEGSERVE_FUSED_WIDE=0).
#   zero_cost_unpaced the same at 8K/32K with prefill calls unpaced (SEGSERVE_FUSED_INFLIGHT=0).
#   zero_cost_nopipe  the same with one evaluation per forward (SEGSERVE_PIPELINE_LAYERS=0).
#   zero_cost_128k    bench/zero_cost.py --backend gpu at 128K, one repeat, wide on.
set -uo pipefail
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

stage() {  # name limit_s command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name rc=$? $(date +%T)"
    tail -n 25 "$OUT/$name.log"
}

for s in "$@"; do
    case $s in
        tests)
            stage tests 540 $py -m pytest -q -x -p no:cacheprovider tests/test_gpu_integration.py \
                tests/test_fused_cuda.py -k "${TESTS_K:-not nothing}" ;;
        kernels)
            stage kernels 110 $py bench/kernels_gpu.py --prefill --contexts 8192,32768 \
                --segments 1,4 --out "$OUT/kernels_prefill.json" ;;
        kernels_wide)
            stage kernels_wide 150 $py bench/kernels_gpu.py --contexts 8192,32768 --segments 1,4 \
                --windows 256 --routes fused_wide,fused_pair32,fused_wide1 \
                --out "$OUT/kernels_wide.json" ;;
        breakdown)
            stage breakdown 300 $py bench/gpu_peak_breakdown.py --contexts 8192,32768,131072 \
                --json-out "$OUT/gpu_peak_breakdown.json" ;;
        zero_cost_wide)
            stage zero_cost_wide 450 env SEGSERVE_FUSED_WIDE=1 $py bench/zero_cost.py --backend gpu \
                --contexts 8192,32768,131072 --repeats 4 --json-out "$OUT/zero_cost_wide.json" \
                --plot "$OUT/zero_cost_wide.png" ;;
        zero_cost_unpaced)
            stage zero_cost_unpaced 200 env SEGSERVE_FUSED_INFLIGHT=0 $py bench/zero_cost.py \
                --backend gpu --contexts 8192,32768 --json-out "$OUT/zero_cost_unpaced.json" ;;
        zero_cost_narrow)
            stage zero_cost_narrow 300 env SEGSERVE_FUSED_WIDE=0 $py bench/zero_cost.py --backend gpu \
                --contexts 8192,32768 --json-out "$OUT/zero_cost_narrow.json" ;;
        zero_cost_nopipe)
            stage zero_cost_nopipe 200 env SEGSERVE_PIPELINE_LAYERS=0 $py bench/zero_cost.py \
                --backend gpu --contexts 8192,32768 --json-out "$OUT/zero_cost_nopipe.json" ;;
        zero_cost_128k)
            stage zero_cost_128k 120 env SEGSERVE_FUSED_WIDE=1 $py bench/zero_cost.py --backend gpu \
                --contexts 131072 --repeats 1 --json-out "$OUT/zero_cost_128k.json" ;;
        *) echo "unknown stage $s" >&2; exit 2 ;;
    esac
done
