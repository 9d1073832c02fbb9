"""Tiny random-weight gemma3 (sliding-window layers) served segmented vs mlx-lm's own caches.

Prints prefill and decode tok/s for stock (RotatingKVCache on the local layers, KVCache on
the global one) and for segmented caches with the composed and the fused CPU routes, and
checks their greedy tokens agree. Usage: `python -m bench.window_gemma3 [PROMPT] [REPS]`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models import gemma3_text

from segserve.kernels.factory import ComposedRoute
from segserve.kernels.fused_cpu import FusedCpuRoute
from segserve.kernels.hook import install, layer_windows
from segserve.kv.segmented import SegmentedCache
from segserve.server.runner import logits_last

DECODE = 64


def _run(model: Any, name: str, caches: list[Any], prompt: list[int], seg: SegmentedCache | None) -> list[int]:
    t0 = time.perf_counter()
    logits = logits_last(model, prompt, caches)
    mx.eval(logits)
    t1 = time.perf_counter()
    if seg is not None:
        seg.record_tokens(prompt)
        seg.seal()  # the turn boundary: the prompt becomes a segment
    toks: list[int] = []
    for _ in range(DECODE):
        tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
        toks.append(tok)
        logits = logits_last(model, [tok], caches)
        mx.eval(logits)
        if seg is not None:
            seg.record_tokens([tok])
    t2 = time.perf_counter()
    print(f"{name:10s} prefill {len(prompt) / (t1 - t0):8.1f} tok/s  decode {DECODE / (t2 - t1):7.1f} tok/s")
    return toks


def main(argv: list[str]) -> None:
    n_prompt = int(argv[0]) if argv else 1536
    reps = int(argv[1]) if len(argv) > 1 else 2
    mx.random.seed(0)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=256, num_hidden_layers=6, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=4096,
        sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
    )
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    install(model)
    windows = layer_windows(model)
    assert isinstance(windows, tuple), windows
    prompt = [(11 * i) % 4000 + 1 for i in range(n_prompt)]
    for _ in range(reps):
        want = _run(model, "stock", model.make_cache(), prompt, None)
        for route in (ComposedRoute(), FusedCpuRoute()):
            seg = SegmentedCache(args.num_hidden_layers, route=route, windows=windows)
            got = _run(model, route.name, list(seg.layers), prompt, seg)
            assert got == want, f"{route.name}: greedy tokens differ from stock"


if __name__ == "__main__":
    main(sys.argv[1:])
