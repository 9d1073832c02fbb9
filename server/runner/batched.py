"""Batched decode: one forward pass for the next token of several sessions.

Owns: `DecodeBackend` (one model's batched decode: the model, its `ModelShape`, the
`cpu_native_layers` setting, and what is built once for it on first use: the compiled
layers and the support verdict), `batch_supported(backend)` and
`decode_batch(backend, tokens, caches)` and `decode_window` (one session's verify window
through the same layers). Engine thread only, except `batch_verdict`.
Nothing is recorded on the model itself: a `LoadedModel` carries its backend (built with
it at load), and every runner over that model shares it.

Why: on a CPU, decode is bound by reading the weights (one row times every matrix). With
B sessions stacked into one [B, 1, hidden] input every weight is read once for all of
them, so B streams cost little more than one (bench/batch_decode.py measures it).
Attention stays per session: each has its own segments, tail, RoPE offset and length, so
the per-layer loop runs the projections batched and the cache/attention part per row,
except where every row's cache is segmented on a route with a shared part (`attend_lse`,
the fused CUDA route): then one plan per step (`segserve.kernels.batch_attention`) serves
each layer with one call per shared history plus one op over all tails.

Every decode step of a supported model goes through here, B = 1 included: outside
attention each layer runs as two compiled graphs (see `_CompiledLayer`), which fuses the
elementwise work between the matmuls (`python bench/batch_decode.py`: one stream 16.0
tok/s against 13.9 through the plain forward), or as the two native CPU ops; one session
whose cache is on the CPU's fused route runs each native layer as one op with its cache
write and attention (`_whole_layer`).

Scope (`batch_support`): mlx-lm 0.32.2's decoder blocks made of the pieces `BlockShape`
names (segserve.kernels.block_cpu): llama (and mistral, which mlx-lm loads as llama; any RoPE
module that passes its offset to `mx.fast.rope`: plain, Llama 3 scaled, YaRN, ...),
qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorm), phi3 (fused q|k|v and gate|up),
olmo2 (no pre-norms; norms on the attention and MLP outputs; q/k RMSNorm over all heads),
granite (embedding, residual and logit multipliers), gemma3_text (sandwich norms with
1 + w, GELU-tanh gate, scaled embedding, sliding-window layers: the window is the cache's,
so a decode step needs no mask) and gemma2 (gemma's sandwich norms, soft-capped attention
and final logits). Before a model is
batched, one batched step over two rows is compared with the model's own forward
(`_agrees_with_forward`); on a mismatch or for any other structure `batch_support` says
no, with the reason (start-up log and `/health`), and the engine decodes sessions one by
one. The attention call goes through the hooked `scaled_dot_product_attention` of the
attention's own module, so segmented caches are served by the segment route and stock
caches by mlx-lm's own function; gemma2's attention, which soft-caps its scores inline,
goes to `segmented_sdpa` with the cap (segmented caches) or to the same formula over the
stock cache's K/V (`reference_attention`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text, granite, llama, olmo2, phi3, qwen2, qwen3

from segserve.kernels import block_cpu
from segserve.kernels.act_cpu import stock_type
from segserve.kernels.batch_attention import (
    BatchPlan,
    LseFn,
    OwnedFn,
    attend_batch,
    batchable,
    plan_batch,
)
from segserve.kernels.block_cpu import BlockShape, NativeBlock, PostFn, PreFn
from segserve.kernels.hook import RoutedGemma2Attention, segmented_sdpa
from segserve.kernels.qmm_cpu import float_x
from segserve.kernels.thread_compile import compile_per_thread
from segserve.kv.segmented import SegmentedLayerCache
from segserve.kv.shape import ModelShape
from segserve.server.runner.forward import (
    decode_pipeline_layers,
    embedding_rows,
    finish_logits,
    head_of,
)
from segserve.server.runner.gemma2_window import WindowedGemma2

log = logging.getLogger("segserve.runner")

_LLAMA = BlockShape()
_GEMMA3 = BlockShape(attn_out_norm="post_attention_layernorm", mlp_in_norm="pre_feedforward_layernorm",
                     mlp_out_norm="post_feedforward_layernorm", qk_norm="head", gelu_gate=True,
                     norm_plus_one=True, clip_residual=True)
_GEMMA2 = BlockShape(attn_out_norm="post_attention_layernorm", mlp_in_norm="pre_feedforward_layernorm",
                     mlp_out_norm="post_feedforward_layernorm", gelu_gate=True, norm_plus_one=True)
# Block class -> (its attention class, its MLP class, what the block is made of). Each
# entry reproduces that family's `TransformerBlock.__call__` in mlx-lm 0.32.2 exactly.
_BLOCKS: dict[type, tuple[type, type, BlockShape]] = {
    llama.TransformerBlock: (llama.Attention, llama.MLP, _LLAMA),
    qwen2.TransformerBlock: (qwen2.Attention, qwen2.MLP, _LLAMA),
    qwen3.TransformerBlock: (qwen3.Attention, qwen3.MLP, BlockShape(qk_norm="head")),
    phi3.TransformerBlock: (phi3.Attention, phi3.MLP,
                            BlockShape(fused_qkv="qkv_proj", fused_gate_up="gate_up_proj")),
    olmo2.TransformerBlock: (olmo2.Attention, olmo2.MLP, BlockShape(
        in_norm=None, attn_out_norm="post_attention_layernorm", mlp_in_norm=None,
        mlp_out_norm="post_feedforward_layernorm", qk_norm="all")),
    granite.TransformerBlock: (granite.Attention, granite.MLP, BlockShape(residual_multiplier=True)),
    gemma3_text.TransformerBlock: (gemma3_text.Attention, gemma3_text.MLP, _GEMMA3),
    gemma2.TransformerBlock: (gemma2.Attention, gemma2.MLP, _GEMMA2),
}
# Model class -> what its own forward does before the blocks: "embed" (scales the
# embedding rows), as in mlx-lm 0.32.2 (after them: `finish_logits`).
_MODELS: dict[type, frozenset[str]] = {
    llama.Model: frozenset(), qwen2.Model: frozenset(), qwen3.Model: frozenset(),
    phi3.Model: frozenset(), olmo2.Model: frozenset(),
    granite.Model: frozenset({"embed"}), gemma3_text.Model: frozenset({"embed"}),
    gemma2.Model: frozenset({"embed"}), WindowedGemma2: frozenset({"embed"}),
}
# Attention classes the hook routes (segserve.kernels.hook) -> the mlx-lm class they compute.
_ROUTED_ATTENTION: dict[type, type] = {RoutedGemma2Attention: gemma2.Attention}


@dataclass(frozen=True, slots=True)
class BatchSupport:
    ok: bool
    reason: str  # why not, or what serves (start-up log, /health)


class DecodeBackend:
    """One model's batched decode. `model`, `shape` and `native_layers` (the
    `cpu_native_layers` setting: the decode layers may run on the native CPU ops) are fixed
    at construction; the compiled layers and the support verdict are built once, on first
    use (engine thread), and kept here for every runner over the model."""

    __slots__ = ("model", "shape", "native_layers", "_layers", "_support")

    def __init__(self, model: nn.Module, shape: ModelShape, *, native_layers: bool = True) -> None:
        self.model = model
        self.shape = shape
        self.native_layers = native_layers
        self._layers: tuple[_CompiledLayer, ...] | None = None
        self._support: BatchSupport | None = None

    def use_layers(self, layers: Sequence[_CompiledLayer]) -> None:
        """Serve decode steps with these compiled layers (benchmarks compare variants)."""
        self._layers = tuple(layers)


def batch_supported(backend: DecodeBackend) -> bool:
    return batch_support(backend).ok


def batch_support(backend: DecodeBackend) -> BatchSupport:
    """Can this model's decode steps be batched? Decided once per backend (the first call
    builds the compiled layers and runs the comparison), logged once."""
    if backend._support is not None:
        return backend._support
    model = backend.model
    why = _structure_gap(model)
    if why is None and _compiled_layers(backend) is None:
        why = "the layers could not be compiled for batched decode"
    if why is None:
        with float_x():  # the structure, not the rounding of x (qmm_cpu.float_x)
            why = _agrees_with_forward(backend)
    verdict = BatchSupport(why is None, why or f"{type(model).__module__.rsplit('.', 1)[-1]} "
                           "blocks batched (checked against the model's own forward)")
    (log.info if verdict.ok else log.warning)(
        "batched decode: %s", verdict.reason if verdict.ok else f"off, {verdict.reason}")
    backend._support = verdict
    return verdict


def _structure_gap(model: nn.Module) -> str | None:
    """None when every layer has a structure `_CompiledLayer` reproduces, else why not."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if type(model) not in _MODELS:
        return f"the {family} architecture's decoder blocks are not built for batched decode"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return "the model has no decoder layers list"
    for layer in layers:
        shape = _BLOCKS.get(type(layer))
        # The MLP's exact type (or the activation-routed class standing for it: act_cpu).
        attn = _ROUTED_ATTENTION.get(type(layer.self_attn), type(layer.self_attn))
        if shape is None or attn is not shape[0] or stock_type(type(layer.mlp)) is not shape[1]:
            return f"layer type {type(layer).__name__} of {family} is not built for batched decode"
        if not callable(getattr(layer.self_attn, "rope", None)):
            return "a layer has no RoPE module"
    if head_of(model) is None:
        return "no output projection found"
    return None


def _embed(backend: DecodeBackend, tokens: Sequence[int] | mx.array) -> mx.array:
    """The embedding rows [B, 1, hidden] as the model's own forward scales them. `tokens`
    may be a lazy array (a pipelined step feeds the previous step's draws)."""
    model = backend.model
    inner: Any = model.model
    ids = tokens.astype(mx.int32) if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
    h = embedding_rows(model, ids[:, None])
    if "embed" in _MODELS[type(model)]:
        if type(model) is granite.Model:
            h = h * inner.embedding_multiplier
        elif isinstance(model, gemma2.Model):  # a Python float, as its forward multiplies
            h = h * (backend.shape.hidden_size**0.5)
        else:  # gemma3: sqrt(hidden) rounded to bfloat16 first, as its forward does
            h = h * mx.array(backend.shape.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
    return h


def _logits(model: nn.Module, h: mx.array) -> mx.array:
    """Final norm and output projection of [B, 1, hidden] -> [B, V]."""
    return finish_logits(model, head_of(model)(model.model.norm(h))[:, 0, :])


def _agrees_with_forward(backend: DecodeBackend) -> str | None:
    """One batched step over two rows against the model's own forward, one row at a time,
    on stock caches: None when the logits match (float rounding), else the reason."""
    from mlx_lm.models.cache import KVCache

    from segserve.kernels.qmm_cpu import error_and_tolerance

    model = backend.model
    n = len(model.model.layers)
    # The model's own caches where it makes them: a sliding-window layer's window is its
    # RotatingKVCache (a decode step has no mask; a plain KVCache would see every key).
    own: Any = getattr(model, "make_cache", None)

    def fresh() -> list[Any]:
        caches = list(own()) if callable(own) else [KVCache() for _ in range(n)]
        # A few rows each: mlx-lm's caches grow by 256 rows, ~15 MB a set on a 28-layer
        # 0.4B model in float32, and the check holds up to three sets at once.
        for c in caches:
            if hasattr(c, "step"):
                c.step = 16
        return caches

    vocab = backend.shape.vocab_size or 2
    prompts = [[(7 * i + 3) % vocab for i in range(5)], [(11 * i + 1) % vocab for i in range(9)]]
    nxt = [prompts[0][-1], prompts[1][0]]
    try:
        batched_caches = [fresh() for _ in prompts]
        for p, caches in zip(prompts, batched_caches, strict=True):
            model(mx.array([p]), cache=caches)
        got = decode_batch(backend, nxt, batched_caches)
        mx.eval(got)
        del batched_caches  # each part evaluated as it comes: the check's peak is one part's
        refs, alts = [], []
        for p, t in zip(prompts, nxt, strict=True):
            caches = fresh()
            model(mx.array([p]), cache=caches)
            refs.append(model(mx.array([[t]]), cache=caches)[0, -1])
            mx.eval(refs[-1])
            # The same logits computed another way (one prefill over prompt + token): how far
            # two exact plans drift apart in this dtype. In bfloat16 over 32 layers that is
            # several ulps of the logits (0.03 on an 8B shape), far above float32's 1e-3
            # relative, and the batched step may differ from the forward by as much.
            alts.append(model(mx.array([p + [t]]), cache=fresh())[0, -1])
            mx.eval(alts[-1])
    except Exception as exc:  # any failure means: decode one by one, as before
        return f"batched step failed its check ({type(exc).__name__}: {exc})"
    for i, (ref, alt) in enumerate(zip(refs, alts, strict=True)):
        ref32 = ref.astype(mx.float32)
        # The two plans below share their rounding where the forward rounds its own way: gemma2's
        # scores, soft-capped in bfloat16 by mlx-lm and in float32 by the batched step. Measured on
        # a tiny random gemma2 in bfloat16: batched and forward both ~0.18-0.21 from the same
        # weights in float32, 0.17-0.22 apart (3 bfloat16 epsilons of the peak logit). So a
        # half-precision model may differ by 8 of its epsilons; a wrong structure errs by the
        # logits' own size, and float32 models keep 1e-3.
        half = ref.dtype in (mx.bfloat16, mx.float16)
        rel = max(1e-3, 8.0 * mx.finfo(ref.dtype).eps) if half else 1e-3
        err, tol = error_and_tolerance(got[i].astype(mx.float32), ref32, rel=rel)
        noise, _ = error_and_tolerance(alt.astype(mx.float32), ref32)
        tol = max(tol, 4.0 * noise)
        if not err <= tol:
            return f"batched step disagrees with the model's forward ({err:.3g} > {tol:.3g})"
    return None


class _CompiledLayer:
    """One layer's decode step outside attention, compiled (elementwise ops fused).

    `pre`: [norm], q/k/v projections, [q/k norm], head split, RoPE at each row's own
    position (one `mx.fast.rope` call with a vector of offsets). `post`: output projection,
    [norm], residual, [norm], MLP, [norm], residual (the block's `BlockShape`). Only the
    cache write and the attention stay per session. Compiled graphs depend on the batch
    size only (one trace per distinct B).
    """

    def __init__(self, layer: Any, native: NativeBlock | None = None) -> None:
        self.layer = layer
        self.native = native
        self.shape: BlockShape = _BLOCKS[type(layer)][2]
        self.pre: PreFn = native.pre if native is not None else compile_per_thread(self._pre)
        self.post: PostFn = native.post if native is not None else compile_per_thread(self._post)

    def _norm(self, name: str | None, x: mx.array) -> mx.array:
        return x if name is None else getattr(self.layer, name)(x)

    def _pre(self, h: mx.array, offsets: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        attn, b, s = self.layer.self_attn, h.shape[0], self.shape
        x = self._norm(s.in_norm, h)  # x: [B, 1, hidden]
        if s.fused_qkv is not None:  # phi3: one product, rows q | k | v
            qkv = getattr(attn, s.fused_qkv)(x)
            dkv = qkv.shape[-1] // (attn.n_heads + 2 * attn.n_kv_heads) * attn.n_kv_heads
            dq = qkv.shape[-1] - 2 * dkv
            q, k, v = mx.split(qkv, [dq, dq + dkv], axis=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if s.qk_norm == "all":  # olmo2: RMSNorm over all heads at once
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q.reshape(b, 1, attn.n_heads, -1)
        k = k.reshape(b, 1, attn.n_kv_heads, -1)
        v = v.reshape(b, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if s.qk_norm == "head":  # qwen3, gemma3: RMSNorm over each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)  # [B, H, 1, D]
        # Every mlx-lm RoPE module hands its offset to mx.fast.rope, which takes one
        # offset per batch row: each session's own position.
        return attn.rope(q, offset=offsets), attn.rope(k, offset=offsets), v

    def _residual(self, h: mx.array, r: mx.array) -> mx.array:
        if self.shape.residual_multiplier:  # granite
            r = r * self.layer.residual_multiplier
        return gemma3_text.clip_residual(h, r) if self.shape.clip_residual else h + r

    def _post(self, h: mx.array, o: mx.array) -> mx.array:
        b, s = h.shape[0], self.shape
        a = self.layer.self_attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, 1, -1))
        h = self._residual(h, self._norm(s.attn_out_norm, a))
        m = self.layer.mlp(self._norm(s.mlp_in_norm, h))
        return self._residual(h, self._norm(s.mlp_out_norm, m))


def _compiled_layers(backend: DecodeBackend) -> list[_CompiledLayer] | None:
    """The model's compiled layers (built once per backend; `_structure_gap` said yes), or None."""
    if backend._layers is not None:
        return list(backend._layers) or None
    native = backend.native_layers
    built = [_CompiledLayer(layer, block_cpu.for_layer(layer, _BLOCKS[type(layer)][2]) if native else None)
             for layer in backend.model.model.layers]
    if built and all(c.native is not None for c in built):
        built = _checked_native(built, backend.shape.hidden_size)
    backend._layers = tuple(built)
    return built or None


def _checked_native(built: list[_CompiledLayer], hidden: int) -> list[_CompiledLayer]:
    """The start-up self-check of the native layer ops (segserve.kernels.block_cpu) on the first
    layer against the MLX ops they replace; on a mismatch every layer keeps MLX's ops."""
    first = built[0]
    assert first.native is not None
    with float_x():  # the structure, not the rounding of x (qmm_cpu.float_x)
        ok, why = block_cpu.agree(first.native, first._pre, first._post, hidden)
    if ok:
        log.info("decode layers: native CPU ops (%s)", why)
        return built
    log.warning("decode layers: MLX ops, native CPU ops disagree (%s)", why)
    return [_CompiledLayer(c.layer) for c in built]


def _batch_plan(caches: Sequence[Any], dtype: mx.Dtype) -> tuple[BatchPlan, LseFn, OwnedFn | None] | None:
    """The step's batched-attention plan when every session's cache is segmented on a
    route that serves a shared part with its LSE (the fused CUDA route's `attend_lse`),
    with the route's owned part for sessions of distinct histories where it has one
    (`attend_owned`), else None (per-session calls). B = 1 keeps the per-session call:
    one fused launch."""
    if len(caches) < 2 or not batchable(caches, dtype):
        return None
    route = caches[0].route
    shared = getattr(route, "attend_lse", None)
    if shared is None or any(c.route is not route for c in caches):
        return None
    owned = getattr(route, "attend_owned", None) if getattr(route, "owned_launches", True) else None
    return plan_batch(caches), shared, owned


def _attend_rows(attn: Any, q: mx.array, k: mx.array, v: mx.array, caches: Sequence[Any],
                 batch: tuple[BatchPlan, LseFn, OwnedFn | None] | None = None,
                 window: int | None = None) -> mx.array:
    """One decode row per session through the layer's attention. `window`: the layer's
    sliding window, for stock caches (a segmented cache knows its own)."""
    if isinstance(attn, gemma2.Attention):
        return _attend_capped(attn, q, k, v, caches, window)
    if batch is not None:  # shared-part calls per history group + one tail op
        return attend_batch(q, k, v, caches, batch[0], attn.scale, batch[1], batch[2])
    outs = []
    one = len(caches) == 1  # no row slices (each is a graph node)
    for i, cache in enumerate(caches):
        qi, kn, vn = (q, k, v) if one else (q[i : i + 1], k[i : i + 1], v[i : i + 1])
        # A segmented cache whose route writes and attends in one op (segserve.kv.segmented).
        fused = getattr(cache, "write_attend", None)
        out = fused(qi, kn, vn, attn.scale) if fused is not None else None
        if out is None:
            ki, vi = cache.update_and_fetch(kn, vn)
            ki, vi = _in_window(ki, vi, cache, window)
            # The hooked name, in the attention's own module (where segserve.kernels.hook patches it).
            sdpa: Any = sys.modules[type(attn).__module__].scaled_dot_product_attention
            out = sdpa(qi, ki, vi, cache=cache, scale=attn.scale, mask=None)
        outs.append(out)  # [1, Hq, 1, D]
    return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


def _softcap(attn: Any) -> float:
    """The attention's score cap (gemma2), 0 for none."""
    return float(attn.attn_logit_softcapping) if isinstance(attn, gemma2.Attention) else 0.0


def _attend_capped(attn: Any, q: mx.array, k: mx.array, v: mx.array, caches: Sequence[Any],
                   window: int | None = None) -> mx.array:
    """gemma2's soft-capped attention, one session at a time (no fused write-and-attend or
    batched plan computes the cap): `segmented_sdpa` with it, for either kind of cache."""
    cap = _softcap(attn)
    outs = []
    for i, cache in enumerate(caches):
        qi, kn, vn = (q, k, v) if len(caches) == 1 else (q[i : i + 1], k[i : i + 1], v[i : i + 1])
        ki, vi = cache.update_and_fetch(kn, vn)
        ki, vi = _in_window(ki, vi, cache, window)
        outs.append(segmented_sdpa(qi, ki, vi, cache, attn.scale, None, softcap=cap))
    return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


def _in_window(keys: mx.array, values: mx.array, cache: Any, window: int | None) -> tuple[mx.array, mx.array]:
    """A stock cache's keys/values as a decode row of a sliding-window layer sees them: the
    last `window` (its own included). Why here: the batched step passes no mask (one row
    per session), and a stock cache keeps every row, so without this a windowed layer
    would attend globally. A segmented cache applies its window itself (unchanged)."""
    if window is None or isinstance(cache, SegmentedLayerCache) or keys.shape[2] <= window:
        return keys, values
    return keys[:, :, -window:, :], values[:, :, -window:, :]


AttendFn = Callable[[int, Any, mx.array, mx.array, mx.array], mx.array]
# (layer index, its layer, rows h) -> h after the whole layer as one op, or None.
WholeFn = Callable[[int, _CompiledLayer, mx.array], mx.array | None]


def _through_layers(compiled: Sequence[_CompiledLayer], h: mx.array, offsets: mx.array,
                    attend: AttendFn, every: int, whole: WholeFn | None = None) -> mx.array:
    """Every layer on rows `h` at positions `offsets`: `whole(layer index, layer, h)` when
    it serves the layer, else pre, `attend(layer index, attention module, q, k, v)` (the
    caches' part), post; an asynchronous evaluation every `every` layers. Returns the last
    hidden rows (lazy)."""
    for li, fns in enumerate(compiled):
        out = whole(li, fns, h) if whole is not None else None
        if out is not None:
            h = out
        else:
            q, k, v = fns.pre(h, offsets)
            h = fns.post(h, attend(li, fns.layer.self_attn, q, k, v))
        if every and (li + 1) % every == 0 and li + 1 < len(compiled):
            mx.async_eval(h)  # type: ignore[no-untyped-call]  # unannotated in mlx's stub
    return h


def _whole_layer(caches: Sequence[Any], offsets: mx.array) -> WholeFn:
    """One session's layers as single native ops (`NativeBlock.layer`) where its cache
    hands out its tail for an in-place write (`write_with`: the CPU's fused route)."""

    def whole(li: int, fns: _CompiledLayer, h: mx.array) -> mx.array | None:
        native, write_with = fns.native, getattr(caches[li], "write_with", None)
        if native is None or write_with is None:
            return None
        attn = fns.layer.self_attn
        cap = _softcap(attn)
        window = getattr(caches[li], "window", None)

        def build(pieces: list[mx.array], _k: mx.array, _v: mx.array, start: int) -> mx.array | None:
            # A window that starts inside the tail: the op reads the tail from its first row
            # (the pieces are then the buffers alone), as the three ops' clipped view does.
            tail_from = max(0, start + 1 - window) if window is not None else 0
            return native.layer(h, offsets, pieces, start, attn.scale, cap, tail_from)

        out: mx.array | None = write_with(native.kv_row, build)
        return out

    return whole


def decode_batch(backend: DecodeBackend, tokens: Sequence[int] | mx.array,
                 caches: Sequence[Sequence[Any]], every: int | None = None,
                 whole_layers: bool = True) -> mx.array:
    """Feed one token per session; returns logits [B, V] (lazy). caches[b][layer].
    `tokens`: ids, or a lazy [B] array of them (the step in flight's draws).
    `every`: layers per asynchronous evaluation (None: `decode_pipeline_layers()`).
    `whole_layers`: one session's native layers as one op each (`_whole_layer`); False
    keeps three (benchmarks and tests compare both)."""
    every = decode_pipeline_layers() if every is None else every
    h = _embed(backend, tokens)  # [B, 1, hidden]
    compiled = _compiled_layers(backend)
    assert compiled is not None
    offsets = mx.array([c[0].offset for c in caches], dtype=mx.int32)  # each row's position
    # Built once per step, reused by every layer (layers differ only in their K/V arrays).
    batch = _batch_plan([c[0] for c in caches], h.dtype)

    windows = backend.shape.windows

    def attend(li: int, attn: Any, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        window = windows[li] if li < len(windows) else None
        return _attend_rows(attn, q, k, v, [c[li] for c in caches], batch, window)

    whole = _whole_layer(caches[0], offsets) if whole_layers and len(caches) == 1 else None
    return _logits(backend.model, _through_layers(compiled, h, offsets, attend, every, whole))


def decode_window(backend: DecodeBackend, tokens: Sequence[int], layers: Sequence[Any]) -> mx.array:
    """Several consecutive tokens of one session (a speculative verify window) through the
    batched step's layers: logits [L, V] (lazy), one row per token, written to `layers`.

    Why: the model's plain forward costs ~70 MLX ops per layer, so on the CPU a window of 9
    rows cost ~7 decode steps; here each layer's work outside attention is the decode step's
    (the native CPU ops or the compiled graphs) with the L rows as its batch, each at its
    own position, and the products read every weight once for all rows. Attention is one
    call per layer with L query rows, causal inside the tail (`segmented_sdpa`: the layer's
    window and gemma2's cap included). `layers`: the session's segmented layer caches."""
    return decode_windows(backend, [tokens], [layers])


def decode_windows(backend: DecodeBackend, windows: Sequence[Sequence[int]],
                   caches: Sequence[Sequence[Any]]) -> mx.array:
    """Each session's own run of consecutive tokens (a verify window of 1 + K_i rows, or
    the one token of a session that drafted nothing) through the batched step's layers in
    one forward: logits [sum L_i, V] (lazy), the sessions' rows in order. `caches[i]` is
    session i's layer caches, each written with its L_i rows.

    The rows of every session are one batch for the work outside attention (each weight is
    read once per step, whatever the draft lengths); attention is per session: one causal
    call over its cache for a window (as `decode_window`), the decode step's own call for a
    single row (`_attend_rows`, the fused write-and-attend where the route has it)."""
    lengths = [len(w) for w in windows]
    if not lengths or min(lengths) < 1:
        raise ValueError("every session needs at least one token")
    h = _embed(backend, [t for w in windows for t in w])  # [N, 1, hidden]
    compiled = _compiled_layers(backend)
    assert compiled is not None
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    offsets = mx.array([c[0].offset + j for c, n in zip(caches, lengths, strict=True) for j in range(n)],
                       dtype=mx.int32)

    def attend(li: int, attn: Any, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        outs = []
        for i, n in enumerate(lengths):
            a, e = starts[i], starts[i + 1]
            qi, ki, vi = (q, k, v) if len(lengths) == 1 else (q[a:e], k[a:e], v[a:e])
            cache = caches[i][li]
            if n == 1:
                outs.append(_attend_rows(attn, qi, ki, vi, [cache]))
                continue
            # The rows came as a batch [L, H, 1, D]; the cache and attention take [1, H, L, D].
            keys, values = cache.update_and_fetch(ki.transpose(2, 1, 0, 3), vi.transpose(2, 1, 0, 3))
            o = segmented_sdpa(qi.transpose(2, 1, 0, 3), keys, values, cache, attn.scale, "causal",
                               softcap=_softcap(attn))
            outs.append(o.transpose(2, 1, 0, 3))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    return _logits(backend.model, _through_layers(compiled, h, offsets, attend, decode_pipeline_layers()))


def batch_verdict(backend: DecodeBackend) -> BatchSupport | None:
    """The decision `batch_support` made for this model, if it ran (reads no MLX state:
    safe off the engine thread, e.g. for `/health`)."""
    return backend._support
