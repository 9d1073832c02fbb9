"""Admission pricing: what a turn adds to memory, and whether to admit, wait or refuse it.

Owns: the pricing rule (`price`) and the admission rule (`decide`), both pure functions of
plain numbers. No mlx, no model, no clock, no environment: the scheduler builds the inputs
from `kv/` and `bank/` stats objects and calls these on whatever thread it runs on.

Invariants:
- `price` counts only the bytes a turn ADDS. History already held in segments is never
  priced again in segmented mode; that is the point of segments (docs/design.md,
  "Scheduling and admission").
- `decide` refuses with `reject_insufficient_memory` (HTTP 507) only when the request cannot
  fit in the best state the server reaches by itself: every evictable bank byte gone and no
  request running. Anything that a finished request would fix is a wait (or 429 when the
  wait queue is full), never a 507.
- Ordinary back-pressure is a returned decision, never an exception. Exceptions are raised
  only for impossible inputs (negative sizes), which are bugs in the caller.

Memory picture used by `decide` (all in bytes, against `budget_bytes`):

    |<-------------------------------- budget ---------------------------------->|
    | weights | bank protected | bank evictable | running (active) |    free     |
              |<--------- bank_ram_bytes ------>|
    capacity_when_idle = budget - weights - bank protected
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal

DecisionKind = Literal["admit", "wait", "reject_queue_full", "reject_insufficient_memory"]
ReasonLabel = Literal[
    "fits", "fits_after_eviction", "wait_for_running", "queue_full", "exceeds_budget"
]


def _check_non_negative(obj: SchedulerLimits | RequestCost | MemoryState) -> None:
    # Negative sizes mean a bookkeeping bug upstream; fail loudly at the boundary.
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """The only numbers admission needs; built once from settings at start-up."""

    budget_bytes: int
    kv_bytes_per_token: int  # K+V rows for every layer, one token
    prefill_chunk_tokens: int
    prefill_transient_bytes_per_token: int  # activation scratch per token of one chunk
    dense_decode_ceiling_bytes: int  # stock mode only: largest contiguous slab priced plainly
    max_queue: int
    queue_timeout_s: float
    segmented: bool
    # Attention scores one call holds, per (query row x key row) pair (all query heads,
    # scores and their exponentials, float32); 0 when the backend's attention holds none
    # (stock flash SDPA on a GPU).
    attention_score_bytes_per_pair: int = 0
    # Key rows whose scores one call holds at most (the tiled route's tile); 0 = untiled,
    # i.e. every key the chunk sees (stock SDPA's CPU fallback materializes them all).
    attention_key_tile_rows: int = 0
    # Per decode/prefill step, independent of the turn: the logits row and the sampler's
    # float32 copies of it (vocabulary-sized). `greedy_step_scratch_bytes`: the same for a
    # plain greedy request (`RequestCost.plain_greedy`), which holds fewer copies; 0 = the
    # full figure for every request.
    step_scratch_bytes: int = 0
    greedy_step_scratch_bytes: int = 0
    # A fused attention route's workspace for one call (0 for routes that hold scores):
    # the bound for any history, whatever the call's key rows.
    attention_fixed_bytes: int = 0
    # The same workspace as a function of the call (`segserve.kernels.fused_cuda` partials): bytes
    # per padded query position and partial slot, key rows per chunk (a chunk is at least
    # this long, so a call's chunks are <= keys / rows + pieces), query positions per
    # window (calls are padded to whole windows) and pieces per launch. 0 = not given.
    attention_ws_bytes_per_slot: int = 0
    attention_ws_chunk_rows: int = 0
    attention_ws_window_rows: int = 0
    attention_ws_max_pieces: int = 0
    # Blocks one launch plans for (a wave of resident blocks) and the KV heads a call's
    # groups come from: chunks per group are also <= wave / groups + pieces.
    attention_ws_wave_blocks: int = 0
    attention_ws_kv_heads: int = 0
    # A decode tail is allocated in steps of this many rows (segmented mode: segserve.kv.segmented's
    # TAIL_STEP): a further choice's tail holds max_tokens rounded up to it. 1 = exact.
    tail_step_rows: int = 1
    # Speculative decoding (segserve.server.spec), 0 when off: the most draft rows one verify step
    # adds to a decode step (its logits and sampler copies are 1 + draft_tokens rows), and
    # the draft index of each sealed token (kept with the segment, in RAM).
    draft_tokens: int = 0
    draft_index_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        _check_non_negative(self)
        if self.tail_step_rows < 1:
            raise ValueError(f"SchedulerLimits.tail_step_rows must be >= 1, got {self.tail_step_rows}")


@dataclass(frozen=True, slots=True)
class RequestCost:
    """Token counts of one turn, after session resolution."""

    new_prompt_tokens: int  # prompt tokens not covered by the reused history
    max_tokens: int
    history_tokens: int = 0  # reused tokens already held in RAM segments
    restore_from_ssd_tokens: int = 0  # reused tokens that must be read back from SSD
    merge_rows: int = 0  # segmented: rows the turn's seals make the tiered merge copy
    choices: int = 1  # `n`: decode rows over one prefilled prompt, each up to max_tokens
    history_segments: int = 0  # segments of the reused history (pieces an attention call reads)
    # Greedy with no logits processor, grammar or logprobs: a step holds only the logits
    # and the argmax's float32 copy (`SchedulerLimits.greedy_step_scratch_bytes`).
    plain_greedy: bool = False
    # May verify drafts (when the limits speculate): priced for a verify window's step
    # scratch and a draft index. A request that fits only without them runs without.
    speculate: bool = True

    def __post_init__(self) -> None:
        _check_non_negative(self)
        if self.choices < 1:
            raise ValueError(f"RequestCost.choices must be >= 1, got {self.choices}")


@dataclass(frozen=True, slots=True)
class MemoryState:
    """A snapshot of who holds memory, taken by the scheduler just before deciding."""

    weights_bytes: int
    active_bytes: int  # reserved by running requests (their admitted prices)
    bank_ram_bytes: int  # all bank bytes in RAM, protected + evictable
    bank_evictable_bytes: int  # part of bank_ram_bytes that may be spilled or dropped now
    running_requests: int
    queued_requests: int  # requests already waiting, not counting the one being decided

    def __post_init__(self) -> None:
        _check_non_negative(self)
        if self.bank_evictable_bytes > self.bank_ram_bytes:
            raise ValueError(
                f"bank_evictable_bytes ({self.bank_evictable_bytes}) exceeds "
                f"bank_ram_bytes ({self.bank_ram_bytes})"
            )

    @property
    def bank_protected_bytes(self) -> int:
        return self.bank_ram_bytes - self.bank_evictable_bytes

    @property
    def used_bytes(self) -> int:
        return self.weights_bytes + self.active_bytes + self.bank_ram_bytes


@dataclass(frozen=True, slots=True)
class PriceBreakdown:
    """Bytes one turn adds, by cause. `total_bytes` is what admission reserves."""

    new_rows_bytes: int  # KV rows of the new prompt and of every choice's tail
    prefill_transient_bytes: int  # activation scratch for one prefill chunk
    attention_scratch_bytes: int  # scores of one attention call (one chunk, one layer)
    restore_bytes: int  # KV rows read back from SSD
    history_copy_bytes: int  # stock mode: copy-on-first-write of the shared history (+ forks)
    dense_slab_bytes: int  # stock mode: full slab(s) when past the dense-decode ceiling
    merge_copy_bytes: int = 0  # segmented mode: segments the turn's merges write
    step_scratch_bytes: int = 0  # logits and sampler copies (held across a seal too)
    choices_scratch_bytes: int = 0  # n > 1: the further choices' decode rows (decode only)

    @property
    def total_bytes(self) -> int:
        # Scratch lives while a step runs and merges happen at a seal, between steps, once
        # the scratch is freed: the peak holds one or the other, never both. The further
        # choices decode only once the prompt's prefill (its scratch) is over.
        scratch = self.prefill_transient_bytes + self.attention_scratch_bytes
        return (
            self.new_rows_bytes
            + max(scratch, self.merge_copy_bytes, self.choices_scratch_bytes)
            + self.restore_bytes
            + self.history_copy_bytes
            + self.dense_slab_bytes
            + self.step_scratch_bytes
        )


def _attention_calls(cost: RequestCost, limits: SchedulerLimits) -> list[tuple[int, int]]:
    """The turn's attention calls that can be largest, as (query rows, key rows).

    Chunk i of the new prompt has min(C, N - iC) rows and sees H + min(N, (i+1)C) keys,
    so the largest is the last full chunk or the final partial one; decode steps are
    1 x (H + N + max_tokens) per choice, and one layer attends for every choice's row
    before its output is joined (`segserve.server.runner.batched`), so `choices` rows at once."""
    history = cost.history_tokens + cost.restore_from_ssd_tokens
    chunk, new = limits.prefill_chunk_tokens, cost.new_prompt_tokens
    full = new // chunk
    calls = [(cost.choices, history + new + cost.max_tokens)]  # the last decode step
    if full:
        calls.append((chunk, history + full * chunk))
    if new - full * chunk:
        calls.append((new - full * chunk, history + new))
    return calls


def _largest_score_block(cost: RequestCost, limits: SchedulerLimits) -> int:
    """Largest (query rows x key rows) of one attention call in this turn, key rows capped
    at the route's key tile when it tiles keys."""
    tile = limits.attention_key_tile_rows
    return max(q * (min(k, tile) if tile else k) for q, k in _attention_calls(cost, limits))


def _fused_workspace(cost: RequestCost, limits: SchedulerLimits) -> int:
    """A fused route's workspace for the turn's largest call: `attention_fixed_bytes`, or
    less where the call's own key rows and pieces bound its partial slots.

    A call of L query positions over K key rows in P pieces writes one partial per chunk
    and window, plus ~sqrt of that many first-level partials: chunks <= K / chunk_rows + P
    (a chunk is at least chunk_rows long and never spans two pieces), positions padded to
    whole windows. Pieces: the history's segments, the prompt's segment once it is sealed
    (decode), the tail. More pieces than one launch takes fall back to the fixed bound."""
    fixed = limits.attention_fixed_bytes
    per_slot, rows, window = (limits.attention_ws_bytes_per_slot, limits.attention_ws_chunk_rows,
                              limits.attention_ws_window_rows)
    pieces = cost.history_segments + 2
    if not (per_slot and rows and window) or pieces > limits.attention_ws_max_pieces:
        return fixed
    wave, kv_heads = limits.attention_ws_wave_blocks, limits.attention_ws_kv_heads
    return min(fixed, max(fused_workspace_bytes(q, k, pieces, per_slot, rows, window, wave, kv_heads)
                          for q, k in _attention_calls(cost, limits)))


def fused_workspace_bytes(
    positions: int,
    keys: int,
    pieces: int,
    per_slot: int,
    chunk_rows: int,
    window_rows: int,
    wave_blocks: int = 0,
    kv_heads: int = 1,
) -> int:
    """Upper bound of one fused call's partials: `positions` query positions (padded to
    whole windows of <= `window_rows`) over `keys` key rows in `pieces` pieces. Chunks per
    (KV head, window) group: <= keys / chunk_rows + pieces, and when `wave_blocks` is given
    <= wave_blocks / groups + pieces (the plan's target, overshot only by piece ends)."""
    w = max(1, min(positions, window_rows))
    windows = -(-positions // w)
    chunks = -(-keys // chunk_rows) + pieces
    if wave_blocks:
        chunks = min(chunks, -(-wave_blocks // (max(1, kv_heads) * windows)) + pieces)
    return per_slot * windows * w * (chunks + math.isqrt(chunks) + 2)


def price(cost: RequestCost, limits: SchedulerLimits) -> PriceBreakdown:
    """Bytes this turn adds to memory.

    Both modes:
    - new rows: `(prompt + max_tokens + (choices - 1) * tail) * kv_bytes_per_token`: with
      `n` choices the prompt is prefilled once and each choice writes its own tail over it
      (one prompt plus n tails, never n prompts). `prompt` is new_prompt_tokens rounded up
      to `tail_step_rows`, the tail buffer's allocation step (measured on the H200: a
      513-row follow-up of an 8B model held 63 rows = 8 MiB more than the unrounded
      price), and so is a further choice's `tail` (max_tokens): n of them multiply the
      rounding, while choice 0's decode rows stay within the margin
      tests/test_admission_peak.py measures;
    - prefill scratch: `min(prefill_chunk_tokens, new_prompt_tokens) *
      prefill_transient_bytes_per_token` (only one chunk's activations live at a time);
    - restore: `restore_from_ssd_tokens * kv_bytes_per_token` (rows come back into RAM);
    - attention scratch: two calls' scores, `2 * L * K * attention_score_bytes_per_pair`
      for the chunk with the largest L x K (`_largest_score_block`: L its query rows, at
      least 1 for decode; K the keys it sees, capped at `attention_key_tile_rows` when the
      route tiles keys), plus a fused route's workspace (`_fused_workspace`). Two,
      not one: MLX allocates an op's output when it encodes it and runs ahead of the
      compute, so the next layer's scores can exist before the previous layer's are freed
      (measured with tests/test_admission_peak.py);
    - step scratch: `step_scratch_bytes` (logits and the sampler's copies of them), or
      `greedy_step_scratch_bytes` when the request is `plain_greedy` and the limits give it
      (measured on the H200: a greedy turn of a 2-layer model peaked at half its price with
      the full sampler's four rows priced, tests/test_gpu_integration.py);
    - speculative decoding (`draft_tokens` > 0 and `cost.speculate`): each choice's step scratch is held by
      `1 + draft_tokens` rows of a verify window, and each choice's draft index of its
      turn (`(new_prompt_tokens + max_tokens) * draft_index_bytes_per_token`) joins the
      new rows;
    - choices scratch: `(choices - 1) * step scratch`, the same for each further
      choice's decode row. It exists only in decode steps, after the prompt's prefill
      scratch is freed, so the peak holds the larger of the two (as with merges).

    Segmented mode adds only its merges: the history stays in its immutable segments and
    the turn writes its own tail, so nothing is copied and no slab ceiling applies, except
    that the tiered merge (segserve.kv.merge_policy) may write the turn's small trailing segments
    into one: `merge_rows * kv_bytes_per_token` (their parts stay referenced by older
    snapshots in the bank, so the merged copy is new memory).

    Stock mode (mlx-lm's contiguous cache) adds:
    - history copy: `history_tokens * kv_bytes_per_token`. The banked snapshot shares the
      live buffer; MLX arrays are copy-on-first-write, so the turn's first write allocates
      a full copy of the history (docs/design.md, "Scheduling and admission"). Rows
      restored from SSD are loaded into the request's own buffer, which nothing else
      shares, so they are not copied again.
    - dense slab: when the whole slab `(history + restored + new prompt + max_tokens) *
      kv_bytes_per_token` is strictly larger than `dense_decode_ceiling_bytes`, that slab
      once more. The stock cache grows by concatenation, so outgrowing the buffer allocates
      a new slab while the old one is alive (measured on the H200: 2.6 GB above turn start
      at 32K, 5.1 GB with a snapshot held). Below the ceiling that transient is bounded by
      the ceiling itself and left to the headroom the dense-decode RAM percent reserves.
    - forks (`choices` > 1): each further choice starts from a view of the prompt's slab
      and its first write copies it: `(choices - 1) * (history + restored + new prompt)`
      rows more in the history copy, and the dense slab once per choice.

    `new_prompt_tokens` may be 0 on a full prefix hit; the caller decides whether the last
    prompt token is re-run (then it passes 1) or its logits were stored.
    """
    per_token = limits.kv_bytes_per_token
    n = cost.choices
    step = limits.tail_step_rows
    tail = -(-cost.max_tokens // step) * step
    prompt = -(-cost.new_prompt_tokens // step) * step
    new_rows = (prompt + cost.max_tokens + (n - 1) * tail) * per_token
    transient = min(limits.prefill_chunk_tokens, cost.new_prompt_tokens) * (
        limits.prefill_transient_bytes_per_token
    )
    restore = cost.restore_from_ssd_tokens * per_token
    attention = 2 * (
        _largest_score_block(cost, limits) * limits.attention_score_bytes_per_pair
        + _fused_workspace(cost, limits)
    )
    history_copy = 0
    dense_slab = 0
    merge_copy = cost.merge_rows * per_token if limits.segmented else 0
    if not limits.segmented:
        prompt_tokens = cost.history_tokens + cost.restore_from_ssd_tokens + cost.new_prompt_tokens
        history_copy = (cost.history_tokens + (n - 1) * prompt_tokens) * per_token
        slab = (prompt_tokens + cost.max_tokens) * per_token
        if slab > limits.dense_decode_ceiling_bytes:
            dense_slab = n * slab
    step_scratch = limits.step_scratch_bytes
    if cost.plain_greedy and limits.greedy_step_scratch_bytes:
        step_scratch = limits.greedy_step_scratch_bytes
    if limits.draft_tokens and cost.speculate:  # every choice may, each with its own turn's index
        step_scratch *= 1 + limits.draft_tokens
        new_rows += n * (cost.new_prompt_tokens + cost.max_tokens) * limits.draft_index_bytes_per_token
    return PriceBreakdown(
        new_rows, transient, attention, restore, history_copy, dense_slab, merge_copy,
        step_scratch, (n - 1) * step_scratch,
    )


@dataclass(frozen=True, slots=True)
class HeldBy:
    """Who holds memory right now; part of every decision so a 507 body can explain itself."""

    weights_bytes: int
    bank_protected_bytes: int
    bank_evictable_bytes: int
    running_bytes: int
    running_requests: int
    queued_requests: int


@dataclass(frozen=True, slots=True)
class AdmissionDetail:
    """Numbers behind a decision; `to_dict()` is the extra body of a 429/503/507 error."""

    needed_bytes: int
    budget_bytes: int
    free_bytes: int  # budget minus everything held; negative when over-committed
    capacity_when_idle_bytes: int  # free once every evictable byte is gone and nothing runs
    held_by: HeldBy
    price: PriceBreakdown
    retry_can_succeed: bool
    shorter_request_could_fit: bool
    max_tokens_that_fit: int | None  # largest max_tokens that fits capacity_when_idle
    retry_after_s: float | None

    def to_dict(self) -> dict[str, object]:
        held = self.held_by
        return {
            "needed_bytes": self.needed_bytes,
            "budget_bytes": self.budget_bytes,
            "free_bytes": self.free_bytes,
            "capacity_when_idle_bytes": self.capacity_when_idle_bytes,
            "held_by": {
                "weights_bytes": held.weights_bytes,
                "bank_protected_bytes": held.bank_protected_bytes,
                "bank_evictable_bytes": held.bank_evictable_bytes,
                "running_bytes": held.running_bytes,
                "running_requests": held.running_requests,
                "queued_requests": held.queued_requests,
            },
            "retry_can_succeed": self.retry_can_succeed,
            "shorter_request_could_fit": self.shorter_request_could_fit,
            "max_tokens_that_fit": self.max_tokens_that_fit,
            "retry_after_s": self.retry_after_s,
        }


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    decision: DecisionKind
    price_bytes: int
    evict_bytes: int  # bank bytes to spill or drop before running; 0 unless fits_after_eviction
    reason: ReasonLabel
    detail: AdmissionDetail


def queue_has_room(queued_requests: int, limits: SchedulerLimits) -> bool:
    """The queue bound, in one place: `max_queue` requests may wait behind the one being
    decided (0 = nobody waits: a request that cannot run now is refused with 429)."""
    return queued_requests < limits.max_queue


RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0


def retry_after_seconds(
    *,
    queued_requests: int,
    running_requests: int,
    mean_request_s: float,
    min_s: float = RETRY_AFTER_MIN_S,
    max_s: float = RETRY_AFTER_MAX_S,
) -> float:
    """Seconds a refused client should wait (HTTP `Retry-After`, for 429 and 503).

    The queue drains about `max(running_requests, 1)` requests every `mean_request_s`, and
    the client would be behind `queued_requests` others, so it waits roughly
    `mean_request_s * (queued_requests + 1) / max(running_requests, 1)`. Rounded up to whole
    seconds (the header carries integers) and clamped to `[min_s, max_s]` so a bad estimate
    neither hammers the server nor parks clients for minutes.
    """
    if mean_request_s < 0 or queued_requests < 0 or running_requests < 0:
        raise ValueError("retry_after_seconds takes non-negative numbers")
    estimate = mean_request_s * (queued_requests + 1) / max(running_requests, 1)
    return float(min(max(math.ceil(estimate), min_s), max_s))


def _max_tokens_that_fit(cost: RequestCost, limits: SchedulerLimits, capacity: int) -> int | None:
    """Largest max_tokens in [1, cost.max_tokens] whose price fits `capacity`, else None.

    Binary search: the price never decreases as max_tokens grows (the stock-mode slab term
    only switches on), so the fitting values form a prefix.
    """
    def fits(m: int) -> bool:
        return price(replace(cost, max_tokens=m), limits).total_bytes <= capacity

    if cost.max_tokens < 1 or not fits(1):
        return None
    lo, hi = 1, cost.max_tokens  # invariant: fits(lo)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _classify(
    needed: int, free: int, idle_capacity: int, limits: SchedulerLimits, state: MemoryState
) -> tuple[DecisionKind, ReasonLabel, int]:
    """The decision ladder of `decide`, as (decision, reason, evict_bytes)."""
    if needed <= free:
        return "admit", "fits", 0
    if needed <= free + state.bank_evictable_bytes:
        # free may be negative (over-committed); the shortfall then covers that too.
        return "admit", "fits_after_eviction", needed - free
    if needed <= idle_capacity:
        if queue_has_room(state.queued_requests, limits):
            return "wait", "wait_for_running", 0
        return "reject_queue_full", "queue_full", 0
    return "reject_insufficient_memory", "exceeds_budget", 0


def decide(
    cost: RequestCost,
    limits: SchedulerLimits,
    state: MemoryState,
    *,
    mean_request_s: float | None = None,
) -> AdmissionDecision:
    """Admit, wait, or refuse one request, checked in this order:

    1. `fits`: price <= free bytes -> admit.
    2. `fits_after_eviction`: price <= free + evictable bank bytes -> admit after evicting
       exactly the shortfall `price - free` (free may be negative if over-committed).
    3. price <= capacity_when_idle: only running requests stand in the way -> `wait` while
       `queued_requests < max_queue`, else `reject_queue_full` (429 with Retry-After).
    4. otherwise `reject_insufficient_memory` (507, reason `exceeds_budget`): even the best
       state the server reaches alone cannot hold it; protected bank bytes are treated as
       held for good, so `retry_can_succeed` is False, and `max_tokens_that_fit` says
       whether the same prompt with fewer generated tokens would fit.

    `mean_request_s` feeds the Retry-After estimate; unknown -> `limits.queue_timeout_s`.
    Queue order is the caller's: it decides for the head of its wait queue first, so a
    newcomer that fits is admitted ahead of waiters only if the caller chooses to ask.
    """
    cost_bytes = price(cost, limits)
    needed = cost_bytes.total_bytes
    free = limits.budget_bytes - state.used_bytes
    idle_capacity = limits.budget_bytes - state.weights_bytes - state.bank_protected_bytes
    kind, reason, evict = _classify(needed, free, idle_capacity, limits, state)

    retry_after: float | None = None
    if kind == "reject_queue_full":
        retry_after = retry_after_seconds(
            queued_requests=state.queued_requests,
            running_requests=state.running_requests,
            mean_request_s=limits.queue_timeout_s if mean_request_s is None else mean_request_s,
        )
    refused_for_size = kind == "reject_insufficient_memory"
    fit = _max_tokens_that_fit(cost, limits, idle_capacity)
    detail = AdmissionDetail(
        needed_bytes=needed,
        budget_bytes=limits.budget_bytes,
        free_bytes=free,
        capacity_when_idle_bytes=idle_capacity,
        held_by=HeldBy(
            weights_bytes=state.weights_bytes,
            bank_protected_bytes=state.bank_protected_bytes,
            bank_evictable_bytes=state.bank_evictable_bytes,
            running_bytes=state.active_bytes,
            running_requests=state.running_requests,
            queued_requests=state.queued_requests,
        ),
        price=cost_bytes,
        retry_can_succeed=not refused_for_size,
        shorter_request_could_fit=refused_for_size and fit is not None,
        max_tokens_that_fit=fit,
        retry_after_s=retry_after,
    )
    return AdmissionDecision(kind, needed, evict, reason, detail)
