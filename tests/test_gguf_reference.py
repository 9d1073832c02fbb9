"""Each GGUF family against mlx-lm's own model of that family on the same weights, and its
decode steps batched against one by one.

The reference is built the way a Hugging Face checkpoint reaches mlx-lm: gguf-py's float32
dequantization of every tensor, the llama converter's Q/K row permutation undone where the
family was written permuted (llama, granite, smollm3: `rope_traditional` families), and
mlx-lm's model class of the family with its own (split-half) RoPE. So the test checks the
tensor map, the RoPE convention, the family's metadata scalars (granite's four scales,
smollm3's no-RoPE step) and, for smollm3, that `smollm3_as_llama` computes what mlx-lm's
smollm3 wrapper computes. Greedy tokens must agree except where the reference's top two
log-probabilities are within `NEAR_TIE` (the served model computes in another precision).

Batched: `decode_batch` over three segmented sessions equals `logits_last` per session,
with the CPU quantized matmul extension routed where it is built (so the native decode
layers are what is compared there: `route_cpu` installs the products they need).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGUFReader, quants

from segserve.kernels import block_cpu, qmm_cpu
from segserve.kernels.composed import attend_segments
from segserve.kernels.hook import install, support_check
from segserve.kv.segmented import SegmentedCache
from segserve.server.runner import batched, logits_last, model_shape
from segserve.server.runner.batched import batch_support, decode_batch
from segserve.server.runner.gguf import load_gguf
from segserve.server.runner.gguf_arch import FAMILIES as ARCHS
from segserve.server.runner.gguf_arch import ROPE_FREQS, FreqRoPE, map_name
from segserve.server.runner.model import float32_embedding_rows
from segserve.server.runner.qweights import float32_activations, route_cpu
from tests.conftest import decode_backend
from tests.gguf_support import FAMILIES, MIN_LAYERS, write_gguf

NEAR_TIE = 0.01
PROMPT = [(37 * i) % 500 + 3 for i in range(24)]


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter `permute` (HF rows (head, half, i) were written as
    (head, i, half))."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference(path: Path) -> tuple[Any, nn.Module]:
    """(our loaded GGUF, mlx-lm's model of the family on the file's float32 weights)."""
    ours = load_gguf(path, dequantize=False, widen_5bit=False)
    arch = str(ours.metadata["general.architecture"])
    fam = ARCHS[arch]
    args = ours.args
    if hasattr(args, "rope_traditional"):  # HF layout: split-half RoPE
        args = dataclasses.replace(args, rope_traditional=False)
    model = fam.module.Model(args)  # granite: mlx-lm's own split-half RoPE; smollm3: its wrapper
    weights: dict[str, mx.array] = {}
    factors = None
    for t in GGUFReader(str(path)).tensors:
        value = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        value = value.reshape(tuple(int(n) for n in reversed(t.shape)))
        if t.name == ROPE_FREQS:
            factors = mx.array(value)
            continue
        if fam.rope_traditional and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = args.num_attention_heads if "attn_q" in t.name else args.num_key_value_heads
            value = _unpermute(value, heads)
        weights[map_name(fam, t.name)] = mx.array(value)
    model.load_weights(list(weights.items()), strict=True)
    if factors is not None:  # llama3: the file's frequency factors, split-half
        head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
        for layer in model.layers:
            layer.self_attn.rope = FreqRoPE(head_dim, False, float(args.rope_theta), factors)
    mx.eval(model.parameters())
    return ours, model


def _greedy(model: nn.Module, n: int = 8) -> tuple[list[int], list[float]]:
    """Greedy tokens without a cache (the whole sequence each step) and each step's top-two
    log-probability margin."""
    seq, out, margins = list(PROMPT), [], []
    for _ in range(n):
        logits = model(mx.array([seq]))[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        top = mx.sort(lp)[-2:]
        margins.append(float((top[1] - top[0]).item()))  # type: ignore[arg-type]
        tok = int(mx.argmax(lp).item())  # type: ignore[arg-type]
        out.append(tok)
        seq.append(tok)
    return out, margins


def _layers(family: str) -> int:
    return max(MIN_LAYERS.get(family, 2), 2)


@pytest.mark.parametrize("recipe", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_equals_mlx_lm_on_the_same_weights(family: str, recipe: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", family, recipe, seed=11, layers=_layers(family))
    ours, ref = reference(path)
    tokens = mx.array([PROMPT])
    got, want = ours.model(tokens).astype(mx.float32), ref(tokens)
    peak = float(mx.max(mx.abs(want)).item())  # type: ignore[arg-type]
    # Q8_0 and Q4_0 codes are exact (K-quants' re-gridded Q6_K tensors are checked tensor by
    # tensor in test_gguf_families); the served model rounds d*q to float16. A Q/K
    # permutation, RoPE convention or scale slip moves the logits by about their own size.
    tol = 1e-2 * peak
    assert float(mx.max(mx.abs(got - want)).item()) <= tol  # type: ignore[arg-type]
    mine, _ = _greedy(ours.model)
    theirs, margins = _greedy(ref)
    for i, (a, b) in enumerate(zip(theirs, mine, strict=True)):
        if a != b:
            assert margins[i] < NEAR_TIE, f"token {i}: {a} != {b} at margin {margins[i]:.4f}"
            break


def test_smollm3_layers_without_rope(tmp_path: Path) -> None:
    """llama.cpp's step: layer i has no RoPE iff (i + 1) % 4 == 0; served under llama's class."""
    g = load_gguf(write_gguf(tmp_path / "s.gguf", "smollm3", "Q8_0", layers=8), dequantize=False)
    assert type(g.model).__module__ == "mlx_lm.models.llama"
    kinds = [type(layer.self_attn.rope).__name__ for layer in g.model.layers]
    assert kinds == ["RoPE", "RoPE", "RoPE", "NoPE"] * 2
    assert all(layer.self_attn.rope.traditional for layer in g.model.layers if kinds[0] == "RoPE"
               and type(layer.self_attn.rope).__name__ == "RoPE")


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_gguf_equals_one_by_one(family: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", family, "Q4_K_M", seed=3, layers=_layers(family))
    check_batched(load_gguf(path, dequantize=False).model, family)


def check_batched(model: nn.Module, family: str, native: bool = True) -> None:
    """`decode_batch` over three segmented sessions equals `logits_last` per session, four
    steps; with the extension routed where it is built, and then (`native`) every layer on
    the native decode ops."""
    routed = mx.default_device() == mx.cpu and qmm_cpu.available()[0]
    if routed:  # as `load_model` serves it on this CPU: float32 activations, the extension
        float32_activations(model)
        float32_embedding_rows(model)
        assert route_cpu(model, model_shape(model))[0]
    assert support_check(model, model_shape(model)).ok
    install(model)
    dec = decode_backend(model)
    verdict = batch_support(dec)
    assert verdict.ok, verdict.reason
    compiled = batched._compiled_layers(dec) or []
    if native and routed and block_cpu.available():  # every family here is served by the native layers
        assert all(c.native is not None for c in compiled), family
    n = len(model.layers)

    def prefilled(p: list[int]) -> SegmentedCache:
        c = SegmentedCache(n, route=attend_segments)
        mx.eval(logits_last(model, p, c.layers))
        c.record_tokens(p)
        c.seal()
        return c

    # x kept in float32 (`qmm_cpu.float_x`, as the start-up check): rounded to 8 bits, x
    # handed over by the native ops and by the one-by-one MLX ops differing in the last float
    # bits can land one code step apart (~0.5 % of a logit), not a structural difference.
    tol = 2e-3
    with qmm_cpu.float_x():
        prompts = [PROMPT, PROMPT[:7], [9, 8, 7, 6, 5]]
        batch, single = [prefilled(p) for p in prompts], [prefilled(p) for p in prompts]
        tokens = [5, 6, 7]
        for _ in range(4):
            got = decode_batch(dec, tokens, [c.layers for c in batch])
            refs = [logits_last(model, [t], c.layers) for t, c in zip(tokens, single, strict=True)]
            for i, r in enumerate(refs):
                scale = max(1.0, float(mx.max(mx.abs(r)).item()))  # type: ignore[arg-type]
                assert mx.allclose(got[i].astype(mx.float32), r.reshape(-1).astype(mx.float32),
                                   atol=tol * scale).item(), (family, i)
            tokens = [int(mx.argmax(r).item()) for r in refs]  # type: ignore[arg-type]
            for c, t in zip(batch + single, tokens + tokens, strict=True):
                c.record_tokens([t])


def test_gemma3_tied_head_is_found_and_routed(tmp_path: Path) -> None:
    """mlx-lm's gemma3 ties its head with a flag on the model, not its args: the loader
    records it, so a prefill chunk computes the last row's logits only, through the CPU
    extension where it is built, and they equal the model's own forward."""
    from mlx_lm.models import gemma3_text

    from segserve.config.settings import load_settings
    from segserve.server.runner import embedded_model_path, load_model
    from segserve.server.runner.forward import head_of

    path = write_gguf(tmp_path / "g.gguf", "gemma3", "Q4_K_M", tokenizer_from=embedded_model_path(), layers=2)
    loaded = load_model(load_settings({"model": str(path), "bank_dir": "none"}, environ={}))
    model = loaded.model
    assert type(model) is gemma3_text.Model and "lm_head" not in model
    head = head_of(model)
    assert head is not None
    if mx.default_device() == mx.cpu and qmm_cpu.available()[0]:
        assert type(head) is qmm_cpu.CpuQuantizedHead
    ids = [(37 * i) % 4000 + 10 for i in range(12)]
    with qmm_cpu.float_x():  # the routing, not the op's rounding of x for Q6_K products
        got = logits_last(model, ids, model.make_cache())
        want = model(mx.array([ids]))[0, -1]
    assert mx.allclose(got, want, atol=1e-3 * max(1.0, float(mx.max(mx.abs(want)).item()))).item()  # type: ignore[arg-type]
