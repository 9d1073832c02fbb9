"""The bank under the engine: SSD round trip, restart, restored vs cold greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from segserve.bank import Bank
from segserve.server.engine import GenerationRequest
from segserve.server.runner import ChatTokenizer
from tests.conftest import make_tiny_model, ram_store, tiny_loaded
from tests.engine_support import make_engine, run

NS = "tiny-bank-engine-test"


def _bank(path: Path) -> Bank:
    return Bank.open(NS, 1 << 30, path, max_disk_bytes=1 << 30, min_free_disk_bytes=0)


def test_restart_restores_from_ssd_with_same_tokens_as_cold(
    tmp_path: Path, gguf_tokenizer: ChatTokenizer, make_request: Callable[..., GenerationRequest]
) -> None:
    loaded = tiny_loaded(gguf_tokenizer, make_tiny_model(seed=5))
    history = list(range(300, 700))  # 400 tokens: two SSD blocks of 256 rows and a partial
    store1 = _bank(tmp_path)
    eng1 = make_engine(loaded, segmented=True, store=store1)
    first = run(eng1, [make_request(history, 5, session_id="chat")])[0]
    eng1.stop()
    store1.close()  # waits for the queued SSD writes

    store2 = _bank(tmp_path)  # a "restarted server": nothing in RAM
    assert [s.id for s in store2.list_sessions()] == ["chat"]
    eng2 = make_engine(loaded, segmented=True, store=store2)
    follow = history + first.tokens + [900, 901, 902]
    warm = run(eng2, [make_request(follow, 6, session_id="chat")])[0]
    stats = store2.stats()
    eng2.stop()
    store2.close()

    eng3 = make_engine(loaded, segmented=True, store=ram_store())
    cold = run(eng3, [make_request(follow, 6)])[0]
    eng3.stop()

    assert warm.started is not None and warm.started.cached_tokens >= len(history)
    assert stats.restores_by_tier.get("ssd", 0) > 0
    assert cold.started is not None and cold.started.cached_tokens == 0
    assert warm.tokens == cold.tokens


def test_stock_mode_uses_the_bank_too(
    gguf_tokenizer: ChatTokenizer, make_request: Callable[..., GenerationRequest]
) -> None:
    loaded = tiny_loaded(gguf_tokenizer, make_tiny_model(seed=6))
    eng = make_engine(loaded, segmented=False, store=ram_store())
    a = run(eng, [make_request(list(range(50, 120)), 4, session_id="st")])[0]
    b = run(eng, [make_request(list(range(50, 120)) + a.tokens + [7, 8], 4, session_id="st")])[0]
    eng.stop()
    assert b.started is not None and b.started.cached_tokens >= 70


def test_partial_reuse_of_a_restored_segment_is_priced_not_fatal(
    tmp_path: Path, gguf_tokenizer: ChatTokenizer, make_request: Callable[..., GenerationRequest]
) -> None:
    """A follow-up that diverges inside the last stored segment after a restart: the bank
    restores the whole segment but reuses a prefix of it (regression: the engine died)."""
    loaded = tiny_loaded(gguf_tokenizer, make_tiny_model(seed=7))
    store1 = _bank(tmp_path)
    eng1 = make_engine(loaded, segmented=True, store=store1)
    prompt = list(range(1000, 1040))
    first = run(eng1, [make_request(prompt, 16, session_id="p")])[0]
    eng1.stop()
    store1.close()

    store2 = _bank(tmp_path)
    eng2 = make_engine(loaded, segmented=True, store=store2)
    stored = prompt + first.tokens
    diverging = stored[: len(stored) - 3] + [5, 6, 7]  # differs inside the last segment
    r = run(eng2, [make_request(diverging, 3, session_id="p")])[0]
    again = run(eng2, [make_request([9, 9, 9], 2)])[0]  # the engine is still alive
    eng2.stop()
    store2.close()
    assert r.failed is None and r.started is not None
    assert r.started.cached_tokens >= len(prompt)
    assert again.failed is None


def test_the_bank_names_its_ssd_directory(tmp_path: Path) -> None:
    # The Responses store sits beside the SSD tier (`EngineClient.cold_root`).
    bank = _bank(tmp_path)
    try:
        assert bank.cold_root == tmp_path
    finally:
        bank.close()
    assert Bank(NS, 1 << 20).cold_root is None
