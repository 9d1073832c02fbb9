"""Memory budget strings, percents and the default budget rule."""

from __future__ import annotations

import re

import pytest

from segserve.server.scheduling import default_budget, parse_memory_budget, parse_percent

GIB = 1024**3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64MB", 64_000_000),
        ("8GiB", 8 * GIB),
        ("512KiB", 524_288),
        ("1.5GB", 1_500_000_000),
        ("1000000", 1_000_000),
        ("1000000B", 1_000_000),
        (" 64 mb ", 64_000_000),
        ("2TiB", 2 * 1024**4),
        ("0.5KiB", 512),
        ("1.0001KiB", 1024),  # 1024.1024 bytes rounds down
        (".5GB", 500_000_000),
    ],
)
def test_parse_sizes(text: str, expected: int) -> None:
    assert parse_memory_budget(text) == expected


def test_parse_percent_of_device_total() -> None:
    assert parse_memory_budget("40%", device_total_bytes=10 * GIB) == 4 * GIB
    assert parse_memory_budget("12.5%", device_total_bytes=1000) == 125
    assert parse_memory_budget("100%", device_total_bytes=1000) == 1000


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("64XB", "unknown unit 'XB'"),
        ("", "expected a number"),
        ("abc", "expected a number"),
        ("-5MB", "expected a number"),
        ("1e9", "expected a number"),
        ("5 M B", "expected a number"),
        ("5MiBs", "unknown unit 'MiBs'"),
        ("0", "at least 1 byte"),
        ("0.4B", "at least 1 byte"),
        ("40%", "needs the device total"),
    ],
)
def test_bad_sizes_name_the_value(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="SEGSERVE_MEMORY_BUDGET") as info:
        parse_memory_budget(text, what="SEGSERVE_MEMORY_BUDGET")
    assert repr(text) in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize("text", ["0%", "101%", "-1%", "x%", "nan%"])
def test_bad_percent_budgets(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_memory_budget(text, device_total_bytes=1000)


@pytest.mark.parametrize(
    ("text", "expected"), [("15", 15.0), ("15%", 15.0), ("12.5", 12.5), (100, 100.0), (0.5, 0.5)]
)
def test_parse_percent(text: str | float, expected: float) -> None:
    assert parse_percent(text) == expected


@pytest.mark.parametrize("text", ["0", "100.01", "-3", "", "inf", "fifteen"])
def test_parse_percent_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="SEGSERVE_DENSE_DECODE_RAM_PERCENT"):
        parse_percent(text, what="SEGSERVE_DENSE_DECODE_RAM_PERCENT")


def test_default_budget_rule() -> None:
    total, available = 100 * GIB, 40 * GIB
    assert default_budget(total, "cpu", available) == 30 * GIB  # 75 % of available
    assert default_budget(total, "cuda", available) == 90 * GIB  # 90 % of the device
    assert default_budget(total, "unified", available) == 40 * GIB  # capped by available
    assert default_budget(total, "unified", 80 * GIB) == 70 * GIB  # 70 % of total


def test_default_budget_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="unknown device kind"):
        default_budget(GIB, "tpu", GIB)  # type: ignore[arg-type]  # an unknown kind, on purpose
    with pytest.raises(ValueError, match="no memory available"):
        default_budget(GIB, "cpu", 0)
    with pytest.raises(ValueError, match="device_total_bytes"):
        default_budget(0, "cuda", GIB)
