"""Speculative decoding from the session's own segments (segserve.server.spec).

Index unit tests (longest then most recent match, prefix views, key collisions, proposals
read across segments); the draft budget; the KV trim of rejected rows; differential tests
of the engine with speculation on and off (greedy tokens identical alone, batched and
across a fork, with drafts actually verified and accepted); a chi-square test that the
rejection rule keeps the model's sampled distribution; and the embedded model repeating
a text (marked `model`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import cast

import mlx.core as mx
import pytest

from segserve.kernels.composed import attend_segments
from segserve.kernels.hook import install
from segserve.kv.segmented import SegmentedCache
from segserve.server.engine import Engine, GenerationRequest
from segserve.server.runner import ChatTokenizer, LoadedModel, SamplingParams
from segserve.server.runner.sampling import Sampler
from segserve.server.runtime import spec_max_batch
from segserve.server.spec import (
    INDEX_BYTES_PER_TOKEN,
    DraftBudget,
    IndexedSegment,
    IndexRegistry,
    SegmentIndex,
    TailIndex,
    accept_one,
    accept_sampled,
    logits_window,
    propose,
)
from tests.conftest import cycling_loaded, make_tiny_model
from tests.engine_support import make_engine, run, run_n


# ---- index -------------------------------------------------------------------------------
def test_segment_index_finds_the_most_recent_occurrence_with_a_follower() -> None:
    idx = SegmentIndex([5, 6, 7, 1, 5, 6, 7, 2, 5, 6])
    assert idx.find([5, 6, 7]) == 7  # the later "5 6 7" (follower 2), not the first (1)
    assert idx.find([5, 6]) == 6  # "5 6" at 8..9 has no follower: the one at 4..5
    assert idx.find([6]) == 6  # the last "6" (position 9) has no follower in the segment
    assert idx.find([9]) is None
    assert idx.find([5, 6, 7], limit=7) == 3  # a prefix view of 7 rows sees the first only
    assert idx.find([]) is None and idx.find([1, 2, 3, 4]) is None


def test_segment_index_key_collisions_never_propose_wrong_tokens() -> None:
    big = 1 << 21  # token ids past the key's 21 bits alias the ones below
    idx = SegmentIndex([3, 4, 9, big + 3, 4, 8])
    assert idx.find([big + 3, 4]) == 5
    assert idx.find([3, 4]) == 2  # same key as (big + 3, 4): the tokens decide
    assert idx.find([big + 4]) is None
    assert idx.nbytes == 8 * 6 + 12 * (5 + 4 + 3)  # the tokens; per n: (rows - n) keys of 8 + 4 bytes


def test_tail_index_and_propose_prefer_longest_then_most_recent() -> None:
    old = SegmentIndex([1, 2, 3, 40, 41, 42, 9, 9])
    new = SegmentIndex([7, 2, 3, 50, 51])
    tail = TailIndex(lead=[51, 1])  # the history's last tokens
    tail.extend([2, 3])
    segs = [IndexedSegment(old, 8), IndexedSegment(new, 5)]
    # "1 2 3" only in the old segment (3-gram beats the newer "2 3"); read on to the end
    # of it, then on through the next segment.
    p = propose(segs, tail, 8)
    assert p is not None and p.ngram == 3 and p.source == "segment"
    assert p.tokens == (40, 41, 42, 9, 9, 7, 2, 3)
    # Without the 3-gram, the most recent "2 3" (the newer segment) wins.
    tail2 = TailIndex(lead=[99])
    tail2.extend([2, 3])
    p2 = propose(segs, tail2, 2)
    assert p2 is not None and p2.ngram == 2 and p2.tokens == (50, 51)
    # A repeat inside the turn: the tail's own occurrence is the most recent.
    tail2.extend([60, 61, 2, 3])
    p3 = propose(segs, tail2, 3)
    assert p3 is not None and p3.source == "tail" and p3.tokens == (60, 61, 2)
    assert propose(segs, tail2, 0) is None
    assert propose(segs, TailIndex(lead=[1, 2]), 4) is None  # nothing generated yet


def test_propose_picks_the_occurrence_whose_earlier_tokens_agree_longest() -> None:
    """A phrase that ends several sentences ("1 2 3"): the most recent occurrence is not the
    one being copied; the one preceded by the same tokens as the sequence's end is."""
    doc = SegmentIndex([10, 1, 2, 3, 20, 11, 1, 2, 3, 21, 12, 1, 2, 3, 22, 99])
    segs = [IndexedSegment(doc, 16)]
    tail = TailIndex(lead=[22, 99])
    tail.extend([10, 1, 2, 3, 20, 11, 1, 2, 3])  # copying: the second sentence's end
    p = propose(segs, tail, 3)
    assert p is not None and p.ngram == 3 and p.source == "segment" and p.tokens == (21, 12, 1)
    # The agreement reads back from the turn into the history before it: the turn holds
    # only "1 2 3", the segment before it ends with 12.
    prompt = SegmentIndex([7, 7, 12])
    t2 = TailIndex(lead=[7, 12])
    t2.extend([1, 2, 3])
    p2 = propose([IndexedSegment(doc, 16), IndexedSegment(prompt, 3)], t2, 2)
    assert p2 is not None and p2.tokens == (22, 99)
    # A repeat inside the turn agrees longest (4 1 2 3): the tail's own occurrence.
    t3 = TailIndex(lead=[5, 6])
    t3.extend([4, 1, 2, 3, 30, 4, 1, 2, 3])
    p3 = propose(segs, t3, 2)
    assert p3 is not None and p3.source == "tail" and p3.tokens == (30, 4)


def test_segment_occurrences_are_exact_and_bounded() -> None:
    big = 1 << 21  # aliases 5 in the key
    idx = SegmentIndex([5, 6, 1, big + 5, 6, 2, 5, 6, 3, 5, 6])
    assert idx.occurrences([5, 6], limit=11).tolist() == [2, 8]  # the aliased one left out
    assert idx.occurrences([5, 6], limit=8).tolist() == [2]  # followers before the limit
    assert idx.occurrences([5, 6], limit=11, most=1).tolist() == [8]  # the most recent
    assert idx.occurrences([4], limit=11).tolist() == []


def test_registry_shares_by_digest_and_rebuilds_after_eviction() -> None:
    reg = IndexRegistry(max_bytes=INDEX_BYTES_PER_TOKEN * 100)  # one index of 100 tokens fits, two do not
    a = reg.ensure("a", list(range(100)))
    assert reg.ensure("a", [0]) is a and reg.built == 1  # shared, not rebuilt
    reg.ensure("b", list(range(100)))  # over the cap: "a" (least recent) goes
    assert len(reg) == 1 and reg.bytes <= reg.max_bytes
    assert reg.ensure("a", list(range(100))) is not a and reg.built == 3


def test_draft_budget_grows_shrinks_and_cools_down() -> None:
    b = DraftBudget(k_max=8, k=4)
    assert b.want() == 4
    b.update(4, 4)
    assert b.want() == 6
    b.update(6, 2)
    assert b.want() == 3
    b.update(3, 0)  # a miss: one step without drafting
    assert [b.want() for _ in range(2)] == [0, 1]
    b.update(1, 0)  # a second miss in a row: two steps
    assert [b.want() for _ in range(3)] == [0, 0, 1]
    assert (b.drafted, b.accepted) == (14, 6)


def test_drop_rows_trims_unrecorded_rows_only() -> None:
    cache = SegmentedCache(2, route=attend_segments)
    for n in (2, 3):  # two rows recorded, then a window of three not yet
        k = mx.zeros((1, 2, n, 8))
        for layer in cache.layers:
            layer.update_and_fetch(k, k)
        if n == 2:
            cache.record_tokens([1, 2])
    with pytest.raises(ValueError):
        cache.drop_rows(4)
    cache.drop_rows(2)
    assert cache.offset == 3
    cache.record_tokens([3])
    assert cache.tokens == (1, 2, 3)


# ---- engine: greedy identical with speculation on and off ----------------------------------
def test_verify_window_rows_equal_one_token_at_a_time() -> None:
    """The verify forward's rows (causal inside the window, the sealed segments before it)
    against feeding the same tokens one by one: the attention path a window takes."""
    model = make_tiny_model(seed=2)
    install(model)
    history = [(i * 91) % 4000 + 5 for i in range(40)]
    window = [11, 12, 13, 14, 15]
    a = SegmentedCache(2, route=attend_segments)
    logits_window(model, history, a.layers)
    a.record_tokens(history)
    a.seal()
    b = SegmentedCache(2, a.base, route=attend_segments)
    got = logits_window(model, window, a.layers)
    want = mx.stack([logits_window(model, [t], b.layers)[0] for t in window])
    mx.eval(got, want)
    # A CUDA GPU's float32 products are TF32: 1.6e-2 apart on logits of ~8 on the H200.
    tol = 1e-3 if mx.default_device() == mx.cpu else 5e-3
    assert mx.allclose(got, want, atol=tol, rtol=tol).item()
    assert (mx.argmax(got, axis=-1) == mx.argmax(want, axis=-1)).all().item()


@pytest.fixture(scope="module")
def loaded(gguf_tokenizer: ChatTokenizer) -> LoadedModel:
    """EOS off: every answer runs to max_tokens, so the token lists compare in full."""
    return cycling_loaded(gguf_tokenizer)


@pytest.fixture(scope="module")
def engines(loaded: LoadedModel) -> Iterator[tuple[Engine, Engine]]:
    # Steps of up to 8 sessions verify drafts (the CPU's own default is 1: see the setting).
    on = make_engine(loaded, segmented=True, chunk=64,
                     settings_over={"speculative": "auto", "speculative_max_batch": "8"})
    off = make_engine(loaded, segmented=True, chunk=64, settings_over={"speculative": "off"})
    assert on.runner.speculative and not off.runner.speculative
    yield on, off
    on.stop()
    off.stop()


TEXT = [(i * 37) % 256 for i in range(60)]
PROMPT = [*TEXT, 17, 18, *TEXT[:40]]  # the text, then a repeat of its start


def _greedy(rid: str, prompt: list[int], max_tokens: int, **kw: object) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), max_tokens, SamplingParams(temperature=0.0), **kw)  # type: ignore[arg-type]


def test_greedy_identical_alone(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    d0, a0 = on.runner.spec_drafted, on.runner.spec_accepted
    (r_on,) = run(on, [_greedy("a-on", PROMPT, 48)])
    (r_off,) = run(off, [_greedy("a-off", PROMPT, 48)])
    assert r_on.failed is None and r_off.failed is None
    assert r_on.tokens == r_off.tokens and len(r_on.tokens) == 48
    assert r_on.text == r_off.text
    assert on.runner.spec_drafted > d0 and on.runner.spec_accepted > a0, "nothing was verified"
    assert off.runner.spec_drafted == 0


def test_greedy_identical_batched_and_uneven(engines: tuple[Engine, Engine]) -> None:
    """Two at once (the batch of two decodes plainly) and then the longer one alone
    (speculating): every token equals the plain engine's."""
    on, off = engines

    def reqs(tag: str) -> list[GenerationRequest]:
        return [_greedy(f"b1-{tag}", PROMPT, 8), _greedy(f"b2-{tag}", PROMPT[5:], 40)]

    a0 = on.runner.spec_accepted
    got = run(on, reqs("on"))
    want = run(off, reqs("off"))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert all(len(r.tokens) == n for r, n in zip(got, (8, 40), strict=True))
    assert on.runner.spec_accepted > a0


def test_rows_speculate_together_with_uneven_drafts(engines: tuple[Engine, Engine]) -> None:
    """Three requests at once, each repeating text from its prompt: their drafts are
    verified in shared steps (one forward, a window per row, rows without a draft feeding
    one token) and every token equals the plain engine's."""
    on, off = engines

    def reqs(tag: str) -> list[GenerationRequest]:
        return [_greedy(f"t{i}-{tag}", PROMPT[i:], n) for i, n in ((0, 40), (3, 33), (7, 26))]

    shared, a0 = on.runner.spec_shared_steps, on.runner.spec_accepted
    got = run(on, reqs("on"))
    want = run(off, reqs("off"))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [len(r.tokens) for r in got] == [40, 33, 26]
    assert on.runner.spec_shared_steps > shared, "no step verified two rows' drafts"
    assert on.runner.spec_accepted > a0


def test_steps_past_the_batch_cap_decode_plainly(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a cap of one session, a step where two requests decode verifies no drafts (a
    step where one decodes alone, while the other still prefills, may), and their tokens
    still equal the plain engine's; alone, a request speculates. The CPU's own default cap
    is two sessions."""
    import segserve.server.runner.runner as runner_mod

    assert spec_max_batch(0) == (2 if mx.default_device() == mx.cpu else 32)
    capped = make_engine(loaded, segmented=True, chunk=64,
                         settings_over={"speculative": "auto", "speculative_max_batch": "1"})
    steps: list[int] = []  # rows of each decode step
    verified: list[int] = []  # rows of each step that verified drafts
    decode, speculate = runner_mod.ModelRunner._decode, runner_mod.ModelRunner._speculate

    def count_decode(self: runner_mod.ModelRunner, batch: list[object], *a: object) -> None:
        steps.append(len(batch))
        decode(self, batch, *a)  # type: ignore[arg-type]  # the runner's own rows

    def count_speculate(self: runner_mod.ModelRunner, batch: list[object], *a: object) -> object:
        verified.append(len(batch))
        return speculate(self, batch, *a)  # type: ignore[arg-type]  # the runner's own rows

    monkeypatch.setattr(runner_mod.ModelRunner, "_decode", count_decode)
    monkeypatch.setattr(runner_mod.ModelRunner, "_speculate", count_speculate)
    try:
        assert capped.runner.spec_max_batch == 1
        got = run(capped, [_greedy("c1", PROMPT, 24), _greedy("c2", PROMPT[3:], 24)])
        assert steps.count(2) >= 10 and set(verified) <= {1}  # no step of two verified drafts
        assert capped.runner.spec_shared_steps == 0
        (alone,) = run(capped, [_greedy("c3", PROMPT, 24)])
        assert capped.runner.spec_drafted > 0
        assert alone.tokens == got[0].tokens
    finally:
        capped.stop()


def test_a_failed_verify_step_rewinds_and_decodes_plainly(
    engines: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first verify forward fails after every layer wrote its window: the caches are
    rewound (rows and token records) and the step decodes plainly; the answer equals the
    plain engine's and later steps still verify drafts."""
    import segserve.server.runner.runner as runner_mod
    from segserve.server.runner.batched import decode_windows as real

    on, off = engines
    calls = [0]

    def flaky(*a: object, **k: object) -> mx.array:
        out = real(*a, **k)  # type: ignore[arg-type]
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected verify failure")
        return out

    monkeypatch.setattr(runner_mod, "decode_windows", flaky)
    prompt = [3, *PROMPT]  # a prefix no other test stored
    (got,) = run(on, [_greedy("rw-on", prompt, 40)])
    (want,) = run(off, [_greedy("rw-off", prompt, 40)])
    assert got.failed is None and got.tokens == want.tokens
    assert calls[0] > 1 and got.done is not None and got.done.accepted_tokens > 0
    # The stored turn's tokens are the conversation's: a follow-up reuses all of it, as on
    # the plain engine (a lost token record would cut the reused prefix short).
    follow = [*prompt, *got.tokens, 9]
    (a,) = run(on, [_greedy("rw-on-2", follow, 2)])
    (b,) = run(off, [_greedy("rw-off-2", follow, 2)])
    assert a.started is not None and b.started is not None
    assert a.started.cached_tokens == b.started.cached_tokens >= len(prompt) + 39


def test_choices_speculate(engines: tuple[Engine, Engine]) -> None:
    """n = 3 greedy choices: each choice drafts from its own turn, and each equals the
    plain engine's choice."""
    on, off = engines
    d0 = on.runner.spec_drafted
    (a_on,) = run_n(on, [_greedy("n-on", PROMPT, 30, n=3)])
    (a_off,) = run_n(off, [_greedy("n-off", PROMPT, 30, n=3)])
    assert a_on.failed is None and a_off.failed is None
    assert a_on.tokens == a_off.tokens and sorted(a_on.tokens) == [0, 1, 2]
    assert all(len(t) == 30 for t in a_on.tokens.values())
    assert on.runner.spec_drafted > d0
    assert all(d.draft_tokens > 0 for d in a_on.done.values()), a_on.done


def test_greedy_identical_across_a_fork(engines: tuple[Engine, Engine]) -> None:
    """Turn 1 stored, then two branches from it (the stored segments' indexes are shared):
    each branch's tokens equal the plain engine's."""
    on, off = engines
    out: dict[str, list[list[int]]] = {}
    for eng, tag in ((on, "on"), (off, "off")):
        (t1,) = run(eng, [_greedy(f"f1-{tag}", PROMPT, 24, session_id=f"fork-{tag}")])
        history = [*PROMPT, *t1.tokens]
        branches = [[*history, 21, *TEXT[:10]], [*history, 22, *TEXT[20:30]]]
        res = [run(eng, [_greedy(f"f{i}-{tag}", b, 24)])[0] for i, b in enumerate(branches, 2)]
        assert all(r.started is not None and r.started.cached_tokens > 0 for r in res)
        out[tag] = [t1.tokens, *(r.tokens for r in res)]
    assert out["on"] == out["off"]
    assert on.runner.indexes.built > 0


class _Allow:
    """A grammar stand-in: every token but `banned`, finished after `finish_after` tokens."""

    def __init__(self, vocab: int, banned: set[int], finish_after: int) -> None:
        self._mask = mx.array([t not in banned for t in range(vocab)])
        self.accepted: list[int] = []
        self.finish_after = finish_after

    def mask(self) -> mx.array:
        return self._mask

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def is_finished(self) -> bool:
        return len(self.accepted) >= self.finish_after


def test_greedy_rows_with_a_grammar_or_a_processor_speculate(engines: tuple[Engine, Engine]) -> None:
    """Greedy rows with a grammar (the mask bans two tokens the plain answer uses) or a
    logits processor (a logit bias) verify drafts, each verified row drawn as a plain step
    draws it after the tokens before it: the tokens equal the plain engine's, the grammar
    saw exactly them, and it ended the row."""
    on, off = engines
    (plain,) = run(off, [_greedy("gp", PROMPT, 30)])
    banned = set(plain.tokens[2:4])
    biased = SamplingParams(temperature=0.0, logit_bias=((plain.tokens[5], -100.0),))
    got: dict[str, list[list[int]]] = {}
    for eng, tag in ((on, "on"), (off, "off")):
        m = _Allow(256, banned, 36)
        g, b = run(eng, [_greedy(f"gg-{tag}", PROMPT, 48, matcher=m),
                         GenerationRequest(f"gb-{tag}", tuple(PROMPT), 40, biased)])
        assert g.done is not None and g.done.finish_reason == "stop" and g.tokens == m.accepted
        assert not banned & set(g.tokens) and len(g.tokens) == 36
        got[tag] = [g.tokens, b.tokens]
        if eng is on:
            assert g.done.draft_tokens > 0 and b.done is not None and b.done.draft_tokens > 0
    assert got["on"] == got["off"]
    assert plain.tokens[5] not in got["on"][1]


def test_logprobs_are_the_models_per_accepted_token(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    sp = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    a0 = on.runner.spec_accepted
    r_on = run(on, [GenerationRequest("lp-on", tuple(PROMPT), 32, sp)])[0]
    r_off = run(off, [GenerationRequest("lp-off", tuple(PROMPT), 32, sp)])[0]
    assert r_on.tokens == r_off.tokens
    assert on.runner.spec_accepted > a0
    assert r_on.done is not None and r_off.done is not None


# ---- sampled: the rejection rule keeps the model's distribution ---------------------------
def _chi2_sf(x: float, k: int) -> float:
    """P(chi2_k > x): the regularized upper incomplete gamma Q(k/2, x/2) (series)."""
    a, z = k / 2.0, x / 2.0
    term = total = 1.0 / a
    n = 1
    while term > 1e-12 * total:
        term *= z / (a + n)
        total += term
        n += 1
    lower = math.exp(-z + a * math.log(z) - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=0.8, top_p=0.95, top_k=6, seed=0),
])
def test_rejection_rule_keeps_the_sampled_distribution(params: SamplingParams) -> None:
    """A tiny model's verify window [last, d]: over many seeded draws the first emitted
    token follows the model's (transformed) distribution whichever draft is proposed, and
    the one after an accepted draft follows the next row's."""
    model = make_tiny_model(seed=1, vocab_size=12)
    install(model)
    sampler = Sampler(params)

    def window(tokens: list[int]) -> tuple[mx.array, list[float], list[float]]:
        cache = SegmentedCache(2, route=attend_segments)
        # / 8: the tiny model's scaled-up weights make its rows nearly one-hot; flatter
        # rows give the test many cells (the rule sees logits of any shape).
        rows = logits_window(model, tokens, cache.layers)[-2:].astype(mx.float32) / 8.0
        probs = mx.softmax(sampler.weights(rows), axis=-1)
        mx.eval(rows, probs)
        p0 = cast(list[float], probs[0].tolist())
        p1 = cast(list[float], probs[1].tolist())
        return rows, p0, p1

    _, p_first, _ = window([3, 5, 7, 1])
    n = 4000
    # The likeliest token as the draft (mostly accepted), then a less likely one.
    for draft in (max(range(12), key=lambda t: p_first[t]), sorted(range(12), key=lambda t: p_first[t])[-3]):
        logits, p0, p1 = window([3, 5, 7, draft])
        firsts = [0] * 12
        seconds = [0] * 12
        for _ in range(n):
            out = accept_sampled(sampler.weights(logits), [draft], sampler.next_key)
            firsts[out[0]] += 1
            if len(out) == 2:
                seconds[out[1]] += 1
        for counts, p in ((firsts, p0), (seconds, p1)):
            total = sum(counts)
            cells = [(c, total * q) for c, q in zip(counts, p, strict=True) if q > 0]
            assert all(c == 0 for c, q in zip(counts, p, strict=True) if q == 0)  # filtered stay out
            assert len(cells) >= 3, "too peaked a distribution to test"
            stat = sum((c - e) ** 2 / e for c, e in cells)
            assert _chi2_sf(stat, len(cells) - 1) > 1e-3, (draft, counts, p)
        assert 0 < sum(seconds) < n  # some drafts accepted, some rejected


def test_one_row_rule_keeps_the_distribution() -> None:
    """`accept_one` (the rule for rows walked one at a time: a grammar, a processor): over
    many seeded draws the token follows p whichever draft is proposed, a masked-out draft
    included (then it is never emitted)."""
    logits = mx.array([2.0, 1.0, 0.5, 0.0, -0.5, -mx.inf])
    p = cast(list[float], mx.softmax(logits).tolist())
    sampler = Sampler(SamplingParams(temperature=1.0, seed=11))
    n = 4000
    for draft in (0, 3, 5):
        counts = [0] * 6
        hits = 0
        for _ in range(n):
            token, accepted = accept_one(sampler.weights(logits), draft, sampler.next_key)
            counts[token] += 1
            hits += accepted
        assert counts[5] == 0
        cells = [(c, n * q) for c, q in zip(counts, p, strict=True) if q > 0]
        stat = sum((c - e) ** 2 / e for c, e in cells)
        assert _chi2_sf(stat, len(cells) - 1) > 1e-3, (draft, counts, p)
        assert hits == counts[draft]


def test_sampled_rows_with_a_grammar_or_a_processor_speculate(engines: tuple[Engine, Engine]) -> None:
    """Sampled rows with a grammar or a logit bias verify drafts row by row: drafts are
    verified and accepted, and no emitted token breaks the mask or the ban."""
    on, _ = engines
    (plain,) = run(on, [_greedy("sp", PROMPT, 20)])
    banned = set(plain.tokens[2:4])
    ban = plain.tokens[5]
    a0 = on.runner.spec_accepted
    m = _Allow(256, banned, 30)
    g, b = run(on, [
        GenerationRequest("sg", tuple(PROMPT), 40, SamplingParams(temperature=0.2, seed=5), matcher=m),
        GenerationRequest("sb", tuple(PROMPT), 30, SamplingParams(temperature=0.2, seed=6,
                                                                  logit_bias=((ban, -100.0),))),
    ])
    assert g.done is not None and g.done.finish_reason == "stop" and g.tokens == m.accepted
    assert not banned & set(g.tokens) and ban not in b.tokens and len(b.tokens) == 30
    assert g.done.draft_tokens > 0 and b.done is not None and b.done.draft_tokens > 0
    assert on.runner.spec_accepted > a0


def test_sampled_requests_speculate(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    a0 = on.runner.spec_drafted
    sp = SamplingParams(temperature=0.3, seed=7)
    (r,) = run(on, [GenerationRequest("s-on", tuple(PROMPT), 40, sp)])
    assert r.failed is None and len(r.tokens) == 40
    assert on.runner.spec_drafted > a0


# ---- the embedded model ------------------------------------------------------------------
@pytest.mark.model
def test_embedded_model_repeats_a_text_identically_with_speculation() -> None:
    """SmolLM2 asked to repeat a paragraph: greedy tokens with speculation equal those
    without, and most drafts are accepted (the text is in the prompt's segment)."""
    from segserve.config.settings import load_settings
    from segserve.server.runner import load_model

    loaded = load_model(load_settings({}, environ={}))
    para = ("The harbor was quiet in the early morning. Fishing boats rocked against the "
            "old wooden pier while gulls circled above the market, waiting for the first "
            "catch of the day to be carried up the stone steps.")
    text = loaded.tokenizer.render([{"role": "user", "content": f"Repeat this text exactly:\n\n{para}"}])
    prompt = loaded.tokenizer.encode(text)
    out = {}
    for mode in ("auto", "off"):
        eng = make_engine(loaded, segmented=True, chunk=256, settings_over={"speculative": mode})
        try:
            (r,) = run(eng, [_greedy(f"m-{mode}", prompt, 40)])
            assert r.failed is None
            out[mode] = (r.tokens, eng.runner.spec_drafted, eng.runner.spec_accepted)
        finally:
            eng.stop()
    assert out["auto"][0] == out["off"][0]
    drafted, accepted = out["auto"][1:]
    assert drafted > 0 and accepted >= drafted // 2, (drafted, accepted)
