"""Per-token cost of sampling (segserve.server.runner.sampling) on the embedded model's vocabulary.

Prints JSON: for each parameter set, the median (and p90) milliseconds of what the runner
does per row and token outside the forward pass: the logits processors when any is on
(`Sampler.process`, with a 512-token prompt and `--generated` tokens of history), the draw,
and `.item()`; all on random float32 logits of the embedded vocabulary (49,152), evaluated
each step. `floor` is a bare seeded `mx.random.categorical` + `.item()`: the least any
seeded draw costs. Variants run interleaved round-robin so machine noise hits all alike.
Compare the numbers with a decode step (`bench/batch_decode.py`, `bench/profile_decode.py`).

Run: .venv/bin/python bench/sampling_cost.py [--steps 200] [--generated 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from segserve.server.runner.sampling import Sampler, SamplingParams  # noqa: E402

VOCAB = 49152

VARIANTS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "default": SamplingParams(),  # temperature 1, everything else off
    "top_p_0.9": SamplingParams(top_p=0.9),
    "top_k_40": SamplingParams(top_k=40),
    "min_p_0.05": SamplingParams(min_p=0.05),
    "penalties": SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "logit_bias_10": SamplingParams(logit_bias=tuple((i * 97, 2.0) for i in range(10))),
    "all_on": SamplingParams(
        0.8, 0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
        repetition_penalty=1.1, logit_bias=tuple((i * 97, 2.0) for i in range(10)),
    ),
}


def _step_fn(params: SamplingParams, generated: int) -> Callable[[mx.array], int]:
    s = Sampler(params)
    prompt = tuple((13 * j) % 5000 + 10 for j in range(512))
    history = [(7 * j) % 3000 + 20 for j in range(generated)]

    def step(logits: mx.array) -> int:
        x = s.process(logits, prompt, history) if s.processes else logits
        return int(s(x).item())  # type: ignore[arg-type]  # item() of a 0-d integer array

    return step


def _floor_fn() -> Callable[[mx.array], int]:
    key = [mx.random.key(0)]

    def step(logits: mx.array) -> int:
        key[0], sub = mx.random.split(key[0])
        return int(mx.random.categorical(logits, key=sub).item())  # type: ignore[arg-type]

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--generated", type=int, default=256)
    args = ap.parse_args()
    fns = {"floor": _floor_fn()} | {k: _step_fn(p, args.generated) for k, p in VARIANTS.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    key = mx.random.key(1)
    for i in range(args.steps + 5):
        key, sub = mx.random.split(key)
        logits = mx.random.normal((VOCAB,), key=sub) * 3.0
        mx.eval(logits)
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(logits)
            if i >= 5:  # warm-up: compiled filters trace on first use
                times[name].append(time.perf_counter() - t0)
    out = {
        name: {
            "median_ms": round(statistics.median(t) * 1000, 4),
            "p90_ms": round(sorted(t)[int(0.9 * len(t))] * 1000, 4),
        }
        for name, t in times.items()
    }
    print(json.dumps({"vocab": VOCAB, "steps": args.steps, "generated": args.generated,
                      "device": str(mx.default_device()), "per_token": out}, indent=1))


if __name__ == "__main__":
    main()
