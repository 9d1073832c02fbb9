"""The CPU quantized matmul op (kernels/native qmm_*) against mx.quantized_matmul.

Products of 4-bit weights (K % 64 == 0) and 8-bit ones round x to 8 bits with `--qmm-x8 on`
(qmm_dot8.cpp: the dot bodies for decode rows, its GEMM from 24 rows on; Q6_K by default,
tests/test_qmm_q6k.py): they are checked against MLX's op on the same rounded x
(`qmm_cpu.x8_product`), and that rounding against float x within its own bound; with the
rounding off (`auto` for these formats, `off`), the float paths.

Differential over shapes (odd N, K a few groups long), group sizes 32/64/128, bits 4/8,
rows 1-16 (decode, batched decode, verify) and 512 (prefill), scale dtypes float32 /
float16 / bfloat16, every SIMD body this CPU runs and one or two threads; then the
drop-in (`segserve.kernels.qmm_cpu.install`) on a tiny model, and the embedded model's greedy
tokens with `--weights q4` (the op) equal to the plain MLX 4-bit path (`quantized`).
Skipped as a whole, with the reason, when the extension is not built.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import pytest

from segserve.kernels import qmm_cpu
from segserve.server.runner import model_shape

_OK, _WHY = qmm_cpu.available()
if not _OK:
    pytest.skip(f"CPU quantized matmul unavailable: {_WHY}", allow_module_level=True)

from segserve.kernels.native import _segattn  # noqa: E402

ISAS = _segattn.qmm_supported_isas()


@pytest.fixture(autouse=True)
def _restore_settings() -> Iterator[None]:
    isa, threads, x8 = _segattn.qmm_isa(), _segattn.qmm_threads(), _segattn.qmm_x8()
    yield
    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_threads(threads)
    _segattn.qmm_set_x8(x8)


def _weights(n: int, k: int, bits: int, gs: int, sdt: mx.Dtype, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * 0.1
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return q, s.astype(sdt), b.astype(sdt)


def _check(x: mx.array, q: mx.array, s: mx.array, b: mx.array, gs: int, bits: int) -> None:
    # Decode rows of 4-bit weights: the op rounds x to 8 bits (qmm_dot8.cpp); the reference
    # is MLX's own op on the same rounded x (`qmm_cpu.x8_product`).
    ref = qmm_cpu.reference_product(x, q, s, b, gs, bits)
    got = _segattn.qmm(x, q, s, b, gs, bits)
    assert got is not None, "the op declined a shape it serves"
    assert got.shape == ref.shape and got.dtype == mx.float32
    err, peak = mx.max(mx.abs(got - ref)).item(), mx.max(mx.abs(ref)).item()
    assert isinstance(err, float) and isinstance(peak, float)
    scale = max(1.0, peak)
    assert err <= 2e-5 * scale * max(1.0, x.shape[-1] / 256), (err, scale)


# (rows, N, K/gs): odd N (tails of the 4- and 2-column tiles), K a few groups; from 24 rows
# on the packed-panel GEMM serves: rows not a multiple of its row tile (6 or 12), N not a
# multiple of its panel (8/16/32 columns), K over its 256-value chunk (C accumulated).
SHAPES = [(1, 1, 1), (1, 7, 3), (1, 131, 5), (2, 33, 2), (3, 9, 4), (4, 66, 3), (5, 17, 2),
          (7, 35, 3), (11, 19, 2), (16, 129, 3), (24, 1, 1), (25, 65, 9), (37, 100, 5),
          (512, 37, 3), (97, 33, 17)]


@pytest.mark.parametrize("x8", ["on", "off"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_matches_mlx_over_shapes(isa: str, bits: int, gs: int, x8: str) -> None:
    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_x8(x8)
    for i, (rows, n, groups) in enumerate(SHAPES):
        k = groups * gs
        q, s, b = _weights(n, k, bits, gs, mx.float16, seed=i)
        x = mx.random.normal((rows, k), key=mx.random.key(100 + i))
        _check(x, q, s, b, gs, bits)


@pytest.mark.parametrize("sdt", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_scale_dtypes_and_threads(sdt: mx.Dtype, threads: int) -> None:
    _segattn.qmm_set_threads(threads)
    for isa in ISAS:
        _segattn.qmm_set_isa(isa)
        for bits in (4, 8):
            # Large enough to be split over the threads (>= 64K weights).
            q, s, b = _weights(515, 384, bits, 64, sdt, seed=bits)
            for rows in (1, 3, 16, 70, 512):
                x = mx.random.normal((rows, 384), key=mx.random.key(rows))
                _check(x, q, s, b, 64, bits)


@pytest.mark.parametrize("x8", ["on", "off"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_compact_k8_scales_match_mlx_and_the_float16_form(isa: str, bits: int, x8: str) -> None:
    """GGUF Q4_K/Q5_K's compact scales (QMM_K8: per 256 weights a float16 factor and eight
    uint8 multipliers) through every body: decode rows, the dot tiles' row groups and the
    GEMM (24+ rows), over odd N and K of 1-11 blocks; against MLX's op on the expanded
    scales, and bitwise against the op itself on the same scales expanded to float32 (the
    same arithmetic, only the scales' storage differs)."""
    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_x8(x8)
    for i, (rows, n, blocks) in enumerate([(1, 7, 1), (1, 131, 4), (3, 9, 2), (16, 66, 3), (25, 65, 11),
                                           (37, 100, 2), (512, 37, 1)]):
        k = 256 * blocks
        q, s, b = qmm_cpu.random_k8(n, k, bits, mx.random.key(i))
        x = mx.random.normal((rows, k), key=mx.random.key(50 + i))
        _check(x, q, s, b, 32, bits)
        got = _segattn.qmm(x, q, s, b, 32, bits)
        same = _segattn.qmm(x, q, qmm_cpu.expand_k8(s), qmm_cpu.expand_k8(b), 32, bits)
        assert got is not None and same is not None
        assert mx.array_equal(got, same).item(), (rows, n, k)


def test_compact_k8_scales_are_declined_where_they_do_not_fit() -> None:
    q, s, b = qmm_cpu.random_k8(8, 512, 4, mx.random.key(0))
    x = mx.ones((1, 512))
    assert _segattn.qmm(x, q, s, b, 64, 4) is None  # K8 is for groups of 32 only
    assert _segattn.qmm(x, q, s[:, :10], b[:, :10], 32, 4) is None  # one block's scales for two
    assert _segattn.qmm(x, q, s, b.astype(mx.float16), 32, 4) is None  # mixed scale kinds


def test_model_shapes_decode_and_prefill() -> None:
    """SmolLM2's projections (4-bit g32) and a slice of its 8-bit head, rows 1/4/16/512."""
    for n, k, bits in ((576, 576, 4), (192, 576, 4), (1536, 576, 4), (576, 1536, 4), (1027, 576, 8)):
        q, s, b = _weights(n, k, bits, 32, mx.float16, seed=n)
        for rows in (1, 4, 16) + ((512,) if n <= 576 and k <= 576 else ()):
            _check(mx.random.normal((rows, k), key=mx.random.key(rows)), q, s, b, 32, bits)


@pytest.mark.parametrize("isa", ISAS)
def test_float_x_rows_are_independent_of_their_pass(isa: str) -> None:
    """With float x, 2..23 rows go through dequantizing passes of up to 8 rows (4 below
    AVX-512), the rows spread evenly over them: a row's product is the same bits in any
    batch of two or more rows (a verify window of 5 or of 9 rows, or sessions batched)."""
    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_x8("off")
    for bits, gs in ((4, 32), (8, 64)):
        q, s, b = _weights(67, 256, bits, gs, mx.float16, seed=bits)
        x = mx.random.normal((23, 256), key=mx.random.key(bits))
        full = _segattn.qmm(x, q, s, b, gs, bits)
        assert full is not None
        for rows in (2, 5, 9, 13, 17):
            part = _segattn.qmm(x[:rows], q, s, b, gs, bits)
            assert part is not None and mx.array_equal(part, full[:rows]).item(), rows


@pytest.mark.parametrize("isa", ISAS)
def test_x8_rows_are_independent_of_their_batch(isa: str) -> None:
    """A row's product is the same bits whether it comes alone or among 2..23 rows."""
    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_x8("on")
    for bits, gs in ((4, 32), (4, 128), (8, 32), (8, 64)):
        q, s, b = _weights(131, 512, bits, gs, mx.float16, seed=bits + gs)
        x = mx.random.normal((23, 512), key=mx.random.key(gs))
        batch = _segattn.qmm(x, q, s, b, gs, bits)
        assert batch is not None
        for r in (0, 5, 22):
            alone = _segattn.qmm(x[r : r + 1], q, s, b, gs, bits)
            assert alone is not None and mx.array_equal(alone[0], batch[r]).item()


@pytest.mark.parametrize("isa", ISAS)
def test_x8_gemm_rows_are_independent_of_their_call(isa: str) -> None:
    """From 24 rows on (the GEMM): a row's product is the same bits in calls of 24, 37 and
    70 rows (whatever its place in the row tiles), and equals its decode-row product up to
    float32 summation order."""
    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_x8("on")
    for gs in (32, 64):
        q, s, b = _weights(77, 640, 4, gs, mx.float16, seed=gs)
        x = mx.random.normal((70, 640), key=mx.random.key(gs + 1))
        full = _segattn.qmm(x, q, s, b, gs, 4)
        assert full is not None
        for rows in (24, 37):
            part = _segattn.qmm(x[70 - rows :], q, s, b, gs, 4)
            assert part is not None and mx.array_equal(part, full[70 - rows :]).item()
        one = _segattn.qmm(x[69:], q, s, b, gs, 4)
        assert one is not None
        peak, err = mx.max(mx.abs(full[69])).item(), mx.max(mx.abs(one[0] - full[69])).item()
        assert isinstance(peak, float) and isinstance(err, float)
        assert err <= 1e-5 * max(1.0, peak)


@pytest.mark.parametrize("isa", ISAS)
def test_x8_rounding_stays_within_its_bound(isa: str) -> None:
    """8-bit x against float x: per block, |x - xhat| <= d / 2 with d = max|x| / 127, so
    |y8 - y| <= sum over blocks of d / 2 * sum |w - centre| (4-bit: the codes centred at 8),
    and in practice well under 2 % of max|y| on Gaussian rows; float32 sums within 1e-5."""
    _segattn.qmm_set_isa(isa)
    for rows, gs, (n, k) in ((1, 32, (37, 576)), (1, 64, (64, 1024)), (1, 128, (9, 2816)), (30, 64, (40, 1024))):
        q, s, b = _weights(n, k, 4, gs, mx.float16, seed=k)
        x = mx.random.normal((rows, k), key=mx.random.key(k)) * 3.0
        _segattn.qmm_set_x8("on")
        y8 = _segattn.qmm(x, q, s, b, gs, 4)
        _segattn.qmm_set_x8("off")
        y = _segattn.qmm(x, q, s, b, gs, 4)
        assert y8 is not None and y is not None
        d = mx.max(mx.abs(x.reshape(rows, -1, 32)), axis=-1) / 127.0  # [rows, blocks]
        codes = mx.dequantize(q, s, b, group_size=gs, bits=4) - mx.repeat(b + 8.0 * s, gs, axis=1).astype(mx.float32)
        bound = (mx.abs(codes).reshape(n, -1, 32).sum(axis=-1)[None] * d[:, None, :] / 2).sum(axis=-1)  # [rows, n]
        err = mx.abs(y8 - y)
        assert mx.all(err <= bound * (1 + 1e-4) + 1e-5).item()
        peak, worst = mx.max(mx.abs(y)).item(), mx.max(err).item()
        assert isinstance(peak, float) and isinstance(worst, float)
        assert 0.0 < worst < 0.02 * peak  # the rounding is really on, and small


def test_x8_leaves_k_not_a_multiple_of_64_in_float() -> None:
    """4-bit rows of K = 96 (three groups of 32) take the float path with 8-bit x on; 8-bit
    weights round every row; `auto` rounds Q6_K only, `off` none."""
    q, s, b = _weights(40, 96, 4, 32, mx.float16, seed=9)
    x = mx.random.normal((1, 96), key=mx.random.key(9))
    _segattn.qmm_set_x8("on")
    assert not qmm_cpu.x8_serves(1, 96, 4) and not qmm_cpu.x8_serves(512, 96, 4)
    assert all(qmm_cpu.x8_serves(rows, 128, 4) for rows in (1, 23, 24, 512))  # dot body; GEMM
    assert qmm_cpu.x8_serves(512, 256, 6)  # Q6_K
    assert all(qmm_cpu.x8_serves(rows, 32, 8) for rows in (1, 23, 24, 512))  # 8-bit: dot body; GEMM
    _segattn.qmm_set_x8("auto")
    assert all(qmm_cpu.x8_serves(rows, 256, 6) for rows in (1, 512))
    assert not any(qmm_cpu.x8_serves(rows, 256, bits) for rows in (1, 512) for bits in (4, 8))
    _segattn.qmm_set_x8("off")
    assert not any(qmm_cpu.x8_serves(rows, 256, bits) for rows in (1, 512) for bits in (4, 6, 8))
    _segattn.qmm_set_x8("on")
    got = _segattn.qmm(x, q, s, b, 32, 4)
    ref = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=4)
    peak = mx.abs(ref).max().item()
    assert got is not None and isinstance(peak, float) and mx.allclose(got, ref, atol=2e-5 * max(1.0, peak)).item()


def test_strided_and_batched_inputs() -> None:
    q, s, b = _weights(45, 256, 4, 64, mx.float16, seed=3)
    base = mx.random.normal((256, 6), key=mx.random.key(5))
    _check(base.T, q, s, b, 64, 4)  # a transposed view: column stride != 1
    _check(mx.random.normal((2, 3, 256), key=mx.random.key(6)), q, s, b, 64, 4)  # [B, L, K]


def test_declines_what_it_does_not_serve() -> None:
    q, s, b = _weights(8, 128, 4, 64, mx.float16, seed=1)
    x = mx.random.normal((2, 128))
    assert _segattn.qmm(x.astype(mx.float16), q, s, b, 64, 4) is None  # x not float32
    assert _segattn.qmm(x, q, s, b, 64, 3) is None  # 3-bit
    assert _segattn.qmm(x, q, s, b, 16, 4) is None  # group size 16
    assert _segattn.qmm(mx.random.normal((2, 96)), q, s, b, 64, 4) is None  # K mismatch
    # The wrapper falls back to MLX's op for those.
    y = qmm_cpu.quantized_matmul(x.astype(mx.float16), q, s, b, group_size=64, bits=4)
    ref = mx.quantized_matmul(x.astype(mx.float16), q, s, b, transpose=True, group_size=64, bits=4)
    assert mx.array_equal(y, ref).item()


def test_self_check_passes_on_model_shapes() -> None:
    ok, why = qmm_cpu.self_check([(576, 576, 4, 32, mx.float16), (49152, 576, 8, 32, mx.float16)])
    assert ok, why


def test_install_fuses_without_a_second_copy_of_the_model() -> None:
    """Fusing q/k/v and gate/up makes new rows: the parts' old rows are freed group by
    group, so memory peaks at one group's copy above the weights, not at a second model."""
    from tests.conftest import make_tiny_model

    model = make_tiny_model(seed=5, num_hidden_layers=6)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    groups: list[tuple[nn.Module, ...]] = [
        (m.self_attn.q_proj, m.self_attn.k_proj, m.self_attn.v_proj) for m in model.layers]
    groups += [(m.mlp.gate_proj, m.mlp.up_proj) for m in model.layers]
    largest = max(sum(p.weight.nbytes + p.scales.nbytes + p.biases.nbytes for p in g) for g in groups)
    fused_total = sum(sum(p.weight.nbytes + p.scales.nbytes + p.biases.nbytes for p in g) for g in groups)
    del groups
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    qmm_cpu.install(model, model_shape(model))
    assert mx.get_active_memory() <= before + largest  # nothing kept twice once done
    assert fused_total > 4 * largest  # the test would see a whole second copy
    assert mx.get_peak_memory() <= before + 2 * largest


def test_install_routes_a_tiny_model() -> None:
    from mlx_lm.models.cache import KVCache

    from segserve.server.runner import logits_last
    from tests.conftest import make_tiny_model

    _segattn.qmm_set_x8("off")  # the routing alone first: the same float products as MLX's
    plain = make_tiny_model(seed=4)
    nn.quantize(plain, group_size=32, bits=4)
    routed = make_tiny_model(seed=4)
    nn.quantize(routed, group_size=32, bits=4)
    count = qmm_cpu.install(routed, model_shape(routed))
    assert count >= 2 * 7
    assert isinstance(routed.layers[0].self_attn.o_proj, qmm_cpu.CpuQuantizedLinear)
    assert isinstance(routed.layers[0].self_attn.q_proj, qmm_cpu.FusedQuantizedPart)
    assert isinstance(routed.layers[0].mlp.up_proj, qmm_cpu.FusedQuantizedPart)
    from mlx.utils import tree_flatten

    def nbytes(m: nn.Module) -> int:
        flat = cast(list[tuple[str, mx.array]], tree_flatten(m.parameters()))
        return sum(v.nbytes for _, v in flat)

    assert nbytes(routed) == nbytes(plain)  # fused weights counted once

    def greedy(model: nn.Module) -> tuple[list[int], mx.array]:
        cache = [KVCache() for _ in range(len(model.layers))]
        logits = first = logits_last(model, list(range(5, 40)), cache)
        toks = []
        for _ in range(8):
            tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]
            toks.append(tok)
            logits = logits_last(model, [tok], cache)
        return toks, first

    a, la = greedy(plain)
    b, lb = greedy(routed)  # the routing itself (off: 4-bit rows in float): MLX's products
    assert a == b
    assert mx.allclose(la, lb, atol=1e-3).item()
    # With 8-bit x (`on`; the prompt's rows through the GEMM, the decode row and the head's
    # one row through the dot body): the prompt's and one decode step's logits move by the
    # rounding's share (relative L2; each rounded block of 32 values is within 1/254 of its
    # largest, and this model's scaled-up weights compound it over two layers and the head to
    # a few %).
    _segattn.qmm_set_x8("on")
    cache_f = [KVCache() for _ in range(len(plain.layers))]
    cache_8 = [KVCache() for _ in range(len(routed.layers))]
    for fed in (list(range(5, 40)), [a[0]]):
        want, got = logits_last(plain, fed, cache_f), logits_last(routed, fed, cache_8)
        rel = (mx.linalg.norm(got - want) / mx.linalg.norm(want)).item()
        assert isinstance(rel, float) and 0.0 < rel < 0.1, rel


@pytest.mark.model
def test_embedded_model_q4_greedy_equals_mlx_4bit() -> None:
    """The op's float products (`--qmm-x8 off`) give MLX's greedy tokens on the embedded
    model (the default's 8-bit x is checked against its own reference above)."""
    from mlx_lm.models.cache import KVCache

    from segserve.config.settings import load_settings
    from segserve.server.runner import LoadedModel, load_model, logits_last

    def greedy(lm: LoadedModel, n: int = 16) -> list[int]:
        ids = lm.tokenizer.encode(lm.tokenizer.render([{"role": "user", "content": "What is the capital of France?"}]))
        cache = [KVCache() for _ in range(lm.num_layers)]
        logits = logits_last(lm.model, ids, cache)
        out: list[int] = []
        for _ in range(n):
            tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]
            out.append(tok)
            logits = logits_last(lm.model, [tok], cache)
        return out

    _segattn.qmm_set_x8("off")
    ext = load_model(load_settings({"weights": "q4"}, environ={}))
    assert "CPU qmm extension" in ext.quantization
    assert isinstance(ext.model.layers[0].mlp.down_proj, qmm_cpu.CpuQuantizedLinear)
    plain = load_model(load_settings({"weights": "quantized"}, environ={}))
    assert "CPU qmm extension" not in plain.quantization
    assert ext.weights_bytes == plain.weights_bytes  # same arrays (fused rows counted once)
    assert greedy(ext) == greedy(plain)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_product_may_round_its_prefill_rows_only(bits: int) -> None:
    """x8="gemm" on one product (a K-quant or Q8_0 GGUF's layers): from the GEMM's rows on
    x is rounded (the op equals `x8_product`), decode rows keep float x, where the process
    runs auto; the process's explicit off or on wins."""
    q, s, b = _weights(40, 256, bits, 32, mx.float16, seed=11)

    def err(got: mx.array | None, ref: mx.array) -> float:
        assert got is not None
        e, peak = mx.max(mx.abs(got - ref)).item(), mx.max(mx.abs(ref)).item()
        assert isinstance(e, float) and isinstance(peak, float)
        return e / max(1.0, peak)

    _segattn.qmm_set_x8("auto")
    for rows in (1, 5, 23, 24, 64):
        x = mx.random.normal((rows, 256), key=mx.random.key(rows))
        got = _segattn.qmm(x, q, s, b, 32, bits, "gemm")
        exact = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=bits)
        if rows >= 24:
            assert err(got, qmm_cpu.x8_product(x, q, s, b, 32, bits)) <= 2e-5
            assert err(got, exact) > 1e-4  # the rounding is really on
        else:
            assert err(got, exact) <= 2e-5
        assert err(_segattn.qmm(x, q, s, b, 32, bits), exact) <= 2e-5  # the process's auto: float
    x = mx.random.normal((64, 256), key=mx.random.key(3))
    exact = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=bits)
    _segattn.qmm_set_x8("off")
    assert err(_segattn.qmm(x, q, s, b, 32, bits, "gemm"), exact) <= 2e-5
    _segattn.qmm_set_x8("on")
    assert err(_segattn.qmm(x, q, s, b, 32, bits, "gemm"), qmm_cpu.x8_product(x, q, s, b, 32, bits)) <= 2e-5


def _symmetric_weights(n: int, k: int, bits: int, gs: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """GGUF Q4_0 / Q8_0 in MLX's affine form: random codes, bias = -centre * scale."""
    q, s, _ = _weights(n, k, bits, gs, mx.float16, seed)
    return q, s, s * qmm_cpu.symmetric_bias(bits)


@pytest.mark.parametrize("x8", ["on", "off"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_weights_without_biases_equal_the_full_form(isa: str, bits: int, x8: str) -> None:
    """Given no biases ([n, 0]) the op derives each group's from its scale: the same
    products, bit for bit, as with the biases held, decode rows and GEMM rows."""
    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_x8(x8)
    for i, (rows, n, groups) in enumerate(SHAPES):
        gs = (32, 64, 128)[i % 3]
        q, s, b = _symmetric_weights(n, groups * gs, bits, gs, seed=i)
        assert qmm_cpu.symmetric(s, b, bits)
        x = mx.random.normal((rows, groups * gs), key=mx.random.key(200 + i))
        empty = qmm_cpu.without_biases(s)
        got = _segattn.qmm(x, q, s, empty, gs, bits)
        full = _segattn.qmm(x, q, s, b, gs, bits)
        assert got is not None and full is not None
        assert mx.array_equal(got, full).item(), (rows, n, groups, gs)
        _check(x, q, s, empty, gs, bits)  # MLX's op on the rebuilt biases


def test_symmetric_is_exact_and_declines_near_misses() -> None:
    q, s, b = _symmetric_weights(8, 64, 8, 32, seed=3)
    assert qmm_cpu.symmetric(s, b, 8)
    assert not qmm_cpu.symmetric(s, b, 4)  # centre 8, not 128
    nudged = b.at[3, 1].add(mx.array(1e-3, dtype=b.dtype))
    assert not qmm_cpu.symmetric(s, nudged, 8)
    _, s2, b2 = _weights(8, 64, 8, 32, mx.float16, seed=3)  # MLX's own: biases of their own
    assert not qmm_cpu.symmetric(s2, b2, 8)
    big = mx.full((2, 2), 1000.0, dtype=mx.float16)  # -128 * 1000 overflows float16
    assert not qmm_cpu.symmetric(big, big * -128.0, 8)
    assert mx.array_equal(qmm_cpu.full_biases(s, qmm_cpu.without_biases(s), 8), b).item()
    assert qmm_cpu.self_check([(64, 256, 8, 32, mx.float16, True), (64, 256, 4, 32, mx.bfloat16, True)])[0]


def test_install_routes_symmetric_layers_without_their_biases() -> None:
    """A model of GGUF Q4_0 / Q8_0 layers: routed without biases (the file's 4.5 / 8.5 bits
    per weight), the same greedy tokens and logits as MLX's own product of the full form."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache

    from segserve.server.runner import logits_last
    from tests.conftest import make_tiny_model

    _segattn.qmm_set_x8("off")
    models = []
    for _ in range(2):
        m = make_tiny_model(seed=6)
        nn.quantize(m, group_size=32, bits=8)
        for _, mod in m.named_modules():
            if type(mod) is nn.QuantizedLinear:
                mod.biases = mod.scales * qmm_cpu.symmetric_bias(8)
        mx.eval(m.parameters())
        models.append(m)
    plain, routed = models
    shapes = qmm_cpu.quantized_shapes(routed)
    assert any(sh[5] for sh in shapes) and qmm_cpu.self_check(shapes)[0]
    qmm_cpu.install(routed, model_shape(routed))
    o_proj = routed.layers[0].self_attn.o_proj
    assert isinstance(o_proj, qmm_cpu.CpuQuantizedLinear) and o_proj.biases.size == 0

    def nbytes(m: nn.Module) -> int:
        flat = cast(list[tuple[str, mx.array]], tree_flatten(m.parameters()))
        return sum(v.nbytes for _, v in flat)

    dropped = sum(mod.biases.nbytes for _, mod in plain.named_modules() if type(mod) is nn.QuantizedLinear)
    assert dropped > 0 and nbytes(routed) == nbytes(plain) - dropped
    cache_p = [KVCache() for _ in range(len(plain.layers))]
    cache_r = [KVCache() for _ in range(len(routed.layers))]
    fed = list(range(5, 40))
    for _ in range(6):
        want, got = logits_last(plain, fed, cache_p), logits_last(routed, fed, cache_r)
        assert mx.allclose(want, got, atol=1e-3).item()
        fed = [int(mx.argmax(want).item())]  # type: ignore[arg-type]
