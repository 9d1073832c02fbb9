"""The attention hook inside real mlx-lm model code: llama, q/k-norm (Qwen3), gated
attention (Laguna); unsupported models keep the stock cache with a reason; a failing
self-check falls back to stock mode."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.models import laguna, llama, qwen3
from mlx_lm.models.cache import KVCache, RotatingKVCache

from segserve.config.settings import load_settings
from segserve.kernels.batch_attention import plain_lse
from segserve.kernels.composed import attend_segments
from segserve.kernels.hook import install, installed, support_check
from segserve.kv.segmented import SegmentedCache
from segserve.server import runtime
from segserve.server.runner import ChatTokenizer, logits_last, model_shape
from tests.conftest import tiny_loaded

COMMON: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, head_dim=64,
    max_position_embeddings=512, tie_word_embeddings=True,
)


def _model(kind: str, **over: Any) -> nn.Module:
    mx.random.seed(1)
    if kind == "llama":
        m: nn.Module = llama.Model(llama.ModelArgs(model_type="llama", rope_theta=10000.0, **COMMON))
    elif kind == "qwen3":
        m = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", rope_theta=10000.0, **COMMON))
    else:
        args = {**COMMON, "tie_word_embeddings": False}
        m = laguna.Model(laguna.ModelArgs(
            model_type="laguna", gating=True, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, **args, **over,
        ))
    m.update(tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, m.parameters()))
    mx.eval(m.parameters())
    return m


def _greedy(model: nn.Module, caches: list[Any], prompt: list[int], n: int, seal: Any = None) -> list[int]:
    logits = logits_last(model, prompt, caches)
    if seal is not None:
        seal(prompt)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
        out.append(tok)
        logits = logits_last(model, [tok], caches)
        if seal is not None:
            seal([tok])
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3", "laguna"])
def test_segmented_matches_stock_inside_model(kind: str) -> None:
    model = _model(kind)
    assert support_check(model, model_shape(model)).ok
    install(model)
    assert installed(model)
    prompt = [(11 * i) % 250 + 1 for i in range(40)]
    stock = _greedy(model, [KVCache() for _ in range(2)], prompt, 10)
    seg = SegmentedCache(2, fanout=100, route=attend_segments)  # no merging here: many pieces through the hook

    def record_and_seal(tokens: list[int]) -> None:
        seg.record_tokens(tokens)
        if len(tokens) > 1 or seg.offset % 3 == 0:  # seal often: many segments + tail
            seg.seal()

    assert _greedy(model, list(seg.layers), prompt, 10, record_and_seal) == stock
    assert len(seg.base.segments) >= 2


def test_unserved_cache_kind_is_unsupported_with_reason() -> None:
    # Sliding-window layers are served (tests/test_sliding_window.py); a rotating cache
    # that keeps leading rows is not.
    model = _model("laguna", layer_types=["sliding_attention", "full_attention"])
    model.make_cache = lambda: [RotatingKVCache(max_size=8, keep=4), KVCache()]
    verdict = support_check(model, model_shape(model))
    assert not verdict.ok and "RotatingKVCache(keep=4)" in verdict.reason


class _WrongRoute:
    name = "wrong"

    def __call__(
        self, queries: mx.array, segments: Any, tail: Any, *, scale: float, causal: bool,
        window: int | None = None,
    ) -> mx.array:
        return mx.zeros_like(queries)


def test_failing_fused_self_check_falls_back_to_the_composed_route(
    monkeypatch: pytest.MonkeyPatch, gguf_tokenizer: ChatTokenizer
) -> None:
    """A fused route that disagrees with stock SDPA at start-up: the composed route, which
    agrees, keeps the segments; the verdict says what failed."""
    from segserve.kernels import factory

    choice = factory.RouteChoice(_WrongRoute(), "wrong", "forced by test")
    monkeypatch.setattr(factory, "select_route", lambda *a, **k: choice)
    verdict, route = runtime.choose_kv(load_settings({}, environ={}), tiny_loaded(gguf_tokenizer))
    assert route is not None and getattr(route, "name", None) == "composed"
    assert verdict.mode == "segmented" and verdict.route == "composed" and verdict.self_check_ok
    assert "wrong failed" in verdict.self_check_detail


class _RouteWithOwned:
    """The composed route with owned launches (as the fused CUDA route has), right or
    wrong: `wrong` swaps the sessions' outputs."""

    name = "with-owned"

    def __init__(self, wrong: bool, owned_launches: bool = True) -> None:
        self.wrong = wrong
        self.owned_launches = owned_launches  # as `fused_cuda.build` sets it from the options

    def __call__(self, *args: Any, **kw: Any) -> mx.array:
        return attend_segments(*args, **kw)

    def attend_owned(self, q: mx.array, sessions: Any, scale: float) -> tuple[mx.array, mx.array]:
        parts = [plain_lse(q[i : i + 1], pieces, scale) for i, pieces in enumerate(sessions)]
        if self.wrong:
            parts = parts[::-1]
        return mx.concatenate([o for o, _ in parts]), mx.concatenate([lse for _, lse in parts])


@pytest.mark.parametrize("wrong", [False, True])
def test_owned_launches_are_checked_at_start_up(
    monkeypatch: pytest.MonkeyPatch, gguf_tokenizer: ChatTokenizer, wrong: bool
) -> None:
    """Owned launches that disagree with SDPA are turned off (one call per history in a
    batched step); the route keeps serving and the verdict says so."""
    from segserve.kernels import factory

    made: list[_RouteWithOwned] = []

    def select(*a: Any, **k: Any) -> Any:
        made.append(_RouteWithOwned(wrong, k["options"].fused_owned))
        return factory.RouteChoice(made[-1], "with-owned", "test")

    monkeypatch.setattr(factory, "select_route", select)
    verdict, route = runtime.choose_kv(load_settings({"fused_owned": "on"}, environ={}), tiny_loaded(gguf_tokenizer))
    chosen = made[-1]
    assert route is chosen and verdict.mode == "segmented" and verdict.self_check_ok
    assert chosen.owned_launches is not wrong
    assert "owned launches" in verdict.self_check_detail
    assert ("one call per history" in verdict.self_check_detail) is wrong
    # The default is on: checked the same way.
    verdict, route = runtime.choose_kv(load_settings({}, environ={}), tiny_loaded(gguf_tokenizer))
    assert made[-1].owned_launches is not wrong and "owned launches" in verdict.self_check_detail
    # Off: not used, not checked.
    verdict, route = runtime.choose_kv(load_settings({"fused_owned": "off"}, environ={}), tiny_loaded(gguf_tokenizer))
    chosen = made[-1]
    assert route is chosen and chosen.owned_launches is False
    assert "owned launches" not in verdict.self_check_detail


def test_check_owned_reports_a_route_that_raises() -> None:
    from segserve.kernels.selfcheck import check_owned

    class Raising(_RouteWithOwned):
        def attend_owned(self, q: mx.array, sessions: Any, scale: float) -> tuple[mx.array, mx.array]:
            raise RuntimeError("launch failed")

    got = check_owned(Raising(False), n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=mx.float32)
    assert not got.ok and "launch failed" in got.detail
    none = check_owned(_WrongRoute(), n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=mx.float32)
    assert none.ok and "no owned launches" in none.detail


def test_failing_self_check_of_every_route_means_stock_mode(
    monkeypatch: pytest.MonkeyPatch, gguf_tokenizer: ChatTokenizer
) -> None:
    from segserve.kernels import factory

    choice = factory.RouteChoice(_WrongRoute(), "wrong", "forced by test")
    monkeypatch.setattr(factory, "select_route", lambda *a, **k: choice)
    monkeypatch.setattr(runtime, "ComposedRoute", lambda **k: _WrongRoute())
    loaded = tiny_loaded(gguf_tokenizer)
    verdict, route = runtime.choose_kv(load_settings({}, environ={}), loaded)
    assert route is None
    assert verdict.mode == "stock" and verdict.self_check_ok is False
    assert verdict.requested_mode == "segmented" and verdict.self_check_detail


def test_stock_setting_keeps_stock(gguf_tokenizer: ChatTokenizer) -> None:
    verdict, route = runtime.choose_kv(load_settings({"segmented_kv": "false"}, environ={}), tiny_loaded(gguf_tokenizer))
    assert route is None
    assert verdict.mode == "stock" and verdict.requested_mode == "stock"


def test_each_cache_carries_its_own_route() -> None:
    """Two caches with different routes in one process, through one hooked model: each is
    served by its own route (no process-wide route to overwrite), stock is untouched."""
    model = _model("llama")
    install(model)
    prompt = [(7 * i) % 250 + 1 for i in range(12)]
    stock = logits_last(model, prompt, [KVCache() for _ in range(2)])
    good = SegmentedCache(2, route=attend_segments)
    wrong = SegmentedCache(2, route=_WrongRoute())
    got_good = logits_last(model, prompt, good.layers)
    got_wrong = logits_last(model, prompt, wrong.layers)
    assert mx.allclose(got_good, stock, atol=1e-4).item()
    assert not mx.allclose(got_wrong, stock, atol=1e-2).item()
    again = logits_last(model, prompt, SegmentedCache(2, route=attend_segments).layers)
    assert mx.allclose(again, stock, atol=1e-4).item()  # the wrong one changed nothing global
    with pytest.raises(RuntimeError, match="no attention route"):
        logits_last(model, prompt, SegmentedCache(2).layers)
