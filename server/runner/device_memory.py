"""How much memory the device has: the input to the automatic memory budget.

Owns: `device_memory()` (called once at start-up) and `MemoryMeter` (what the memory
guard reads after every engine step).
CPU: Linux's MemTotal / MemAvailable; CUDA: the device's memory size from MLX;
Apple unified memory: MLX's reported memory size (shared with the OS).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import mlx.core as mx

DeviceKind = Literal["unified", "cuda", "cpu"]


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    kind: DeviceKind
    total_bytes: int
    available_bytes: int


def _meminfo() -> tuple[int, int]:
    fields: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = fields.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
    avail = fields.get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * page
    return int(total), int(avail)


def device_memory() -> DeviceMemory:
    info = mx.device_info()
    size = int(info.get("memory_size", 0) or 0)
    if mx.default_device() == mx.gpu and size:
        is_cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
        kind: DeviceKind = "cuda" if is_cuda else "unified"
        active = mx.get_active_memory()
        return DeviceMemory(kind, size, max(0, size - active))
    total, avail = _meminfo()
    return DeviceMemory("cpu", total, avail)


class MemoryMeter:
    """MLX memory as the guard sees it: the larger of active memory and the peak since the
    previous reading, so a transient inside a step (prefill activations, a merge) that
    passed the budget is acted on even when active memory is back under it after the step.

    Reading resets MLX's peak counter (engine thread only); `peak` keeps the process-wide
    maximum, which `/health` and `/metrics` report. Only the server uses this meter: code
    that measures MLX's peak itself (tests, benchmarks) keeps the plain active reading.
    """

    def __init__(self) -> None:
        self.peak = int(mx.get_peak_memory())

    def __call__(self) -> int:
        step_peak = int(mx.get_peak_memory())
        mx.reset_peak_memory()
        active = int(mx.get_active_memory())
        self.peak = max(self.peak, step_peak, active)
        return max(step_peak, active)
