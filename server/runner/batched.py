"""Batched decode: one forward pass for the next token of several sessions.

Owns: `batch_supported(model)` and `decode_batch(model, tokens, caches)`. Engine thread only.

Why: on a CPU, decode is bound by reading the weights (one row times every matrix). With
B sessions stacked into one [B, 1, hidden] input every weight is read once for all of
them, so B streams cost little more than one (bench/batch_decode.py measures it).
Attention stays per session: each has its own segments, tail, RoPE offset and length, so
the per-layer loop runs the projections batched and the cache/attention part per row.

Every decode step of a supported model goes through here, B = 1 included: outside
attention each layer runs as two compiled graphs (see `_CompiledLayer`), which fuses the
elementwise work between the matmuls (`python bench/batch_decode.py`: one stream 16.0
tok/s against 13.9 through the plain forward).

Scope: mlx-lm's llama family layer structure (`mlx_lm.models.llama.TransformerBlock`
with its `Attention`/`MLP`); `batch_supported` says no for anything else and the engine
then decodes sessions one by one. The attention call goes through the hooked
`scaled_dot_product_attention` of the llama module, so segmented caches are served by the
segment route and stock caches by mlx-lm's own function.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from kernels import block_cpu
from kernels.block_cpu import NATIVE_LAYERS_ATTR, NativeBlock, PostFn, PreFn
from server.runner.forward import decode_pipeline_layers, head_of

log = logging.getLogger("segserve.runner")


def batch_supported(model: nn.Module) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return (
        type(model) is llama.Model
        and bool(layers)
        and all(type(layer) is llama.TransformerBlock for layer in layers)  # type: ignore[union-attr]
        and head_of(model) is not None
        and _compiled_layers(model) is not None
    )


class _CompiledLayer:
    """One layer's decode step outside attention, compiled (elementwise ops fused).

    `pre`: norm, q/k/v projections, head split, RoPE at each row's own position (one
    `mx.fast.rope` call with a vector of offsets). `post`: output projection, residual,
    norm, MLP, residual. Only the cache write and the attention stay per session.
    Compiled graphs depend on the batch size only (one trace per distinct B).
    """

    def __init__(self, layer: Any, native: NativeBlock | None = None) -> None:
        self.layer = layer
        self.native = native
        self.pre: PreFn = native.pre if native is not None else mx.compile(self._pre)
        self.post: PostFn = native.post if native is not None else mx.compile(self._post)

    def _pre(self, h: mx.array, offsets: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        attn, b = self.layer.self_attn, h.shape[0]
        x = self.layer.input_layernorm(h)  # x: [B, 1, hidden]
        q = attn.q_proj(x).reshape(b, 1, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(x).reshape(b, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = attn.v_proj(x).reshape(b, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        r = attn.rope  # q: [B, Hq, 1, D]; k, v: [B, Hkv, 1, D]
        kw = {"traditional": r.traditional, "base": r.base, "scale": r.scale, "offset": offsets}
        return mx.fast.rope(q, r.dims, **kw), mx.fast.rope(k, r.dims, **kw), v

    def _post(self, h: mx.array, o: mx.array) -> mx.array:
        b = h.shape[0]
        h = h + self.layer.self_attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, 1, -1))
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))  # type: ignore[no-any-return]


def _compiled_layers(model: nn.Module) -> list[_CompiledLayer] | None:
    """Per-model compiled layers (built once), or None when RoPE is not the plain kind."""
    cached = getattr(model, "_segserve_compiled_layers", None)
    if cached is not None:
        return list(cached) or None
    layers = model.model.layers
    plain = all(type(layer.self_attn.rope) is nn.RoPE for layer in layers)
    # `load_model` records the `cpu_native_layers` setting on the model (default on).
    native = bool(getattr(model, NATIVE_LAYERS_ATTR, True))
    built = [_CompiledLayer(layer, block_cpu.for_layer(layer) if native else None)
             for layer in layers] if plain else []
    if built and all(c.native is not None for c in built):
        built = _checked_native(built, int(model.args.hidden_size))
    object.__setattr__(model, "_segserve_compiled_layers", tuple(built))
    return built or None


def _checked_native(built: list[_CompiledLayer], hidden: int) -> list[_CompiledLayer]:
    """The start-up self-check of the native layer ops (kernels.block_cpu) on the first
    layer against the MLX ops they replace; on a mismatch every layer keeps MLX's ops."""
    first = built[0]
    assert first.native is not None
    ok, why = block_cpu.agree(first.native, first._pre, first._post, hidden)
    if ok:
        log.info("decode layers: native CPU ops (%s)", why)
        return built
    log.warning("decode layers: MLX ops, native CPU ops disagree (%s)", why)
    return [_CompiledLayer(c.layer) for c in built]


def _attend_rows(attn: Any, q: mx.array, k: mx.array, v: mx.array, caches: Sequence[Any]) -> mx.array:
    outs = []
    one = len(caches) == 1  # no row slices (each is a graph node)
    for i, cache in enumerate(caches):
        qi, kn, vn = (q, k, v) if one else (q[i : i + 1], k[i : i + 1], v[i : i + 1])
        # A segmented cache whose route writes and attends in one op (kv.segmented).
        fused = getattr(cache, "write_attend", None)
        out = fused(qi, kn, vn, attn.scale) if fused is not None else None
        if out is None:
            ki, vi = cache.update_and_fetch(kn, vn)
            # The hooked name (kernels.hook patches it into mlx-lm's llama module).
            sdpa: Any = llama.scaled_dot_product_attention  # type: ignore[attr-defined]
            out = sdpa(qi, ki, vi, cache=cache, scale=attn.scale, mask=None)
        outs.append(out)  # [1, Hq, 1, D]
    return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


def decode_batch(model: nn.Module, tokens: Sequence[int], caches: Sequence[Sequence[Any]],
                 every: int | None = None) -> mx.array:
    """Feed one token per session; returns logits [B, V] (lazy). caches[b][layer].
    `every`: layers per asynchronous evaluation (None: `decode_pipeline_layers()`)."""
    every = decode_pipeline_layers() if every is None else every
    inner: Any = model.model
    h = inner.embed_tokens(mx.array(list(tokens), dtype=mx.int32)[:, None])  # [B, 1, hidden]
    compiled = _compiled_layers(model)
    assert compiled is not None
    offsets = mx.array([c[0].offset for c in caches], dtype=mx.int32)  # each row's position
    for li, fns in enumerate(compiled):
        q, k, v = fns.pre(h, offsets)
        o = _attend_rows(fns.layer.self_attn, q, k, v, [c[li] for c in caches])
        h = fns.post(h, o)
        if every and (li + 1) % every == 0 and li + 1 < len(compiled):
            mx.async_eval(h)  # type: ignore[no-untyped-call]  # unannotated in mlx's stub
    h = inner.norm(h)
    head = head_of(model)
    assert head is not None
    return head(h)[:, 0, :]  # type: ignore[no-any-return]
