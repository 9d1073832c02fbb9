"""bench/soak_summary.py counts lost turns across the soak's restart and 5xx answers."""

from __future__ import annotations

import json
from pathlib import Path

from bench.soak_summary import summarise


def _write(out: Path, before: dict[str, int], after: dict[str, int], statuses: dict[str, int]) -> None:
    (out / "rss.csv").write_text("elapsed_s,rss_kib\n0,1000\n20,1100\n")
    (out / "memory.log").write_text("# 0\n")
    (out / "round-1.json").write_text(json.dumps({"requests": sum(statuses.values()), "status_counts": statuses}))
    for name, d in (("before", before), ("after", after)):
        data = [{"id": k, "turns": v} for k, v in d.items()]
        (out / f"sessions-{name}.json").write_text(json.dumps({"object": "list", "data": data}))


def test_nothing_lost(tmp_path: Path) -> None:
    _write(tmp_path, {"a": 3, "b": 8}, {"a": 3, "b": 8}, {"200": 11})
    s = summarise(tmp_path)
    assert s["restart"]["lost_turns"] == 0 and s["server_errors_5xx"] == 0
    assert s["restart"]["turns_before"] == s["restart"]["turns_after"] == 11


def test_missing_session_and_turns_counted(tmp_path: Path) -> None:
    _write(tmp_path, {"a": 3, "b": 8, "c": 2}, {"a": 1, "b": 8}, {"200": 9, "503": 1, "507": 2, "429": 4})
    s = summarise(tmp_path)
    assert s["restart"]["lost_turns"] == 2 + 2
    assert s["restart"]["lost_sessions"] == ["a", "c"]
    assert s["server_errors_5xx"] == 3
