"""The merge policy replayed on numbers: segment counts and rows copied per workload.

Owns: nothing the server imports. No MLX, no model: `segserve.kv.merge_policy.plan_merge` is applied
to sequences of seal sizes (rows per sealed turn half, oldest first) through
`segserve.kv.merge_policy.seal_onto`, as the segmented cache applies it after each seal. Three policies side by side:
- `size_tiered`: the server's policy (tier and count rules);
- `no_count_rule`: the same without the count rule (`max_segments` unbounded), to show what
  stranded segments do;
- `seal_counting`: the rule this project used before (a sealed segment is tier 0 whatever
  its size; four trailing segments of one tier merge), kept here as the reference.
Workloads: 300 random seals of 1-6,000 rows (5 seeds), a long document followed by short
turns, an agent loop of short calls and tool results, and a chat of mid-size turns.
Per workload and policy: the most segments the list held, rows copied per row sealed, and
the largest merge (rows). For the document, also the seal at which its first segment was
first copied (None: never).

Run: python bench/merge_replay.py [--json-out bench/results/merge_replay.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from segserve.kv.merge_policy import MergePlan, plan_merge, seal_onto  # noqa: E402

Planner = Callable[[Sequence[int], Sequence[int]], MergePlan | None]


def seal_counting(levels: Sequence[int], rows: Sequence[int], fanout: int = 4,
                  max_merge_rows: int = 65536) -> MergePlan | None:
    """The previous rule: `fanout` trailing segments of one level merge into level + 1."""
    if len(levels) < fanout or len(set(levels[-fanout:])) != 1:
        return None
    start = len(levels) - fanout
    total = sum(rows[start:])
    return None if total > max_merge_rows else MergePlan(start, len(levels), total, levels[-1] + 1)


POLICIES: dict[str, Planner] = {
    "size_tiered": lambda lv, rw: plan_merge(lv, rw),
    "no_count_rule": lambda lv, rw: plan_merge(lv, rw, max_segments=1 << 30),
    "seal_counting": seal_counting,
}


def workloads() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for seed in range(5):
        rng = random.Random(seed)
        out[f"random_{seed}"] = [rng.choice([1, 8, 64, 300, 900, 2500, 6000]) for _ in range(300)]
    out["document"] = [7616, 64] + [512, 64] * 60
    rng = random.Random(9)
    out["agent"] = [n for _ in range(400) for n in (rng.randint(20, 200), rng.randint(1, 60))]
    out["chat"] = [n for _ in range(200) for n in (rng.randint(10, 400), rng.randint(50, 800))]
    return out


def replay(seals: Sequence[int], plan: Planner) -> dict[str, Any]:
    levels: list[int] = []
    rows: list[int] = []
    copied = largest = most = 0
    first_copied_at: int | None = None
    for i, n in enumerate(seals):
        for p in seal_onto(levels, rows, n, plan):
            if p.start == 0 and first_copied_at is None:
                first_copied_at = i
            copied += p.rows
            largest = max(largest, p.rows)
        most = max(most, len(levels))
    return {
        "max_segments": most,
        "copies_per_row": round(copied / max(1, sum(seals)), 3),
        "largest_merge_rows": largest,
        "first_segment_copied_at_seal": first_copied_at,
        "final_segments": len(levels),
    }


def run() -> dict[str, Any]:
    return {
        "bench": "merge_replay",
        "results": {name: {pol: replay(seals, plan) for pol, plan in POLICIES.items()}
                    for name, seals in workloads().items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json-out", help="also write the JSON report here")
    args = ap.parse_args(argv)
    text = json.dumps(run(), indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
