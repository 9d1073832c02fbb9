"""Segments at no cost: segmented / stock for decode, follow-up TTFT and peak, one run.

The segments-at-no-cost benchmark. It runs `bench/followup.py`'s measurement (two in-process engines,
segmented and stock, over the same model; one conversation grown turn by turn; at each
history length a follow-up turn runs `--repeats` times per mode, interleaved) at the issue's
history lengths and reports, per length, the ratios that the goals are stated in:

    decode_tps_ratio   segmented decode tok/s / stock decode tok/s       goal >= 0.97
    ttft_ratio         segmented follow-up TTFT / stock                  goal <= 1.0
    peak_ratio         segmented peak above the turn's start / stock     goal <= 1.0

Presets (`--backend`):
    cpu: the embedded model, histories 64, 512, 2K, 8K tokens (the last one 7,900: the model's
         context is 8,192 and the follow-up and reply must fit).
    gpu: a random-weight Llama-3-8B shape in bfloat16 (`random8b`), histories 8K, 32K, 128K.
Every number comes from the same process and the same minute; JSON to stdout (and
--json-out), a PNG of the three ratios with --plot. Exit code 1 when a measurement is
invalid (history not reused); missed goals are reported, not an error.

Run:
    python bench/zero_cost.py --backend cpu --json-out bench/results/zero_cost_cpu.json \
        --plot bench/results/zero_cost_cpu.png
    python bench/zero_cost.py --backend gpu --json-out bench/results/zero_cost_h200.json \
        --plot bench/results/zero_cost_h200.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import followup  # noqa: E402
from bench.common import emit_json, exit_now, log, plot_panels  # noqa: E402

PRESETS: dict[str, list[str]] = {
    "cpu": ["--model", "embedded", "--contexts", "64,512,2048,7900", "--repeats", "2",
            "--warmup", "1", "--decode-tokens", "32", "--followup-tokens", "64",
            "--chunk-tokens", "512", "--prefill-chunk", "256"],
    "gpu": ["--model", "random8b", "--contexts", "8192,32768,131072", "--repeats", "2",
            "--warmup", "1", "--decode-tokens", "64", "--followup-tokens", "512",
            "--chunk-tokens", "8192", "--prefill-chunk", "256", "--bank-gib", "100"],
    "smoke": ["--smoke"],
}
GOALS = {"decode_tps_ratio": (">=", 0.97), "ttft_ratio": ("<=", 1.0), "peak_ratio": ("<=", 1.0)}


def _ratios(row: dict[str, Any]) -> dict[str, float | None]:
    seg, stock = row["segmented"], row["stock"]
    step_s, step_k = seg["decode_step_s"], stock["decode_step_s"]
    peak_s, peak_k = seg["peak_above_start_bytes"], stock["peak_above_start_bytes"]
    return {
        "decode_tps_ratio": step_k / step_s if step_s and step_k else None,
        "ttft_ratio": seg["ttft_s"] / stock["ttft_s"] if stock["ttft_s"] else None,
        "peak_ratio": peak_s / peak_k if peak_k else None,
    }


def _met(name: str, value: float | None) -> bool | None:
    if value is None:
        return None
    op, bound = GOALS[name]
    return value >= bound if op == ">=" else value <= bound


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    table = []
    for row in report["results"]:
        r = _ratios(row)
        seg, stock = row["segmented"], row["stock"]
        table.append({
            "history_tokens": row["history_tokens"],
            "context_tokens": row["context_tokens"],
            "decode_tps": {"segmented": _tps(seg), "stock": _tps(stock)},
            "ttft_s": {"segmented": seg["ttft_s"], "stock": stock["ttft_s"]},
            "peak_above_start_mib": {
                "segmented": _mib(seg["peak_above_start_bytes"]),
                "stock": _mib(stock["peak_above_start_bytes"]),
            },
            # Up to the first token: the prefill alone (the whole turn adds decode and the
            # seal, merges included).
            "prefill_peak_above_start_mib": {
                "segmented": _mib(seg["prefill_peak_above_start_bytes"]),
                "stock": _mib(stock["prefill_peak_above_start_bytes"]),
            },
            **r,
            "goals_met": {k: _met(k, v) for k, v in r.items()},
        })
    return {"goals": {k: f"{op} {b}" for k, (op, b) in GOALS.items()}, "table": table}


def _wide_state(report: dict[str, Any]) -> str:
    """Whether the fused CUDA route ran prefill chunks on its wide path (`build`'s rule)."""
    if report["model"].get("route") != "fused_cuda":
        return "n/a (route is not fused_cuda)"
    from segserve.kernels import fused_cuda

    m = report["model"]
    keys, why = fused_cuda.wide_path(int(m["head_dim"]), getattr(mx, str(m["kv_dtype"])))
    if keys is None:
        return f"off ({why})"
    return f"on, {'paired' if keys else 'one window per block'} ({why})"


def _paced_state(report: dict[str, Any]) -> int | None:
    """Prefill calls the fused CUDA route lets queue at once (`build`'s rule; 0: unpaced)."""
    if report["model"].get("route") != "fused_cuda":
        return None
    from segserve.kernels import fused_cuda

    return fused_cuda.in_flight_prefill()


def _tps(mode: dict[str, Any]) -> float | None:
    return 1.0 / mode["decode_step_s"] if mode["decode_step_s"] else None


def _mib(value: float | None) -> float | None:
    return None if value is None else value / (1 << 20)


def _plot_report(summary: dict[str, Any], report: dict[str, Any], path: str) -> None:
    m = report["model"]
    plot(summary, f"segmented / stock, {m['id']} ({m['route']}, {m['device']})", path)


def plot(summary: dict[str, Any], title: str, path: str) -> None:
    rows = summary["table"]
    x = [r["history_tokens"] for r in rows]
    plot_panels(path, x, "history (tokens)", [
        ("decode tok/s, segmented / stock", {"ratio": [r["decode_tps_ratio"] for r in rows]}),
        ("follow-up TTFT, segmented / stock", {"ratio": [r["ttft_ratio"] for r in rows]}),
        ("peak above turn start, segmented / stock", {"ratio": [r["peak_ratio"] for r in rows]}),
    ], title)


def _partial_writer(backend: str, path: str | None
                    ) -> Callable[[dict[str, Any], list[dict[str, Any]]], None] | None:
    """With --json-out: rewrite it after each history length (marked "partial"), so a run
    stopped by a time limit (128K on the GPU takes minutes to grow) keeps what it measured."""
    if path is None:
        return None

    def write(model: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        report = {"bench": "followup", "model": model, "results": rows}
        out = {"bench": "zero_cost", "backend": backend, "partial": True,
               "summary": summarize(report), "followup": report}
        Path(path).write_text(json.dumps(out, indent=2) + "\n")

    return write


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=sorted(PRESETS), required=True,
                   help="cpu (embedded model, 64..8K) | gpu (random 8B bf16, 8K..128K) | smoke")
    p.add_argument("--repeats", help="override the preset's measured follow-ups per mode")
    p.add_argument("--contexts", help="override the preset's history lengths (comma-separated)")
    p.add_argument("--json-out", help="also write the JSON report here")
    p.add_argument("--plot", help="write a PNG of the three ratios here")
    p.add_argument("--replot", metavar="JSON",
                   help="only redraw --plot from a saved report (e.g. one written on the device)")
    a = p.parse_args(argv)
    if a.replot:
        if not a.plot:
            p.error("--replot needs --plot")
        saved = json.loads(Path(a.replot).read_text())
        _plot_report(saved["summary"], saved["followup"], a.plot)
        return 0
    args = list(PRESETS[a.backend])
    if a.repeats:
        args += ["--repeats", a.repeats]
    if a.contexts:
        args += ["--contexts", a.contexts]
    cfg = followup.parse_args(args)
    report = followup.run(cfg, _partial_writer(a.backend, a.json_out))
    summary = summarize(report)
    out = {"bench": "zero_cost", "backend": a.backend, "summary": summary, "followup": report,
           "fused_cuda_wide": _wide_state(report), "fused_cuda_in_flight": _paced_state(report)}
    emit_json(out, a.json_out)
    if a.plot:
        _plot_report(summary, report, a.plot)
    if not report["all_history_reused"]:
        log("invalid measurement: the history was not reused")
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())
