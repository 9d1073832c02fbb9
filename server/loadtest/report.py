"""The JSON report of a run, the percentiles table, and segmented / stock ratios.

Percentiles are nearest-rank over the requests that completed (HTTP 200, no error):
TTFT, ITL (all gaps between content chunks, pooled), end-to-end latency, and each
request's output tokens/s (1 / time per output token). Failures are counted by HTTP
status and by `status code` (0 = no response: connection refused, client deadline).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from typing import Any

from segserve.server.loadtest.client import RequestRecord
from segserve.server.loadtest.runner import LoadConfig, RunResult

PERCENTILES = (50, 90, 95, 99)


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest rank: the smallest value with at least p % of the values <= it."""
    if not sorted_values:
        return None
    return sorted_values[max(math.ceil(p / 100 * len(sorted_values)), 1) - 1]


def distribution(values: list[float]) -> dict[str, float | int | None]:
    """p50/p90/p95/p99, mean and count of `values`."""
    s = sorted(values)
    out: dict[str, float | int | None] = {f"p{p}": percentile(s, p) for p in PERCENTILES}
    out["mean"] = sum(s) / len(s) if s else None
    out["n"] = len(s)
    return out


def summarize(result: RunResult, cfg: LoadConfig) -> dict[str, Any]:
    recs = result.records
    ok = [r for r in recs if r.ok]
    tokens = sum(r.tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    reasons = Counter((r.error_code, r.error_message) for r in recs if r.status == 507)
    failures = Counter(f"{r.status} {r.error_code}" for r in recs if not r.ok)
    sample, wall = result.sample, result.wall_s
    lags = [r.start_s - r.scheduled_s for r in recs if r.scheduled_s is not None]
    return {
        "config": asdict(cfg),
        "model": result.model,
        "mode": "closed_loop" if cfg.rate is None else "open_loop",
        "conversations": result.conversations,
        "requests": len(recs),
        "completed": len(ok),
        "status_counts": dict(sorted(Counter(str(r.status) for r in recs).items())),
        "errors_by_status": dict(sorted(Counter(str(r.status) for r in recs
                                                if not r.ok).items())),
        "failures": dict(sorted(failures.items())),
        "insufficient_memory_507": {
            "count": sum(reasons.values()),
            "reasons": [{"code": code, "message": msg, "count": n}
                        for (code, msg), n in reasons.most_common(20)],
        },
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([g for r in ok for g in r.itl_s]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_s": distribution([r.e2e_s for r in ok]),
        "output_tokens_per_s": distribution(
            [t for r in ok if (t := r.output_tokens_per_s) is not None]),
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "send_lag_s": distribution(lags) if cfg.rate is not None else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_token_ratio": cached / prompt if prompt else None,
        "server_peak_memory_bytes": sample.peak_bytes if sample else None,
        "guard_interventions": sample.guard_interventions if sample else None,
        "bank_evictions": sample.bank_evictions if sample else None,
        "server_memory": {"series": result.memory_series,
                          "samples": [[round(t, 3), v] for t, v in result.memory]},
        "wall_s": wall,
    }


def _rows() -> tuple[tuple[str, tuple[str, ...]], ...]:
    rows: list[tuple[str, tuple[str, ...]]] = [
        ("requests", ("requests",)), ("completed", ("completed",)),
        ("HTTP 507", ("insufficient_memory_507", "count")),
    ]
    for label, key in (("TTFT s", "ttft_s"), ("ITL s", "itl_s"), ("E2E s", "e2e_s"),
                       ("out tok/s/req", "output_tokens_per_s")):
        rows += [(f"{label} p{p}", (key, f"p{p}")) for p in PERCENTILES]
    rows += [
        ("tokens/s (all)", ("tokens_per_s",)), ("cached ratio", ("cached_token_ratio",)),
        ("peak bytes", ("server_peak_memory_bytes",)), ("wall s", ("wall_s",)),
    ]
    return tuple(rows)


TABLE = _rows()


def _get(report: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = report
    for key in path:
        value = value[key]
    return value


def ratios(seg: dict[str, Any], stock: dict[str, Any]) -> dict[str, float | None]:
    """segmented / stock for each table row; None when either side is missing or zero."""
    out: dict[str, float | None] = {}
    for label, path in TABLE:
        a, b = _get(seg, path), _get(stock, path)
        out[label] = a / b if a is not None and b else None
    return out


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def format_table(reports: dict[str, dict[str, Any]]) -> str:
    """Rows: the metrics; columns: the runs (and their ratio when there are two)."""
    names = list(reports)
    with_ratio = len(names) == 2
    head = ["metric", *names] + (["ratio"] if with_ratio else [])
    rows = [head]
    rat = ratios(reports[names[0]], reports[names[1]]) if with_ratio else {}
    for label, path in TABLE:
        cells = [_get(reports[n], path) for n in names] + ([rat[label]] if with_ratio else [])
        rows.append([label] + [_cell(v) for v in cells])
    # failures by "HTTP-status code" (status 0: no response; 200: cut or failed mid-stream)
    failures = sorted({f for n in names for f in reports[n]["failures"]})
    for failure in failures:
        counts = [reports[n]["failures"].get(failure, 0) for n in names]
        rows.append([f"failed {failure}"] + [str(c) for c in counts]
                    + (["-"] if with_ratio else []))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def jsonl_lines(run: str, records: list[RequestRecord]) -> list[str]:
    return [json.dumps({"run": run, **r.to_json()}) for r in records]
