"""Admission pricing and decisions, with plain numbers and exact expected bytes."""

from __future__ import annotations

import dataclasses

import pytest

from segserve.server.scheduling.admission import (
    MemoryState,
    PriceBreakdown,
    RequestCost,
    SchedulerLimits,
    decide,
    price,
    retry_after_seconds,
)

KV = 100  # bytes per token of KV rows
SCRATCH = 10  # transient bytes per prefill token


def limits(segmented: bool, **overrides: object) -> SchedulerLimits:
    base: dict[str, object] = dict(
        budget_bytes=10_000_000,
        kv_bytes_per_token=KV,
        prefill_chunk_tokens=512,
        prefill_transient_bytes_per_token=SCRATCH,
        dense_decode_ceiling_bytes=1_000_000,
        max_queue=4,
        queue_timeout_s=30.0,
        segmented=segmented,
    )
    base.update(overrides)
    return SchedulerLimits(**base)  # type: ignore[arg-type]  # overrides are typed per field by the caller


# --- price -------------------------------------------------------------------------------


def test_segmented_prices_only_what_the_turn_adds() -> None:
    cost = RequestCost(new_prompt_tokens=1000, max_tokens=200, history_tokens=5000)
    got = price(cost, limits(segmented=True))
    # 1200 new rows; scratch for one 512-token chunk; the 5000 history rows are not priced.
    assert got == PriceBreakdown(120_000, 5_120, 0, 0, 0, 0)
    assert got.total_bytes == 125_120


def test_stock_adds_the_history_copy_of_the_first_write() -> None:
    cost = RequestCost(new_prompt_tokens=1000, max_tokens=200, history_tokens=5000)
    seg = price(cost, limits(segmented=True)).total_bytes
    stock = price(cost, limits(segmented=False))
    # slab (5000 + 1200) * 100 = 620_000 stays under the 1_000_000 ceiling.
    assert stock == PriceBreakdown(120_000, 5_120, 0, 0, 500_000, 0)
    assert stock.total_bytes - seg == 5000 * KV


def test_dense_ceiling_boundary_in_stock_mode() -> None:
    at_ceiling = limits(segmented=False, dense_decode_ceiling_bytes=620_000)
    exact = RequestCost(new_prompt_tokens=1000, max_tokens=200, history_tokens=5000)
    assert price(exact, at_ceiling).dense_slab_bytes == 0  # slab == ceiling: not over
    one_more = dataclasses.replace(exact, max_tokens=201)
    over = price(one_more, at_ceiling)
    assert over == PriceBreakdown(120_100, 5_120, 0, 0, 500_000, 620_100)
    assert over.total_bytes == 1_245_320


def test_no_ceiling_in_segmented_mode() -> None:
    cost = RequestCost(new_prompt_tokens=1000, max_tokens=200, history_tokens=5000)
    got = price(cost, limits(segmented=True, dense_decode_ceiling_bytes=0))
    assert got.dense_slab_bytes == 0
    assert got.total_bytes == 125_120


def test_restore_from_ssd_is_priced_but_not_copied() -> None:
    cost = RequestCost(
        new_prompt_tokens=10, max_tokens=5, history_tokens=100, restore_from_ssd_tokens=300
    )
    assert price(cost, limits(segmented=True)) == PriceBreakdown(1_500, 100, 0, 30_000, 0, 0)
    # stock: history copy is the RAM history only; the slab counts the restored rows.
    stock = limits(segmented=False, dense_decode_ceiling_bytes=41_499)
    assert price(cost, stock) == PriceBreakdown(1_500, 100, 0, 30_000, 10_000, 41_500)


def test_prefill_transient_is_one_chunk_at_most() -> None:
    seg = limits(segmented=True)
    assert price(RequestCost(100, 1), seg).prefill_transient_bytes == 1_000
    assert price(RequestCost(512, 1), seg).prefill_transient_bytes == 5_120
    assert price(RequestCost(5_000, 1), seg).prefill_transient_bytes == 5_120
    assert price(RequestCost(0, 1), seg).total_bytes == KV


def test_attention_scratch_is_the_largest_call_twice() -> None:
    # 8 bytes per (query row, key row) pair; chunks of 512 over 5000 history rows.
    cost = RequestCost(new_prompt_tokens=1000, max_tokens=200, history_tokens=5000)
    untiled = limits(segmented=False, attention_score_bytes_per_pair=8)
    # chunk 0: 512 rows x 5512 keys; chunk 1: 488 rows x 6000 keys -> the second is larger.
    assert price(cost, untiled).attention_scratch_bytes == 2 * 488 * 6000 * 8
    tiled = limits(segmented=True, attention_score_bytes_per_pair=8, attention_key_tile_rows=2048)
    assert price(cost, tiled).attention_scratch_bytes == 2 * 512 * 2048 * 8  # capped by the tile
    decode_only = RequestCost(new_prompt_tokens=0, max_tokens=10, history_tokens=5000)
    assert price(decode_only, untiled).attention_scratch_bytes == 2 * 5010 * 8
    short = RequestCost(new_prompt_tokens=10, max_tokens=10, history_tokens=90)
    assert price(short, tiled).attention_scratch_bytes == 2 * 10 * 100 * 8  # below one tile
    assert price(cost, limits(segmented=True)).attention_scratch_bytes == 0  # flash: none


def test_merges_are_priced_in_segmented_mode_only() -> None:
    cost = RequestCost(new_prompt_tokens=10, max_tokens=5, history_tokens=100, merge_rows=40)
    assert price(cost, limits(segmented=True)).merge_copy_bytes == 40 * KV
    assert price(cost, limits(segmented=False)).merge_copy_bytes == 0


def test_speculation_prices_every_choice_s_window_and_index() -> None:
    """A request that may speculate: each choice's step scratch is a window of 1 + K rows,
    and each choice holds a draft index of its turn (prompt and answer)."""
    spec = limits(segmented=True, step_scratch_bytes=50, draft_tokens=8, draft_index_bytes_per_token=3)
    plain = limits(segmented=True, step_scratch_bytes=50)
    for n in (1, 3):
        cost = RequestCost(new_prompt_tokens=100, max_tokens=20, history_tokens=0, choices=n)
        got, base = price(cost, spec), price(cost, plain)
        assert got.step_scratch_bytes == 9 * 50
        assert got.choices_scratch_bytes == (n - 1) * 9 * 50
        assert got.new_rows_bytes - base.new_rows_bytes == n * 120 * 3


# --- decide ------------------------------------------------------------------------------
# kv 1 byte/token and no scratch, so price == new_prompt_tokens + max_tokens.
# budget 1_000_000 = weights 400_000 + running 100_000 + bank 300_000 (200_000 evictable)
# + free 200_000; capacity when idle = 1_000_000 - 400_000 - 100_000 protected = 500_000.

UNIT = limits(
    segmented=True, budget_bytes=1_000_000, kv_bytes_per_token=1,
    prefill_transient_bytes_per_token=0, max_queue=2, queue_timeout_s=10.0,
)
STATE = MemoryState(
    weights_bytes=400_000, active_bytes=100_000, bank_ram_bytes=300_000,
    bank_evictable_bytes=200_000, running_requests=3, queued_requests=0,
)


def ask(total: int, state: MemoryState = STATE) -> tuple[str, str, int]:
    d = decide(RequestCost(new_prompt_tokens=1, max_tokens=total - 1), UNIT, state)
    assert d.price_bytes == total
    return d.decision, d.reason, d.evict_bytes


def test_fits_exactly_and_one_byte_over() -> None:
    assert ask(200_000) == ("admit", "fits", 0)
    assert ask(200_001) == ("admit", "fits_after_eviction", 1)


def test_eviction_shortfall_is_exact_up_to_all_evictable() -> None:
    assert ask(350_000) == ("admit", "fits_after_eviction", 150_000)
    assert ask(400_000) == ("admit", "fits_after_eviction", 200_000)
    assert ask(400_001) == ("wait", "wait_for_running", 0)


def test_over_committed_free_is_negative_and_shortfall_covers_it() -> None:
    over = dataclasses.replace(STATE, active_bytes=450_000)  # used 1_150_000
    assert ask(10, over) == ("admit", "fits_after_eviction", 150_010)
    assert ask(50_001, over) == ("wait", "wait_for_running", 0)


def test_wait_until_capacity_when_idle_then_507() -> None:
    assert ask(500_000) == ("wait", "wait_for_running", 0)
    assert ask(500_001) == ("reject_insufficient_memory", "exceeds_budget", 0)


def test_queue_full_boundary_and_retry_after() -> None:
    one_slot = dataclasses.replace(STATE, queued_requests=1)
    assert ask(450_000, one_slot)[0] == "wait"
    full = dataclasses.replace(STATE, queued_requests=2)
    d = decide(RequestCost(1, 449_999), UNIT, full)
    assert (d.decision, d.reason) == ("reject_queue_full", "queue_full")
    # mean defaults to queue_timeout_s: ceil(10 * (2 + 1) / 3) = 10
    assert d.detail.retry_after_s == 10.0
    assert d.detail.retry_can_succeed is True
    d2 = decide(RequestCost(1, 449_999), UNIT, full, mean_request_s=4.0)
    assert d2.detail.retry_after_s == 4.0
    no_queue = dataclasses.replace(UNIT, max_queue=0)
    assert decide(RequestCost(1, 449_999), no_queue, STATE).decision == "reject_queue_full"


def test_507_detail_explains_needs_holders_and_shorter_request() -> None:
    d = decide(RequestCost(new_prompt_tokens=1, max_tokens=500_000), UNIT, STATE)
    assert d.decision == "reject_insufficient_memory"
    assert d.detail.to_dict() == {
        "needed_bytes": 500_001,
        "budget_bytes": 1_000_000,
        "free_bytes": 200_000,
        "capacity_when_idle_bytes": 500_000,
        "held_by": {
            "weights_bytes": 400_000,
            "bank_protected_bytes": 100_000,
            "bank_evictable_bytes": 200_000,
            "running_bytes": 100_000,
            "running_requests": 3,
            "queued_requests": 0,
        },
        "retry_can_succeed": False,
        "shorter_request_could_fit": True,
        "max_tokens_that_fit": 499_999,
        "retry_after_s": None,
    }


def test_507_when_the_prompt_alone_does_not_fit() -> None:
    d = decide(RequestCost(new_prompt_tokens=500_000, max_tokens=10), UNIT, STATE)
    assert d.decision == "reject_insufficient_memory"
    assert d.detail.max_tokens_that_fit is None
    assert d.detail.shorter_request_could_fit is False


def test_max_tokens_that_fit_across_the_stock_ceiling_step() -> None:
    # price(m) = (100 + m) + 500 history copy + (600 + m if 600 + m > 1000 else 0)
    stock = dataclasses.replace(
        UNIT, segmented=False, budget_bytes=1_100, dense_decode_ceiling_bytes=1_000
    )
    empty = MemoryState(0, 0, 0, 0, 0, 0)
    d = decide(RequestCost(100, 1_000, history_tokens=500), stock, empty)
    assert d.price_bytes == 3_200
    assert d.decision == "reject_insufficient_memory"
    assert d.detail.max_tokens_that_fit == 400  # price(400) = 1_000; price(401) = 2_002


def test_same_request_admitted_segmented_refused_stock() -> None:
    empty = MemoryState(weights_bytes=600_000, active_bytes=0, bank_ram_bytes=300_000,
                        bank_evictable_bytes=0, running_requests=0, queued_requests=0)
    cost = RequestCost(new_prompt_tokens=1_000, max_tokens=1_000, history_tokens=300_000)
    assert decide(cost, UNIT, empty).reason == "fits"
    stock = dataclasses.replace(UNIT, segmented=False, dense_decode_ceiling_bytes=150_000)
    refused = decide(cost, stock, empty)
    assert refused.price_bytes == 2_000 + 300_000 + 302_000
    assert refused.decision == "reject_insufficient_memory"


# --- helpers and validation --------------------------------------------------------------


@pytest.mark.parametrize(
    ("mean", "queued", "running", "expected"),
    [(10.0, 3, 2, 20.0), (10.0, 0, 3, 4.0), (0.0, 0, 1, 1.0), (1_000.0, 5, 1, 60.0),
     (2.0, 0, 0, 2.0)],
)
def test_retry_after_seconds(mean: float, queued: int, running: int, expected: float) -> None:
    got = retry_after_seconds(queued_requests=queued, running_requests=running,
                              mean_request_s=mean)
    assert got == expected


def test_invalid_inputs_raise() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        RequestCost(new_prompt_tokens=1, max_tokens=-1)
    with pytest.raises(ValueError, match="bank_evictable_bytes"):
        MemoryState(0, 0, bank_ram_bytes=5, bank_evictable_bytes=6,
                    running_requests=0, queued_requests=0)
    with pytest.raises(ValueError):
        retry_after_seconds(queued_requests=-1, running_requests=0, mean_request_s=1.0)


def test_values_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        STATE.active_bytes = 0  # type: ignore[misc]  # writing a frozen field, on purpose


# --- n choices: one prompt plus n tails ----------------------------------------------------


def test_n_choices_price_one_prompt_and_n_tails() -> None:
    one = RequestCost(new_prompt_tokens=1000, max_tokens=200, history_tokens=5000)
    four = dataclasses.replace(one, choices=4)
    lim = limits(segmented=True, step_scratch_bytes=7_000)
    p1, p4 = price(one, lim), price(four, lim)
    # 1000 prompt rows once + 4 tails of 200 (never 4 x 1200); the history is not priced.
    assert p4.new_rows_bytes == (1000 + 4 * 200) * KV
    assert p4.step_scratch_bytes == 7_000 and p4.choices_scratch_bytes == 3 * 7_000
    # The further choices' decode scratch (21_000) exceeds the prefill chunk's (5_120); they
    # never coexist (decode starts once the prefill ended), so the larger one is priced.
    assert p4.total_bytes == (1000 + 800) * KV + max(5_120, 21_000) + 7_000
    assert p4.total_bytes - p1.total_bytes == 3 * 200 * KV + 21_000 - 5_120


def test_further_choices_scratch_and_prefill_scratch_never_add_up() -> None:
    # A long prompt: the prefill chunk's scratch (512 x 10) is larger than 2 choices' rows'.
    cost = RequestCost(new_prompt_tokens=4000, max_tokens=10, choices=3)
    got = price(cost, limits(segmented=True, step_scratch_bytes=1_000))
    assert got.choices_scratch_bytes == 2_000 and got.prefill_transient_bytes == 5_120
    assert got.total_bytes == (4000 + 30) * KV + 5_120 + 1_000


def test_plain_greedy_prices_the_smaller_step_scratch() -> None:
    cost = RequestCost(new_prompt_tokens=100, max_tokens=10, choices=2)
    greedy = dataclasses.replace(cost, plain_greedy=True)
    lim = limits(segmented=True, step_scratch_bytes=4_000, greedy_step_scratch_bytes=2_000)
    assert price(cost, lim).step_scratch_bytes == 4_000
    got = price(greedy, lim)
    assert got.step_scratch_bytes == 2_000 and got.choices_scratch_bytes == 2_000
    # Step scratch and the further choice's both halve (the prefill chunk's 1_000 is smaller).
    assert price(cost, lim).total_bytes - got.total_bytes == 2_000 + 2_000
    # Limits that give no greedy figure price every request with the full one.
    assert price(greedy, limits(segmented=True, step_scratch_bytes=4_000)).step_scratch_bytes == 4_000


def test_further_tails_are_rounded_to_the_tail_step() -> None:
    cost = RequestCost(new_prompt_tokens=100, max_tokens=10, choices=3)
    got = price(cost, limits(segmented=True, tail_step_rows=64))
    # The prompt's buffer is allocated in 64-row steps (128 rows), choice 0's decode rows
    # priced exactly (10), each further choice's tail a 64-row step.
    assert got.new_rows_bytes == (128 + 10 + 2 * 64) * KV
    assert price(dataclasses.replace(cost, choices=1), limits(segmented=True, tail_step_rows=64)).new_rows_bytes == 138 * KV


def test_n_choices_decode_attention_is_per_choice() -> None:
    lim = limits(segmented=True, attention_score_bytes_per_pair=2)
    cost = RequestCost(new_prompt_tokens=1, max_tokens=10)
    # The largest score block is the last decode step: 1 x 11 keys, one per choice.
    assert price(cost, lim).attention_scratch_bytes == 2 * 11 * 2
    assert price(dataclasses.replace(cost, choices=3), lim).attention_scratch_bytes == 2 * 3 * 11 * 2


def test_stock_forks_copy_the_prompt_slab_per_further_choice() -> None:
    cost = RequestCost(new_prompt_tokens=1000, max_tokens=200, history_tokens=5000, choices=3)
    got = price(cost, limits(segmented=False))
    # Choice 0 copies the shared history (5000 rows); choices 1 and 2 each copy the whole
    # prompt slab they start from (6000 rows). The slab 6200 rows stays under the ceiling.
    assert got.history_copy_bytes == (5000 + 2 * 6000) * KV and got.dense_slab_bytes == 0
    over = price(cost, limits(segmented=False, dense_decode_ceiling_bytes=600_000))
    assert over.dense_slab_bytes == 3 * 6200 * KV


def test_n_choices_can_be_refused_where_one_is_admitted() -> None:
    lim = limits(segmented=True, budget_bytes=400_000)
    state = MemoryState(weights_bytes=100_000, active_bytes=100_000, bank_ram_bytes=0,
                        bank_evictable_bytes=0, running_requests=1, queued_requests=0)
    one = RequestCost(new_prompt_tokens=500, max_tokens=500)
    assert decide(one, lim, state).decision == "admit"  # 105_120 <= 200_000 free
    sixteen = dataclasses.replace(one, choices=16)  # 16 tails: 855_120 > 300_000 idle capacity
    d = decide(sixteen, lim, state)
    assert d.decision == "reject_insufficient_memory" and d.detail.max_tokens_that_fit is not None
    assert price(dataclasses.replace(sixteen, max_tokens=d.detail.max_tokens_that_fit), lim).total_bytes <= 300_000


def test_choices_below_one_raise() -> None:
    with pytest.raises(ValueError, match="choices"):
        RequestCost(new_prompt_tokens=1, max_tokens=1, choices=0)
