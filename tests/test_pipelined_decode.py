"""Pipelined decode steps against step-by-step decoding: the same tokens and the same stored
cache (`ModelRunner(pipeline_steps=...)`, the `--pipeline-decode-steps` setting).

Each case runs the same requests through two engines on the same tiny random-weight model,
one pipelined and one not, and compares every request's tokens, text and finish reason and
the K/V rows and tokens of every turn the engine stored (the snapshot `ModelRunner.finish`
returned, or the sealed prompt of a cancelled request). Requests run concurrently with
different prompt lengths (chunked prefill: they join the decode batch at different steps)
and different `max_tokens` (they leave at different steps); the cases cover stop strings,
EOS, `max_tokens`, a seeded sampled request, a plain-path request (log-probabilities) in
the same batch, and a cancellation mid-stream. Routes: the composed one, the CPU fused
op (it writes the tail in place: a dropped speculative row must not show), stock mode.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from segserve.config.settings import load_settings
from segserve.kernels.composed import attend_segments
from segserve.kernels.fused_cpu import FusedCpuRoute, available
from segserve.kv.segment import Snapshot
from segserve.server.engine import Done, Engine, Failed, GenerationRequest, RequestHandle, Token
from segserve.server.runner import ChatTokenizer, SamplingParams
from segserve.server.runtime import make_engine
from tests.conftest import make_tiny_model, ram_store, tiny_loaded
from tests.engine_support import run_all

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Outcome:
    tokens: list[int]
    text: str
    reason: str | None
    failed: bool


def _route(kind: str) -> Any:
    if kind == "composed":
        return attend_segments
    if kind == "fused_cpu":
        if not available()[0]:
            pytest.skip(f"fused CPU op: {available()[1]}")
        return FusedCpuRoute()
    return None  # stock


@dataclass
class Stored:
    """A stored turn read on the engine thread (its arrays belong to that thread's stream)."""

    tokens: tuple[int, ...]
    rows: int
    kv: list[np.ndarray]  # per layer, keys then values, every segment concatenated


def _read(snap: Snapshot | None) -> Stored | None:
    if snap is None:
        return None
    kv = []
    for layer in range(len(snap.segments[0].keys)):
        for part in ("keys", "values"):
            kv.append(np.concatenate([np.array(getattr(s, part)[layer]) for s in snap.segments], axis=2))
    return Stored(snap.tokens, snap.rows, kv)


def _engine(tok: ChatTokenizer, kind: str, pipelined: bool) -> tuple[Engine, dict[str, Stored | None]]:
    settings = load_settings({"prefill_chunk": "16", "pipeline_decode_steps": "on" if pipelined else "off"},
                             environ={})
    loaded = tiny_loaded(tok, make_tiny_model(seed=3))
    eng = make_engine(settings, loaded, ram_store(), route=_route(kind))
    assert eng.runner.pipeline_steps is pipelined
    stored: dict[str, Stored | None] = {}
    finish, abandon = eng.runner.finish, eng.runner.abandon

    def spy_finish(request_id: str, choice: int = 0) -> Any:
        turn = finish(request_id, choice)
        stored[request_id] = _read(turn.snapshot)
        return turn

    def spy_abandon(request_id: str) -> Snapshot | None:
        snap = abandon(request_id)
        stored.setdefault(request_id, _read(snap))
        return snap

    eng.runner.finish = spy_finish  # type: ignore[method-assign]
    eng.runner.abandon = spy_abandon  # type: ignore[method-assign]
    eng.start()
    return eng, stored


def _drive(eng: Engine, reqs: Sequence[GenerationRequest], cancel_after: dict[str, int]) -> list[Outcome]:
    async def one(handle: RequestHandle) -> Outcome:
        toks: list[int] = []
        text: list[str] = []
        rid = handle.request.request_id
        while True:
            ev = await asyncio.wait_for(handle.queue.get(), 120)
            if isinstance(ev, Token):
                toks.append(ev.token_id)
                text.append(ev.text)
                if len(toks) == cancel_after.get(rid):
                    handle.cancel()
                    return Outcome(toks, "".join(text), "cancelled", False)
            elif isinstance(ev, Done):
                return Outcome(toks, "".join(text) + ev.tail_text, ev.finish_reason, False)
            elif isinstance(ev, Failed):
                return Outcome(toks, "".join(text), None, True)

    return run_all(eng, reqs, one)


def _both(tok: ChatTokenizer, kind: str, make: Callable[[], list[GenerationRequest]],
          cancel_after: dict[str, int] | None = None,
          ) -> tuple[list[Outcome], list[Outcome], dict[str, Stored | None], dict[str, Stored | None]]:
    results = []
    for pipelined in (False, True):
        eng, stored = _engine(tok, kind, pipelined)
        try:
            out = _drive(eng, make(), cancel_after or {})
            # The engine ends a cancelled request at its next step: wait until it has.
            for _ in range(200):
                if eng.running == 0:
                    break
                asyncio.run(asyncio.sleep(0.01))
            assert eng.running == 0 and not eng.runner.inflight
            assert eng.scheduler.reserved == {}
            assert (eng.runner.pipelined > 0) is pipelined
        finally:
            eng.stop()
        results.append((out, stored))
    (plain, plain_stored), (piped, piped_stored) = results
    return plain, piped, plain_stored, piped_stored


def _same_snapshots(a: dict[str, Stored | None], b: dict[str, Stored | None]) -> None:
    assert a.keys() == b.keys()
    for rid, sa in a.items():
        sb = b[rid]
        assert (sa is None) == (sb is None), rid
        if sa is None or sb is None:
            continue
        assert sa.tokens == sb.tokens, rid
        assert sa.rows == sb.rows == len(sa.tokens), rid
        for i, (ka, kb) in enumerate(zip(sa.kv, sb.kv, strict=True)):
            assert ka.shape == kb.shape, (rid, i)
            if mx.default_device() == mx.cpu:
                assert np.array_equal(ka, kb), (rid, i)
            else:  # a GPU's products differ in their last bits with the batch's row count
                assert np.allclose(ka, kb, rtol=1e-2, atol=1e-2), (rid, i)


def _prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple(200 + (i * 37 + salt * 101) % 4000 for i in range(n))


@pytest.mark.parametrize("kind", ["composed", "fused_cpu", "stock"])
def test_joining_and_leaving_requests_match_step_by_step(gguf_tokenizer: ChatTokenizer, kind: str) -> None:
    """Five concurrent requests (prompts 5..40 tokens in 16-token chunks, 3..24 tokens
    out), one of them sampled with a seed and one asking for log-probabilities (plain
    path: the batch drains the step in flight while it decodes)."""

    def make() -> list[GenerationRequest]:
        return [
            GenerationRequest("a", _prompt(5, 1), 24, GREEDY),
            GenerationRequest("b", _prompt(40, 2), 9, GREEDY),
            GenerationRequest("c", _prompt(21, 3), 3, GREEDY),
            GenerationRequest("d", _prompt(12, 4), 17, SamplingParams(temperature=0.8, seed=7)),
            GenerationRequest("e", _prompt(30, 5), 6, SamplingParams(temperature=0.0, logprobs=True)),
        ]

    plain, piped, sp, sq = _both(gguf_tokenizer, kind, make)
    assert [o.reason for o in plain] == ["length"] * 5
    assert plain == piped
    _same_snapshots(sp, sq)


def test_stop_string_and_eos_end_at_the_same_token(gguf_tokenizer: ChatTokenizer) -> None:
    """A stop string taken from the plain run's text, and an EOS id set to a token the
    plain run produces: both modes stop there, with the same stored turn (the pipelined
    run had already fed the final token to the next step: that row is dropped)."""
    (free,), _, _, _ = _both(gguf_tokenizer, "fused_cpu",
                             lambda: [GenerationRequest("x", _prompt(9, 6), 20, GREEDY)])
    assert len(free.tokens) == 20
    eos = free.tokens[7]
    assert eos not in free.tokens[:7]
    stop = free.text[len(free.text) // 3 : len(free.text) // 3 + 3]
    tok = dataclasses.replace(gguf_tokenizer, eos_ids=frozenset({eos}))

    def make() -> list[GenerationRequest]:
        return [
            GenerationRequest("eos", _prompt(9, 6), 20, GREEDY),
            GenerationRequest("stop", _prompt(9, 6), 20, GREEDY, stops=(stop,)),
            GenerationRequest("other", _prompt(25, 7), 20, GREEDY),
        ]

    plain, piped, sp, sq = _both(tok, "fused_cpu", make)
    assert plain == piped
    _same_snapshots(sp, sq)
    # EOS ends the request without a Token event: the 7 tokens before it.
    assert plain[0].reason == "stop" and plain[0].tokens == free.tokens[:7]
    assert plain[1].reason == "stop" and len(plain[1].tokens) < 20
    assert sp["eos"] is not None and sp["eos"].tokens[-7:] == tuple(free.tokens[:7])


@pytest.mark.parametrize("kind", ["fused_cpu", "stock"])
def test_cancellation_mid_stream_matches(gguf_tokenizer: ChatTokenizer, kind: str) -> None:
    """A client that goes away after 4 tokens: the others' tokens and every stored turn
    (the cancelled one's sealed prompt) are the same in both modes."""

    def make() -> list[GenerationRequest]:
        return [
            GenerationRequest("gone", _prompt(10, 8), 40, GREEDY),
            GenerationRequest("stays", _prompt(14, 9), 30, GREEDY),
        ]

    plain, piped, sp, sq = _both(gguf_tokenizer, kind, make, {"gone": 4})
    assert plain[0].reason == piped[0].reason == "cancelled"
    assert plain[0].tokens == piped[0].tokens
    assert plain[1] == piped[1] and plain[1].reason == "length"
    _same_snapshots(sp, sq)


def test_the_setting_turns_it_on_only_when_asked() -> None:
    from segserve.server.runner.forward import decode_steps_pipelined

    assert decode_steps_pipelined("on") and not decode_steps_pipelined("off")
    assert not decode_steps_pipelined("auto", "cpu") and decode_steps_pipelined("auto", "gpu")
    assert decode_steps_pipelined("auto") == (mx.default_device() == mx.gpu)
    with pytest.raises(ValueError, match="auto, on or off"):
        decode_steps_pipelined("yes")
    assert load_settings({}, environ={}).pipeline_decode_steps == "auto"


def test_a_failing_request_fails_alone_in_both_modes(gguf_tokenizer: ChatTokenizer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose decode raises (batched or alone) fails; the others' tokens and
    stored turns are those of a run where it failed step by step (the pipelined launch
    that raised left nothing written and the batch decoded the plain way)."""
    import segserve.server.runner.runner as runner_mod

    poison = 4242
    # What runner_mod calls until patched (the public functions it imports).
    from segserve.server.runner import decode_batch as real_batch
    from segserve.server.runner import logits_last as real_last

    def batch(model: Any, tokens: Any, caches: Sequence[Sequence[Any]]) -> Any:
        if any(poison in c[-1].parent.tokens for c in caches):
            raise RuntimeError("injected decode failure")
        return real_batch(model, tokens, caches)

    def last(model: Any, tokens: Sequence[int], layers: Sequence[Any]) -> Any:
        if len(tokens) == 1 and poison in layers[-1].parent.tokens:
            raise RuntimeError("injected decode failure")
        return real_last(model, tokens, layers)

    monkeypatch.setattr(runner_mod, "decode_batch", batch)
    monkeypatch.setattr(runner_mod, "logits_last", last)

    def make() -> list[GenerationRequest]:
        return [
            GenerationRequest("ok", _prompt(6, 10), 20, GREEDY),
            GenerationRequest("bad", (poison, *_prompt(8, 11)), 20, GREEDY),
            GenerationRequest("ok2", _prompt(18, 12), 12, SamplingParams(temperature=0.9, seed=5)),
        ]

    plain, piped, sp, sq = _both(gguf_tokenizer, "fused_cpu", make)
    assert plain == piped
    assert plain[1].failed and not plain[0].failed and not plain[2].failed
    _same_snapshots(sp, sq)
