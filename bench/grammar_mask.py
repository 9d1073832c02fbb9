"""Per-token cost of grammar masking (segserve.server.chat.grammar) next to one decode step.

Prints JSON: for `json_object` and a `json_schema`, the median over N steps of
- `mask_ms`: `GrammarMatcher.mask()` (llguidance bitmask + unpack to a bool mx.array),
- `apply_ms`: `apply_mask` on [vocab] logits, evaluated,
- `accept_ms`: `GrammarMatcher.accept(token)`,
- `total_ms` and `ratio` = total / decode step (goal <= 0.10),
next to `decode_step_ms`: the median of one decode step of the embedded SmolLM2 (weights
as the server loads them on this device: float32 on CPU, quantized elsewhere) through
mlx-lm's llama with a KV cache after a 64-token prompt — `model(token, cache)` + eval, not
the server's fused CPU route, so it is the plain mlx-lm step.

The walk picks the argmax of masked random logits each step, so it stays inside the
grammar; a matcher that finishes is replaced by a fresh one.

Run: .venv/bin/python bench/grammar_mask.py [--steps 300]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from segserve.server.chat.grammar import (  # noqa: E402
    CompiledGrammar,
    GrammarVocab,
    apply_mask,
    compile_response_format,
)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["person", "company"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False,
}


def _modules() -> tuple[Any, Any]:
    return (
        importlib.import_module("segserve.server.runner.gguf"),
        importlib.import_module("segserve.server.runner.tokenizer"),
    )


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 4)


def decode_step_s(gguf: Any, steps: int) -> tuple[float, int]:
    path = gguf.embedded_model_path()
    g = gguf.load_gguf(path, dequantize=mx.default_device() == mx.cpu)
    model = g.model
    cache = make_prompt_cache(model)
    prompt = mx.array([[(i * 37) % 1000 + 100 for i in range(64)]])
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    tok = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(tok, cache=cache)
        tok = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)
        mx.eval(tok)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), int(logits.shape[-1])


def mask_costs(grammar: CompiledGrammar, vocab_size: int, steps: int) -> dict[str, float]:
    mask_t: list[float] = []
    apply_t: list[float] = []
    accept_t: list[float] = []
    m = grammar.matcher()
    key = mx.random.key(0)
    for _ in range(steps):
        if m.is_finished():
            m = grammar.matcher()
        key, sub = mx.random.split(key)
        logits = mx.random.normal((vocab_size,), key=sub)
        mx.eval(logits)
        t0 = time.perf_counter()
        mask = m.mask()
        t1 = time.perf_counter()
        masked = apply_mask(logits, mask)
        mx.eval(masked)
        t2 = time.perf_counter()
        token = int(mx.argmax(masked).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
        t3 = time.perf_counter()
        assert m.accept(token), m.error
        t4 = time.perf_counter()
        mask_t.append(t1 - t0)
        apply_t.append(t2 - t1)
        accept_t.append(t4 - t3)
    total = [a + b + c for a, b, c in zip(mask_t, apply_t, accept_t, strict=True)]
    return {
        "mask_ms": _ms(mask_t),
        "apply_ms": _ms(apply_t),
        "accept_ms": _ms(accept_t),
        "total_ms": _ms(total),
        "total_p90_ms": round(sorted(total)[int(0.9 * len(total))] * 1000, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    gguf, tokmod = _modules()
    _, meta = mx.load(str(gguf.embedded_model_path()), return_metadata=True)
    chat, tok = tokmod.from_gguf_metadata(meta)
    step_s, logits_width = decode_step_s(gguf, max(20, args.steps // 5))
    t0 = time.perf_counter()
    vocab = GrammarVocab.from_tokenizer(tok, vocab_size=logits_width, eos_ids=chat.eos_ids)
    vocab_build_s = time.perf_counter() - t0
    out: dict[str, Any] = {
        "device": str(mx.default_device()),
        "vocab_size": logits_width,
        "steps": args.steps,
        "decode_step_ms": round(step_s * 1000, 3),
        "grammar_vocab_build_s": round(vocab_build_s, 3),
        "formats": {},
    }
    formats: dict[str, dict[str, Any]] = {
        "json_object": {"type": "json_object"},
        "json_schema": {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": SCHEMA, "strict": True},
        },
    }
    for name, rf in formats.items():
        t0 = time.perf_counter()
        g = compile_response_format(rf, vocab)
        compile_ms = (time.perf_counter() - t0) * 1000
        assert g is not None
        costs = mask_costs(g, logits_width, args.steps)
        costs["compile_ms"] = round(compile_ms, 3)
        costs["ratio"] = round(costs["total_ms"] / (step_s * 1000), 4)
        out["formats"][name] = costs
    out["goal_ratio"] = 0.10
    out["meets_goal"] = all(f["ratio"] <= 0.10 for f in out["formats"].values())
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
