"""A whole decoder layer as one native op (`NativeBlock.layer`) against the same layer as
three (`pre`, the fused CPU route's write-and-attend, `post`).

Per family batched decode serves (tiny random 4-bit models, the CPU's float16 cache on the
fused route, a sealed first turn as a segment, gemma3's windows outgrown, gemma2's soft
cap): one session decoded with the whole-layer op and a twin decoded with three ops give
the same logits and tokens step after step, the same rows in their tails, and the op did
serve every layer it could (a spy counts). Then what the op refuses: arguments that are
not the ops' outputs, pieces it does not serve. Skipped without the extension's ops.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from segserve.kernels import block_cpu, qmm_cpu
from segserve.kernels.fused_cpu import FusedCpuRoute
from segserve.kernels.fused_cpu import available as fused_available
from segserve.kernels.hook import install, layer_windows
from segserve.kv.segmented import SegmentedCache
from segserve.server.runner import logits_last
from segserve.server.runner.batched import decode_batch
from tests.conftest import decode_backend
from tests.test_batched_families import FAMILIES, make_family

if not qmm_cpu.available()[0] or block_cpu._ext() is None or not fused_available()[0]:
    pytest.skip("native block ops unavailable (extension not built)", allow_module_level=True)
if mx.default_device() != mx.cpu:
    pytest.skip("the whole-layer op runs on the CPU", allow_module_level=True)


def _cache(model: Any) -> SegmentedCache:
    windows = layer_windows(model)
    assert not isinstance(windows, str)
    return SegmentedCache(len(model.layers), route=FusedCpuRoute(), dtype=mx.float16, windows=windows)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_whole_layer_equals_three_ops(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_family(family, bits=4)
    install(model)
    dec = decode_backend(model)
    served = []
    real = block_cpu.NativeBlock.layer

    def spy(self: block_cpu.NativeBlock, *args: Any, **kwargs: Any) -> mx.array | None:
        out = real(self, *args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(block_cpu.NativeBlock, "layer", spy)
    one, three = _cache(model), _cache(model)
    first, second = list(range(20, 39)), [5, 9, 11]  # 19 rows: past gemma3's window of 8
    for cache in (one, three):
        mx.eval(logits_last(model, first, cache.layers))
        cache.record_tokens(first)
        cache.seal()
        mx.eval(logits_last(model, second, cache.layers))
        cache.record_tokens(second)
    tok_one = tok_three = 7
    steps = 12  # the tail outgrows gemma3's window of 8
    for _ in range(steps):
        a = decode_batch(dec, [tok_one], [one.layers])
        b = decode_batch(dec, [tok_three], [three.layers], whole_layers=False)
        mx.eval(a, b)
        assert mx.array_equal(a, b).item(), float(mx.max(mx.abs(a - b)).item())  # type: ignore[arg-type]
        tok_one, tok_three = int(mx.argmax(a[0]).item()), int(mx.argmax(b[0]).item())  # type: ignore[arg-type]
        assert tok_one == tok_three
        one.record_tokens([tok_one])
        three.record_tokens([tok_three])
    rows = one._written[0]
    assert rows == three._written[0] == len(second) + steps
    for li in range(len(model.layers)):
        for got, want in zip(one._tail(li), three._tail(li), strict=True):
            assert got is not None and want is not None
            assert mx.array_equal(got[:, :, :rows], want[:, :, :rows]).item()
    # Every layer was served, a windowed one's also once its window starts inside the tail.
    assert all(served) and len(served) == steps * len(model.layers)


def test_what_the_layer_op_refuses() -> None:
    """A tail read from a row on (`tail_from`) is served only for the buffers alone (a window
    that starts inside the tail leaves no segment visible) and from a row the step reaches."""
    model = make_family("llama", bits=4)
    install(model)
    layer = model.layers[0]
    native = block_cpu.for_layer(layer)
    assert native is not None
    nkv, d = layer.self_attn.n_kv_heads, model.args.head_dim
    seg = [mx.zeros((1, nkv, 5, d), mx.float16) for _ in range(2)]
    bufs = [mx.zeros((1, nkv, 16, d), mx.float16) for _ in range(2)]
    mx.eval(seg, bufs)
    h = mx.random.normal((1, 1, model.args.hidden_size))
    at = mx.array([9], dtype=mx.int32)
    scale = float(layer.self_attn.scale)
    assert native.layer(h, at, [*seg, *bufs], 4, scale, 0.0, tail_from=2) is None  # a segment too
    assert native.layer(h, at, bufs, 4, scale, 0.0, tail_from=5) is None  # past the new row
    assert native.layer(h, at, bufs, 4, scale, 0.0, tail_from=-1) is None
    out = native.layer(h, at, bufs, 4, scale, 0.0, tail_from=2)
    assert out is not None and out.shape == h.shape
    mx.eval(out)
