"""Batched decode vs one session at a time: same logits (rounding), same greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest

from segserve.kernels.composed import attend_segments
from segserve.kernels.hook import install
from segserve.kv.segmented import SegmentedCache
from segserve.kv.stock import StockCache
from segserve.server.engine import GenerationRequest
from segserve.server.runner import (
    apply_cpu_layout,
    batch_supported,
    decode_batch,
    logits_last,
    model_shape,
)
from segserve.server.runner.sampling import SamplingParams
from tests.conftest import decode_backend, make_tiny_model, tiny_loaded
from tests.engine_support import make_engine, run


def _prefilled(model: object, prompt: list[int], segmented: bool) -> SegmentedCache | StockCache:
    cache = SegmentedCache(2, route=attend_segments) if segmented else StockCache(2)
    mx.eval(logits_last(model, prompt, cache.layers))
    cache.record_tokens(prompt)
    cache.seal()
    return cache


def test_batch_matches_single_with_mixed_caches() -> None:
    model = make_tiny_model(seed=4)
    apply_cpu_layout(model, model_shape(model))  # the fused projections must also hold under batching
    install(model)
    dec = decode_backend(model)
    assert batch_supported(dec)
    prompts = [list(range(10, 10 + n)) for n in (7, 30, 1)]
    kinds = [True, False, True]
    batch_caches = [_prefilled(model, p, k) for p, k in zip(prompts, kinds, strict=True)]
    single_caches = [_prefilled(model, p, k) for p, k in zip(prompts, kinds, strict=True)]
    tokens = [5, 6, 7]
    for _ in range(4):
        batched = decode_batch(dec, tokens, [c.layers for c in batch_caches])
        singles = [logits_last(model, [t], c.layers) for t, c in zip(tokens, single_caches, strict=True)]
        for i, one in enumerate(singles):
            # Same products over 3 rows instead of 1: float32 rounding only.
            assert mx.allclose(batched[i], one, atol=1e-3).item()
        tokens = [int(mx.argmax(x).item()) for x in singles]  # type: ignore[arg-type]  # item() of a 0-d integer array
        assert tokens == [int(mx.argmax(batched[i]).item()) for i in range(3)]  # type: ignore[arg-type]  # item() of a 0-d integer array
        for c, t in zip(batch_caches + single_caches, tokens + tokens, strict=True):
            c.record_tokens([t])


def test_other_architectures_are_not_batched() -> None:
    """starcoder2's blocks (LayerNorm, ungated MLP) are not built for batched decode: no,
    with a reason."""
    from mlx_lm.models import starcoder2

    from segserve.server.runner.batched import batch_support

    args = starcoder2.ModelArgs(
        model_type="starcoder2", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
    )
    verdict = batch_support(decode_backend(starcoder2.Model(args)))
    assert not verdict.ok and "starcoder2" in verdict.reason


def test_pipelined_forward_is_the_same_computation() -> None:
    # `every` > 0 evaluates the trunk every few layers while the rest is built (the GPU
    # default for prefill chunks): the same ops in the same order, so logits and cache rows
    # are identical.
    model = make_tiny_model(seed=6)
    install(model)
    dec = decode_backend(model)
    prompt = list(range(20, 53))
    for segmented in (True, False):
        plain = _prefilled(model, prompt[:20], segmented)
        piped = _prefilled(model, prompt[:20], segmented)
        want = logits_last(model, prompt[20:], plain.layers, every=0)
        got = logits_last(model, prompt[20:], piped.layers, every=1)
        assert mx.array_equal(want, got).item()
        for c in (plain, piped):
            c.record_tokens(prompt[20:])
        # The decode step reads every row each cache holds: equal logits, equal rows; a
        # decode step evaluated every layer (SEGSERVE_PIPELINE_DECODE on a GPU) too.
        for step in range(3):
            want = decode_batch(dec, [7 + step], [plain.layers], every=0)
            got = decode_batch(dec, [7 + step], [piped.layers], every=1 + step % 2)
            assert mx.array_equal(want, got).item()
            for c in (plain, piped):
                c.record_tokens([7 + step])


def test_greedy_drawn_with_the_step_equals_the_samplers_draw(
    gguf_tokenizer: Any, make_request: Callable[..., GenerationRequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runner draws plain greedy rows' tokens in the step's own evaluation
    # (`ModelRunner._plain_greedy`); the sampler's draw is the plain path. Three sessions
    # decode together (one of them sampled, so the batch mixes both kinds).
    from segserve.server.runner.runner import ModelRunner

    loaded = tiny_loaded(gguf_tokenizer, make_tiny_model(seed=8))

    def generate() -> list[list[int]]:
        # Step by step: a pipelined step also draws for a row that just ended (discarded).
        eng = make_engine(loaded, segmented=True, settings_over={"pipeline_decode_steps": "off"})
        try:
            reqs = [make_request(list(range(20 + 9 * i, 40 + 9 * i)), 12) for i in range(2)]
            reqs.append(make_request(list(range(5, 30)), 12, sampling=SamplingParams(temperature=0.7, seed=3)))
            return [r.tokens for r in run(eng, reqs)]
        finally:
            eng.stop()

    from segserve.server.runner.sampling import Sampler

    draws = [0]
    own = Sampler.__call__

    def counted(self: Sampler, logits: mx.array) -> mx.array:
        draws[0] += 1
        return own(self, logits)

    monkeypatch.setattr(Sampler, "__call__", counted)
    fast = generate()
    fast_draws, draws[0] = draws[0], 0
    monkeypatch.setattr(ModelRunner, "_plain_greedy", staticmethod(lambda seq: False))
    plain = generate()
    assert fast == plain and all(len(t) == 12 for t in fast)
    # The greedy rows' decode tokens (11 each) did not go through the sampler.
    assert plain[0] and draws[0] - fast_draws == 2 * 11


def test_support_check_refuses_a_wrong_batched_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up comparison is not vacuous: a batched step that hands each session the
    other's logits (a structural error) is refused, the real one accepted, although the
    tolerance widens to the dtype's own drift between two exact plans."""
    from segserve.server.runner import batched

    dec = decode_backend(make_tiny_model())
    assert batched._agrees_with_forward(dec) is None
    real = batched.decode_batch
    monkeypatch.setattr(batched, "decode_batch", lambda m, toks, caches: real(m, toks, caches)[::-1])
    why = batched._agrees_with_forward(dec)
    assert why is not None and "disagrees" in why


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_half_precision_support_check(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In bfloat16 the check allows the dtype's own rounding (gemma2's forward soft-caps its
    scores in bfloat16, the batched step in float32: both ~3 epsilons of the peak logit from
    the same weights in float32) and still refuses a structural error."""
    import mlx.core as mx

    from segserve.kernels.hook import install
    from segserve.server.runner import batched
    from tests.test_batched_families import make_family

    model = make_family(family)
    model.set_dtype(mx.bfloat16)
    install(model)
    dec = decode_backend(model)
    assert batched._agrees_with_forward(dec) is None
    real = batched.decode_batch
    monkeypatch.setattr(batched, "decode_batch", lambda m, toks, caches: real(m, toks, caches)[::-1])
    why = batched._agrees_with_forward(dec)
    assert why is not None and "disagrees" in why


def test_support_check_turns_batching_off_on_a_disagreement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched step that disagrees with the model's forward turns batched decode off."""
    from segserve.server.runner import batched

    real = batched.decode_batch
    monkeypatch.setattr(batched, "decode_batch", lambda m, toks, caches: real(m, toks, caches)[::-1])
    verdict = batched.batch_support(decode_backend(make_tiny_model()))
    assert not verdict.ok and "disagrees" in verdict.reason
