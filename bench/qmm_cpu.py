"""CPU quantized matmul: the extension (kernels/native qmm) vs mx.quantized_matmul vs float32.

Part 1, per shape of the embedded model's linear layers, two GGUF Q6_K shapes (a Q4_K_M
file's down projection and output head), Llama-8B-sized layers, and
rows (1 = decode, 4/16 = batched decode / verify, 512 = prefill): ms per call and GB/s of
weight bytes read (packed weights + scales + biases; float32: 4 bytes per weight) for
  ext   `_segattn.qmm` (every ISA body this CPU runs when --isas all),
  mlx   `mx.quantized_matmul` (MLX's own CPU kernel),
  f32   `x @ Wt`, Wt float32 [K, N] contiguous (BLAS; the served float32 layout).
Weights are cycled over enough copies (>= --cold-bytes) that each call reads from DRAM,
as decode does (98 MB of 4-bit weights per token, over the 48 MB L3); all variants of a
shape run interleaved in one process, so machine noise hits them alike.

Part 2 (--decode-tokens > 0): decode tok/s of the embedded model, each in its own process
(same BLAS preload): float32 + BLAS (the [in,out] layout), MLX q4 (the file's 4-bit
weights through mx.quantized_matmul), extension q4 (`--weights q4`), interleaved over
--repeats; the greedy tokens of the two q4 routes are compared.

    LD_PRELOAD=$(ls /usr/lib/*-linux-gnu/blis-pthread/libblis.so.4|head -1) \
      .venv/bin/python bench/qmm_cpu.py --json-out bench/out/qmm_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# (label, N out, K in, bits, group size)
SMOL_SHAPES = [
    ("smol.q_proj/o_proj", 576, 576, 4, 32),
    ("smol.k_proj/v_proj", 192, 576, 4, 32),
    ("smol.gate/up_proj", 1536, 576, 4, 32),
    ("smol.down_proj", 576, 1536, 4, 32),
    ("smol.lm_head(q8)", 49152, 576, 8, 32),
]
# GGUF Q6_K in its own 256-value blocks (bits 6; what a Q4_K_M file keeps in ffn_down,
# attn_v and the output head): a 28-layer 0.4B shape's down projection and its head.
Q6K_SHAPES = [
    ("q4km.ffn_down(q6k)", 1024, 2816, 6, 16),
    ("q4km.output(q6k)", 49152, 1024, 6, 16),
]
LLAMA8B_SHAPES = [
    ("llama8b.q_proj/o_proj", 4096, 4096, 4, 64),
    ("llama8b.gate/up_proj", 14336, 4096, 4, 64),
    ("llama8b.down_proj", 4096, 14336, 4, 64),
]


def _time_calls(fn: Any, n_copies: int, iters: int) -> float:
    """Seconds per call: `iters` calls cycling over the copies, each evaluated alone."""
    import mlx.core as mx

    mx.eval(fn(0))  # warm-up (allocations, worker start)
    t = time.perf_counter()
    for i in range(iters):
        mx.eval(fn(i % n_copies))
    return (time.perf_counter() - t) / iters


def bench_shapes(rows_list: list[int], cold_bytes: int, isas: list[str], llama: bool, budget_s: float,
                 mlx_max_macs: float = 2e9) -> list[dict[str, Any]]:
    import mlx.core as mx

    from segserve.kernels import qmm_cpu

    ok, why = qmm_cpu.available()
    ext: Any = None
    if ok:
        from segserve.kernels.native import _segattn

        ext = _segattn
        default_isa = ext.qmm_isa()
        supported = list(ext.qmm_supported_isas())
        if isas == ["all"]:
            isas = supported
        isas = [i for i in isas if i in supported] or [default_isa]
    out: list[dict[str, Any]] = []
    shapes = SMOL_SHAPES + Q6K_SHAPES + (LLAMA8B_SHAPES if llama else [])
    mx.random.seed(0)
    for label, n, k, bits, gs in shapes:
        w_f = mx.random.normal((n, k)) * 0.02
        q_bytes = n * k * bits // 8 + 2 * n * (k // gs) * 2  # float16 scales + biases
        if bits == qmm_cpu.Q6K_BITS:  # 210 bytes per 256 values: codes, int8 scales, f16 d
            q_bytes = n * k // 256 * 210
        f_bytes = n * k * 4
        q_copies = max(1, min(64, -(-cold_bytes // q_bytes)))
        f_copies = max(1, min(64, -(-cold_bytes // f_bytes), (2 << 30) // f_bytes))
        qs = []
        for i in range(q_copies):
            if bits == qmm_cpu.Q6K_BITS:
                qs.append(qmm_cpu.random_q6k(n, k, mx.random.key(i)))
                continue
            w, s, b = mx.quantize(w_f + 0.0, group_size=gs, bits=bits)
            qs.append((w, s.astype(mx.float16), b.astype(mx.float16)))
        mx.eval(qs)
        fts = [mx.contiguous(w_f.T) + 0.0 for _ in range(f_copies)]
        mx.eval(fts)
        for rows in rows_list:
            x = mx.random.normal((rows, k))
            mx.eval(x)
            row: dict[str, Any] = {"shape": label, "n": n, "k": k, "bits": bits, "group_size": gs, "rows": rows,
                                   "weight_mb_q": round(q_bytes / 1e6, 2), "weight_mb_f32": round(f_bytes / 1e6, 2)}
            def q_mlx(i: int, x: Any = x, qs: Any = qs, gs: int = gs, bits: int = bits) -> Any:
                w, sc, bi = qs[i]
                return mx.quantized_matmul(x, w, sc, bi, transpose=True, group_size=gs, bits=bits)

            def q_ext(i: int, x: Any = x, qs: Any = qs, gs: int = gs, bits: int = bits) -> Any:
                return ext.qmm(x, *qs[i], gs, bits)

            def f32(i: int, x: Any = x, fts: Any = fts) -> Any:
                return x @ fts[i]

            # iterations: about budget_s per variant, at least 3 (probed on the fastest route)
            probe = _time_calls(q_ext if ext is not None else f32, q_copies if ext is not None else f_copies, 2)
            # MLX's own CPU op runs ~0.25 GMAC/s at 512 rows: minutes on Llama-8B layers.
            run_mlx = rows * n * k <= mlx_max_macs and bits != qmm_cpu.Q6K_BITS  # MLX has no Q6_K op
            iters = max(3, min(400, int(budget_s / max(probe, 1e-6))))
            variants: dict[str, Any] = {}
            for _rep in range(2):  # interleaved twice; best of the two per variant
                if ext is not None:
                    for isa in isas:
                        ext.qmm_set_isa(isa)
                        variants.setdefault(f"ext_{isa}", []).append(_time_calls(q_ext, q_copies, iters))
                    ext.qmm_set_isa(default_isa)
                if run_mlx:
                    variants.setdefault("mlx", []).append(_time_calls(q_mlx, q_copies, max(2, iters // 8)))
                variants.setdefault("f32", []).append(_time_calls(f32, f_copies, iters))
            for name, secs in variants.items():
                sec = min(secs)
                nbytes = f_bytes if name == "f32" else q_bytes
                row[name] = {"ms": round(sec * 1e3, 4), "gb_s": round(nbytes / sec / 1e9, 2),
                             "gflops": round(2 * rows * n * k / sec / 1e9, 2)}
            ext_best = min((v["ms"] for kk, v in row.items() if kk.startswith("ext_")), default=None)
            if not run_mlx:
                row["mlx"] = "no Q6_K op" if bits == qmm_cpu.Q6K_BITS else "skipped (over --mlx-max-macs)"
            if ext_best:
                if run_mlx:
                    row["ext_x_mlx"] = round(row["mlx"]["ms"] / ext_best, 2)
                row["ext_x_f32"] = round(row["f32"]["ms"] / ext_best, 2)
            print(json.dumps(row), file=sys.stderr, flush=True)
            out.append(row)
    return out


DECODE_VARIANTS = {
    "f32_blas": {"weights": "float32", "cpu_layout": "true"},
    "mlx_q4": {"weights": "quantized", "cpu_layout": "false"},
    "ext_q4": {"weights": "q4", "cpu_layout": "true"},
}


def _decode_child(name: str, prompt_tokens: int, decode_tokens: int) -> dict[str, Any]:
    from bench.common import prefill_decode
    from segserve.config.settings import load_settings
    from segserve.server.runner import load_model

    lm = load_model(load_settings(DECODE_VARIANTS[name], environ={}))
    timed = prefill_decode(lm, prompt_tokens, decode_tokens)
    return {"prefill_tok_s": round(timed["prefill_tok_s"], 2), "decode_tok_s": round(timed["decode_tok_s"], 2),
            "weights_bytes": lm.weights_bytes, "quantization": lm.quantization, "tokens": timed["tokens"]}


def bench_decode(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in DECODE_VARIANTS}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEGSERVE_")}
    for rep in range(args.repeats):
        names = list(DECODE_VARIANTS) if rep % 2 == 0 else list(reversed(DECODE_VARIANTS))
        for name in names:
            print(f"[qmm_cpu] decode repeat {rep + 1}: {name}", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--child", name, "--prompt-tokens", str(args.prompt_tokens),
                   "--decode-tokens", str(args.decode_tokens)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
            if proc.returncode != 0:
                runs[name].append({"error": proc.stderr[-1500:]})
            else:
                runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out[name] = {"error": rs[0]["error"] if rs else "not run"}
            continue
        out[name] = {
            "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in ok), 2),
            "prefill_tok_s": round(statistics.median(r["prefill_tok_s"] for r in ok), 2),
            "decode_tok_s_runs": [r["decode_tok_s"] for r in ok],
            "weights_bytes": ok[0]["weights_bytes"],
            "quantization": ok[0]["quantization"],
            "tokens": ok[0]["tokens"],
        }
    if "error" not in out.get("ext_q4", {"error": 1}) and "error" not in out.get("mlx_q4", {"error": 1}):
        out["ext_q4_same_tokens_as_mlx_q4"] = out["ext_q4"]["tokens"] == out["mlx_q4"]["tokens"]
        for base in ("f32_blas", "mlx_q4"):
            if "error" not in out[base]:
                out[f"ext_q4_decode_x_{base}"] = round(out["ext_q4"]["decode_tok_s"] / out[base]["decode_tok_s"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,16,512")
    p.add_argument("--isas", default="avx512,avx2", help="'all', or a comma list (avx512,avx2,generic)")
    p.add_argument("--mlx-max-macs", type=float, default=2e9, help="skip mx.quantized_matmul above this")
    p.add_argument("--cold-bytes", type=int, default=96 << 20)
    p.add_argument("--budget-s", type=float, default=0.15, help="seconds per variant per shape")
    p.add_argument("--no-llama", action="store_true", help="skip the Llama-8B-sized layers")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-shapes", action="store_true")
    p.add_argument("--json-out")
    p.add_argument("--child")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_decode_child(args.child, args.prompt_tokens, args.decode_tokens)))
        return 0
    import mlx.core as mx

    from segserve.kernels import qmm_cpu

    result: dict[str, Any] = {"cpus": os.cpu_count(), "extension": qmm_cpu.available()[1],
                              "ld_preload": os.environ.get("LD_PRELOAD", ""), "mlx": version("mlx")}
    big = mx.ones((64 << 20,))  # 256 MB float32: one reduction = a DRAM read rate reference
    mx.eval(big)
    secs = min(_time_calls(lambda i, big=big: mx.sum(big), 1, 3) for _ in range(3))
    result["read_gb_s_mx_sum_256mb"] = round(big.nbytes / secs / 1e9, 2)
    big = mx.zeros((0,))
    if not args.skip_shapes:
        isas = ["all"] if args.isas == "all" else [s for s in args.isas.split(",") if s]
        result["shapes"] = bench_shapes([int(r) for r in args.rows.split(",")], args.cold_bytes, isas,
                                        not args.no_llama, args.budget_s, args.mlx_max_macs)
    if args.decode_tokens > 0:
        result["decode"] = bench_decode(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
