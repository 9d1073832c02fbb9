"""CPU weight layout transform: same logits/greedy tokens as the plain model."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from segserve.server.runner import logits_last, model_shape
from segserve.server.runner.cpu_layout import FusedPart, TransposedLinear, apply_cpu_layout
from tests.conftest import make_tiny_model


def _greedy(model: object, n: int = 8) -> tuple[list[int], mx.array]:
    cache = [KVCache() for _ in range(2)]
    logits = logits_last(model, list(range(5, 40)), cache)
    first = logits
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
        out.append(tok)
        logits = logits_last(model, [tok], cache)
    return out, first


def _nbytes(params: object) -> int:
    flat = cast(list[tuple[str, mx.array]], tree_flatten(params))  # a list without `destination`
    return sum(v.nbytes for _, v in flat)


def test_layout_and_fusion_keep_greedy_tokens() -> None:
    plain = make_tiny_model(seed=9)
    fast = make_tiny_model(seed=9)
    report = apply_cpu_layout(fast, model_shape(fast))
    assert report.linears == 2 * 7 and report.fused_groups == 2 * 2 and report.tied_head
    attn = fast.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedPart) and isinstance(attn.o_proj, TransposedLinear)
    a_toks, a_logits = _greedy(plain)
    b_toks, b_logits = _greedy(fast)
    assert a_toks == b_toks
    # Same products, another summation order: float32 rounding only.
    assert mx.allclose(a_logits, b_logits, atol=1e-3).item()


def test_parameter_bytes_counted_once() -> None:
    plain = make_tiny_model(seed=1)
    fast = make_tiny_model(seed=1)
    report = apply_cpu_layout(fast, model_shape(fast))
    size = _nbytes(plain.parameters())
    fused = _nbytes(fast.parameters())
    assert fused == size + report.extra_bytes


def test_quantized_models_untouched() -> None:
    import mlx.nn as nn

    m = make_tiny_model(seed=2)
    nn.quantize(m, group_size=32, bits=4)
    report = apply_cpu_layout(m, model_shape(m))
    assert report.linears == 0 and report.fused_groups == 0
