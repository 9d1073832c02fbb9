"""The attention hook: routes a segmented cache to segment attention inside mlx-lm models.

Owns: `install(model)`, `support_check(model, shape)`, `layer_windows(model)`, `shape_support(...)`,
the replacement `scaled_dot_product_attention` and the routed gemma2 attention.

Every mlx-lm 0.32.2 model module imports `scaled_dot_product_attention` by name from
`mlx_lm.models.base` and calls it with `cache=`. So the hook replaces that name in each
module the loaded model's layers come from (one place, at load time). The replacement
holds no state: it routes on the cache's type. A `SegmentedLayerCache` goes to the route
that cache carries (`SegmentedCache(..., route=...)`; keys and values passed in are the
tail rows, the sealed segments come from the cache); anything else goes to the original
function unchanged, so stock mode is exactly mlx-lm. Because the route travels with the
cache and not in a process-wide global, two engines with different routes can coexist.

gemma2 is the exception: its attention soft-caps the scores inline (cap * tanh(s / cap))
and never calls that name. `install` gives its attention layers a subclass whose
`__call__` routes a segmented cache with the cap (`softcap=`: the CPU op and the composed
route compute it) and runs mlx-lm's own code for any other cache.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base
from mlx_lm.models import gemma2
from mlx_lm.models.cache import KVCache, RotatingKVCache

from segserve.kernels.composed import SUPPORTED_HEAD_DIMS
from segserve.kernels.selfcheck import reference_attention
from segserve.kv.segmented import SegmentedLayerCache
from segserve.kv.shape import ModelShape

_STOCK = mlx_base.scaled_dot_product_attention
_HOOK_ATTR = "scaled_dot_product_attention"

Route = Callable[..., mx.array]


@dataclass(frozen=True, slots=True)
class Support:
    ok: bool
    reason: str
    head_dim: int
    n_q_heads: int
    n_kv_heads: int
    windows: tuple[int, ...] = ()  # the distinct sliding windows of the model's layers
    softcap: float = 0.0  # the attention logits' soft cap (gemma2), 0: none


def segmented_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
    softcap: float = 0.0,
) -> mx.array:
    if not isinstance(cache, SegmentedLayerCache):
        if softcap:  # MLX's SDPA has no capping step: the model's own formula
            if sinks is not None:
                raise NotImplementedError("attention sinks with soft-capped scores")
            return reference_attention(queries, keys, values, scale=scale, mask=mask, softcap=softcap)
        return _STOCK(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    route = cache.route
    if route is None:
        raise RuntimeError("segmented cache has no attention route (SegmentedCache(route=...))")
    if sinks is not None:
        raise NotImplementedError("attention sinks are not served by segments")
    if mask is not None and not isinstance(mask, str):
        raise NotImplementedError("explicit mask arrays are not served by segments")
    # queries: [1, Hq, L, D]; keys/values: the tail rows [1, Hkv, T, D]
    # Routes and test fakes without window / softcap arguments keep working: each is
    # passed only to the layers and models that have one.
    extra: dict[str, Any] = {}
    if cache.window is not None:
        extra["window"] = cache.window
    if softcap:
        extra["softcap"] = softcap
    return route(queries, cache.segment_kv(), (keys, values), scale=scale, causal=mask == "causal", **extra)


class RoutedGemma2Attention(gemma2.Attention):
    """mlx-lm 0.32.2's gemma2 attention with segmented caches routed (`segmented_sdpa`
    with the model's soft cap); any other cache runs the parent's code unchanged."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not isinstance(cache, SegmentedLayerCache):
            return super().__call__(x, mask, cache)
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=cache.offset)
        k = self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        # The segmented cache's mask is "causal" / None (`SegmentedLayerCache.make_mask`).
        out = segmented_sdpa(q, k, v, cache, self.scale, mask, softcap=float(self.attn_logit_softcapping))
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))  # type: ignore[no-any-return]


def _gemma2_attention(model: nn.Module) -> bool:
    """Whether every layer's attention is gemma2's (routed or not yet)."""
    layers = getattr(model, "layers", None) or []
    return bool(layers) and all(
        type(getattr(layer, "self_attn", None)) in (gemma2.Attention, RoutedGemma2Attention) for layer in layers
    )


def _attention_modules(model: nn.Module) -> list[Any]:
    mods: dict[str, Any] = {}
    for _, m in model.named_modules():
        name = type(m).__module__
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, _HOOK_ATTR):
            mods[name] = mod
    return list(mods.values())


def support_check(model: nn.Module, shape: ModelShape) -> Support:
    """Can every layer of this model (of `shape`, read at load) be served by segments?
    (Reason when not.) Global layers and sliding-window layers (`layer_windows`) both are."""
    heads, kv_heads, head_dim = shape.n_q_heads, shape.n_kv_heads, shape.head_dim
    capping = shape.attn_logit_softcapping

    def verdict(ok: bool, reason: str, windows: tuple[int, ...] = ()) -> Support:
        return Support(ok, reason, head_dim, heads, kv_heads, windows, capping if ok else 0.0)

    routed = _gemma2_attention(model)  # its own attention class, routed by `install`
    if capping and not routed:
        return verdict(False, (
            f"attention logits are soft-capped (attn_logit_softcapping={capping}) inside this "
            "model's own attention code, which segment attention cannot serve"
        ))
    if not routed and not _attention_modules(model):
        return verdict(False, "model module does not call mlx-lm's scaled_dot_product_attention")
    if shape.cache_refusal:
        return verdict(False, shape.cache_refusal)
    windows = shape.windows
    ok, why = shape_support(head_dim, heads, kv_heads)
    if not ok:
        return verdict(False, why)
    sliding = sorted({w for w in windows if w is not None})
    if sliding:
        n = sum(w is not None for w in windows)
        capped = f", logits soft-capped at {capping:g}" if capping else ""
        return verdict(True, (
            f"{len(windows) - n} global layers and {n} sliding-window layers "
            f"(window {', '.join(str(w) for w in sliding)}) over segments{capped}"
        ), tuple(sliding))
    if capping:
        return verdict(True, f"all layers are full attention, logits soft-capped at {capping:g}")
    return verdict(True, "all layers are full attention over a plain KV cache")


def layer_windows(model: nn.Module) -> tuple[int | None, ...] | str:
    """Each layer's sliding window (None: global attention) from the model's own caches,
    or the reason the caches cannot be served by segments.

    mlx-lm's `RotatingKVCache(max_size=W, keep=0)` keeps the last W keys and its masks hide
    the rest, so the query at position p sees (p - W, p]: that is the window segments serve
    (`segserve.kernels.window`). A cache that keeps leading rows (`keep` > 0) or any other kind is
    refused by name."""
    if not hasattr(model, "make_cache"):
        return tuple(None for _ in getattr(model, "layers", ()))
    windows: list[int | None] = []
    other: set[str] = set()
    for cache in model.make_cache():
        if type(cache) is KVCache:
            windows.append(None)
        elif type(cache) is RotatingKVCache and cache.keep == 0 and cache.max_size >= 1:
            windows.append(int(cache.max_size))
        elif type(cache) is RotatingKVCache:
            other.add(f"RotatingKVCache(keep={cache.keep})")
        else:
            other.add(type(cache).__name__)
    if other:
        return f"model needs cache kinds {sorted(other)}, not plain or sliding-window KV"
    return tuple(windows)


def shape_support(head_dim: int, n_q_heads: int, n_kv_heads: int) -> tuple[bool, str]:
    """Can segment attention serve these shapes? (ok, reason); the reason says why not.
    The one place of the shape rule (head sizes: `segserve.kernels.composed.SUPPORTED_HEAD_DIMS`)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        dims = ", ".join(str(d) for d in SUPPORTED_HEAD_DIMS)
        return False, f"head_dim {head_dim} is not supported (supported: {dims})"
    if n_kv_heads <= 0 or n_q_heads <= 0:
        return False, f"head counts must be positive (q={n_q_heads}, kv={n_kv_heads})"
    if n_q_heads % n_kv_heads != 0:
        return False, (
            f"{n_q_heads} query heads are not a multiple of {n_kv_heads} KV heads "
            "(grouped-query attention needs Hq % Hkv == 0)"
        )
    return True, (
        f"supported: head_dim {head_dim}, {n_q_heads} query heads over {n_kv_heads} KV heads"
    )


def install(model: nn.Module) -> list[str]:
    """Point every module the model's layers come from at the hook; returns their names.
    Idempotent, and harmless for stock caches (the hook passes them through)."""
    patched = []
    for mod in _attention_modules(model):
        setattr(mod, _HOOK_ATTR, segmented_sdpa)
        patched.append(mod.__name__)
    swapped = False
    for _, m in model.named_modules():
        if type(m) is gemma2.Attention:
            m.__class__ = RoutedGemma2Attention
            swapped = True
    if swapped:
        patched.append(RoutedGemma2Attention.__qualname__)
    return patched


def installed(model: nn.Module) -> bool:
    if _gemma2_attention(model):
        return all(type(layer.self_attn) is RoutedGemma2Attention for layer in model.layers)
    mods = _attention_modules(model)
    return bool(mods) and all(getattr(m, _HOOK_ATTR) is segmented_sdpa for m in mods)
