"""The CPU's half-size KV cache and the decode step's write + attend in one op.

- The fused CPU op over float16/bfloat16 K/V under float32 queries vs stock SDPA over the
  same rows concatenated in float32 (every SIMD body; decode, verify and prefill windows).
- `attend_append` (the op writes a decode step's rows into the tail buffers, then attends):
  the buffers hold the rounded rows afterwards, the output equals the plain write + attend,
  and what it does not serve (an unevaluated or shared-looking buffer, no room) answers
  None with nothing written.
- `SegmentedCache(dtype=float16)` inside a model: decode through `decode_batch` (the fused
  write) equals the plain write path token for token, rows rounded once; sealing after
  fused writes keeps every row.
- The served model: a GGUF on CPU stores float16 K/V under float32 queries, and stock mode
  gets its own dtype and price (`stock_mode`).
Skipped as a whole, with the reason, when the extension is not built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest

from segserve.kernels import fused_cpu
from segserve.kernels.composed import KVPair, attend_segments

_OK, _WHY = fused_cpu.available()
if not _OK:
    pytest.skip(f"fused_cpu extension unavailable: {_WHY}", allow_module_level=True)

from segserve.kernels.fused_cpu import FusedCpuRoute  # noqa: E402
from segserve.kernels.hook import install  # noqa: E402
from segserve.kernels.native import _segattn  # noqa: E402
from segserve.kernels.selfcheck import self_check  # noqa: E402
from segserve.kv.segmented import TAIL_STEP, SegmentedCache  # noqa: E402
from segserve.server.runner import decode_batch, logits_last, stock_mode  # noqa: E402
from tests.conftest import decode_backend, make_tiny_model, tiny_loaded  # noqa: E402
from tests.test_kernels_composed import TOL, kv, queries, reference, scalar  # noqa: E402

HALF = [mx.float16, mx.bfloat16]


def no_fallback(*args: Any, **kwargs: Any) -> mx.array:
    raise AssertionError("the fused op did not serve this call (fell back to composed)")


ROUTE = FusedCpuRoute(fallback=no_fallback)


def as_f32(pairs: Sequence[KVPair]) -> list[KVPair]:
    return [(k.astype(mx.float32), v.astype(mx.float32)) for k, v in pairs]


def max_err(a: mx.array, b: mx.array) -> float:
    return scalar(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


# --- the op over half-size K/V under float32 queries ------------------------------------------


@pytest.mark.parametrize("isa", _segattn.supported_isas())
@pytest.mark.parametrize("kv_dtype", HALF)
@pytest.mark.parametrize(("n_q", "causal"), [(1, True), (8, True), (300, True), (8, False)])
def test_half_kv_under_float32_queries_matches_stock(isa: str, kv_dtype: mx.Dtype, n_q: int, causal: bool) -> None:
    _segattn.set_isa(isa)
    try:
        segments = [kv(n, 3, 64, kv_dtype) for n in (300, 0, 1, 77)]
        k, v = kv(n_q + 20, 3, 64, kv_dtype)
        tail = (k[:, :, : n_q + 5], v[:, :, : n_q + 5])  # a view of a bigger buffer, as served
        q = queries(9, n_q)
        got = ROUTE(q, segments, tail, scale=0.125, causal=causal)
        # The reference reads the very same (rounded) rows, widened: only summation order differs.
        want = reference(q, as_f32(segments), as_f32([tail])[0], 0.125, causal)
        assert got.dtype == mx.float32
        assert max_err(got, want) <= TOL[mx.float32]
    finally:
        _segattn.set_isa(_segattn.supported_isas()[0])


def test_self_check_covers_the_mixed_dtypes() -> None:
    res = self_check(ROUTE, n_q_heads=9, n_kv_heads=3, head_dim=64, dtype=mx.float16,
                     query_dtype=mx.float32)
    assert res.ok and res.tolerance == TOL[mx.float32], res.detail


def test_mixed_dtypes_it_does_not_serve_go_to_composed() -> None:
    seen: list[str] = []

    def spy(q: mx.array, segs: Sequence[KVPair], tail: KVPair | None, **kw: Any) -> mx.array:
        seen.append(str(q.dtype))
        return attend_segments(q, segs, tail, **kw)

    route = FusedCpuRoute(fallback=spy)
    route(queries(4, 1, dtype=mx.float16), [kv(10)], None, scale=0.125, causal=True)  # f32 K/V, f16 Q
    route(queries(4, 1), [kv(10, dtype=mx.float16)], kv(3), scale=0.125, causal=True)  # pieces differ
    assert seen == ["mlx.core.float16", "mlx.core.float32"]


# --- attend_append: the op writes the step's rows -------------------------------------------


def _buffers(cap: int, dtype: mx.Dtype, rows: int) -> tuple[mx.array, mx.array]:
    k, v = kv(cap, 3, 64, dtype)
    # Rows past `rows` hold garbage the op must overwrite (or never read).
    mx.eval(k, v)
    return k, v


@pytest.mark.parametrize("buf_dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize(("start", "n"), [(0, 1), (10, 1), (20, 3)])
def test_attend_append_writes_then_attends(buf_dtype: mx.Dtype, start: int, n: int) -> None:
    segments = [kv(50, 3, 64, buf_dtype), kv(7, 3, 64, buf_dtype)]
    kb, vb = _buffers(64, buf_dtype, start)
    before_k = mx.array(kb)  # a copy: the op writes kb itself
    before_v = mx.array(vb)
    k_new, v_new = kv(n, 3, 64, mx.float32)
    q = queries(9, n)
    out = ROUTE.attend_append(q, segments, (k_new, v_new), (kb, vb), start, scale=0.125)
    assert out is not None
    mx.eval(out)
    # The buffers now hold the new rows, rounded to their dtype, and nothing else changed.
    assert mx.array_equal(kb[:, :, start : start + n], k_new.astype(buf_dtype)).item()
    assert mx.array_equal(vb[:, :, start : start + n], v_new.astype(buf_dtype)).item()
    assert mx.array_equal(kb[:, :, :start], before_k[:, :, :start]).item()
    assert mx.array_equal(vb[:, :, start + n :], before_v[:, :, start + n :]).item()
    tail = (kb[:, :, : start + n], vb[:, :, : start + n])
    want = reference(q, as_f32(segments), as_f32([tail])[0], 0.125, True)
    assert max_err(out, want) <= TOL[mx.float32]


def test_attend_append_reads_strided_new_rows() -> None:
    # Batched decode hands each session its row of a [B, H, 1, D] batch: a strided view.
    kb, vb = _buffers(64, mx.float16, 0)
    k_all, v_all = kv(1, 3, 64, mx.float32, b=3)
    q_all = queries(9, 1, b=3)
    out = ROUTE.attend_append(q_all[1:2], [], (k_all[1:2], v_all[1:2]), (kb, vb), 5, scale=0.125)
    assert out is not None
    mx.eval(out)
    assert mx.array_equal(kb[:, :, 5:6], k_all[1:2].astype(mx.float16)).item()
    want = reference(q_all[1:2], [], as_f32([(kb[:, :, :6], vb[:, :, :6])])[0], 0.125, True)
    assert max_err(out, want) <= TOL[mx.float32]


def test_attend_append_declines_what_it_cannot_write() -> None:
    k_new, v_new = kv(1, 3, 64)
    q = queries(9, 1)
    lazy = mx.zeros((1, 3, 64, 64)) + 1.0  # not evaluated: its bytes do not exist yet
    kb, vb = _buffers(64, mx.float32, 0)
    wide = mx.zeros((1, 3, 64, 128))
    mx.eval(wide)
    strided = wide[..., :64]  # evaluated, but not its own contiguous bytes
    assert ROUTE.attend_append(q, [], (k_new, v_new), (lazy, vb), 0, scale=0.1) is None
    assert ROUTE.attend_append(q, [], (k_new, v_new), (strided, strided), 0, scale=0.1) is None
    assert ROUTE.attend_append(q, [], (k_new, v_new), (kb, vb), 64, scale=0.1) is None  # no room
    assert ROUTE.attend_append(q[..., :32], [], (k_new[..., :32], v_new[..., :32]), (kb, vb), 0, scale=0.1) is None


# --- the cache and the model ------------------------------------------------------------------


class _PlainRoute:
    """The fused route without its append form: the plain write + attend path."""

    name = "plain"

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return ROUTE(*args, **kwargs)


def _decode(model: Any, route: Any, prompt: list[int], steps: int, dtype: mx.Dtype | None) -> tuple[list[int], list[mx.array], SegmentedCache]:
    cache = SegmentedCache(2, route=route, dtype=dtype)
    dec = decode_backend(model)
    logits = logits_last(model, prompt, cache.layers)
    cache.record_tokens(prompt)
    cache.seal()
    tokens, outs = [], []
    for _ in range(steps):
        tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
        tokens.append(tok)
        logits = decode_batch(dec, [tok], [cache.layers])[0]
        outs.append(logits)
        cache.record_tokens([tok])
    mx.eval(outs)
    return tokens, outs, cache


def test_fused_write_decodes_like_the_plain_path_in_float16() -> None:
    model = make_tiny_model(seed=3)
    install(model)
    prompt = [(13 * i) % 400 + 3 for i in range(37)]
    steps = TAIL_STEP + 6  # crosses a tail growth inside the decode
    fused_tokens, fused_logits, fused = _decode(model, ROUTE, prompt, steps, mx.float16)
    plain_tokens, plain_logits, plain = _decode(model, _PlainRoute(), prompt, steps, mx.float16)
    assert fused_tokens == plain_tokens
    for a, b in zip(fused_logits, plain_logits, strict=True):
        assert max_err(a, b) <= 1e-3
    # The rows the op wrote are the rows the plain path wrote, and they seal intact.
    seg_f, seg_p = fused.seal().segments[-1], plain.seal().segments[-1]
    assert seg_f.rows == seg_p.rows == steps
    for layer in range(2):
        assert seg_f.keys[layer].dtype == mx.float16
        assert max_err(seg_f.keys[layer], seg_p.keys[layer]) <= 1e-3
        assert max_err(seg_f.values[layer], seg_p.values[layer]) <= 1e-3


def test_float16_cache_stays_close_to_float32() -> None:
    model = make_tiny_model(seed=5)
    install(model)
    prompt = [(7 * i) % 300 + 2 for i in range(20)]
    half_tokens, half_logits, half = _decode(model, ROUTE, prompt, 8, mx.float16)
    full_tokens, full_logits, _ = _decode(model, ROUTE, prompt, 8, None)
    assert half.base.segments[0].keys[0].dtype == mx.float16
    assert half_tokens == full_tokens  # well separated logits (tiny model, scaled weights)
    # Rounding K/V to float16 moves logits by ~1e-3 relative, not more.
    scale = max(scalar(mx.abs(x).max()) for x in full_logits)
    assert max(max_err(a, b) for a, b in zip(half_logits, full_logits, strict=True)) <= 1e-2 * scale


def test_stock_mode_stores_and_prices_what_the_layers_compute(gguf_tokenizer: Any) -> None:
    import dataclasses

    loaded = tiny_loaded(gguf_tokenizer)
    assert stock_mode(loaded) is loaded  # one dtype: nothing to change
    half = dataclasses.replace(loaded, kv_dtype="float16", query_dtype="float32",
                               kv_bytes_per_token=loaded.kv_bytes_per_token // 2)
    stock = stock_mode(half)
    assert stock.kv_dtype == "float32" and stock.kv_bytes_per_token == loaded.kv_bytes_per_token
    assert stock.namespace != half.namespace  # the bank never mixes the two modes' rows
