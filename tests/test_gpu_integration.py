"""On a CUDA GPU (skipped elsewhere): the server picks the fused route, its start-up
self-check passes at the model's shapes, and the engine's greedy tokens with segments
(fused route) equal those of stock mode over several turns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import mlx.core as mx
import pytest

from segserve.config.settings import load_settings
from segserve.server import runtime
from segserve.server.engine import GenerationRequest, NullObserver
from segserve.server.runner import ChatTokenizer
from tests.conftest import make_tiny_model, ram_store, tiny_loaded
from tests.engine_support import check_turns_within_price, price_spy, run

pytestmark = pytest.mark.gpu

if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
    pytest.skip("needs MLX with a CUDA GPU", allow_module_level=True)


class _Codec:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(32 + i % 90) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(32 + token_id % 90).encode()

    @property
    def backend(self) -> None:
        return None


def _tokenizer(eos: frozenset[int] = frozenset({0})) -> ChatTokenizer:
    return ChatTokenizer(_Codec(), "{{ messages }}", eos, "", "", 256)


def test_fused_route_serves_and_matches_stock(make_request: Callable[..., GenerationRequest]) -> None:
    model = make_tiny_model(seed=11, vocab_size=256)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())  # lazy arrays of the main thread's stream can't run elsewhere
    loaded = tiny_loaded(_tokenizer(), model)
    loaded = dataclasses.replace(loaded, kv_dtype="bfloat16")
    settings = load_settings({}, environ={})
    verdict, route = runtime.choose_kv(settings, loaded)
    assert verdict.mode == "segmented" and verdict.route == "fused_cuda", verdict
    assert verdict.self_check_ok, verdict.self_check_detail
    seg = runtime.make_engine(settings, loaded, ram_store(), NullObserver(), route=route)
    stock = runtime.make_engine(settings, loaded, ram_store(), NullObserver(), route=None)
    seg.start()
    stock.start()
    try:
        history = [3, 4, 5]
        for turn in range(4):
            prompt = history + [10 + turn] * (20 + 30 * turn)
            a = run(seg, [make_request(prompt, 12, session_id="g")])[0]
            b = run(stock, [make_request(prompt, 12, session_id="g")])[0]
            assert a.failed is None and b.failed is None
            assert a.tokens == b.tokens, f"turn {turn}"
            history = prompt + a.tokens
    finally:
        seg.stop()
        stock.stop()


def test_fused_turn_peak_is_within_its_price(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the GPU: the fused route (bf16; 64-row prefill chunks take the
    # wide path) allocates what admission prices for it: peak <= price <= 2 x peak.
    costs = price_spy(monkeypatch)
    model = make_tiny_model(seed=3)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    loaded = tiny_loaded(_tokenizer(eos=frozenset({-1})), model, context=4096)
    # bf16 K/V: half the float32 row bytes `tiny_loaded` assumes.
    loaded = dataclasses.replace(
        loaded, kv_dtype="bfloat16", kv_bytes_per_token=loaded.kv_bytes_per_token // 2
    )
    settings = load_settings({"prefill_chunk": "64"}, environ={})
    verdict, route = runtime.choose_kv(settings, loaded)
    assert verdict.route == "fused_cuda", verdict
    engine = runtime.make_engine(settings, loaded, ram_store(), NullObserver(), route=route)
    engine.start()
    try:
        check_turns_within_price(engine, costs)
    finally:
        engine.stop()
