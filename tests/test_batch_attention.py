"""Batched segmented attention (segserve.kernels.batch_attention) against per-session calls.

The CPU cases run the whole decomposition (plan, tail stacking and mask, shared part by
`plain_lse`, LSE merge, order) and `decode_batch`'s dispatch with a route that offers
`attend_lse`; the `gpu` cases run the fused CUDA route's shared part on a CUDA device.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from segserve.kernels import batch_attention
from segserve.kernels.batch_attention import attend_batch, plain_lse, plan_batch
from segserve.kernels.composed import attend_segments
from segserve.kernels.hook import install
from segserve.kv.segmented import SegmentedCache
from segserve.server.runner import batch_supported, decode_batch, logits_last
from tests.conftest import decode_backend, make_tiny_model

HAS_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX with a CUDA GPU")
H_KV, HQ, D = 2, 8, 64
F32_TOL = 1e-4


@pytest.fixture
def on_cpu() -> Any:
    """The float32 comparisons run on the CPU device also where a GPU is the default (a
    CUDA GPU's float32 products are TF32, whose rounding drowns these tolerances)."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


def _normal(shape: tuple[int, ...], key: Any, dtype: mx.Dtype) -> mx.array:
    return mx.random.normal(shape, key=key).astype(dtype)


def _history(rows: list[int], seed: int, dtype: mx.Dtype) -> SegmentedCache:
    """A one-layer cache whose base holds segments of `rows` rows."""
    cache = SegmentedCache(1, route=attend_segments)
    keys = mx.random.split(mx.random.key(seed), 2 * len(rows))
    for i, r in enumerate(rows):
        cache.layers[0].update_and_fetch(_normal((1, H_KV, r, D), keys[2 * i], dtype),
                                         _normal((1, H_KV, r, D), keys[2 * i + 1], dtype))
        cache.record_tokens(list(range(r)))
        cache.seal()
    return cache


def _sessions(dtype: mx.Dtype) -> list[SegmentedCache]:
    """Two forks of one history, one fork of another (3 segments), one without history,
    each with its own tail length."""
    a, b = _history([70, 5], 1, dtype), _history([130, 64, 9], 2, dtype)
    out = [SegmentedCache(1, a.base, route=attend_segments),
           SegmentedCache(1, b.base, route=attend_segments),
           SegmentedCache(1, a.base, route=attend_segments),
           SegmentedCache(1, route=attend_segments)]
    for i, (c, t) in enumerate(zip(out, (3, 0, 66, 1), strict=True)):
        if t:
            ks = mx.random.split(mx.random.key(10 + i), 2)
            c.layers[0].update_and_fetch(_normal((1, H_KV, t, D), ks[0], dtype),
                                         _normal((1, H_KV, t, D), ks[1], dtype))
    return out


def _distinct_sessions(dtype: mx.Dtype) -> list[SegmentedCache]:
    """Two forks of one history, two sessions with histories of their own (one of 3
    segments), one without history: two groups of one, as unrelated users."""
    a, b, c = _history([70, 5], 1, dtype), _history([130, 64, 9], 2, dtype), _history([300], 3, dtype)
    out = [SegmentedCache(1, b.base, route=attend_segments),
           SegmentedCache(1, a.base, route=attend_segments),
           SegmentedCache(1, route=attend_segments),
           SegmentedCache(1, c.base, route=attend_segments),
           SegmentedCache(1, a.base, route=attend_segments)]
    for i, (cache, t) in enumerate(zip(out, (2, 0, 5, 70, 1), strict=True)):
        if t:
            ks = mx.random.split(mx.random.key(20 + i), 2)
            cache.layers[0].update_and_fetch(_normal((1, H_KV, t, D), ks[0], dtype),
                                             _normal((1, H_KV, t, D), ks[1], dtype))
    return out


def _plain_owned(q: mx.array, sessions: Any, scale: float) -> tuple[mx.array, mx.array]:
    """The owned part by plain ops: row i over session i's pieces."""
    parts = [plain_lse(q[i : i + 1], pieces, scale) for i, pieces in enumerate(sessions)]
    return mx.concatenate([o for o, _ in parts]), mx.concatenate([lse for _, lse in parts])


def _check(dtype: mx.Dtype, shared: Any, route: Any, atol: float, owned: Any = None,
           make: Any = _sessions) -> None:
    batch, single = make(dtype), make(dtype)
    layers = [c.layers[0] for c in batch]
    n = len(batch)
    for step in range(3):
        ks = mx.random.split(mx.random.key(100 + step), 3)
        q = _normal((n, HQ, 1, D), ks[0], dtype)
        k = _normal((n, H_KV, 1, D), ks[1], dtype)
        v = _normal((n, H_KV, 1, D), ks[2], dtype)
        plan = plan_batch(layers)
        if make is _sessions:
            assert sorted(len(g) for g in plan.groups) == [1, 2] and plan.n_without == 1
        else:  # shared groups first, then the sessions of histories of their own
            assert [len(g) for g in plan.groups] == [2, 1, 1] and plan.singles == 2
            assert plan.groups[1:] == ((0,), (3,)) and plan.n_without == 1
        got = attend_batch(q, k, v, layers, plan, 0.125, shared, owned)
        for i, c in enumerate(single):
            lc = c.layers[0]
            kt, vt = lc.update_and_fetch(k[i : i + 1], v[i : i + 1])
            want = route(q[i : i + 1], lc.segment_kv(), (kt, vt), scale=0.125, causal=True)
            assert got.dtype == want.dtype
            err = float(mx.abs(got[i : i + 1].astype(mx.float32) - want.astype(mx.float32)).max().item())  # type: ignore[arg-type]  # item() of a float array
            assert err <= atol, (step, i, err)
        # The batched step wrote the same rows as update_and_fetch.
        for bc, sc in zip(batch, single, strict=True):
            assert bc.offset == sc.offset
            rows = bc._written[0]
            got_k, want_k = _tail_keys(bc), _tail_keys(sc)
            assert mx.array_equal(got_k[:, :, :rows], want_k[:, :, :rows]).item()


def _tail_keys(cache: SegmentedCache) -> mx.array:
    """Layer 0's tail keys without making the cache read its tail (which would turn a row of
    the batch's stack into views and end the stack's reuse)."""
    stack = cache._stacks[0]
    if cache._k[0] is None and stack is not None:
        return stack[0][stack[2] : stack[2] + 1]
    assert cache._k[0] is not None
    return cache._k[0]


def test_batch_equals_per_session_on_cpu(on_cpu: None) -> None:
    _check(mx.float32, plain_lse, attend_segments, F32_TOL)


def test_sessions_of_distinct_histories_go_together_through_the_owned_part(on_cpu: None) -> None:
    calls: list[int] = []

    def owned(q: mx.array, sessions: Any, scale: float) -> tuple[mx.array, mx.array]:
        calls.append(q.shape[0])
        return _plain_owned(q, sessions, scale)

    _check(mx.float32, plain_lse, attend_segments, F32_TOL, owned, _distinct_sessions)
    assert calls == [2, 2, 2]  # one call per step for both sessions of their own history
    _check(mx.float32, plain_lse, attend_segments, F32_TOL, None, _distinct_sessions)  # per group


def test_plain_lse_is_the_log_sum_exp(on_cpu: None) -> None:
    ks = mx.random.split(mx.random.key(3), 5)
    q = _normal((1, HQ, 3, D), ks[0], mx.float32)
    pieces = [(_normal((1, H_KV, n, D), ks[1 + 2 * i], mx.float32),
               _normal((1, H_KV, n, D), ks[2 + 2 * i], mx.float32)) for i, n in enumerate((17, 40))]
    out, lse = plain_lse(q, pieces, 0.2)
    k = mx.concatenate([p[0] for p in pieces], axis=2)
    v = mx.concatenate([p[1] for p in pieces], axis=2)
    qg = q.reshape(1, H_KV, -1, D) * 0.2
    s = qg @ k.swapaxes(-1, -2)
    want_lse = mx.logsumexp(s, axis=-1).reshape(1, HQ, 3)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2)
    assert mx.allclose(lse, want_lse, atol=F32_TOL).item()
    assert mx.allclose(out, want, atol=1e-5).item()


class _RouteWithLse:
    """The composed route plus a shared part with its LSE: what the fused CUDA route
    offers, so `decode_batch` takes the batched path on the CPU."""

    name = "composed+lse"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kw: Any) -> mx.array:
        return attend_segments(*args, **kw)

    def attend_lse(self, q: mx.array, pieces: Any, scale: float) -> tuple[mx.array, mx.array]:
        self.calls += 1
        return plain_lse(q, pieces, scale)


def test_decode_batch_dispatches_and_matches(monkeypatch: pytest.MonkeyPatch, on_cpu: None) -> None:
    model = make_tiny_model(seed=4)
    install(model)
    dec = decode_backend(model)
    assert batch_supported(dec)
    n_layers = len(model.model.layers)
    route = _RouteWithLse()
    used: list[int] = []
    real = batch_attention.attend_batch

    def counting(*a: Any, **kw: Any) -> mx.array:
        used.append(1)
        return real(*a, **kw)

    monkeypatch.setattr("segserve.server.runner.batched.attend_batch", counting)

    def sessions(r: Any) -> list[SegmentedCache]:
        root = SegmentedCache(n_layers, route=r)
        prompt = list(range(10, 40))
        mx.eval(logits_last(model, prompt, root.layers))
        root.record_tokens(prompt)
        base = root.seal()
        forks = [SegmentedCache(n_layers, base, route=r) for _ in range(3)]
        forks.append(SegmentedCache(n_layers, route=r))  # no history
        for i, c in enumerate(forks):
            extra = [50 + i] * (i + 1)
            mx.eval(logits_last(model, extra, c.layers))
            c.record_tokens(extra)
        return forks

    batch, single = sessions(route), sessions(attend_segments)
    tokens = [5, 6, 7, 8]
    for _ in range(3):
        got = decode_batch(dec, tokens, [c.layers for c in batch])
        want = [logits_last(model, [t], c.layers) for t, c in zip(tokens, single, strict=True)]
        for i, w in enumerate(want):
            assert mx.allclose(got[i], w, atol=1e-3).item()
        tokens = [int(mx.argmax(w).item()) for w in want]  # type: ignore[arg-type]  # item() of an integer array
        for c in batch + single:
            c.record_tokens([tokens[(batch + single).index(c) % 4]])
    assert used and route.calls > 0
    # B = 1 keeps the per-session call.
    n = len(used)
    decode_batch(dec, [1], [batch[0].layers])
    assert len(used) == n


@pytest.mark.gpu
@needs_gpu
def test_batch_equals_per_session_fused_cuda() -> None:
    from segserve.kernels.fused_cuda import FusedCudaRoute

    route = FusedCudaRoute()
    _check(mx.bfloat16, route.attend_lse, route, 2e-2)


@pytest.mark.gpu
@needs_gpu
def test_batch_of_distinct_histories_equals_per_session_fused_cuda() -> None:
    from segserve.kernels.fused_cuda import FusedCudaRoute

    route = FusedCudaRoute()
    _check(mx.bfloat16, route.attend_lse, route, 2e-2, route.attend_owned, _distinct_sessions)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("max_pieces", [17, 4])
def test_fused_attend_owned_matches_plain(max_pieces: int) -> None:
    """Sessions of 1-3 pieces of uneven lengths, one of 18 (alone, merged by LSE); with
    4 pieces per launch the sessions split over several launches."""
    from segserve.kernels.fused_cuda import FusedCudaRoute

    route = FusedCudaRoute(max_pieces=max_pieces)
    counts = [[2048], [300, 65], [5000, 64, 1], [18] * 18, [700], [129, 4000]]
    keys = iter(mx.random.split(mx.random.key(9), 1 + 2 * sum(len(c) for c in counts)))
    q = _normal((len(counts), 32, 1, 128), next(keys), mx.bfloat16)
    sessions = [[(_normal((1, 8, r, 128), next(keys), mx.bfloat16), _normal((1, 8, r, 128), next(keys), mx.bfloat16))
                 for r in rows] for rows in counts]
    for _ in range(2):  # the second call replays the cached launches
        out, lse = route.attend_owned(q, sessions, 0.088)
        ref_out, ref_lse = _plain_owned(q, sessions, 0.088)
        assert out.dtype == mx.float32 and out.shape == (len(counts), 32, 1, 128)
        assert mx.allclose(out, ref_out, atol=2e-2).item()
        assert mx.allclose(lse, ref_lse, atol=2e-2).item()


@pytest.mark.gpu
@needs_gpu
def test_fused_attend_lse_matches_plain() -> None:
    from segserve.kernels.fused_cuda import FusedCudaRoute

    route = FusedCudaRoute(max_pieces=2)  # 3 pieces: two launches merged by LSE
    ks = mx.random.split(mx.random.key(5), 7)
    q = _normal((1, 32, 40, 128), ks[0], mx.bfloat16)
    pieces = [(_normal((1, 8, n, 128), ks[1 + 2 * i], mx.bfloat16),
               _normal((1, 8, n, 128), ks[2 + 2 * i], mx.bfloat16))
              for i, n in enumerate((2048, 300, 65))]
    out, lse = route.attend_lse(q, pieces, 0.088)
    ref_out, ref_lse = plain_lse(q, pieces, 0.088)
    assert out.dtype == mx.float32
    assert mx.allclose(out, ref_out, atol=2e-2).item()
    assert mx.allclose(lse, ref_lse, atol=2e-2).item()


def test_window_layers_are_not_batched() -> None:
    """A sliding-window layer anywhere keeps the per-session calls (the plan has no window)."""
    plain = SegmentedCache(2, route=attend_segments)
    windowed = SegmentedCache(2, route=attend_segments, windows=[None, 16])
    assert batch_attention.batchable([plain.layers[0]], mx.float32)
    assert not batch_attention.batchable([plain.layers[0], windowed.layers[0]], mx.float32)
    half = SegmentedCache(2, route=attend_segments, dtype=mx.float16)
    assert not batch_attention.batchable([half.layers[0]], mx.float32)


def test_batched_tails_stay_private_after_the_step(on_cpu: None) -> None:
    """After batched steps each session's tail is a view of the batch's stack: a seal
    copies its rows out (the segment holds its own rows only), and a session decoding
    alone afterwards writes its own rows, never another's."""
    batch = _sessions(mx.float32)
    layers = [c.layers[0] for c in batch]
    for step in range(2):
        ks = mx.random.split(mx.random.key(200 + step), 3)
        plan = plan_batch(layers)
        out = attend_batch(_normal((4, HQ, 1, D), ks[0], mx.float32),
                           _normal((4, H_KV, 1, D), ks[1], mx.float32),
                           _normal((4, H_KV, 1, D), ks[2], mx.float32), layers, plan, 0.125, plain_lse)
        mx.eval(out)
    assert batch[0]._tail_shared
    rows = [c._written[0] for c in batch]
    assert rows == [5, 2, 68, 3]
    other = mx.array(_tail_keys(batch[2])[:, :, : rows[2]])
    # Session 1 decodes alone: its write must not reach session 2's rows.
    k1 = mx.full((1, H_KV, 1, D), 7.0)
    batch[1].layers[0].update_and_fetch(k1, k1)
    assert mx.array_equal(_tail_keys(batch[2])[:, :, : rows[2]], other).item()
    batch[0].record_tokens([1] * 5)
    seg = batch[0].seal().segments[-1]
    assert seg.keys[0].shape[2] == 5
    assert not batch[0]._tail_shared


def _checked_step(batch: list[SegmentedCache], single: list[SegmentedCache], seed: int,
                  order: list[int]) -> tuple[Any, bool]:
    """One batched step of `order`'s sessions (one layer), checked against the same step
    per session on the twins in `single`: outputs, and the rows each tail holds. Returns the
    step's plan and whether it took the previous stack whole (`_kept_stack`)."""
    ks = mx.random.split(mx.random.key(seed), 3)
    q = _normal((len(order), HQ, 1, D), ks[0], mx.float32)
    k = _normal((len(order), H_KV, 1, D), ks[1], mx.float32)
    v = _normal((len(order), H_KV, 1, D), ks[2], mx.float32)
    layers = [batch[i].layers[0] for i in order]
    plan = plan_batch(layers)
    kept = batch_attention._kept_stack(layers, plan.tail_pad) is not None
    got = attend_batch(q, k, v, layers, plan, 0.125, plain_lse)
    for row, i in enumerate(order):
        lc = single[i].layers[0]
        kt, vt = lc.update_and_fetch(k[row : row + 1], v[row : row + 1])
        want = attend_segments(q[row : row + 1], lc.segment_kv(), (kt, vt), scale=0.125, causal=True)
        assert mx.allclose(got[row : row + 1], want, atol=F32_TOL).item(), (seed, i)
        rows = batch[i]._written[0]
        assert mx.array_equal(_tail_keys(batch[i])[:, :, :rows], _tail_keys(single[i])[:, :, :rows]).item()
    return plan, kept


def test_the_stack_is_kept_only_while_every_tail_is_its_view(on_cpu: None) -> None:
    """The next step of the same sessions writes into the previous step's stack (no
    re-stacking); a session that wrote alone, a reordered batch or another padding
    re-stacks, and every step still equals per-session calls."""
    batch, single = _sessions(mx.float32), _sessions(mx.float32)

    def step(seed: int, order: list[int]) -> bool:
        return _checked_step(batch, single, seed, order)[1]

    assert not step(1, [0, 1, 2, 3])  # first step: stacked from the tails
    assert step(2, [0, 1, 2, 3])  # same sessions, same order: the stack is kept
    assert not step(3, [1, 0, 2, 3])  # reordered
    assert step(4, [1, 0, 2, 3])
    k1 = mx.full((1, H_KV, 1, D), 3.0)
    batch[1].layers[0].update_and_fetch(k1, k1)  # session 1 writes alone
    single[1].layers[0].update_and_fetch(k1, k1)
    assert not step(5, [1, 0, 2, 3])
    assert step(6, [1, 0, 2, 3])
    assert not step(7, [1, 0, 2])  # a session left the batch


def test_a_changed_batch_takes_the_kept_rows_as_runs(on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """When sessions join, leave or the padding moves, the rows of the previous stack that
    are still consecutive come as one slice each: only the sessions not in it are stacked
    from their own tails, and every step still equals per-session calls."""
    batch = _sessions(mx.float32) + _distinct_sessions(mx.float32)
    single = _sessions(mx.float32) + _distinct_sessions(mx.float32)
    stacked: list[int] = []
    padded_tail = SegmentedCache.padded_tail

    def spy(self: SegmentedCache, layer: int, rows: int, like: mx.array) -> Any:
        stacked.append(batch.index(self))
        return padded_tail(self, layer, rows, like)

    monkeypatch.setattr(SegmentedCache, "padded_tail", spy)

    def step(seed: int, order: list[int]) -> tuple[list[int], int]:
        stacked.clear()
        plan, _ = _checked_step(batch, single, seed, order)
        return list(stacked), plan.tail_pad

    assert step(1, [0, 1, 3]) == ([0, 1, 3], 64)  # first step: every tail on its own
    assert step(2, [0, 1, 3, 4]) == ([4], 64)  # one joins: the three kept rows are one slice
    assert step(3, [0, 3, 4]) == ([], 64)  # one leaves: two runs, nothing re-stacked
    assert step(4, [5, 0, 3, 4, 6]) == ([5, 6], 64)  # joins at both ends
    assert step(5, [5, 0, 2, 3, 4, 6]) == ([2], 128)  # a 66-row tail: the padding grows
    assert step(6, [5, 0, 3, 4, 6]) == ([], 64)  # it leaves: the padding shrinks again
    assert step(7, [4, 3, 0, 5, 6]) == ([], 64)  # reordered: runs of one row each
