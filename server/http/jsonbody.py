"""Request bodies as JSON, refusing what would otherwise fail later as a 500.

Owns: `parse_json(raw)`. Every refusal is an `InvalidRequest` (400): a body that is not
UTF-8, not JSON, nested deeper than `MAX_DEPTH`, an integer longer than `MAX_INT_DIGITS`
digits (Python refuses > 4,300 anyway, with a ValueError), a number that is not finite
(`NaN`, `Infinity`, `1e999`), or a string holding a lone surrogate (`"\\ud800"`: valid
JSON, but no tokenizer or UTF-8 encoder takes it).
"""

from __future__ import annotations

import json
from typing import Any

from segserve.server.http.errors import InvalidRequest

MAX_DEPTH = 32
MAX_INT_DIGITS = 40


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes, what: str = "body") -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{what} is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise InvalidRequest(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError, so are our hooks' errors
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None
    _check(data, what)
    return data


def _check(data: Any, what: str) -> None:
    """Depth and lone surrogates, iteratively (no recursion on client data)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path or what)
        elif isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise InvalidRequest(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(k, str):
                    _check_text(k, sub)
                if isinstance(v, str | dict | list):
                    stack.append((v, depth + 1, sub))


def _check_text(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        safe = where[:64].encode("ascii", "backslashreplace").decode("ascii")
        raise InvalidRequest(
            f"{safe}: string holds a lone surrogate at character {exc.start}", param=safe or None
        ) from None
