"""How many conversations with banked histories fit in memory: segmented vs stock KV.

Plain numbers from the admission price model (`segserve.server.scheduling.admission.price`),
no model loaded. A model shape (default: Llama-3-8B in bfloat16: 32 layers, 8 KV heads of
128, hidden 4096, MLP 14336, vocabulary 128256) gives the K/V bytes per token and the
weights; a device gives the memory budget (`default_budget`: an H200's 141 GB at the
`cuda` share, or `--ram-gb` of available RAM at the `cpu` share).

Scenario: N sessions, each holding a banked history of `context` tokens, each running one
follow-up turn at once (`--new-tokens` prompt tokens, `--max-tokens` out). Sessions come
in groups of `--branches` that fork one history (1: every session its own history). Memory:

    weights + groups * history + N * price(turn)  <=  budget

Segmented mode: the turn reads the banked segments in place, so its price is its own rows
(plus scratch); stock mode (mlx-lm's contiguous cache): the history is shared with the live
buffer and the turn's first write copies it (`history_copy_bytes`), and past the dense-decode
ceiling (15 % of device memory, the default) the grown slab once more. The largest N that
fits is printed as JSON per (mode, context).

Run: `python bench/capacity.py` (H200) or `python bench/capacity.py --device cpu --ram-gb 64`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from segserve.kv.segmented import TAIL_STEP
from segserve.server.scheduling.admission import PriceBreakdown, RequestCost, SchedulerLimits, price
from segserve.server.scheduling.memory_budget import default_budget

GB = 10**9


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    intermediate: int = 14336
    vocab: int = 128256
    params: int = 8_030_261_248
    dtype_bytes: int = 2  # bfloat16 weights and K/V

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weights_bytes(self) -> int:
        return self.params * self.dtype_bytes


def limits(shape: Shape, budget: int, device_total: int, segmented: bool, chunk: int = 512) -> SchedulerLimits:
    """The scheduler's numbers for this shape, as `segserve.server.runtime.make_limits` builds
    them (activation and step scratch by the same formulas; a fused route holds no scores)."""
    return SchedulerLimits(
        budget_bytes=budget,
        kv_bytes_per_token=shape.kv_bytes_per_token,
        prefill_chunk_tokens=chunk,
        prefill_transient_bytes_per_token=4 * (6 * shape.hidden + 3 * shape.intermediate),
        dense_decode_ceiling_bytes=device_total * 15 // 100,
        max_queue=1024,
        queue_timeout_s=60.0,
        segmented=segmented,
        step_scratch_bytes=4 * shape.vocab * 4,
        greedy_step_scratch_bytes=2 * shape.vocab * 4,
        tail_step_rows=TAIL_STEP if segmented else 1,
    )


def turn_price(lim: SchedulerLimits, context: int, new_tokens: int, max_tokens: int) -> PriceBreakdown:
    cost = RequestCost(new_prompt_tokens=new_tokens, max_tokens=max_tokens, history_tokens=context,
                       history_segments=1 if context else 0)
    return price(cost, lim)


def sessions_that_fit(budget: int, weights: int, history: int, turn: int, branches: int) -> int:
    """Largest N with weights + ceil(N / branches) * history + N * turn <= budget."""
    n = 0
    while True:
        m = n + 1
        groups = -(-m // branches)
        if weights + groups * history + m * turn > budget:
            return n
        n = m


def run(shape: Shape, device: str, memory_bytes: int, contexts: list[int], new_tokens: int,
        max_tokens: int, branches: int) -> dict[str, Any]:
    budget = default_budget(memory_bytes, "cuda" if device == "gpu" else "cpu", memory_bytes)
    rows = []
    for ctx in contexts:
        history = ctx * shape.kv_bytes_per_token
        row: dict[str, Any] = {"context": ctx, "history_bytes": history}
        for mode in ("segmented", "stock"):
            lim = limits(shape, budget, memory_bytes, mode == "segmented")
            p = turn_price(lim, ctx, new_tokens, max_tokens)
            n = sessions_that_fit(budget, shape.weights_bytes, history, p.total_bytes, branches)
            row[mode] = {"turn_price_bytes": p.total_bytes, "history_copy_bytes": p.history_copy_bytes,
                         "dense_slab_bytes": p.dense_slab_bytes, "sessions": n}
        row["ratio_segmented_over_stock"] = round(row["segmented"]["sessions"] / max(1, row["stock"]["sessions"]), 2)
        rows.append(row)
    return {
        "shape": "llama-3-8b bf16" if shape == Shape() else str(shape),
        "device": device, "memory_bytes": memory_bytes, "budget_bytes": budget,
        "weights_bytes": shape.weights_bytes, "kv_bytes_per_token": shape.kv_bytes_per_token,
        "new_tokens": new_tokens, "max_tokens": max_tokens, "branches": branches, "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--memory-gb", type=float, default=141.0, help="gpu: device memory (H200: 141)")
    p.add_argument("--ram-gb", type=float, default=64.0, help="cpu: RAM available to the server")
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--branches", type=int, default=1, help="sessions forking each history")
    a = p.parse_args(argv)
    mem = int((a.memory_gb if a.device == "gpu" else a.ram_gb) * GB)
    out = run(Shape(), a.device, mem, [int(c) for c in a.contexts.split(",")], a.new_tokens,
              a.max_tokens, a.branches)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
