"""The default memory budget rule.

Owns: the budget when none is set (`default_budget`) and the device kinds it knows. The
size and percent strings of the settings are parsed by `segserve.config.sizes`
(`parse_memory_budget`, `parse_percent`, re-exported here for the scheduler's callers).
Pure functions: the caller reads the device totals and passes them in.
"""

from __future__ import annotations

from typing import Literal

from segserve.config.sizes import parse_memory_budget, parse_percent

__all__ = ["DEFAULT_PERCENT", "DeviceKind", "default_budget", "parse_memory_budget", "parse_percent"]

DeviceKind = Literal["unified", "cuda", "cpu"]

# Shares of memory the default budget takes; see `default_budget` for why.
DEFAULT_PERCENT: dict[DeviceKind, int] = {"cpu": 75, "cuda": 90, "unified": 70}


def default_budget(device_total_bytes: int, kind: DeviceKind, available_bytes: int) -> int:
    """Default memory budget in bytes when `SEGSERVE_MEMORY_BUDGET` is not set.

    - `cpu`: 75 % of the RAM available now. The host is shared with other processes, so
      the total says little; a quarter of what is free stays for them and the page cache.
    - `cuda`: 90 % of device memory. The GPU is ours alone; the rest covers the CUDA
      context, library workspaces and allocator fragmentation.
    - `unified` (Apple silicon): 70 % of total RAM, and never more than is available now.
      GPU and OS share one pool and Metal's recommended working set is a bit above that
      share; exceeding it swaps instead of failing.

    The budget covers everything admission counts: weights, bank RAM tier and running turns.
    """
    if device_total_bytes <= 0 or available_bytes < 0:
        raise ValueError(
            f"device_total_bytes must be > 0 and available_bytes >= 0, got "
            f"{device_total_bytes} and {available_bytes}"
        )
    if kind not in DEFAULT_PERCENT:
        raise ValueError(f"unknown device kind {kind!r} (use unified, cuda or cpu)")
    pct = DEFAULT_PERCENT[kind]
    if kind == "cpu":
        budget = available_bytes * pct // 100
    elif kind == "cuda":
        budget = device_total_bytes * pct // 100
    else:
        budget = min(device_total_bytes * pct // 100, available_bytes)
    if budget <= 0:
        raise ValueError(f"no memory available for a {kind} budget (available_bytes=0)")
    return budget
