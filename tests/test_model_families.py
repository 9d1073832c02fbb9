"""mlx-lm model directories of each family, served through the server's own loader.

For tiny random-weight directories of llama, Llama 3 scaled RoPE, mistral, qwen2, qwen3,
phi3 (and with LongRoPE), olmo2, granite, smollm3 (no RoPE in every 4th layer), gemma2 and
gemma3 (sliding windows the prompts outgrow) and a 4-bit quantized llama (mlx-lm's `quantize_model`): the loader
takes them (quantization reported as the file has it), the first request succeeds in
segmented and in stock mode, segmented greedy tokens equal stock's (a difference is
allowed only where stock's top two log-probabilities are within `NEAR_TIE`: the
segmented cache may store rows at another precision), batched decode equals the plain
forward where the model is batched, and a follow-up turn reuses the first. Also: the
model's `generation_config.json` fills the sampling fields a request leaves out.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import quantize_model

from segserve.config.settings import load_settings
from segserve.kernels import qmm_cpu
from segserve.kernels.composed import attend_segments
from segserve.kv.segmented import SegmentedCache
from segserve.server.engine import Done, Failed, GenerationRequest, RequestHandle, Started, Token
from segserve.server.http.schemas import ChatCompletionRequest
from segserve.server.runner import (
    embedded_model_path,
    from_gguf_metadata,
    logits_last,
    tokenizer_config,
)
from segserve.server.runner.batched import batch_support, batch_verdict, decode_batch
from segserve.server.runner.sampling import SamplingParams
from segserve.server.runtime import Runtime, build_runtime
from tests.conftest import ram_store

NEAR_TIE = 0.01  # logprob margin under which stock and segmented may pick differently
VOCAB = 4096  # below the tokenizer's 49,152: every id the model emits still decodes

BASE: dict[str, Any] = dict(
    hidden_size=256, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, head_dim=64,
    max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
)
# family -> (config.json overrides, quantized bits or None)
FAMILIES: dict[str, tuple[dict[str, Any], int | None]] = {
    "llama": ({"model_type": "llama"}, None),
    "llama3-rope": ({"model_type": "llama", "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}, None),
    "mistral": ({"model_type": "mistral"}, None),
    "qwen2": ({"model_type": "qwen2"}, None),
    "qwen3": ({"model_type": "qwen3"}, None),
    "phi3": ({"model_type": "phi3", "tie_word_embeddings": False}, None),
    "olmo2": ({"model_type": "olmo2", "tie_word_embeddings": False}, None),
    "granite": ({"model_type": "granite", "embedding_multiplier": 2.0, "attention_multiplier": 0.125,
                 "residual_multiplier": 0.5, "logits_scaling": 2.0, "attention_bias": False,
                 "mlp_bias": False}, None),
    "smollm3": ({"model_type": "smollm3", "num_hidden_layers": 4}, None),  # layer 3 has no RoPE
    # LongRoPE switching at position 16: the prompts (23, 40, 5 tokens) and decode cross it
    "phi3-longrope": ({"model_type": "phi3", "tie_word_embeddings": False, "original_max_position_embeddings": 16,
                       "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(32)],
                                        "long_factor": [1.0 + 2.0 * i for i in range(32)]}}, None),
    "llama-4bit": ({"model_type": "llama"}, 4),
    # Sliding windows of 16 positions that the prompts (23, 40 tokens) outgrow: Gemma 2's on
    # its even layers (its config's `sliding_window`), Gemma 3's on all but every 2nd.
    "gemma2": ({"model_type": "gemma2", "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "sliding_window": 16}, None),
    "gemma3": ({"model_type": "gemma3_text", "query_pre_attn_scalar": 64, "sliding_window": 16,
                "sliding_window_pattern": 2}, None),
}
# family -> (segmented, batched): what this build serves (README's family table)
EXPECTED = {
    "llama": (True, True), "llama3-rope": (True, True), "mistral": (True, True),
    "qwen2": (True, True), "qwen3": (True, True), "phi3": (True, True),
    "olmo2": (True, True), "granite": (True, True), "smollm3": (True, True), "phi3-longrope": (True, True),
    "llama-4bit": (True, True), "gemma2": (True, True), "gemma3": (True, True),
}


def write_family_dir(out: Path, family: str, generation: dict[str, Any] | None = None) -> Path:
    """A tiny random-weight mlx-lm directory of `family` with SmolLM2's tokenizer."""
    over, bits = FAMILIES[family]
    config = {**BASE, **over}
    module = {"mistral": "llama"}.get(config["model_type"], config["model_type"])
    arch = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(5)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Larger-than-default weights: greedy choices well apart (few near ties).
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    if bits is not None:
        model, config = quantize_model(model, config, 32, bits)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    _, meta = mx.load(str(embedded_model_path()), return_metadata=True)
    assert isinstance(meta, dict)
    chat, tok = from_gguf_metadata(meta)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(chat, 2048)))
    if generation is not None:
        (out / "generation_config.json").write_text(json.dumps(generation))
    return out


def _runtime(model_dir: Path, segmented: bool, **over: str) -> Runtime:
    settings = load_settings(
        {"model": str(model_dir), "segmented_kv": str(segmented).lower(), "prefill_chunk": "16", **over},
        environ={},
    )
    rt = build_runtime(settings, store=ram_store())
    rt.engine.start()
    return rt


def _run(rt: Runtime, reqs: list[GenerationRequest]) -> list[tuple[Started | None, list[Token], Any]]:
    """Submit together (they decode as one batch where the model is batched)."""

    async def one(handle: RequestHandle) -> tuple[Started | None, list[Token], Any]:
        started, toks = None, []
        while True:
            ev = await asyncio.wait_for(handle.queue.get(), 120)
            if isinstance(ev, Started):
                started = ev
            elif isinstance(ev, Token):
                toks.append(ev)
            elif isinstance(ev, (Done, Failed)):
                return started, toks, ev

    async def main() -> list[tuple[Started | None, list[Token], Any]]:
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(r, loop) for r in reqs]
        for h in handles:
            rt.engine.submit(h)
        return list(await asyncio.gather(*(one(h) for h in handles)))

    return asyncio.run(main())


def _greedy(rid: str, prompt: list[int], n: int = 10, session: str | None = None) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), n, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
                             session_id=session)


def _same_or_near_tie(ref: list[Token], got: list[Token]) -> None:
    """Equal greedy tokens, up to the first place where `ref` was a near tie."""
    for a, b in zip(ref, got, strict=False):
        if a.token_id != b.token_id:
            assert a.logprob is not None and len(a.logprob.top) == 2
            margin = a.logprob.top[0][1] - a.logprob.top[1][1]
            assert margin < NEAR_TIE, f"token {a.index}: {a.token_id} != {b.token_id} at margin {margin:.4f}"
            return
    assert len(ref) == len(got)


def _stop(rt: Runtime) -> None:
    rt.engine.stop()


PROMPTS = [[(13 * i + 7) % (VOCAB - 10) + 10 for i in range(n)] for n in (23, 40, 5)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_serves(family: str, tmp_path: Path) -> None:
    model_dir = write_family_dir(tmp_path / family, family)
    want_segmented, want_batched = EXPECTED[family]
    stock = _runtime(model_dir, segmented=False)
    try:
        if FAMILIES[family][1] is None:
            assert stock.loaded.quantization.startswith("mlx-lm unquantized float32")
        else:
            assert stock.loaded.quantization.startswith("mlx-lm affine g32 4-bit")
            routed = "[CPU qmm extension]" in stock.loaded.quantization
            assert routed == qmm_cpu.available()[0]
        ref = [toks for _, toks, end in _run(stock, [_greedy(f"s{i}", p) for i, p in enumerate(PROMPTS[:1])])
               if isinstance(end, Done)]
        assert len(ref) == 1 and ref[0]
    finally:
        _stop(stock)
    seg = _runtime(model_dir, segmented=True)
    try:
        assert (seg.kv.mode == "segmented") == want_segmented, seg.kv.reason
        verdict = batch_verdict(seg.loaded.decode)
        assert verdict is not None and verdict.ok == want_batched, verdict
        health = seg.serving.health()["model"]["batched_decode"]
        assert health == {"on": want_batched, "reason": verdict.reason}
        # First request, alone: stock's greedy tokens (up to a near tie).
        (started, toks, end), = _run(seg, [_greedy("a", PROMPTS[0], session="s")])
        assert isinstance(end, Done), end
        assert started is not None and started.cached_tokens == 0
        _same_or_near_tie(ref[0], toks)
        # A follow-up turn of the same session reuses the first turn's rows.
        follow = [*PROMPTS[0], *(t.token_id for t in toks), 11, 12, 13]
        (started2, toks2, end2), = _run(seg, [_greedy("b", follow, 4, session="s")])
        assert isinstance(end2, Done) and toks2, end2
        assert started2 is not None and started2.cached_tokens >= len(PROMPTS[0])
        # Three sessions at once (one batch where batched) equal each one alone.
        alone = [_run(seg, [_greedy(f"c{i}", p, 6)])[0][1] for i, p in enumerate(PROMPTS)]
        together = _run(seg, [_greedy(f"d{i}", p, 6) for i, p in enumerate(PROMPTS)])
        for one, (_, many, end3) in zip(alone, together, strict=True):
            assert isinstance(end3, Done)
            _same_or_near_tie(one, many)
    finally:
        _stop(seg)


@pytest.mark.parametrize("family", [f for f, (_, batched) in EXPECTED.items() if batched])
def test_batched_step_equals_plain_forward(family: str, tmp_path: Path) -> None:
    """decode_batch over three segmented sessions against the model's own forward per
    session (the plain path), four steps: same logits up to float rounding."""
    rt = _runtime(write_family_dir(tmp_path / family, family), segmented=True)
    try:
        model, dec = rt.loaded.model, rt.loaded.decode
        assert batch_support(dec).ok
        n = rt.loaded.num_layers

        def prefilled(p: list[int]) -> SegmentedCache:
            c = SegmentedCache(n, route=attend_segments, windows=rt.loaded.shape.windows or None)
            mx.eval(logits_last(model, p, c.layers))
            c.record_tokens(p)
            c.seal()
            return c

        batch, single = [prefilled(p) for p in PROMPTS], [prefilled(p) for p in PROMPTS]
        tokens = [5, 6, 7]
        for _ in range(4):
            got = decode_batch(dec, tokens, [c.layers for c in batch])
            refs = [logits_last(model, [t], c.layers) for t, c in zip(tokens, single, strict=True)]
            for i, ref in enumerate(refs):
                scale = max(1.0, float(mx.max(mx.abs(ref)).item()))  # type: ignore[arg-type]
                assert mx.allclose(got[i], ref.reshape(-1), atol=2e-3 * scale).item()
            tokens = [int(mx.argmax(r).item()) for r in refs]  # type: ignore[arg-type]
            for c, t in zip(batch + single, tokens + tokens, strict=True):
                c.record_tokens([t])
    finally:
        _stop(rt)


def test_generation_config_fills_left_out_fields(tmp_path: Path) -> None:
    from segserve.server.http.openai_api import _sampling, model_card

    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": "high", "repetition_penalty": 1.1,
           "do_sample": True}
    model_dir = write_family_dir(tmp_path / "llama", "llama", generation=gen)
    rt = _runtime(model_dir, segmented=False)
    try:
        own = rt.loaded.sampling_defaults
        # min_p of the wrong type is left out (OpenAI's default serves), never a failed start
        assert own.as_dict() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
        assert rt.serving.health()["model"]["sampling_defaults"] == own.as_dict()
        assert model_card(rt.serving)["sampling_defaults"] == own.as_dict()

        def resolved(**fields: Any) -> SamplingParams:
            body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
            return _sampling(rt.serving, body, False, 0)

        left_out = resolved()
        assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p,
                left_out.repetition_penalty) == (0.6, 0.9, 20, 0.0, 1.1)
        assert resolved(temperature=None, top_k=None).temperature == 0.6  # null = left out
        explicit = resolved(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
        assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.repetition_penalty) == (0.0, 1.0, 0, 1.0)
    finally:
        _stop(rt)
    off = _runtime(model_dir, segmented=False, generation_config="none")
    try:
        assert off.loaded.sampling_defaults.as_dict() == {}
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
        params = _sampling(off.serving, body, False, 0)
        assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.0)
        assert "sampling_defaults" not in model_card(off.serving)
    finally:
        _stop(off)


def test_generation_defaults_reach_the_sampler(tmp_path: Path) -> None:
    """With the model's temperature 0 a request that leaves temperature out decodes
    greedily: the same tokens as an explicit temperature 0, on every try."""
    from segserve.server.http.openai_api import _sampling

    model_dir = write_family_dir(tmp_path / "llama", "llama", generation={"temperature": 0.0})
    rt = _runtime(model_dir, segmented=True)
    try:
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
        params = _sampling(rt.serving, body, True, 2)
        reqs = [GenerationRequest(f"g{i}", tuple(PROMPTS[1]), 6, params) for i in range(2)]
        outs = [[t.token_id for t in toks] for _, toks, _ in _run(rt, reqs)]
        greedy = [t.token_id for t in _run(rt, [_greedy("x", PROMPTS[1], 6)])[0][1]]
        assert outs[0] == outs[1] == greedy
    finally:
        _stop(rt)

