"""How much memory the device has: the input to the automatic memory budget.

Owns: `device_memory()`. Called once at start-up.
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
    size = int(info.get("memory_size", 0) or 0)  # type: ignore[call-overload]
    if mx.default_device() == mx.gpu and size:
        is_cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
        kind: DeviceKind = "cuda" if is_cuda else "unified"
        active = mx.get_active_memory()
        return DeviceMemory(kind, size, max(0, size - active))
    total, avail = _meminfo()
    return DeviceMemory("cpu", total, avail)
