"""The segmented KV cache: immutable segments (shared) plus one private tail per request.

Owns: `SegmentedCache` (one request's memory across layers) and `SegmentedLayerCache`
(the per-layer object an mlx-lm model sees). Only the engine thread calls them.

    base: Snapshot (segment refs, never written)      tail (this request only)
    [seg 0][seg 1]...[seg n-1]                         [rows 0..written) + spare capacity

- `update_and_fetch` writes new rows into the tail and returns the tail rows only; the
  attention hook (`segserve.kernels.hook`) reads `segment_kv(layer)` for the sealed part and calls
  the cache's own `route` (chosen by `segserve.kernels.factory`, passed in at construction), which
  merges by log-sum-exp. Nothing here ever concatenates the history.
- The tail is its own buffer (allocated here, never a slice of a segment), so writing it
  never triggers MLX's copy-on-write of a shared buffer.
- `seal()` turns the tail into a segment (a view of the tail buffer when little capacity
  is spare, else an exact-size copy of the turn's rows only), appends it to the base, and
  applies the size-tiered merge plan (`segserve.kv.merge_policy`), which never rewrites big segments.

- `windows` (optional) gives each layer's sliding window W (None: global attention), as
  the model's own caches say (`segserve.kernels.hook.layer_windows`). A window layer keeps every
  segment like any other layer (forks and rewinds share them; no rotating buffer): the
  route is told W and reads only the keys inside the queries' windows.
- `dtype` (optional) is the storage dtype: rows arriving in another dtype are rounded to
  it as they are written (the CPU's float16 cache under float32 activations); the route
  then reads float16 K/V with float32 queries.

Invariants: every layer's tail holds the same rows once a forward pass finishes;
`offset == base.rows + written`; `len(tail_tokens) == written` after `record_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from segserve.kv.merge_policy import plan_merge
from segserve.kv.segment import Segment, Snapshot

# The batched step's stacked tails [B, H_kv, T, D] (keys, values) and a session's row in them.
BatchStack = tuple[mx.array, mx.array, int]
# (pieces, buf_k, buf_v, start) -> the op that writes the new rows at `start` and attends, or None.
AppendBuild = Callable[[list[mx.array], mx.array, mx.array, int], mx.array | None]

TAIL_STEP = 64


class SegmentedCache:
    """One request's KV memory: a base snapshot (refs) plus a private growing tail."""

    def __init__(
        self,
        num_layers: int,
        base: Snapshot | None = None,
        *,
        max_merge_rows: int = 65536,
        fanout: int = 4,
        route: Callable[..., mx.array] | None = None,
        dtype: mx.Dtype | None = None,
        windows: Sequence[int | None] | None = None,
    ) -> None:
        self.base = base or Snapshot()
        if windows is not None and len(windows) != num_layers:
            raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
        self.windows: tuple[int | None, ...] = tuple(windows or (None,) * num_layers)
        self.dtype = dtype  # storage dtype of the tail (None: the dtype rows arrive in)
        # The attention route over segments + tail (`kernels`): it travels with the cache,
        # so two engines (or a test and a server) can use different routes in one process.
        self.route = route
        self._num_layers = num_layers
        self._k: list[mx.array | None] = [None] * num_layers  # [1, H_kv, cap, D]
        self._v: list[mx.array | None] = [None] * num_layers
        self._written = [0] * num_layers
        self._tail_tokens: list[int] = []
        self._reserve = 0
        self._max_merge_rows = max_merge_rows
        self._fanout = fanout
        self.seals = 0
        self.merges = 0
        self.merged_rows = 0
        self._segment_kv_cache: list[list[tuple[mx.array, mx.array]]] | None = None
        self._tail_shared = False  # the tail is a batch's stack or views of one (`adopt_stack`)
        # Per layer, the batch's stack the tail is a row of (`adopt_stack`): keys, values,
        # row, written rows at adoption.
        self._stacks: list[tuple[mx.array, mx.array, int, int] | None] = [None] * num_layers

    @property
    def layers(self) -> list[SegmentedLayerCache]:
        """Per-layer views for the model, made on each access. They point at this cache and it
        keeps no list of them: a stored list would be a reference cycle, and a finished
        request's tail buffers (MBs of MLX memory) would then live until Python's cyclic GC
        ran, which under load can be minutes (measured: "other" memory grew to 1.47 GB)."""
        return [SegmentedLayerCache(self, i) for i in range(self._num_layers)]

    # ---- engine-facing -------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self.base.rows + self._written[-1]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.base.tokens + tuple(self._tail_tokens)

    def reserve(self, rows: int) -> None:
        """Size the next tail allocation for `rows` more rows (e.g. the known prompt);
        it applies to the current tail only and is forgotten at the next seal."""
        self._reserve = max(0, rows)

    def record_tokens(self, tokens: Sequence[int]) -> None:
        self._tail_tokens.extend(int(t) for t in tokens)
        if len(self._tail_tokens) != self._written[-1]:
            raise AssertionError("tail tokens and tail rows disagree")

    def segment_kv(self, layer: int) -> list[tuple[mx.array, mx.array]]:
        if self._segment_kv_cache is None:
            segs = self.base.segments
            self._segment_kv_cache = [
                [(s.keys[i], s.values[i]) for s in segs] for i in range(self._num_layers)
            ]
        return self._segment_kv_cache[layer]

    def seal(self) -> Snapshot:
        """Freeze the tail into a segment (turn boundary) and merge small neighbours."""
        rows = self._written[-1]
        if rows > 0:
            tails = [self._tail(i) for i in range(self._num_layers)]
            seg = Segment.seal(
                [self._exact(k, rows) for k, _ in tails],
                [self._exact(v, rows) for _, v in tails],
                self._tail_tokens,
                self.base.digest,
            )
            self.base = Snapshot(self.base.segments + (seg,))
            self.seals += 1
            self._reset_tail()
            while self._apply_merge():  # merges cascade: tier k -> k + 1 -> ...
                pass
        return self.base

    def drop_tail(self) -> None:
        """Forget the unsealed rows (cancelled request): the base is untouched."""
        self._reset_tail()

    def drop_rows(self, n: int) -> None:
        """Forget the last `n` rows written to every layer whose tokens were not recorded
        yet (a speculative verify window's rejected drafts): a trim of the row count, the
        buffers are not copied (the next write overwrites the rows)."""
        written = self._written[-1]
        if not 0 <= n <= written - len(self._tail_tokens):
            raise ValueError(f"cannot drop {n} rows: {written - len(self._tail_tokens)} unrecorded")
        if any(w != written for w in self._written):
            raise AssertionError("layers hold different row counts")
        self._written = [written - n] * self._num_layers

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.tail_nbytes()

    def tail_nbytes(self) -> int:
        return sum(self._tail_layer_nbytes(i) for i in range(self._num_layers))

    def _tail_layer_nbytes(self, layer: int) -> int:
        k, v, stack = self._k[layer], self._v[layer], self._stacks[layer]
        if k is None and stack is not None:  # this session's share of the batch's stack
            return (stack[0].nbytes + stack[1].nbytes) // stack[0].shape[0]
        return (k.nbytes if k is not None else 0) + (v.nbytes if v is not None else 0)

    def _tail(self, layer: int) -> tuple[mx.array | None, mx.array | None]:
        """The layer's tail buffers; a tail adopted from a batch's stack (`adopt_stack`)
        becomes its row of the stack (views) here, the first time anything reads it."""
        stack = self._stacks[layer]
        if self._k[layer] is None and stack is not None:
            k_t, v_t, row, _ = stack
            self._k[layer], self._v[layer] = k_t[row : row + 1], v_t[row : row + 1]
            self._stacks[layer] = None  # from now on the views are the tail
        return self._k[layer], self._v[layer]

    # ---- internals -------------------------------------------------------------------
    def _exact(self, buf: mx.array | None, rows: int) -> mx.array:
        assert buf is not None
        view = buf[:, :, :rows, :]
        spare = buf.shape[2] - rows
        if spare <= max(16, rows // 8) and not self._tail_shared:
            return view  # keep the tail buffer itself: no copy, little waste
        return mx.array(view)  # copy the turn's rows only, release the spare capacity

    def _reset_tail(self) -> None:
        self._k = [None] * self._num_layers
        self._v = [None] * self._num_layers
        self._written = [0] * self._num_layers
        self._tail_tokens = []
        self._reserve = 0  # a prompt-sized reserve must not size the decode tail too
        self._tail_shared = False
        self._stacks = [None] * self._num_layers
        self._segment_kv_cache = None

    def _apply_merge(self) -> bool:
        segs = self.base.segments
        plan = plan_merge(
            [s.level for s in segs],
            [s.rows for s in segs],
            fanout=self._fanout,
            max_merge_rows=self._max_merge_rows,
        )
        if plan is None:
            return False
        run = segs[plan.start : plan.end]
        keys = [mx.concatenate([s.keys[i] for s in run], axis=2) for i in range(self._num_layers)]
        vals = [
            mx.concatenate([s.values[i] for s in run], axis=2) for i in range(self._num_layers)
        ]
        tokens = [t for s in run for t in s.tokens]
        merged = Segment.seal(keys, vals, tokens, run[0].parent_digest, plan.level)
        mx.eval(merged.keys, merged.values)
        self.base = Snapshot(segs[: plan.start] + (merged,))
        self.merges += 1
        self.merged_rows += plan.rows
        self._segment_kv_cache = None
        return True

    def write_attend(self, layer: int, queries: mx.array, keys: mx.array, values: mx.array,
                     scale: float) -> mx.array | None:
        """A decode step's cache write and attention as one op, when the route has that
        form (`attend_append`, the CPU's fused route): the op writes the rows into the
        tail buffer itself. None (and nothing written) otherwise: `update_and_fetch` then.

        Why: per layer it saves the six graph nodes of the plain write + attend (two
        slice_updates, two dtype casts, two slices)."""
        append = getattr(self.route, "attend_append", None)
        if append is None:
            return None
        window = self.windows[layer]
        extra = {} if window is None else {"window": window}  # routes without windows: as before

        def build(pieces: list[mx.array], buf_k: mx.array, buf_v: mx.array, start: int) -> mx.array | None:
            out: mx.array | None = append(queries, self.segment_kv(layer), (keys, values),
                                          (buf_k, buf_v), start, scale=scale, **extra)
            return out

        return self.write_with(layer, keys, build, pieces=False)

    def write_with(self, layer: int, like: mx.array, build: AppendBuild, *, pieces: bool = True) -> mx.array | None:
        """One op that writes this step's `like.shape[2]` new rows of `layer` into the tail
        buffers itself (at row `start`) and attends: `build(pieces, buf_k, buf_v, start)`
        makes it, with `pieces` the segments as the CPU's fused route takes them (k0, v0,
        ..., clipped to a sliding window; none when the window starts inside the tail, and
        `build` then reads the tail from the window's first row; then buf_k, buf_v) when
        asked. None (and nothing written) when the route has no such form, the tail is
        shared, the window is not served there, or `build` declines. `like`: [1, H_kv, n, D] rows of the new ones'
        shape (only the shape is read).

        The buffers it hands out are this cache's private tail, evaluated before the op is
        built (a grown buffer is evaluated here, once per TAIL_STEP rows), so the in-place
        write is safe."""
        route_pieces = getattr(self.route, "append_pieces", None)
        if route_pieces is None or self._tail_shared:  # never write a shared buffer in place
            return None
        n = like.shape[2]
        flat: list[mx.array] = []
        if pieces:
            flat = route_pieces(self.segment_kv(layer), n, self._written[layer], self.windows[layer], in_tail=True)
            if flat is None:
                return None
        buf_k, buf_v, prev = self._room(layer, like, like, evaluated=True)
        out = build([*flat, buf_k, buf_v] if pieces else [], buf_k, buf_v, prev)
        if out is not None:
            self._written[layer] = prev + n
        return out

    def padded_tail(self, layer: int, rows: int, like: mx.array) -> tuple[mx.array, mx.array, int]:
        """The layer's tail buffers at exactly `rows` rows (>= written + 1: grown, or a view
        of the first `rows`; the buffers themselves in the common case, no op) and the
        written count: a batched decode step stacks every session's tail at one length
        (`segserve.kernels.batch_attention`). `like`: [1, H_kv, n, D] rows of the dtype."""
        prev = self._written[layer]
        buf_k, buf_v = self._tail(layer)
        if buf_k is None or buf_v is None or buf_k.shape[2] < rows:
            buf_k, buf_v = self._grow(buf_k, buf_v, like, like, rows, prev)
            self._k[layer], self._v[layer] = buf_k, buf_v
        if buf_k.shape[2] == rows:
            return buf_k, buf_v, prev
        return buf_k[:, :, :rows, :], buf_v[:, :, :rows, :], prev

    def adopt_stack(self, layer: int, keys: mx.array, values: mx.array, row: int, written: int) -> None:
        """Take row `row` of a batched step's stacked tails `keys`/`values` [B, H_kv, cap, D]
        (rows [0, written) valid) as the layer's tail. It stays the stack's row, with no view
        made (`_tail` makes one when something reads the tail), so the next batched step of
        the same sessions takes the stack back whole (`kept_stack`). Such a tail is never
        written in place (`write_attend` declines) and `seal` copies its rows out, so a
        segment never keeps the batch's buffer alive."""
        self._k[layer] = self._v[layer] = None
        self._stacks[layer] = (keys, values, row, written)
        self._written[layer] = written
        self._tail_shared = True

    def kept_stack(self, layer: int) -> BatchStack | None:
        """The batch's stacked tail buffers this layer's tail was adopted from, and this
        session's row in them, while the tail is still exactly that row with the rows it
        had (no read as a view, write, trim or growth since): the next batched step of the
        same sessions can write into the stack again instead of re-stacking every tail."""
        kept = self._stacks[layer]
        if kept is None or self._k[layer] is not None or self._written[layer] != kept[3]:
            return None
        return kept[0], kept[1], kept[2]

    def _room(self, layer: int, keys: mx.array, values: mx.array,
              evaluated: bool = False) -> tuple[mx.array, mx.array, int]:
        """The layer's tail buffers with room for `keys`' rows after the written ones
        (grown when full; `evaluated`: a grown buffer is evaluated at once, for an op that
        writes it in place) and the row the new ones start at."""
        n = keys.shape[2]
        prev = self._written[layer]
        buf_k, buf_v = self._tail(layer)
        if buf_k is None or buf_v is None or prev + n > buf_k.shape[2]:
            buf_k, buf_v = self._grow(buf_k, buf_v, keys, values, prev + n, prev)
            if evaluated:
                mx.eval(buf_k, buf_v)
            self._k[layer], self._v[layer] = buf_k, buf_v
        return buf_k, buf_v, prev

    def _write(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys/values: [1, H_kv, n, D]
        n = keys.shape[2]
        buf_k, buf_v, prev = self._room(layer, keys, values)
        buf_k[:, :, prev : prev + n, :] = keys
        buf_v[:, :, prev : prev + n, :] = values
        self._written[layer] = prev + n
        return buf_k[:, :, : prev + n, :], buf_v[:, :, : prev + n, :]

    def _grow(
        self,
        buf_k: mx.array | None,
        buf_v: mx.array | None,
        keys: mx.array,
        values: mx.array,
        need: int,
        rows: int,
    ) -> tuple[mx.array, mx.array]:
        cap = max(need, self._reserve)
        cap = ((cap + TAIL_STEP - 1) // TAIL_STEP) * TAIL_STEP
        b, h, _, dk = keys.shape
        # The slice assignments in `_write` round other dtypes to the buffer's.
        new_k = mx.zeros((b, h, cap, dk), self.dtype or keys.dtype)
        new_v = mx.zeros((b, h, cap, values.shape[3]), self.dtype or values.dtype)
        if buf_k is not None and buf_v is not None:
            # Only this turn's rows move: the tail is private, segments are never copied.
            new_k[:, :, :rows, :] = buf_k[:, :, :rows, :]
            new_v[:, :, :rows, :] = buf_v[:, :, :rows, :]
        return new_k, new_v


class SegmentedLayerCache:
    """What one mlx-lm attention layer sees. Satisfies `segserve.kv.protocol.LayerCache`."""

    def __init__(self, parent: SegmentedCache, layer: int) -> None:
        self.parent = parent
        self.layer = layer

    @property
    def offset(self) -> int:
        return self.parent.base.rows + self.parent._written[self.layer]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.parent._write(self.layer, keys, values)

    def write_attend(self, queries: mx.array, keys: mx.array, values: mx.array,
                     scale: float) -> mx.array | None:
        """`SegmentedCache.write_attend` for this layer (decode fast path, or None)."""
        return self.parent.write_attend(self.layer, queries, keys, values, scale)

    def write_with(self, like: mx.array, build: AppendBuild) -> mx.array | None:
        """`SegmentedCache.write_with` for this layer (a whole-layer decode op, or None)."""
        return self.parent.write_with(self.layer, like, build)

    def segment_kv(self) -> list[tuple[mx.array, mx.array]]:
        return self.parent.segment_kv(self.layer)

    @property
    def window(self) -> int | None:
        """This layer's sliding window W (keys at positions (p - W, p]), None if global."""
        return self.parent.windows[self.layer]

    @property
    def route(self) -> Callable[..., mx.array] | None:
        return self.parent.route

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if window_size is not None and window_size != self.window:
            # The window is applied by the route from `self.window` (the model's cache
            # size, what stock mode's rotating cache keeps); a mask asking for another one
            # must not be silently replaced by it.
            raise NotImplementedError(
                f"a mask with sliding window {window_size} was asked of a layer whose window is "
                f"{self.window}: not served by segments"
            )
        # "causal" is interpreted by the hook as causal inside the tail, bottom-right aligned;
        # every sealed segment precedes the queries. A window layer's route hides the keys
        # before each query's window (`window`); the mask itself stays "causal" / None.
        return None if N == 1 else "causal"

    @property
    def state(self) -> tuple[Snapshot, int]:
        return self.parent.base, self.parent._written[self.layer]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Trim rows from the tail only: sealed segments are immutable."""
        written = self.parent._written[self.layer]
        k = min(n, written)
        self.parent._written[self.layer] = written - k
        if self.layer == self.parent._num_layers - 1:
            del self.parent._tail_tokens[len(self.parent._tail_tokens) - k :]
        return k

    @property
    def nbytes(self) -> int:
        seg = sum(a.nbytes + b.nbytes for a, b in self.segment_kv())
        return seg + self.parent._tail_layer_nbytes(self.layer)

    def empty(self) -> bool:
        return self.offset == 0
