"""What the load test reads from a server's Prometheus `/metrics` text, if it has one.

Tolerant on purpose (any server, any exposition): a line that does not parse is skipped.
Memory in use prefers segserve's split gauges, then its older `segserve_memory_bytes`,
then the process's resident memory that most Prometheus clients export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')

Samples = list[tuple[str, dict[str, str], float]]


def samples(text: str) -> Samples:
    """(name, labels, value) for every sample line of a text exposition."""
    out: Samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out.append((match.group(1), dict(_LABEL.findall(match.group(2) or "")), value))
    return out


def _matches(found: dict[str, str], labels: dict[str, str]) -> bool:
    return all(found.get(k) == v for k, v in labels.items())


def parse_metric(text: str, name: str, labels: dict[str, str]) -> float | None:
    """First sample of `name` whose labels include `labels`; None when there is none."""
    for n, found, value in samples(text):
        if n == name and _matches(found, labels):
            return value
    return None


def sum_metric(parsed: Samples, name: str, labels: dict[str, str] | None = None) -> float | None:
    """Sum of the samples of `name` (with `labels`); None when there is none."""
    values = [v for n, f, v in parsed if n == name and _matches(f, labels or {})]
    return sum(values) if values else None


def sum_by_label(parsed: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, found, value in parsed:
        if n == name and label in found:
            out[found[label]] = out.get(found[label], 0.0) + value
    return out


# (series, labels) tried in order; the first present is the reading.
_IN_USE: tuple[tuple[str, dict[str, str]], ...] = (
    ("segserve_memory_used_bytes", {}),  # summed over `kind`
    ("segserve_memory_bytes", {"kind": "active"}),
    ("process_resident_memory_bytes", {}),
)
_PEAK: tuple[tuple[str, dict[str, str]], ...] = (("segserve_memory_peak_bytes", {}), ("segserve_memory_bytes", {"kind": "peak"}))


def memory_in_use(parsed: Samples) -> tuple[str, float] | None:
    """(series used, bytes) of the server's memory in use, or None."""
    for name, labels in _IN_USE:
        value = sum_metric(parsed, name, labels)
        if value is not None:
            return name, value
    return None


@dataclass(frozen=True, slots=True)
class ServerSample:
    """What the server's /metrics said at the end of the load."""

    peak_bytes: int | None
    guard_interventions: dict[str, float]
    bank_evictions: dict[str, float]


def server_sample(text: str) -> ServerSample:
    parsed = samples(text)
    peak = None
    for name, labels in _PEAK:
        peak = sum_metric(parsed, name, labels)
        if peak is not None:
            break
    return ServerSample(
        None if peak is None else int(peak),
        sum_by_label(parsed, "segserve_guard_interventions_total", "reason"),
        sum_by_label(parsed, "segserve_bank_evictions_total", "reason"),
    )
