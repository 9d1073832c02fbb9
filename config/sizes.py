"""Size and percent strings of the settings, parsed.

Owns: turning `SEGSERVE_MEMORY_BUDGET`-style text (`64MB`, `8GiB`, `1.5GB`, `1000000`,
`40%`) into whole bytes, and percents such as `SEGSERVE_DENSE_DECODE_RAM_PERCENT` into
floats. Pure functions: the settings check their form before the model loads, and the
runtime parses them against the device's totals (a percent needs them).

Invariants: every parse returns a positive int (bytes) or a float in (0, 100] (percent), or
raises ValueError whose message quotes the offending text. Decimal units are powers of
1000 (`KB`, `MB`, `GB`, `TB`), binary units powers of 1024 (`KiB`, `MiB`, `GiB`, `TiB`);
units are case-insensitive and a fractional result is rounded down to whole bytes.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def _number(text: str, what: str, raw: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"invalid {what} {raw!r}: {text!r} is not a number") from None
    if not value.is_finite():
        raise ValueError(f"invalid {what} {raw!r}: must be a finite number")
    return value


def _percent(raw: str, what: str) -> Decimal:
    value = _number(raw.strip().removesuffix("%").strip(), what, raw)
    if not Decimal(0) < value <= Decimal(100):
        raise ValueError(f"invalid {what} {raw!r}: must be > 0 and <= 100")
    return value


def parse_percent(text: str | float, *, what: str = "percent") -> float:
    """Parse a percent in (0, 100]: `15`, `15%`, `12.5`, or a number. Returns e.g. 15.0."""
    return float(_percent(str(text), what))


def parse_memory_budget(
    text: str,
    *,
    device_total_bytes: int | None = None,
    what: str = "memory budget",
    minimum: int = 1,
) -> int:
    """Parse a memory size into whole bytes.

    Accepted: plain bytes (`1000000`), a size with a unit (`64MB`, `8GiB`, `512KiB`,
    `1.5GB`, `64 mb`), or a percent of `device_total_bytes` (`40%`; needs the total).
    `what` names the setting in error messages, e.g. "SEGSERVE_MEMORY_BUDGET";
    `minimum` is the smallest result allowed (0 for a floor that may be off).
    """
    raw = text
    stripped = text.strip()
    if stripped.endswith("%"):
        if device_total_bytes is None or device_total_bytes <= 0:
            raise ValueError(f"invalid {what} {raw!r}: a percent needs the device total")
        pct = _percent(raw, what)
        return _at_least(int(pct * device_total_bytes / 100), what, raw, minimum)
    match = _SIZE.match(stripped)
    if match is None:
        raise ValueError(
            f"invalid {what} {raw!r}: expected a number with an optional unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB) or a percent like 40%"
        )
    number, unit = match.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(
            f"invalid {what} {raw!r}: unknown unit {unit!r} "
            f"(use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"
        )
    # Decimal keeps `1.5GB` exact; float would give 1499999999.9999998.
    return _at_least(int(_number(number, what, raw) * scale), what, raw, minimum)


def _at_least(value: int, what: str, raw: str, minimum: int) -> int:
    if value < minimum:
        raise ValueError(f"invalid {what} {raw!r}: must be at least {minimum} byte(s)")
    return value
