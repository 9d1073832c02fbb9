"""Quantized products on the CPU with 8-bit x (integer dot products) against float x, side
by side in one process, printed as JSON.

Part 1, per layer shape of the families bench's ~0.5B shape (hidden 1024, MLP 2816, 49K
vocabulary) and per weight format the 8-bit-x bodies serve (4-bit and 8-bit affine with
groups of 32, GGUF Q6_K): one row (decode) ms per call and GB/s of weight bytes, `x8` (`--qmm-x8 on`)
and `f32` (`off`), interleaved round-robin over --rounds; weights are cycled over enough
copies (>= --cold-bytes) that every call reads DRAM, as decode does; the largest error of
each against the float64 product, relative to the largest |y|. Then --prefill-rows rows
(prefill: the 8-bit-x GEMM against the float GEMM), ms per call and the speed-up.

Part 2 (--model FILE): one decode step of that model (the engine's batched forward, B = 1,
native layers) under `--qmm-x8 on` and `off`, interleaved, and where the greedy tokens of
--tokens steps part from off's.

Part 3 (--text FILE): the perplexity of --model (default: the embedded model) over the
first --text-tokens tokens of FILE, with and without 8-bit x, fed in pieces of 16 tokens
(decode rows: the dot body) and of 64 (the GEMM), as the quality check of the rounding.

    .venv/bin/python bench/qmm_x8.py --json-out bench/results/qmm_x8_cpu.json \\
        --model /tmp/fam/llama3-Q4_K_M.gguf
    .venv/bin/python bench/qmm_x8.py --skip-products --text /usr/share/common-licenses/GPL-3
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np
from common import cpu_model, emit_json

from segserve.kernels import qmm_cpu
from segserve.kernels.native import _segattn

# (label, N out, K in)
SHAPES = [("q/o_proj", 1024, 1024), ("k/v_proj", 256, 1024), ("gate/up_proj", 2816, 1024),
          ("down_proj", 1024, 2816), ("lm_head", 49152, 1024)]
FORMATS = [("affine4_g32", 4, 32), ("affine8_g32", 8, 32), ("q6_k", qmm_cpu.Q6K_BITS, qmm_cpu.Q6K_GROUP)]


def _weights(n: int, k: int, bits: int, gs: int, key: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    if bits == qmm_cpu.Q6K_BITS:
        return qmm_cpu.random_q6k(n, k, key)
    w, s, b = mx.quantize(mx.random.normal((n, k), key=key) * 0.02, group_size=gs, bits=bits)
    return w, s.astype(mx.float16), b.astype(mx.float16)


def _dense(q: tuple[mx.array, mx.array, mx.array], gs: int, bits: int) -> np.ndarray:
    if bits == qmm_cpu.Q6K_BITS:
        return np.array(qmm_cpu.dequantize_q6k(*q), dtype=np.float64)
    w, s, b = q
    return np.array(mx.dequantize(w, s, b, group_size=gs, bits=bits).astype(mx.float32), dtype=np.float64)


def _product(x: mx.array, q: tuple[mx.array, mx.array, mx.array], gs: int, bits: int) -> mx.array:
    y = _segattn.qmm(x, q[0], q[1], q[2], gs, bits)
    assert y is not None, "the op declined weights it serves"
    return y


def _per_call(q: list[Any], x: mx.array, gs: int, bits: int, iters: int) -> float:
    mx.eval(_product(x, q[0], gs, bits))
    t = time.perf_counter()
    for i in range(iters):
        mx.eval(_product(x, q[i % len(q)], gs, bits))
    return (time.perf_counter() - t) / iters


def bench_products(rounds: int, cold_bytes: int) -> list[dict[str, Any]]:
    rows = []
    for fmt, bits, gs in FORMATS:
        for label, n, k in SHAPES:
            one = _weights(n, k, bits, gs, mx.random.key(0))
            nbytes = sum(a.nbytes for a in one)
            copies = max(1, min(64, -(-cold_bytes // nbytes)))
            q = [one] + [_weights(n, k, bits, gs, mx.random.key(i + 1)) for i in range(copies - 1)]
            mx.eval(q)
            x = mx.random.normal((1, k), key=mx.random.key(99))
            exact = np.array(x, dtype=np.float64) @ _dense(one, gs, bits).T
            iters = max(5, min(400, int(0.05 / max(_per_call(q, x, gs, bits, 2), 1e-6))))
            times: dict[str, list[float]] = {"x8": [], "f32": []}
            err = {}
            for _ in range(rounds):
                for name in times:
                    _segattn.qmm_set_x8("on" if name == "x8" else "off")
                    times[name].append(_per_call(q, x, gs, bits, iters))
                    y = np.array(_product(x, one, gs, bits), dtype=np.float64)
                    err[name] = float(np.abs(y - exact).max() / np.abs(exact).max())
            _segattn.qmm_set_x8("auto")
            row: dict[str, Any] = {"format": fmt, "shape": label, "n": n, "k": k, "weight_mb": round(nbytes / 1e6, 2)}
            for name, secs in times.items():
                sec = statistics.median(secs)
                row[name] = {"ms": round(sec * 1e3, 4), "gb_s": round(nbytes / sec / 1e9, 2),
                             "max_rel_err": float(f"{err[name]:.3g}")}
            row["x8_speedup"] = round(row["f32"]["ms"] / row["x8"]["ms"], 2)
            print(row, flush=True)
            rows.append(row)
    return rows


def bench_prefill(rounds: int, rows: int) -> list[dict[str, Any]]:
    """`rows` rows per call (the GEMMs), weights and x in cache: compute-bound."""
    out = []
    for fmt, bits, gs in FORMATS:
        for label, n, k in SHAPES[:4]:
            q = _weights(n, k, bits, gs, mx.random.key(0))
            x = mx.random.normal((rows, k), key=mx.random.key(98))
            mx.eval(q, x)
            times: dict[str, list[float]] = {"x8": [], "f32": []}
            for _ in range(rounds):
                for name in times:
                    _segattn.qmm_set_x8("on" if name == "x8" else "off")
                    times[name].append(_per_call([q], x, gs, bits, 5))
            _segattn.qmm_set_x8("auto")
            ms = {name: statistics.median(secs) * 1e3 for name, secs in times.items()}
            row = {"format": fmt, "shape": label, "rows": rows, "n": n, "k": k,
                   "f32_ms": round(ms["f32"], 3), "x8_ms": round(ms["x8"], 3),
                   "x8_speedup": round(ms["f32"] / ms["x8"], 2),
                   "x8_gop_s": round(2 * rows * n * k / ms["x8"] / 1e6, 1)}
            print(row, flush=True)
            out.append(row)
    return out


def perplexity(path: str | None, text_path: str, n_tokens: int) -> dict[str, Any]:
    """Perplexity over the text's first tokens, 8-bit x (`on`) and `off`, per piece size."""
    import math

    from mlx_lm.models.cache import make_prompt_cache

    from segserve.config.settings import load_settings
    from segserve.server.runner import load_model

    lm = load_model(load_settings({"weights": "auto", **({"model": path} if path else {})}, environ={}))
    with open(text_path, encoding="utf-8") as f:
        ids = lm.tokenizer.encode(f.read())[:n_tokens]
    result: dict[str, Any] = {"model": path or "embedded", "weights": lm.quantization, "text": text_path,
                              "tokens": len(ids)}
    for piece in (16, 64):
        ppl = {}
        for mode in ("off", "on"):
            _segattn.qmm_set_x8(mode)
            cache = make_prompt_cache(lm.model)
            nll, count = 0.0, 0
            for i in range(0, len(ids) - 1, piece):
                logits = lm.model(mx.array(ids[i : i + piece])[None], cache=cache)[0].astype(mx.float32)
                target = ids[i + 1 : i + 1 + piece]
                lp = logits[: len(target)] - mx.logsumexp(logits[: len(target)], axis=-1, keepdims=True)
                picked = mx.take_along_axis(lp, mx.array(target)[:, None], axis=-1)
                nll -= float(picked.sum().item())  # type: ignore[arg-type]  # item() of a 0-d float array
                count += len(target)
            ppl[mode] = math.exp(nll / count)
        _segattn.qmm_set_x8("auto")
        result[f"pieces_of_{piece}"] = {"perplexity_off": round(ppl["off"], 4), "perplexity_x8": round(ppl["on"], 4),
                                        "x8_over_off": round(ppl["on"] / ppl["off"], 5)}
        print(piece, result[f"pieces_of_{piece}"], flush=True)
    return result


def bench_model(path: str, rounds: int, tokens: int) -> dict[str, Any]:
    from segserve.config.settings import load_settings
    from segserve.kernels.factory import select_route
    from segserve.kernels.hook import install
    from segserve.kv.segmented import SegmentedCache
    from segserve.server.runner import load_model
    from segserve.server.runner.batched import decode_batch

    settings = load_settings({"model": path, "weights": "auto"}, environ={})
    lm = load_model(settings)
    route = select_route("cpu", head_dim=lm.head_dim, n_q_heads=lm.shape.n_q_heads, n_kv_heads=lm.n_kv_heads,
                         dtype=mx.float32).route
    install(lm.model)

    def greedy(mode: str) -> tuple[list[int], list[float]]:
        _segattn.qmm_set_x8(mode)
        cache = SegmentedCache(lm.num_layers, route=route, dtype=getattr(mx, lm.kv_dtype))
        prompt = [(7 * i) % 1000 + 10 for i in range(256)]
        tok, steps, out = prompt[-1], [], []
        for t in prompt[:-1]:
            mx.eval(decode_batch(lm.decode, [t], [cache.layers]))
            cache.record_tokens([t])
        for _ in range(tokens):
            t0 = time.perf_counter()
            logits = decode_batch(lm.decode, [tok], [cache.layers])
            nxt = mx.argmax(logits, axis=-1)
            mx.eval(nxt)
            steps.append(time.perf_counter() - t0)
            cache.record_tokens([tok])
            tok = int(nxt.item())  # type: ignore[arg-type]  # item() of a 0-d integer array
            out.append(tok)
        return out, steps

    modes = ("on", "off")
    step: dict[str, list[float]] = {m: [] for m in modes}
    tokens_of: dict[str, list[int]] = {}
    for _ in range(rounds):
        for mode in modes:
            toks, secs = greedy(mode)
            step[mode].append(statistics.median(secs))
            tokens_of[mode] = toks
    _segattn.qmm_set_x8("auto")
    ms = {m: statistics.median(step[m]) * 1e3 for m in modes}

    def agree(m: str) -> dict[str, Any]:
        pairs = list(zip(tokens_of[m], tokens_of["off"], strict=True))
        return {"same": sum(a == b for a, b in pairs),
                "first_difference_at": next((i for i, (a, b) in enumerate(pairs) if a != b), None)}

    return {"model": path, "weights": lm.quantization, "step_ms": {m: round(v, 3) for m, v in ms.items()},
            "speedup_vs_off": round(ms["off"] / ms["on"], 3),
            "greedy_tokens": tokens, "greedy_vs_off": agree("on")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold-bytes", type=int, default=96 << 20)
    p.add_argument("--model", help="a GGUF file or mlx-lm directory for the decode step (Part 2)")
    p.add_argument("--tokens", type=int, default=32, help="greedy decode steps per model run")
    p.add_argument("--skip-products", action="store_true")
    p.add_argument("--prefill-rows", type=int, default=256, help="rows of the GEMM part (0: skip it)")
    p.add_argument("--text", help="a text file for the perplexity part (Part 3)")
    p.add_argument("--text-tokens", type=int, default=1024)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    ok, why = qmm_cpu.available()
    if not ok:
        raise SystemExit(f"the CPU extension is not available: {why}")
    report: dict[str, Any] = {"command": "python bench/qmm_x8.py", "machine": cpu_model(),
                              "isa": _segattn.qmm_isa(), "threads": _segattn.qmm_threads()}
    if not args.skip_products:
        report["products"] = bench_products(args.rounds, args.cold_bytes)
        if args.prefill_rows:
            report["prefill_products"] = bench_prefill(args.rounds, args.prefill_rows)
    if args.model:
        report["decode"] = bench_model(args.model, args.rounds, args.tokens)
    if args.text:
        report["perplexity"] = perplexity(args.model, args.text, args.text_tokens)
    emit_json(report, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
