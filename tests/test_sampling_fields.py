"""Sampling parameters and the grammar hook of the runner.

On synthetic logits: each parameter moves the distribution the expected way, and our
draws equal `mlx_lm.sample_utils.make_sampler`'s for the same key. Through the engine on a
tiny random-weight llama: penalties reduce repeats, `logit_bias` bans and forces, the same
seed gives the same tokens batched and alone, logprobs stay the model's own, and a
`json_object` grammar gives JSON that parses for 20 seeds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler

from segserve.server.chat.grammar import GrammarVocab, compile_response_format
from segserve.server.engine import Done, Engine, Failed, GenerationRequest, RequestHandle, Token
from segserve.server.runner import ChatTokenizer
from segserve.server.runner.sampling import REPETITION_CONTEXT, Sampler, SamplingParams
from tests.conftest import make_tiny_model, tiny_loaded
from tests.engine_support import Result, make_engine, run

V = 1000


def _logits(seed: int = 0, n: int = V, scale: float = 3.0) -> mx.array:
    return mx.random.normal((n,), key=mx.random.key(seed)) * scale


def _tok(a: mx.array) -> int:
    return int(a.item())  # type: ignore[arg-type]  # item() of a 0-d integer array


def _row(a: mx.array) -> list[float]:
    return cast(list[float], a.reshape(-1).tolist())


def _draws(s: Sampler, logits: mx.array, n: int) -> list[int]:
    return [_tok(s(logits)) for _ in range(n)]


def _feedback(params: SamplingParams, logits: mx.array, n: int) -> list[int]:
    """n tokens from fixed logits, each step seeing the tokens drawn before (a model that
    always says the same thing: repeats are up to the penalties)."""
    s = Sampler(params)
    prompt: tuple[int, ...] = (1, 2, 3)
    out: list[int] = []
    for _ in range(n):
        x = s.process(logits, prompt, out) if s.processes else logits
        out.append(_tok(s(x)))
    return out


def _repeats(tokens: Sequence[int]) -> int:
    return len(tokens) - len(set(tokens))


# ------------------------------------------------------------------ the sampler alone


def test_defaults_build_nothing() -> None:
    s = Sampler(SamplingParams())
    assert not SamplingParams().processes and not s.processes
    assert not Sampler(SamplingParams(top_k=-1, min_p=0.0, repetition_penalty=1.0)).processes
    for on in ({"presence_penalty": 0.5}, {"frequency_penalty": -0.5},
               {"repetition_penalty": 1.1}, {"logit_bias": ((3, 1.0),)}):
        assert Sampler(SamplingParams(**on)).processes, on


@pytest.mark.parametrize(
    "temp, top_p, min_p, top_k",
    [(1.0, 1.0, 0.0, 0), (0.7, 0.9, 0.0, 0), (1.3, 0.5, 0.0, 0), (0.8, 1.0, 0.05, 0),
     (1.0, 1.0, 0.0, 40), (0.9, 0.95, 0.1, 50)],
)
def test_draws_equal_mlx_lm_make_sampler(temp: float, top_p: float, min_p: float, top_k: int) -> None:
    """The same key gives the same tokens as mlx-lm's sampler on the global generator."""
    logits = _logits(1, 8192, scale=1.5)
    # mlx-lm's sampler takes log-probabilities; ours normalizes only when a filter is on
    # (the categorical is shift-invariant), so both get the same log-probabilities here.
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ref = make_sampler(temp, top_p, min_p, 1, top_k)
    for seed in (0, 7):
        mx.random.seed(seed)  # the global generator's key becomes mx.random.key(seed)
        theirs = [_tok(ref(logprobs)) for _ in range(60)]
        ours = _draws(Sampler(SamplingParams(temp, top_p, seed, top_k=top_k, min_p=min_p)), logprobs, 60)
        assert ours == theirs
        # from raw logits: the same draws (the log-softmax is a shift)
        assert _draws(Sampler(SamplingParams(temp, top_p, seed, top_k=top_k, min_p=min_p)), logits, 60) == theirs
        assert len(set(ours)) > 1


def test_plain_greedy_is_the_request_with_nothing_between_logits_and_argmax() -> None:
    # Admission prices these requests with less step scratch (`RequestCost.plain_greedy`):
    # anything that builds more vocabulary-sized rows must turn it off.
    def req(matcher: object = None, **kw: Any) -> GenerationRequest:
        return GenerationRequest("r", (1, 2), 4, SamplingParams(**{"temperature": 0.0, **kw}), matcher=matcher)

    assert req().plain_greedy
    assert not req(temperature=0.7).plain_greedy
    assert not req(logprobs=True).plain_greedy
    assert not req(repetition_penalty=1.2).plain_greedy
    assert not req(logit_bias=((3, 1.0),)).plain_greedy
    assert not req(matcher=object()).plain_greedy


def test_top_k_one_is_greedy() -> None:
    for seed in range(5):
        logits = _logits(seed, scale=0.5)  # flat: plain sampling would wander
        greedy = _tok(Sampler(SamplingParams(temperature=0.0))(logits))
        assert set(_draws(Sampler(SamplingParams(1.5, seed=seed, top_k=1)), logits, 50)) == {greedy}
        assert len(set(_draws(Sampler(SamplingParams(1.5, seed=seed)), logits, 50))) > 10


def test_top_k_off_values_change_nothing() -> None:
    logits = _logits(2)
    plain = _draws(Sampler(SamplingParams(seed=3)), logits, 60)
    for k in (0, -1, V, V + 5):  # off, off, and no narrower than the vocabulary
        assert _draws(Sampler(SamplingParams(seed=3, top_k=k)), logits, 60) == plain
    top5 = {int(t) for t in _row(mx.argsort(-logits)[:5])}
    assert set(_draws(Sampler(SamplingParams(seed=3, top_k=5)), logits, 200)) <= top5


def test_min_p_filters_unlikely_tokens() -> None:
    probs = [0.5, 0.3, 0.15, 0.04, 0.01]
    logits = mx.log(mx.array(probs))
    seen = set(_draws(Sampler(SamplingParams(seed=1)), logits, 1000))
    assert {3, 4} <= seen  # without min_p the unlikely tokens do come up
    # min_p 0.1: keep p >= 0.1 * 0.5 = 0.05
    assert set(_draws(Sampler(SamplingParams(seed=1, min_p=0.1)), logits, 1000)) == {0, 1, 2}
    assert set(_draws(Sampler(SamplingParams(seed=1, min_p=0.5)), logits, 300)) == {0, 1}


def test_logit_bias_bans_and_forces() -> None:
    logits = _logits(4, scale=0.5)
    top = _tok(mx.argmax(logits))
    banned = SamplingParams(seed=2, temperature=0.0, logit_bias=((top, -100.0),))
    s = Sampler(banned)
    assert _tok(s(s.process(logits, (), []))) != top
    s = Sampler(SamplingParams(seed=2, logit_bias=((top, -100.0),)))
    assert top not in {_tok(s(s.process(logits, (), []))) for _ in range(500)}
    forced = 17 if top != 17 else 18
    s = Sampler(SamplingParams(seed=2, temperature=1.5, logit_bias=((forced, 100.0),)))
    assert {_tok(s(s.process(logits, (), []))) for _ in range(500)} == {forced}


def test_presence_and_frequency_count_generated_tokens_only() -> None:
    logits = mx.zeros((10,))
    s = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert _row(s.process(logits, (4, 4, 4), [])) == [0.0] * 10  # the prompt is not counted
    out = _row(s.process(logits, (4,), [3, 3, 3, 5]))
    assert out[3] == pytest.approx(-0.5 - 3 * 0.25)  # presence once, frequency per time
    assert out[5] == pytest.approx(-0.5 - 0.25)
    assert out[4] == 0.0 and _row(logits) == [0.0] * 10  # the input is left as it was
    # every generated token counts, however long ago (no window)
    far = _row(s.process(logits, (), [6] + [7] * 500))
    assert far[6] == pytest.approx(-0.75)


def test_repetition_penalty_sees_recent_prompt_and_generated() -> None:
    logits = mx.array([2.0, -2.0, 2.0, 2.0, 2.0])
    s = Sampler(SamplingParams(repetition_penalty=2.0))
    out = _row(s.process(logits, (0, 1), [2]))
    assert out == [1.0, -4.0, 1.0, 2.0, 2.0]  # sign-aware: both move down
    # only the last REPETITION_CONTEXT tokens of prompt + generated count
    old = (3,) + (0,) * REPETITION_CONTEXT
    assert _row(s.process(logits, old, []))[3] == 2.0


@pytest.mark.parametrize(
    "temperature, penalty",
    [(1.0, {"presence_penalty": 1.5}), (1.0, {"frequency_penalty": 0.5}),
     (1.0, {"repetition_penalty": 2.0}), (0.0, {"frequency_penalty": 0.5})],
    ids=["presence", "frequency", "repetition", "frequency-greedy"],
)
def test_penalties_reduce_repeats_on_fixed_logits(temperature: float, penalty: dict[str, float]) -> None:
    base = pen = 0
    for seed in range(5):
        logits = _logits(seed, n=200, scale=1.5)
        base += _repeats(_feedback(SamplingParams(temperature, seed=seed), logits, 60))
        pen += _repeats(_feedback(SamplingParams(temperature, seed=seed, **penalty), logits, 60))  # type: ignore[arg-type]
    assert pen < 0.8 * base, (base, pen)


def test_bad_parameters_fail_at_construction() -> None:
    for bad in ({"top_k": -2}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"top_p": 0.0},
                {"temperature": -1.0}, {"presence_penalty": float("nan")},
                {"logit_bias": ((-1, 1.0),)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampler(SamplingParams(**bad))
    with pytest.raises(ValueError, match="logit_bias"):
        Sampler(SamplingParams(logit_bias=((V, 1.0),))).check_vocab(V)


# ------------------------------------------------------------------ through the engine

NO_EOS = ((0, -100.0), (2, -100.0))  # the tokenizer's EOS ids: full-length rows


@pytest.fixture(scope="module")
def small_vocab_engine(gguf_tokenizer: ChatTokenizer) -> Iterator[Engine]:
    """A 256-token random model: small enough that plain decoding repeats itself."""
    eng = make_engine(tiny_loaded(gguf_tokenizer, make_tiny_model(seed=5, vocab_size=256)), segmented=True)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def engine(gguf_tokenizer: ChatTokenizer) -> Iterator[Engine]:
    eng = make_engine(tiny_loaded(gguf_tokenizer, make_tiny_model(seed=5)), segmented=True)
    yield eng
    eng.stop()


def _req(tag: str, prompt: Sequence[int], n: int, sampling: SamplingParams, **kw: Any) -> GenerationRequest:
    return GenerationRequest(tag, tuple(prompt), n, sampling, **kw)


def _prompts(k: int) -> list[list[int]]:
    return [list(range(100 + 10 * p, 110 + 10 * p)) for p in range(k)]


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.5}],
    ids=["presence", "frequency", "repetition"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_penalties_reduce_repeats_in_generation(
    small_vocab_engine: Engine, penalty: dict[str, float], temperature: float
) -> None:
    def repeats(kw: dict[str, float]) -> int:
        reqs = [_req(f"rep-{temperature}-{sorted(kw)}-{i}", p, 64,
                     SamplingParams(temperature, seed=i, logit_bias=NO_EOS, **kw))  # type: ignore[arg-type]
                for i, p in enumerate(_prompts(6))]
        results = run(small_vocab_engine, reqs)
        assert all(r.done is not None and r.done.completion_tokens == 64 for r in results)
        return sum(_repeats(r.tokens) for r in results)

    base, pen = repeats({}), repeats(penalty)
    assert pen < 0.8 * base, (base, pen)


def test_logit_bias_bans_and_forces_in_generation(engine: Engine) -> None:
    prompt = _prompts(1)[0]
    plain = run(engine, [_req("lb-plain", prompt, 12, SamplingParams(0.0, logit_bias=NO_EOS))])[0]
    ban = tuple((t, -100.0) for t in set(plain.tokens)) + NO_EOS
    banned = run(engine, [_req("lb-ban", prompt, 12, SamplingParams(0.0, logit_bias=ban))])[0]
    assert not set(banned.tokens) & set(plain.tokens)
    forced = run(engine, [_req("lb-force", prompt, 12, SamplingParams(1.0, seed=1, logit_bias=((1234, 100.0),)))])[0]
    assert forced.tokens == [1234] * 12


def test_logprobs_report_the_model_distribution(engine: Engine) -> None:
    """A token forced by logit_bias is reported with the model's own (low) logprob, not
    the ~0 of the biased distribution it was drawn from."""
    req = _req("lp", _prompts(1)[0], 3, SamplingParams(
        1.0, seed=1, logprobs=True, top_logprobs=2, logit_bias=((1234, 100.0),)))
    got = _token_logprobs(engine, req)
    assert [t for t, _, _ in got] == [1234] * 3
    for _, lp, top in got:
        assert lp < -1.0 and top[0][0] != 1234 and top[0][1] > lp


def _token_logprobs(engine: Engine, req: GenerationRequest) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    async def main() -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
        h = RequestHandle(req, asyncio.get_running_loop())
        engine.submit(h)
        out = []
        while True:
            ev = await asyncio.wait_for(h.queue.get(), 60)
            if isinstance(ev, Token):
                assert ev.logprob is not None
                out.append((ev.token_id, ev.logprob.logprob, ev.logprob.top))
            elif isinstance(ev, Done | Failed):
                return out

    return asyncio.run(main())


SEEDED = [
    SamplingParams(0.9, seed=11, top_k=50, min_p=0.02, presence_penalty=0.5,
                   frequency_penalty=0.3, repetition_penalty=1.2, logit_bias=((7, 3.0),)),
    SamplingParams(1.1, 0.9, seed=12, repetition_penalty=1.3),
    SamplingParams(0.8, seed=13),
]


def test_same_seed_same_tokens_batched_and_alone(engine: Engine) -> None:
    prompts = _prompts(3)
    together = run(engine, [_req(f"b-{i}", p, 16, s) for i, (p, s) in enumerate(zip(prompts, SEEDED, strict=True))])
    alone = [run(engine, [_req(f"a-{i}", p, 16, s)])[0] for i, (p, s) in enumerate(zip(prompts, SEEDED, strict=True))]
    for t, a in zip(together, alone, strict=True):
        assert t.done is not None and len(t.tokens) > 1
        assert t.tokens == a.tokens
    again = run(engine, [_req("c-0", prompts[0], 16, SEEDED[0])])[0]
    assert again.tokens == alone[0].tokens
    other = run(engine, [_req("d-0", prompts[0], 16, SamplingParams(0.9, seed=99))])[0]
    assert other.tokens != alone[0].tokens


# ------------------------------------------------------------------ the grammar hook


class _Matcher:
    """Allows `allowed` only; finished after `finish_after` accepted tokens; rejects when
    `reject` (a broken matcher: the row must end as a failure)."""

    def __init__(self, vocab: int, allowed: Sequence[int], finish_after: int, reject: bool = False) -> None:
        m = [False] * vocab
        for t in allowed:
            m[t] = True
        self._mask = mx.array(m)
        self.accepted: list[int] = []
        self.finish_after = finish_after
        self.reject = reject
        self.error: str | None = None

    def mask(self) -> mx.array:
        return self._mask

    def accept(self, token_id: int) -> bool:
        if self.reject:
            self.error = "injected rejection"
            return False
        self.accepted.append(token_id)
        return True

    def is_finished(self) -> bool:
        return len(self.accepted) >= self.finish_after


def test_matcher_masks_and_finishes_with_stop(engine: Engine) -> None:
    m = _Matcher(49152, [300, 301, 302], finish_after=5)
    r = run(engine, [_req("g-1", _prompts(1)[0], 50, SamplingParams(1.0, seed=3), matcher=m)])[0]
    assert r.done is not None and r.done.finish_reason == "stop"
    assert r.tokens == m.accepted and len(r.tokens) == 5 and set(r.tokens) <= {300, 301, 302}


def test_matcher_rejection_ends_the_row(engine: Engine) -> None:
    m = _Matcher(49152, [300], finish_after=5, reject=True)
    ok = _Matcher(49152, [301], finish_after=3)
    bad, good = run(engine, [
        _req("g-bad", _prompts(1)[0], 20, SamplingParams(0.0), matcher=m),
        _req("g-good", _prompts(2)[1], 20, SamplingParams(0.0), matcher=ok),
    ])
    assert bad.failed is not None and bad.tokens == []
    assert good.done is not None and good.tokens == [301] * 3


def test_json_object_through_the_engine_parses_for_20_seeds(
    engine: Engine, gguf_tokenizer: ChatTokenizer
) -> None:
    backend = gguf_tokenizer.backend
    assert backend is not None
    vocab = GrammarVocab.from_tokenizer(backend, vocab_size=49152, eos_ids=gguf_tokenizer.eos_ids)
    g = compile_response_format({"type": "json_object"}, vocab)
    assert g is not None
    # A random model almost never draws a quote inside a string: nudge the tokens that can
    # close strings and objects (the mask, not the bias, is what keeps the text valid),
    # and ban the bare "{}" so the objects have content.
    texts = [backend.decode([i]) for i in range(49152)]
    bias = tuple((i, -100.0 if "{}" in t else 5.0) for i, t in enumerate(texts) if '"' in t or "}" in t)
    reqs = [_req(f"json-{s}", _prompts(1)[0], 512, SamplingParams(1.0, seed=s, logit_bias=bias),
                 matcher=g.matcher()) for s in range(20)]
    results: list[Result] = run(engine, reqs)
    sizes = []
    for s, r in enumerate(results):
        assert r.done is not None and r.done.finish_reason == "stop", (s, r.failed, r.text[-80:])
        value = json.loads(r.text)
        assert isinstance(value, dict) and value, (s, r.text)
        sizes.append(len(r.tokens))
    assert max(sizes) > 20  # not only trivial objects
