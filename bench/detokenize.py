"""Per-token cost of detokenizing (segserve.server.runner.textstream) on the embedded tokenizer.

Prints JSON: microseconds per token of `TextStream.push` over the README's text (its first
`--tokens` ids), without stop strings and with two, beside a full re-decode of the output so
far per token (what an incremental detokenizer avoids) measured at the same output lengths.
Variants run interleaved round-robin so machine noise hits all alike. Compare the numbers
with a decode step (`bench/batch_decode.py`, `bench/profile_decode.py`): the stream runs on
the engine thread, between steps.

Run: .venv/bin/python bench/detokenize.py [--tokens 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from segserve.config.settings import load_settings  # noqa: E402
from segserve.server.runner.model import load_model  # noqa: E402
from segserve.server.runner.textstream import TextStream  # noqa: E402


def _stream(decode: Callable[[Sequence[int]], str], ids: list[int], stops: list[str]) -> float:
    ts = TextStream(decode, stops)
    t = time.perf_counter()
    for i in ids:
        ts.push(i)
    ts.flush()
    return (time.perf_counter() - t) / len(ids) * 1e6


def _full(decode: Callable[[Sequence[int]], str], ids: list[int]) -> float:
    t = time.perf_counter()
    for n in range(1, len(ids) + 1):
        decode(ids[:n])
    return (time.perf_counter() - t) / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    tok = load_model(load_settings({}, environ={})).tokenizer
    ids = list(tok.encode((ROOT / "README.md").read_text()))[: a.tokens]
    variants: dict[str, Callable[[], float]] = {
        "stream_no_stops": lambda: _stream(tok.decode, ids, []),
        "stream_two_stops": lambda: _stream(tok.decode, ids, ["</answer>", "\n\nUser:"]),
        "full_redecode": lambda: _full(tok.decode, ids),
    }
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.repeats):
        for k, f in variants.items():
            runs[k].append(f())
    print(json.dumps({
        "tokens": len(ids),
        "repeats": a.repeats,
        "us_per_token_median": {k: round(statistics.median(v), 2) for k, v in runs.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
