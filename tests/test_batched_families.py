"""Batched decode equals one session at a time, per family, on tiny random-weight models.

For every family `segserve.server.runner.batched` serves (llama, Llama 3 scaled RoPE, qwen2 with
q/k/v biases, qwen3, phi3, olmo2, granite, gemma3_text with sliding-window layers whose
window the prompts outgrow, gemma2 with soft-capped attention and logits), float32 and 4-bit (through the CPU quantized matmul, fused
projections): the start-up comparison says yes, and three sessions of different lengths
decoded together give each session's logits from the model's own forward one at a time
(same products over 3 rows instead of 1: float32 rounding) and the same greedy tokens,
over segmented caches (the windows the runner gives) and over the model's own caches.
Those comparisons keep x in float32 (`qmm_cpu.float_x`, as the start-up check does): x
rounded to 8 bits turns the two plans' float32 differences into code steps. With the
rounding on (`--qmm-x8 on`), a session's batched logits are the same bits as its step alone.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache

from segserve.kernels import qmm_cpu
from segserve.kernels.composed import attend_segments
from segserve.kernels.hook import install, layer_windows
from segserve.kv.segmented import SegmentedCache
from segserve.server.runner import logits_last, model_shape
from segserve.server.runner.batched import _BLOCKS, DecodeBackend, batch_support, decode_batch
from segserve.server.runner.forward import embedding_rows
from segserve.server.runner.gemma2_window import install_gemma2_windows
from tests.conftest import decode_backend

BASE: dict[str, Any] = dict(
    hidden_size=256, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, head_dim=64,
    max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
)
# name -> (mlx-lm module, config overrides)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {"tie_word_embeddings": False}),
    "olmo2": ("olmo2", {"tie_word_embeddings": False}),
    "granite": ("granite", {"embedding_multiplier": 2.0, "attention_multiplier": 0.125,
                            "residual_multiplier": 0.5, "logits_scaling": 2.0,
                            "attention_bias": False, "mlp_bias": False}),
    "gemma3": ("gemma3_text", {"sliding_window": 8, "sliding_window_pattern": 2,
                               "query_pre_attn_scalar": 64}),
    # Caps small against this model's scores and logits, so a missing cap shows; windows of
    # 8 on its even layers (`make_family`).
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 64, "attn_logit_softcapping": 5.0,
                          "final_logit_softcapping": 8.0}),
}
PROMPTS = [list(range(20, 25)), list(range(30, 49)), [7]]  # 19 > gemma2's and gemma3's window of 8
# Relative tolerance of logits computed over different row counts: float32 rounding on the
# CPU; a CUDA GPU's float32 products are TF32 (10-bit mantissa inputs), measured up to
# 1.4e-3 of the peak logit on an H200 and 3.1e-3 on an H100 (llama and granite in float,
# stock caches as much as segmented ones).
REL = 1e-4 if mx.default_device() == mx.cpu else 5e-3


def make_family(name: str, bits: int | None = None, seed: int = 3) -> Any:
    """A tiny random-weight model of family `name`; `bits`: quantized and routed through
    the CPU quantized matmul with q/k/v and gate/up fused (as the loader does)."""
    module, over = FAMILIES[name]
    arch = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict({**BASE, "model_type": module, **over}))
    if name == "gemma2":  # its windows on the even layers (mlx-lm's config drops them), as the loader does
        model = install_gemma2_windows(model, 8)
    # Larger-than-default weights: greedy choices well apart; norm weights off 1 (and off
    # gemma's 0) so a wrong norm placement shows.
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p + 0.3 * mx.random.normal(p.shape),
                          model.parameters()))
    if bits is not None:
        nn.quantize(model, group_size=32, bits=bits)
        qmm_cpu.install(model, model_shape(model))
    mx.eval(model.parameters())
    return model


def _caches(model: Any, segmented: bool) -> list[Any]:
    n = len(model.layers)
    if segmented:
        windows = layer_windows(model)
        assert not isinstance(windows, str)
        return SegmentedCache(n, route=attend_segments, windows=windows).layers
    own = getattr(model, "make_cache", None)
    return list(own()) if callable(own) else [KVCache() for _ in range(n)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_is_batched(family: str) -> None:
    model = make_family(family)
    verdict = batch_support(decode_backend(model))
    assert verdict.ok, verdict.reason
    assert all(type(layer) in _BLOCKS for layer in model.layers)


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("segmented", [True, False])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_equals_one_by_one(family: str, segmented: bool, bits: int | None) -> None:
    with qmm_cpu.float_x():
        _batched_equals_one_by_one(family, segmented, bits)


def _batched_equals_one_by_one(family: str, segmented: bool, bits: int | None) -> None:
    model = make_family(family, bits)
    install(model)
    dec = decode_backend(model)
    assert batch_support(dec).ok
    together = [_caches(model, segmented) for _ in PROMPTS]
    alone = [_caches(model, segmented) for _ in PROMPTS]
    tokens = []
    for p, a, b in zip(PROMPTS, together, alone, strict=True):
        mx.eval(logits_last(model, p, a), logits_last(model, p, b))
        tokens.append(p[-1] * 3 % 512)
    for _ in range(4):
        got = decode_batch(dec, tokens, together)
        want = [logits_last(model, [t], c) for t, c in zip(tokens, alone, strict=True)]
        mx.eval(got, want)
        for i, ref in enumerate(want):
            peak = float(mx.max(mx.abs(ref)).item())  # type: ignore[arg-type]
            err = float(mx.max(mx.abs(got[i] - ref)).item())  # type: ignore[arg-type]
            assert err <= REL * max(1.0, peak), (i, err, peak)
        picked = [int(mx.argmax(x).item()) for x in want]  # type: ignore[arg-type]
        assert picked == [int(mx.argmax(got[i]).item()) for i in range(len(PROMPTS))]  # type: ignore[arg-type]
        tokens = picked


def test_gemma3_float16_rows_start_a_float32_residual() -> None:
    """A quantized gemma3 embedding with float16 scales (a GGUF's) hands out float16 rows,
    which gemma3's residual adds would keep: the forward starts from float32 rows instead,
    as batched decode's layers compute, so a prompt's last logits equal the decode step's
    over the same token. Other families' first norm promotes the rows themselves."""
    with qmm_cpu.float_x():
        model = make_family("gemma3", 4)
        emb = model.model.embed_tokens
        emb.scales, emb.biases = emb.scales.astype(mx.float16), emb.biases.astype(mx.float16)
        mx.eval(emb.scales, emb.biases)
        ids = mx.array([[3, 4]], dtype=mx.int32)
        assert embedding_rows(model, ids).dtype == mx.float32
        assert model.model.embed_tokens(ids).dtype == mx.float16
        plain = make_family("llama", 4)
        pe = plain.model.embed_tokens
        pe.scales, pe.biases = pe.scales.astype(mx.float16), pe.biases.astype(mx.float16)
        assert embedding_rows(plain, ids).dtype == mx.float16  # its norm promotes them
        prompt = PROMPTS[1]
        whole, part = _caches(model, True), _caches(model, True)
        want = logits_last(model, prompt, whole)
        mx.eval(logits_last(model, prompt[:-1], part))
        got = decode_batch(decode_backend(model), [prompt[-1]], [part])[0]
        peak = float(mx.max(mx.abs(want)).item())  # type: ignore[arg-type]
        err = float(mx.max(mx.abs(got - want)).item())  # type: ignore[arg-type]
        assert err <= REL * max(1.0, peak), (err, peak)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_windows_reach_the_batched_step_over_stock_caches(family: str) -> None:
    """Stock mode's caches keep every key of a sliding layer (plain KVCache); the batched
    step, which passes no mask, applies each layer's window to them itself, so it equals
    the step over the model's own rotating caches. Not vacuous: the same step with the
    windows unknown to it (every layer global) differs once a prompt outgrows the window."""
    model = make_family(family)
    n = len(model.layers)
    plain = [[KVCache() for _ in range(n)] for _ in PROMPTS[:2]]
    blind = [[KVCache() for _ in range(n)] for _ in PROMPTS[:2]]
    windowed = [_caches(model, False) for _ in PROMPTS[:2]]
    for p, a, b, c in zip(PROMPTS[:2], plain, blind, windowed, strict=True):
        mx.eval(logits_last(model, p, a), logits_last(model, p, b), logits_last(model, p, c))
    dec = decode_backend(model)
    assert any(w is not None for w in dec.shape.windows)
    got = decode_batch(dec, [1, 2], plain)
    want = decode_batch(dec, [1, 2], windowed)
    assert mx.allclose(got, want, atol=1e-4).item()
    unaware = DecodeBackend(model, dataclasses.replace(dec.shape, windows=(None,) * n))
    globally = decode_batch(unaware, [1, 2], blind)
    assert mx.allclose(globally[0], want[0], atol=1e-4).item()  # 6 keys: inside the window of 8
    assert not mx.allclose(globally[1], want[1], atol=1e-3).item()  # 20 keys: 12 outside it


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_window_equals_the_model_s_forward(family: str, bits: int | None) -> None:
    """A speculative verify window through the batched step's layers (`decode_window`: its
    rows as the batch, one causal attention call per layer) gives the logits of the model's
    own forward over the same tokens, row by row, and leaves the same cache behind: the
    next window continues either alike. gemma3's prompt outgrows its window of 8, so the
    window's rows see different key ranges; gemma2's caps apply."""
    with qmm_cpu.float_x():
        _verify_window_equals_the_model_s_forward(family, bits)


def _verify_window_equals_the_model_s_forward(family: str, bits: int | None) -> None:
    from segserve.server.runner.batched import decode_window
    from segserve.server.spec import logits_window

    model = make_family(family, bits)
    install(model)
    dec = decode_backend(model)
    assert batch_support(dec).ok
    ours, plain = _caches(model, True), _caches(model, True)
    prompt = PROMPTS[1]
    mx.eval(logits_last(model, prompt, ours), logits_last(model, prompt, plain))
    for window in ([5, 9, 13, 17, 21], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48]):
        got = decode_window(dec, window, ours)
        want = logits_window(model, window, plain)
        mx.eval(got, want)
        assert got.shape == want.shape == (len(window), 512)
        peak = float(mx.max(mx.abs(want)).item())  # type: ignore[arg-type]
        err = float(mx.max(mx.abs(got - want)).item())  # type: ignore[arg-type]
        assert err <= REL * max(1.0, peak), (err, peak)
        assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(want, axis=-1)).item()
        assert ours[0].offset == plain[0].offset


@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_windows_of_several_sessions_equal_each_alone(family: str) -> None:
    """Several sessions' verify windows of different lengths in one forward
    (`decode_windows`: their rows one batch, attention per session; a session with one
    token takes the decode step's own call) give each session the logits of the model's
    forward over its own tokens, and leave each cache where that forward leaves its own."""
    with qmm_cpu.float_x():
        _verify_windows_of_several_sessions(family)


def _verify_windows_of_several_sessions(family: str) -> None:
    from segserve.server.runner.batched import decode_windows
    from segserve.server.spec import logits_window

    model = make_family(family)
    install(model)
    dec = decode_backend(model)
    ours = [_caches(model, True) for _ in PROMPTS]
    plain = [_caches(model, True) for _ in PROMPTS]
    for p, a, b in zip(PROMPTS, ours, plain, strict=True):
        mx.eval(logits_last(model, p, a), logits_last(model, p, b))
    for windows in ([[5, 9, 13, 17, 21], [3], [40, 41, 42]], [[6], [7, 8], [9]]):
        got = decode_windows(dec, windows, ours)
        want = mx.concatenate([logits_window(model, w, c) for w, c in zip(windows, plain, strict=True)])
        mx.eval(got, want)
        assert got.shape == want.shape == (sum(map(len, windows)), 512)
        peak = float(mx.max(mx.abs(want)).item())  # type: ignore[arg-type]
        err = float(mx.max(mx.abs(got - want)).item())  # type: ignore[arg-type]
        assert err <= REL * max(1.0, peak), (err, peak)
        assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(want, axis=-1)).item()
        assert [c[0].offset for c in ours] == [c[0].offset for c in plain]


@pytest.mark.parametrize("family", ["llama3-rope", "qwen2", "gemma3", "gemma2"])
def test_x8_batched_rows_are_their_sessions_own_bits(family: str) -> None:
    """4-bit weights with x rounded to 8 bits (`--qmm-x8 on`): three sessions decoded together
    give each the same logits, bit for bit, as its own batch of one on the same path."""
    if not qmm_cpu.available()[0]:
        pytest.skip(qmm_cpu.available()[1])
    from segserve.kernels.native import _segattn

    before = _segattn.qmm_x8()
    _segattn.qmm_set_x8("on")
    try:
        _x8_batched_rows(family)
    finally:
        _segattn.qmm_set_x8(before)


def _x8_batched_rows(family: str) -> None:
    model = make_family(family, 4)
    install(model)
    dec = decode_backend(model)
    assert batch_support(dec).ok
    together = [_caches(model, True) for _ in PROMPTS]
    alone = [_caches(model, True) for _ in PROMPTS]
    tokens = [p[-1] * 3 % 512 for p in PROMPTS]
    for p, a, b in zip(PROMPTS, together, alone, strict=True):
        mx.eval(logits_last(model, p, a), logits_last(model, p, b))
    for _ in range(3):
        got = decode_batch(dec, tokens, together)
        want = [decode_batch(dec, [t], [c])[0] for t, c in zip(tokens, alone, strict=True)]
        mx.eval(got, want)
        for i, ref in enumerate(want):
            assert mx.array_equal(got[i], ref).item(), (family, i)
        tokens = [int(mx.argmax(x).item()) for x in want]  # type: ignore[arg-type]
