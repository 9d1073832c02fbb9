"""Batched vs one-by-one decode (the embedded model, or `--model`): is batching worth keeping?

For B sessions (each with its own segmented cache at `--context` tokens), times one
decode token for all of them done (a) as one batched forward (`segserve.server.runner.batched`) and
(b) as B single-session forwards, interleaved round-robin so machine noise hits both.
Prints JSON: median ms per round, aggregate tokens/s, and the ratio batched/sequential.
Run: `python bench/batch_decode.py --batch 1,2,4,8 --context 512` (`--model FILE` for
another model, e.g. a K-quant GGUF).

`--host`: per B, the median time the host spends building one batched step's graph
(before any op runs) against the whole step: the most that pipelining steps, or fewer
attention calls per layer, can take off a step.

`--steps-ab`: pipelined decode steps against step by step, through the engine (the
`--pipeline-decode-steps` setting) on this device's segmented route (`--model`: another
model, e.g. an 8B directory on a GPU): for each B, B concurrent greedy requests of `--context`
prompt tokens and `--tokens` new ones on an engine with the setting on, then off, `--repeats`
times interleaved; decode tok/s = tokens after the first / (last token - first token), per
request, summed over the B requests; the JSON has the median per mode and the ratio on/off.

`--arrivals N`: time to first token of prompts that arrive while B sessions decode, through
the engine (its default settings: a step runs one prefill chunk beside the decode batch), in
segmented and stock mode (`--kv`), one after the other on the same weights. B greedy requests
of `--context` prompt tokens decode `--tokens` new tokens each; once every one has streamed
its first token, N requests of `--arrival-tokens` prompt tokens arrive one at a time, `--gap`
seconds after the previous one's first token. Per mode: TTFT p50 / p99 / max of the arrivals,
the decoders' aggregate tok/s before the arrivals and while they run, and their longest
token-to-token gap during the arrivals; decoders that ended before the last arrival (too few
`--tokens`) are counted, and such a run is flagged. One arrival before them is not counted
(the first prefill chunk beside a decode batch compiles its kernels). `trace` in each row:
the engine's turns inside the arrivals' window (count, median, the five slowest with the
decode rows and prefill tokens each held) and the longest garbage collection there.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import mlx.core as mx

from segserve.config.settings import load_settings
from segserve.kernels.hook import Route, install
from segserve.kv.segmented import SegmentedCache
from segserve.server.engine import Engine
from segserve.server.runner import LoadedModel, decode_batch, logits_last


def _sessions(lm: LoadedModel, b: int, ctx: int, route: Route) -> list[SegmentedCache]:
    out = []
    for i in range(b):
        cache = SegmentedCache(lm.num_layers, route=route)
        prompt = [(13 * j + i) % 5000 + 10 for j in range(ctx)]
        for s in range(0, ctx, 256):
            mx.eval(logits_last(lm.model, prompt[s : s + 256], cache.layers))
            cache.record_tokens(prompt[s : s + 256])
        cache.seal()
        out.append(cache)
    return out


def _round_batched(lm: LoadedModel, caches: list[SegmentedCache]) -> None:
    mx.eval(decode_batch(lm.decode, [42] * len(caches), [c.layers for c in caches]))
    for c in caches:
        for layer in c.layers:
            layer.trim(1)  # keep the context fixed across repeats


def _round_single(lm: LoadedModel, caches: list[SegmentedCache]) -> None:
    for c in caches:
        mx.eval(logits_last(lm.model, [42], c.layers))
        for layer in c.layers:
            layer.trim(1)


def measure(lm: LoadedModel, b: int, ctx: int, repeats: int, route: Route) -> dict[str, Any]:
    caches = _sessions(lm, b, ctx, route)
    times: dict[str, list[float]] = {"batched": [], "sequential": []}
    fns = {"batched": _round_batched, "sequential": _round_single}
    for fn in fns.values():
        fn(lm, caches)  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn(lm, caches)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "batch": b,
        "round_ms": {k: round(1e3 * v, 2) for k, v in med.items()},
        "aggregate_tok_s": {k: round(b / v, 2) for k, v in med.items()},
        "ratio_time_batched_over_sequential": round(med["batched"] / med["sequential"], 3),
    }


def host_share(lm: LoadedModel, b: int, ctx: int, repeats: int, route: Route) -> dict[str, Any]:
    """How much of a batched decode step is the host building its graph (Python, the
    per-session attention calls) before any op runs: median ms of the build and of the
    whole step (build + evaluation)."""
    caches = _sessions(lm, b, ctx, route)
    build, step = [], []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        logits = decode_batch(lm.decode, [42] * b, [c.layers for c in caches])
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        for c in caches:
            for layer in c.layers:
                layer.trim(1)
        if r:  # the first round compiles
            build.append(t1 - t0)
            step.append(t2 - t0)
    med_b, med_s = statistics.median(build), statistics.median(step)
    return {"batch": b, "build_ms": round(1e3 * med_b, 3), "step_ms": round(1e3 * med_s, 2),
            "build_share": round(med_b / med_s, 3)}


def _started_engine(lm: LoadedModel, route: Route | None, settings: dict[str, str], bank_bytes: int) -> Engine:
    """A fresh engine on `lm` (segmented on `route`, stock without), its own RAM bank of
    `bank_bytes`, started."""
    from segserve.bank import Bank, bank_namespace
    from segserve.server.runtime import make_engine

    ns = bank_namespace(model="bench", revision="r", dtype="f", quantization="q", kv_layout="t",
                        tokenizer="t", chat_template="t")
    eng = make_engine(load_settings(settings, environ={}), lm, Bank(ns, bank_bytes), route=route)
    eng.start()
    return eng


def _engine_run(lm: LoadedModel, route: Route, pipelined: bool, b: int, ctx: int, tokens: int,
                salt: int) -> float:
    """B concurrent greedy requests through a fresh engine; aggregate decode tok/s."""
    import asyncio

    from segserve.server.engine import Done, GenerationRequest, RequestHandle, Token
    from segserve.server.runner import SamplingParams

    eng = _started_engine(lm, route, {"pipeline_decode_steps": "on" if pipelined else "off"}, 1 << 30)
    reqs = [GenerationRequest(f"r{salt}-{i}", tuple((13 * j + 7 * i + salt) % 5000 + 10 for j in range(ctx)),
                              tokens, SamplingParams(temperature=0.0)) for i in range(b)]

    async def one(h: RequestHandle) -> float:
        times: list[float] = []
        while True:
            ev = await asyncio.wait_for(h.queue.get(), 600)
            if isinstance(ev, Token):
                times.append(time.perf_counter())
            elif isinstance(ev, Done):
                return (len(times) - 1) / (times[-1] - times[0])
            elif not hasattr(ev, "prompt_tokens"):  # Failed
                raise RuntimeError(f"request failed: {ev}")

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(r, loop) for r in reqs]
        for h in handles:
            eng.submit(h)
        return list(await asyncio.gather(*(one(h) for h in handles)))

    try:
        return sum(asyncio.run(main()))
    finally:
        eng.stop()


class _TurnTrace:
    """Every engine turn's length and what its step held, and the interpreter's garbage
    collections, for --arrivals: the slowest turns inside the arrivals' window show what a
    stall of every decoder was (a long prefill chunk, a long decode step, or time outside
    the model: admission, the bank, the memory guard, a collection)."""

    def __init__(self, eng: Engine) -> None:
        self.turns: list[dict[str, Any]] = []
        self.collections: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        turn, execute = eng._turn, eng.runner.execute
        step: dict[str, Any] = {}

        def timed_execute(plan: Any) -> Any:
            t = time.perf_counter()
            try:
                return execute(plan)
            finally:
                step.update(execute_s=time.perf_counter() - t, decode_rows=len(plan.decode),
                            prefill_tokens=plan.prefill.tokens if plan.prefill else 0,
                            admitted=len(plan.admitted))

        def timed_turn() -> None:
            step.clear()
            t = time.perf_counter()
            turn()
            self.turns.append({"at": t, "turn_s": time.perf_counter() - t, **step})

        # Instance attributes shadow the methods: the engine thread's loop calls these.
        eng._turn = timed_turn  # type: ignore[method-assign]
        eng.runner.execute = timed_execute  # type: ignore[method-assign]
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.collections.append((self._gc_started, time.perf_counter() - self._gc_started,
                                     int(info.get("generation", -1))))

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def report(self, t0: float, t1: float, slowest: int = 5) -> dict[str, Any]:
        """Turns that started in [t0, t1): how many, their median, the `slowest` with what
        they held (times from t0), and the longest garbage collection in the window."""
        inside = [t for t in self.turns if t0 <= t["at"] < t1]
        worst = sorted(inside, key=lambda t: -t["turn_s"])[:slowest]
        gcs = [c for c in self.collections if t0 <= c[0] < t1]
        return {
            "turns": len(inside),
            "turn_s_median": round(statistics.median(t["turn_s"] for t in inside), 4) if inside else None,
            "slowest_turns": [{k: (round(v - t0, 3) if k == "at" else round(v, 4) if isinstance(v, float) else v)
                               for k, v in t.items()} for t in worst],
            "collections": len(gcs),
            "longest_collection": ({"at": round(gcs_max[0] - t0, 3), "s": round(gcs_max[1], 4),
                                    "generation": gcs_max[2]}
                                   if (gcs_max := max(gcs, key=lambda c: c[1], default=None)) else None),
        }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def arrivals(lm: LoadedModel, route: Route | None, b: int, ctx: int, tokens: int, n: int,
             arrival_tokens: int, gap_s: float) -> dict[str, Any]:
    """TTFT of `n` prompts arriving one at a time while `b` requests decode (see --arrivals)."""
    import asyncio

    from segserve.server.engine import Done, GenerationRequest, RequestHandle, Token
    from segserve.server.runner import SamplingParams

    eng = _started_engine(lm, route, {}, 1 << 34)
    trace = _TurnTrace(eng)

    def prompt(i: int, rows: int) -> tuple[int, ...]:
        return tuple((13 * j + 7 * i) % 5000 + 10 for j in range(rows))

    greedy = SamplingParams(temperature=0.0)
    decoders = [GenerationRequest(f"d{i}", prompt(i, ctx), tokens, greedy) for i in range(b)]
    stamps: list[list[float]] = [[] for _ in range(b)]
    ended: list[float | None] = [None] * b

    async def decode(i: int, h: RequestHandle) -> None:
        while True:
            ev = await h.queue.get()
            if isinstance(ev, Token):
                stamps[i].append(time.perf_counter())
            elif isinstance(ev, Done) or not hasattr(ev, "prompt_tokens"):  # Done or Failed
                ended[i] = time.perf_counter()
                return

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(r, loop) for r in decoders]
        tasks = [asyncio.create_task(decode(i, h)) for i, h in enumerate(handles)]
        for h in handles:
            eng.submit(h)
        while any(not s for s in stamps):  # every decoder past its prefill
            await asyncio.sleep(0.01)
        t_all = time.perf_counter()
        await asyncio.sleep(max(gap_s, 0.5))

        async def arrive(k: int) -> float:
            h = RequestHandle(GenerationRequest(f"a{k}", prompt(1000 + k, arrival_tokens), 2, greedy), loop)
            t0 = time.perf_counter()
            eng.submit(h)
            first = None
            while True:
                ev = await asyncio.wait_for(h.queue.get(), 600)
                if isinstance(ev, Token) and first is None:
                    first = time.perf_counter() - t0
                if isinstance(ev, Done) or not hasattr(ev, "prompt_tokens"):
                    break
            if first is None:
                raise RuntimeError(f"arrival {k} ended without a token: {ev}")
            return first

        # One arrival first, not counted: the first prefill chunk beside a decode batch
        # (kernels compiled for its shapes) is a start-up cost, not a time to first token.
        warm = await arrive(-1)
        await asyncio.sleep(gap_s)
        t_start = time.perf_counter()
        ttft: list[float] = []
        for k in range(n):
            ttft.append(await arrive(k))
            await asyncio.sleep(gap_s)
        t_end = time.perf_counter()
        eng.stop()
        await asyncio.gather(*tasks)

        def count(a: float, e: float) -> int:
            return sum(a <= t < e for s in stamps for t in s)

        gaps = [y - x for s in stamps for x, y in zip(s, s[1:], strict=False) if t_start <= y < t_end]
        early = sum(1 for e in ended if e is not None and e < t_end)
        return {
            "sessions": b, "context": ctx, "arrivals": n, "arrival_tokens": arrival_tokens,
            "ttft_s": {"p50": round(_pct(ttft, 0.5), 4), "p99": round(_pct(ttft, 0.99), 4),
                       "max": round(max(ttft), 4)},
            "warm_up_arrival_ttft_s": round(warm, 4),
            "decode_tok_s_before": round(count(t_all, t_start) / (t_start - t_all), 1),
            "decode_tok_s_during": round(count(t_start, t_end) / (t_end - t_start), 1),
            "longest_token_gap_s": round(max(gaps), 4) if gaps else None,
            "decoders_ended_early": early,
            "valid": early == 0,
            "trace": trace.report(t_start, t_end),
        }

    try:
        return asyncio.run(main())
    finally:
        eng.stop()
        trace.close()


def steps_ab(lm: LoadedModel, route: Route, b: int, ctx: int, tokens: int, repeats: int) -> dict[str, Any]:
    got: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(repeats):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            got[mode].append(_engine_run(lm, route, mode == "on", b, ctx, tokens, salt=r))
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"batch": b, "decode_tok_s": {k: round(v, 2) for k, v in med.items()},
            "runs": {k: [round(x, 2) for x in v] for k, v in got.items()},
            "ratio_on_over_off": round(med["on"] / med["off"], 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps-ab", action="store_true",
                   help="pipelined decode steps on vs off through the engine")
    p.add_argument("--tokens", type=int, default=48, help="--steps-ab: new tokens per request")
    p.add_argument("--arrivals", type=int, default=0,
                   help="TTFT of this many prompts arriving while --batch sessions decode")
    p.add_argument("--arrival-tokens", type=int, default=512, help="--arrivals: prompt tokens of each")
    p.add_argument("--gap", type=float, default=0.2, help="--arrivals: seconds between them")
    p.add_argument("--kv", default="segmented,stock", help="--arrivals: modes, in this order")
    p.add_argument("--host", action="store_true",
                   help="the host's graph-building time per batched step against the step")
    p.add_argument("--model", default=None,
                   help="a model the server can load (default: the embedded one), "
                        "or random:FAMILY:FORMAT for bench/families_gpu.py's random 8B shape")
    args = p.parse_args(argv)
    from pathlib import Path

    from segserve.server.runtime import choose_kv

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.families_gpu import load_spec

    lm = load_spec(args.model)
    verdict, chosen = choose_kv(load_settings({}, environ={}), lm)  # this device's route, self-checked
    if chosen is None:
        raise SystemExit(f"segmented KV unavailable here: {verdict}")
    if args.steps_ab or args.arrivals:
        if args.arrivals:
            rows = []
            for b in args.batch.split(","):
                for kv in args.kv.split(","):
                    row = arrivals(lm, chosen if kv == "segmented" else None, int(b), args.context,
                                   args.tokens, args.arrivals, args.arrival_tokens, args.gap)
                    rows.append({"kv": kv, **row})
                    print(json.dumps(rows[-1]), flush=True, file=sys.stderr)
        else:
            rows = [steps_ab(lm, chosen, int(b), args.context, args.tokens, args.repeats)
                    for b in args.batch.split(",")]
        print(json.dumps({"model": lm.model_id, "weights": lm.quantization, "device": str(mx.default_device()),
                          "context": args.context, "tokens": args.tokens, "rows": rows}, indent=2), flush=True)
        return 0
    install(lm.model)
    bench = host_share if args.host else measure
    rows = [bench(lm, int(b), args.context, args.repeats, chosen) for b in args.batch.split(",")]
    print(json.dumps({"model": lm.model_id, "weights": lm.quantization, "context": args.context, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
