"""Smoke test of bench/speed.py and bench/peers.py: tiny runs against segserve only.

Runs each script as a user would (a subprocess from the repository root, `--smoke`), so
the server start-up, the streaming client, the report layout and the server shutdown are
all exercised on the real embedded model. Checks the JSON layout and that the numbers are
present, never how fast they are: the machine is shared and timings vary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[1]
# A safety net against a hung run, not a speed assertion.
HANG_GUARD_S = 300


def _run(script: str, args: list[str], out: Path) -> dict[str, Any]:
    # SEGSERVE_* from the caller's shell must not change the server under test.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEGSERVE_")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke", "--json-out", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout)
    assert json.loads(out.read_text()) == report
    return report


def test_speed_smoke(tmp_path: Path) -> None:
    report = _run("speed.py", [], tmp_path / "speed.json")
    assert {"config", "server", "model", "bandwidth", "warmup", "short", "long"} <= set(report)
    assert report["model"]["bytes_per_decoded_token"] > 0
    assert report["bandwidth"]["limit_gb_s"] > 0
    assert report["server"]["rss_bytes"] > 0
    for kind in ("short", "long"):
        w = report[kind]
        assert w["errors"] == []
        assert w["ttft_s"] > 0
        assert w["warm_ttft_s"] is None or w["warm_ttft_s"] > 0  # greedy text may end early
        assert w["decode_tok_s"] is None or w["decode_tok_s"] > 0
        assert isinstance(w["bandwidth_fraction"], float | None)
        # The follow-up resends the first turn, so the server reuses part of it.
        assert all(n is not None and n < w["warm_runs"][0]["prompt_tokens"]
                   for n in w["warm_prompt_tokens_processed"])
    assert report["long"]["prompt_tokens"] > report["short"]["prompt_tokens"]


def test_peers_smoke_segserve_only(tmp_path: Path) -> None:
    plot = tmp_path / "peers.png"
    report = _run("peers.py", ["--only", "segserve", "--plot", str(plot)],
                  tmp_path / "peers.json")
    assert "mlx_lm" not in report and "ratios_segserve_over_mlx_lm" not in report
    seg = report["segserve"]
    assert {"warmup", "single_prompt", "conversation", "concurrent", "peak_rss_bytes"} <= set(seg)
    turns = seg["conversation"]
    assert [t["turn"] for t in turns] == [0, 1]
    for t in turns:
        assert t["status"] == 200 and t["error"] is None
        assert t["ttft_s"] > 0 and t["rss_bytes"] > 0
        assert isinstance(t["prompt_tokens_processed"], int)
    # Turn 1 resends turn 0: segserve must find that prefix by itself.
    assert turns[1]["prompt_tokens_processed"] < turns[1]["prompt_tokens"]
    assert seg["single_prompt"]["ttft_s"] == turns[0]["ttft_s"]
    conc = seg["concurrent"]
    assert conc["errors"] == 0 and conc["completed"] == conc["requests"] == 4
    assert conc["aggregate_tok_s"] > 0
    assert plot.stat().st_size > 0


@pytest.mark.parametrize("order", [[], ["--sequential"]])
def test_cpu_peers_smoke(tmp_path: Path, order: list[str]) -> None:
    """bench/cpu_peers.py, interleaved (default) and one server after the other:
    llama-server (when `make bench-peers-setup` built it) and segserve q4; without the
    binary its entry says why and segserve still runs."""
    built = (ROOT / "bench" / "out" / "llama.cpp" / "bin" / "llama-server").is_file()
    plot = tmp_path / "cpu_peers.png"
    report = _run("cpu_peers.py", ["--servers", "llama_server,segserve_q4", "--plot", str(plot), *order],
                  tmp_path / "cpu_peers.json")
    names = ["segserve_q4"] + (["llama_server"] if built else [])
    if not built:
        assert "make bench-peers-setup" in report["llama_server"]["skipped"]
        assert report["ratios"] == {}
    for name in names:
        r = report[name]
        assert r["single_runs"][0]["error"] is None and r["single_runs"][0]["status"] == 200
        assert r["prompt_tokens"] > 0 and r["prefill_tok_s"] > 0
        assert r["concurrent"]["errors"] == [] and r["concurrent"]["completion_tokens"] > 0
        assert r["peak_rss_bytes"] > 0
    if built:
        assert set(report["ratios"]["segserve_q4_x_llama_server"]) >= {"prefill", "decode", "peak_rss"}
    assert plot.stat().st_size > 0
