"""Summarise a `bench/soak.sh` run as JSON: RSS over time, MLX memory vs what the bank holds.

    python bench/soak_summary.py OUT_DIR [--json-out FILE]

Reads OUT_DIR/rss.csv, memory.log, idle.txt and round-*.json. "unaccounted" is MLX's
active memory minus the weights and the bank's RAM tier: under load it is the running
requests' tails and step scratch; at idle (after the load stops) it should return to ~0,
which is what "nothing accumulates" means.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path
from typing import Any

_LINE = re.compile(r'^(segserve_\w+)(?:\{(\w+)="([^"]*)"\})? (\S+)$')


def _samples(text: str) -> dict[str, dict[str, float]]:
    """memory.log / idle.txt -> {time label: {"name{label}": value}}."""
    out: dict[str, dict[str, float]] = {}
    cur = "idle"
    for line in text.splitlines():
        if line.startswith("# "):
            cur = line[2:].strip()
            out.setdefault(cur, {})
            continue
        m = _LINE.match(line)
        if m:
            name, _, lab, val = m.groups()
            out.setdefault(cur, {})[f"{name}{{{lab}}}" if lab else name] = float(val)
    return out


def _value(s: dict[str, float], *names: str) -> float | None:
    for n in names:
        if n in s:
            return s[n]
    return None


def _row(s: dict[str, float]) -> dict[str, float | None]:
    used = [v for k, v in s.items() if k.startswith("segserve_memory_used_bytes{")]
    # The old gauge had an "active" kind; the new one's kinds sum to MLX's active memory.
    active = _value(s, "segserve_memory_bytes{active}") or (sum(used) if used else None)
    weights = _value(s, "segserve_memory_bytes{weights}", "segserve_memory_used_bytes{weights}")
    bank = _value(s, "segserve_bank_bytes{ram}")
    un = None
    if active is not None and weights is not None and bank is not None:
        un = active - weights - bank
    return {"mlx_active_gb": _gb(active), "bank_ram_gb": _gb(bank), "unaccounted_gb": _gb(un)}


def _gb(v: float | None) -> float | None:
    return None if v is None else round(v / 1e9, 3)


def _restart(out: Path) -> dict[str, Any] | None:
    """Sessions listed before a SIGTERM and after the restart on the same bank directory:
    a turn is lost when a session is missing afterwards or lists fewer turns."""
    before_p, after_p = out / "sessions-before.json", out / "sessions-after.json"
    if not (before_p.exists() and after_p.exists()):
        return None
    before = {s["id"]: s["turns"] for s in json.loads(before_p.read_text())["data"]}
    after = {s["id"]: s["turns"] for s in json.loads(after_p.read_text())["data"]}
    lost = {sid: n - after.get(sid, 0) for sid, n in before.items() if after.get(sid, 0) < n}
    return {
        "sessions_before": len(before), "turns_before": sum(before.values()),
        "sessions_after": len(after), "turns_after": sum(after.values()),
        "lost_turns": sum(lost.values()), "lost_sessions": sorted(lost),
    }


def summarise(out: Path) -> dict[str, Any]:
    rss = [(int(r["elapsed_s"]), int(r["rss_kib"])) for r in csv.DictReader(open(out / "rss.csv"))]
    mem = _samples((out / "memory.log").read_text())
    idle_text = (out / "idle.txt").read_text() if (out / "idle.txt").exists() else ""
    idle = _samples(idle_text).get("idle", {})
    idle_rss = re.search(r"rss_kib (\d+)", idle_text)
    rounds = [json.loads(p.read_text()) for p in sorted(out.glob("round-*.json"))]
    statuses: dict[str, int] = {}
    failures: dict[str, int] = {}
    for r in rounds:
        for k, v in r.get("status_counts", {}).items():
            statuses[k] = statuses.get(k, 0) + v
        for k, v in r.get("failures", {}).items():
            failures[k] = failures.get(k, 0) + v
    last = rss[-1][0] if rss else 0
    server_errors = sum(v for k, v in statuses.items() if k.startswith("5"))
    tail = [kib for t, kib in rss if t >= last * 0.6]  # the last 40 % of the run
    return {
        "bench": "soak",
        "minutes": round(last / 60, 1),
        "requests": sum(r.get("requests", 0) for r in rounds),
        "status_counts": statuses,
        "failures": failures,
        "server_errors_5xx": server_errors,
        "restart": _restart(out),
        "rss_gb": {
            "start": round(rss[0][1] / 1048576, 3),
            "max": round(max(k for _, k in rss) / 1048576, 3),
            "end": round(rss[-1][1] / 1048576, 3),
            "last_40pct_range": [round(min(tail) / 1048576, 3), round(max(tail) / 1048576, 3)],
            "idle": round(int(idle_rss.group(1)) / 1048576, 3) if idle_rss else None,
        },
        "memory_under_load": {t: _row(s) for t, s in list(mem.items())[:: max(1, len(mem) // 12)]},
        "memory_idle": _row(idle),
        "rss_series": rss,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="the OUT_DIR given to bench/soak.sh")
    ap.add_argument("--json-out", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    text = json.dumps(summarise(a.out_dir), indent=1)
    print(text)
    if a.json_out:
        a.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
