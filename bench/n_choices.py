"""`n` choices in one request (forks of one prefilled prompt) vs n separate requests.

The requirement: "memory above start and wall time for n = 1, 2, 4, 8 in one request vs n
separate requests with the same prompt (sequential and/or concurrent), on the embedded
model, a prompt of ~1000 tokens and ~32 new tokens".

How: one in-process engine built by the server's own factory (segmented mode, the
server's attention route, a RAM-only session bank), EOS off so every choice decodes exactly
`--max-tokens` tokens. For each n, three ways, each on a fresh salt (nothing reused from an
earlier measurement):
  one         - one request with `n` choices: one prefill, n forks decoded together;
  sequential  - n requests with the same prompt, one after another (the 2nd..nth reuse the
                prompt's rows the 1st stored in the bank: what a client looping gets);
  concurrent  - n requests with the same prompt submitted together (each prefills the
                prompt: none is stored yet when they start).
Sampling: temperature 0.8 with seed S for choice i = S + i, and seed S + i for the i-th
separate request, so the tokens can be compared (`tokens_match`: choice i == request i;
batched floats may differ from lone ones in the last bits, so a mismatch is reported, not
fatal). Measured: wall time submit -> last `Done`, and MLX's peak memory above the active
memory at the start (`gc` + `mx.reset_peak_memory()` first); `held_after_bytes` is what
stays allocated once all ended (the bank's stored turns).

Noisy: the CPU machines have 2 cores and are shared; compare within one run (the ratios
`one_over_*` are computed from the same run).

Run (embedded model):
    python bench/n_choices.py --json-out bench/results/n_choices.json
Smoke (random tiny llama): python bench/n_choices.py --model tiny --prompt-tokens 64 --max-tokens 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.common import (  # noqa: E402
    MODELS,
    BenchError,
    bank_store,
    bench_route,
    emit_json,
    exit_now,
    load_bench_model,
    log,
    model_info,
    new_conversation,
    start_engine,
)
from segserve.server.engine import Done, Engine, Failed, GenerationRequest, RequestHandle, Token  # noqa: E402
from segserve.server.runner import SamplingParams  # noqa: E402

SEED = 1000
TIMEOUT_S = 1800.0


def _request(rid: str, prompt: Sequence[int], max_tokens: int, seed: int, salt: str, n: int = 1) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), max_tokens, SamplingParams(temperature=0.8, seed=seed),
                             salt=salt, n=n)


def measure(engine: Engine, waves: Sequence[Sequence[GenerationRequest]]) -> dict[str, Any]:
    """Run the waves one after another (the requests of a wave together); tokens per
    (request, choice) in submission order, wall time and memory above the start."""

    async def wave(reqs: Sequence[GenerationRequest]) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(r, loop) for r in reqs]
        for h in handles:
            engine.submit(h)
        out: list[list[int]] = []
        for h in handles:
            tokens: dict[int, list[int]] = {i: [] for i in range(h.request.n)}
            ended = 0
            while ended < h.request.n:
                ev = await asyncio.wait_for(h.queue.get(), TIMEOUT_S)
                if isinstance(ev, Token):
                    tokens[ev.index].append(ev.token_id)
                elif isinstance(ev, Done):
                    ended += 1
                elif isinstance(ev, Failed):
                    raise BenchError(f"{h.request.request_id} failed: {ev.error.message}")
            out += [tokens[i] for i in range(h.request.n)]
        return out

    async def go() -> tuple[list[list[int]], float]:
        t0 = time.perf_counter()
        tokens: list[list[int]] = []
        for reqs in waves:
            tokens += await wave(reqs)
        return tokens, time.perf_counter() - t0

    gc.collect()
    mx.synchronize()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    tokens, wall = asyncio.run(go())
    gc.collect()
    mx.synchronize()
    return {
        "wall_s": round(wall, 3),
        "peak_above_start_bytes": max(0, mx.get_peak_memory() - start),
        "held_after_bytes": mx.get_active_memory() - start,
        "tokens": tokens,
    }


def run_n(engine: Engine, prompt: list[int], n: int, max_tokens: int, modes: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    one = measure(engine, [[_request(f"one-{n}", prompt, max_tokens, SEED, f"one-{n}", n)]])
    out["one"] = one
    for mode in modes if n > 1 else ():
        reqs = [_request(f"{mode}-{n}-{i}", prompt, max_tokens, SEED + i, f"{mode}-{n}") for i in range(n)]
        waves = [[r] for r in reqs] if mode == "sequential" else [reqs]
        out[mode] = measure(engine, waves)
    for mode in modes if n > 1 else ():
        r = out[mode]
        r["tokens_match"] = r["tokens"] == one["tokens"]
        r["one_over_this"] = {
            "wall": round(one["wall_s"] / r["wall_s"], 3),
            "peak": round(one["peak_above_start_bytes"] / max(1, r["peak_above_start_bytes"]), 3),
        }
    for r in out.values():
        r["tokens"] = len(r["tokens"])  # choices/requests answered (the ids are not reported)
    log(f"n={n}: " + ", ".join(f"{m} {r['wall_s']:.1f}s {r['peak_above_start_bytes'] / 2**20:.1f}MiB"
                             for m, r in out.items()))
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="embedded")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ns", default="1,2,4,8")
    p.add_argument("--modes", default="sequential,concurrent")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    ns = [int(x) for x in a.ns.split(",")]
    modes = [m for m in a.modes.split(",") if m]
    if any(m not in ("sequential", "concurrent") for m in modes):
        raise BenchError(f"unknown mode in {a.modes!r}")
    loaded = load_bench_model(a.model)
    route, _ = bench_route(loaded)
    engine = start_engine(loaded, bank_store(loaded, 8 << 30), segmented=True, prefill_chunk=a.prefill_chunk)
    try:
        conv = new_conversation(loaded)
        prompt = conv.prompt(conv.user(a.prompt_tokens, "n-choices"))
        log(f"prompt {len(prompt)} tokens, {a.max_tokens} new per choice, n in {ns}")
        warm = _request("warm", prompt[:32], 2, SEED, "warm")
        measure(engine, [[warm]])  # compiles the decode graphs outside the measurements
        runs = {str(n): run_n(engine, prompt, n, a.max_tokens, modes) for n in ns}
    finally:
        engine.stop()
    report = {
        "bench": "n_choices",
        "model": model_info(loaded, route),
        "prompt_tokens": len(prompt),
        "max_tokens": a.max_tokens,
        "prefill_chunk": a.prefill_chunk,
        "note": "one run on a shared 2-core CPU: wall times are noisy; compare ratios within this run",
        "runs": runs,
    }
    emit_json(report, a.json_out)
    return report


if __name__ == "__main__":
    try:
        main()
    except BenchError as exc:
        log(f"error: {exc}")
        exit_now(1)
    exit_now(0)
