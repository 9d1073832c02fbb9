"""Batched decode: one forward pass for the next token of several sessions.

Owns: `batch_supported(model)` and `decode_batch(model, tokens, caches)`. Engine thread only.

Why: on a CPU, decode is bound by reading the weights (one row times every matrix). With
B sessions stacked into one [B, 1, hidden] input every weight is read once for all of
them, so B streams cost little more than one (bench/batch_decode.py measures it).
Attention stays per session: each has its own segments, tail, RoPE offset and length, so
the per-layer loop runs the projections batched and the cache/attention part per row.

Scope: mlx-lm's llama family layer structure (`mlx_lm.models.llama.TransformerBlock`
with its `Attention`/`MLP`); `batch_supported` says no for anything else and the engine
then decodes sessions one by one. The attention call goes through the hooked
`scaled_dot_product_attention` of the llama module, so segmented caches are served by the
segment route and stock caches by mlx-lm's own function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from server.forward import head_of


def batch_supported(model: nn.Module) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return (
        type(model) is llama.Model
        and bool(layers)
        and all(type(layer) is llama.TransformerBlock for layer in layers)  # type: ignore[union-attr]
        and head_of(model) is not None
    )


def _attention(attn: Any, x: mx.array, caches: Sequence[Any]) -> mx.array:
    # x: [B, 1, hidden]; one cache per row
    b = x.shape[0]
    q = attn.q_proj(x).reshape(b, 1, attn.n_heads, -1).transpose(0, 2, 1, 3)  # [B, Hq, 1, D]
    k = attn.k_proj(x).reshape(b, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)  # [B, Hkv, 1, D]
    v = attn.v_proj(x).reshape(b, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    outs = []
    for i, cache in enumerate(caches):
        qi = attn.rope(q[i : i + 1], offset=cache.offset)
        ki = attn.rope(k[i : i + 1], offset=cache.offset)
        ki, vi = cache.update_and_fetch(ki, v[i : i + 1])
        outs.append(
            llama.scaled_dot_product_attention(qi, ki, vi, cache=cache, scale=attn.scale, mask=None)
        )  # [1, Hq, 1, D]
    o = mx.concatenate(outs, axis=0).transpose(0, 2, 1, 3).reshape(b, 1, -1)
    return attn.o_proj(o)  # type: ignore[no-any-return]


def decode_batch(model: nn.Module, tokens: Sequence[int], caches: Sequence[Sequence[Any]]) -> mx.array:
    """Feed one token per session; returns logits [B, V] (lazy). caches[b][layer]."""
    inner: Any = model.model  # type: ignore[attr-defined]
    h = inner.embed_tokens(mx.array(list(tokens), dtype=mx.int32)[:, None])  # [B, 1, hidden]
    for li, layer in enumerate(inner.layers):
        r = _attention(layer.self_attn, layer.input_layernorm(h), [c[li] for c in caches])
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = inner.norm(h)
    head = head_of(model)
    assert head is not None
    return head(h)[:, 0, :]  # type: ignore[no-any-return]
