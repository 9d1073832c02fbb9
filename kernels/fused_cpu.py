"""Fused CPU route: attention over every segment and the tail in one MLX op.

Owns: `FusedCpuRoute` (an `AttentionRoute`, name "fused_cpu"), `available` and the
registry hooks `applies`/`build`. The op itself is the C++ primitive in `kernels/native/`
(`_segattn.attend`, built by `python -m segserve.kernels.native.build`): one pass over all pieces
with an online softmax in float32, each piece read in place through its strides (the tail
is a slice of a bigger buffer), the G query heads of a KV head together so each K/V row is
read once, SIMD body chosen at run time (AVX-512 / AVX2+FMA / portable).

Why: the composed route costs ~20 MLX ops per layer call (~0.75 ms fixed on a 2-core
CPU); this is one op, cheaper than stock SDPA over one contiguous buffer at every length
(bench/attn_cpu.py).

Host path per call (30 per decoded token): flatten the pieces into one list and call the
extension; shape, dtype and head_dim checks happen in C++, which answers None for what it
does not serve (K/V dtype unlike Q other than float16/bfloat16 K/V under float32 queries,
head_dim outside 64/128/256, other dtypes); that call goes to the composed route unchanged.
No mx.array is made per call besides the output.

Sliding windows (`window=W`): the pieces are clipped to the queries' windows
(`segserve.kernels.window.clip_to_window`, views); when every query then sees every kept key (any
decode step) the op runs on the views, else (a prefill chunk across a window start) the
op takes the window and masks each query's keys before its own start (query l of L at
position p, counted from the end of the tail, sees (p - W, p]).

Soft-capped scores (`softcap=C`, gemma2): the op turns each scaled score s into
C * tanh(s / C) before the softmax (vectorized through its exp2: (E - 1) / (E + 1)).

Invariants: same contract as `segserve.kernels.composed.attend_segments` (segment rows visible to
every query; tail row j visible to query i iff not causal or j <= T - L + i; a row that
sees no key is zeros; output in the query dtype; K/V never copied or concatenated).
Not differentiable (no vjp), CPU only. Under `mx.compile` the op is kept as one node
(it has output_shapes, so shapeless compilation works too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import mlx.core as mx

from segserve.kernels.composed import SUPPORTED_HEAD_DIMS, KVPair, attend_segments
from segserve.kernels.window import clip_segments, clip_to_window

HEAD_DIMS = SUPPORTED_HEAD_DIMS
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

Fallback = Callable[..., mx.array]


@lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """Can the fused CPU op run here? (ok, reason); imports the built extension once."""
    from segserve.kernels.native import build

    if not build.module_path().exists():
        return False, f"extension not built ({build.rebuild_hint()})"
    if build.has_sources() and not build.up_to_date():
        return False, f"extension is older than its sources ({build.rebuild_hint()})"
    try:
        from segserve.kernels.native import _segattn
    except ImportError as exc:
        return False, f"extension does not import: {exc}"
    return True, f"segserve.kernels.native._segattn, {_segattn.isa()} kernel, {_segattn.threads()} thread(s)"


def supports(head_dim: int, n_q_heads: int, n_kv_heads: int, dtype: mx.Dtype) -> tuple[bool, str]:
    """Shapes the op serves (availability is `available`); reason when not."""
    if head_dim not in HEAD_DIMS:
        return False, f"head_dim {head_dim} not in {HEAD_DIMS}"
    if n_kv_heads <= 0 or n_q_heads % n_kv_heads:
        return False, f"{n_q_heads} query heads not a multiple of {n_kv_heads} KV heads"
    if dtype not in DTYPES:
        return False, f"dtype {dtype} (op serves float32, float16, bfloat16)"
    return True, f"D={head_dim}, G={n_q_heads // n_kv_heads}, {dtype}"


def applies(query: Any) -> bool:
    """Registry predicate (`segserve.kernels.factory.FusedRouteSpec.applies`, takes a RouteQuery)."""
    if query.backend != "cpu":
        return False
    ok, _ = supports(query.head_dim, query.n_q_heads, query.n_kv_heads, query.dtype)
    return ok and available()[0]


def build(query: Any = None) -> FusedCpuRoute:
    """Registry constructor (`FusedRouteSpec.build`)."""
    return FusedCpuRoute()


class FusedCpuRoute:
    """`AttentionRoute` over segments + tail in one CPU op; composed route otherwise."""

    name = "fused_cpu"

    def __init__(self, *, fallback: Fallback = attend_segments) -> None:
        ok, why = available()
        if not ok:
            raise RuntimeError(f"fused_cpu route unavailable: {why}")
        from segserve.kernels.native import _segattn

        self._attend = _segattn.attend
        self._append = _segattn.attend_append
        self.fallback = fallback

    def scratch_bytes(self, n_q_heads: int, n_kv_heads: int, head_dim: int, query_rows: int) -> int:
        """Upper bound of one call's working memory besides its output: per-thread tiles
        (a few KB, kept between calls) and, when the keys are split across threads, one
        float32 partial (acc, max, sum) per query row and split. Admission prices it."""
        from segserve.kernels.native import _segattn

        threads = max(1, int(_segattn.threads()))
        return threads * (n_q_heads * query_rows * (head_dim + 2) * 4 + (1 << 18))

    def __call__(
        self,
        queries: mx.array,
        segments: Sequence[KVPair],
        tail: KVPair | None,
        *,
        scale: float,
        causal: bool,
        window: int | None = None,
        softcap: float = 0.0,
    ) -> mx.array:
        extra = {"softcap": softcap} if softcap else {}  # a fallback without the argument keeps working
        op_window = 0
        if window is not None:
            # The pieces are clipped to the queries' windows first (views): every decode
            # step then sees every kept key; a prefill chunk straddling a window start
            # (`view.masked`) hands the op the window, which masks each query's own start.
            view = clip_to_window(segments, tail, queries.shape[2], window)
            if view.masked:
                if not causal or tail is None:  # positions are the tail's: not this op's case
                    return self.fallback(queries, segments, tail, scale=scale, causal=causal,
                                         window=window, **extra)
                op_window = window
            segments, tail = view.segments, view.tail
        flat = [a for kv in segments for a in kv]
        if tail is not None:
            flat.extend(tail)
        out = self._attend(queries, flat, scale, causal and tail is not None, op_window, softcap)
        if out is None:  # not served by the op (dtype, head_dim, mismatched pieces)
            return self.fallback(queries, segments, tail, scale=scale, causal=causal,
                                 window=window, **extra)
        return out

    def attend_append(
        self,
        queries: mx.array,
        segments: Sequence[KVPair],
        new: KVPair,
        buffers: KVPair,
        start: int,
        *,
        scale: float,
        window: int | None = None,
    ) -> mx.array | None:
        """The decode step's form (`segserve.kv.segmented.SegmentedCache.write_attend`): the op
        writes the new rows into the tail `buffers` at row `start` and attends over the
        segments and the buffers' first `start + n` rows (causal inside them). None when
        the op does not serve the call; then nothing was written.

        `window`: a sliding-window layer's W. Served when one row is written and its window
        starts inside the segments (they are clipped to it, views); otherwise None, and the
        plain write + `__call__` serve the step."""
        flat = self.append_pieces(segments, new[0].shape[2], start, window)
        if flat is None:
            return None
        return self._append(queries, flat, new[0], new[1], buffers[0], buffers[1], start, scale)

    @staticmethod
    def append_pieces(segments: Sequence[KVPair], n_new: int, start: int,
                      window: int | None, in_tail: bool = False) -> list[mx.array] | None:
        """The segments an append of `n_new` rows at tail row `start` attends over, as the
        op takes them (k0, v0, k1, v1, ...): all of them, or for a sliding-window layer
        those clipped to the new row's window (views); None when more than one row is
        written under a window, or when the window starts inside the tail unless the
        caller's op reads the tail from the window's start (`in_tail`: then none)."""
        if window is not None:
            seg_rows = sum(k.shape[2] for k, _ in segments)
            first = seg_rows + start + n_new - window  # the new row's lowest visible key
            if n_new != 1 or (first > seg_rows and not in_tail):
                return None
            segments = clip_segments(segments, max(0, first))
        return [a for kv in segments for a in kv]
