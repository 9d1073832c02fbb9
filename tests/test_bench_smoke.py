"""Smoke runs of the in-process benchmarks (bench/followup.py, bench/resume.py).

Both run end to end on a tiny random-weight llama (`--smoke --model tiny`) with their
outputs in tmp_path. Only the report's shape and its validity flags are checked (greedy
tokens identical, history reused, SSD restore happened): never wall-clock times.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "bench"
_RUN_KEYS = {"ttft_s", "decode_step_s", "peak_above_start_bytes", "prefill_peak_above_start_bytes",
             "cached_tokens", "prompt_tokens", "tokens"}
_SUMMARY_KEYS = {"ttft_s", "decode_step_s", "peak_above_start_bytes",
                 "prefill_peak_above_start_bytes", "cached_tokens", "runs"}


def _load(name: str) -> ModuleType:
    # bench/ is scripts, not a package: load by path, as tests/test_loadtest.py does.
    spec = importlib.util.spec_from_file_location(f"segserve_bench_{name}", _BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    return mod


def _check_summary(summary: dict[str, Any], repeats: int) -> None:
    assert set(summary) >= _SUMMARY_KEYS
    assert len(summary["runs"]) == repeats
    for run in summary["runs"]:
        assert set(run) == _RUN_KEYS
        assert run["peak_above_start_bytes"] > 0
        assert 0 < run["prefill_peak_above_start_bytes"] <= run["peak_above_start_bytes"]


def test_followup_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "followup.json", tmp_path / "followup.png"
    rc = _load("followup").main(
        ["--smoke", "--model", "tiny", "--json-out", str(out), "--plot", str(png)]
    )
    report = json.loads(out.read_text())
    assert rc == 0
    assert json.loads(capsys.readouterr().out) == report  # stdout carries only the report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["bench"] == "followup" and report["model"]["layers"] == 2
    assert [r["target_context"] for r in report["results"]] == report["config"]["contexts"]
    for r in report["results"]:
        _check_summary(r["segmented"], report["config"]["repeats"])
        _check_summary(r["stock"], report["config"]["repeats"])
        assert set(r["ratio_segmented_over_stock"]) == {"ttft", "decode_step", "peak_above_start"}
        assert r["greedy_identical"] and r["history_reused"]
        # Memory is deterministic, not a timing: stock copies the history, segments do not.
        assert r["ratio_segmented_over_stock"]["peak_above_start"] < 1
    assert report["all_greedy_identical"] and report["all_history_reused"]
    assert report["bank_evictions"] == {"segmented": {}, "stock": {}}


def test_resume_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "resume.json"
    rc = _load("resume").main(
        ["--smoke", "--model", "tiny", "--json-out", str(out), "--bank-dir", str(tmp_path / "b")]
    )
    report = json.loads(out.read_text())
    assert rc == 0
    assert json.loads(capsys.readouterr().out) == report
    repeats = report["config"]["repeats"]
    for way in ("ram", "ssd", "cold"):
        _check_summary(report[way], repeats)
    assert set(report["ratios_ttft"]) == {"ssd_over_ram", "cold_over_ram", "cold_over_ssd"}
    assert len(report["ssd"]["restored_segments"]) == repeats
    assert all(n > 0 for n in report["ssd"]["restored_segments"])
    assert report["cold"]["cached_tokens"] == [0] * repeats
    assert min(report["ram"]["cached_tokens"]) >= report["conversation"]["history_tokens"] > 0
    assert report["greedy_identical"] and report["history_reused"] and report["ssd_restored"]


def test_zero_cost_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "zero_cost.json", tmp_path / "zero_cost.png"
    rc = _load("zero_cost").main(["--backend", "smoke", "--json-out", str(out), "--plot", str(png)])
    report = json.loads(out.read_text())
    assert rc == 0
    assert json.loads(capsys.readouterr().out) == report
    table = report["summary"]["table"]
    assert [r["history_tokens"] for r in table] == [
        r["history_tokens"] for r in report["followup"]["results"]
    ]
    for row in table:
        for key in ("decode_tps_ratio", "ttft_ratio", "peak_ratio"):
            assert row[key] is not None and row[key] > 0
            assert row["goals_met"][key] in (True, False)
    assert png.stat().st_size > 0


def test_merge_replay_reports_every_policy_and_workload() -> None:
    # Numbers only (no model, no clock): the report's shape, and the facts the merge
    # policy's docstring quotes from it.
    bench = _load("merge_replay")
    res = bench.run()["results"]
    assert set(res) >= {"document", "agent", "chat", "random_0"}
    for per_policy in res.values():
        assert set(per_policy) == {"size_tiered", "no_count_rule", "seal_counting"}
    doc = res["document"]
    assert doc["seal_counting"]["first_segment_copied_at_seal"] == 3
    assert doc["size_tiered"]["first_segment_copied_at_seal"] > 40
    for name in ("agent", "chat"):
        assert res[name]["size_tiered"]["max_segments"] <= 12 < res[name]["seal_counting"]["max_segments"]


def test_families_gpu_smoke() -> None:
    """bench/families_gpu.py on tiny shapes: every family is served segmented (no refusal)
    and reports the three decode rates it compares."""
    fam = _load("families_gpu")
    report = fam.run(["llama3", "qwen3", "gemma3", "gemma2"], ["bf16"], "tiny", 48, 4, repeats=1)
    assert [r["family"] for r in report["rows"]] == ["llama3", "qwen3", "gemma3", "gemma2"]
    for row in report["rows"]:
        assert not row["route"].startswith("refused"), row["route"]
        assert row["mlx_lm"]["decode_tok_s"] > 0
        assert row["segmented"]["decode_tok_s"] > 0 and row["stock"]["decode_tok_s"] > 0


@pytest.mark.model
def test_speculative_window_cost_smoke() -> None:
    """bench/speculative.py --window-cost on the embedded model: every variant timed, each
    window of the batched layers and of the plain forward against the decode step, and a
    shared verify step of 4 sessions against their plain batched step."""
    report = _load("speculative").window_cost(repeats=1)
    ms = report["median_ms"]
    assert set(ms) == {"decode_step", "batch4_decode_step", "batch4_window5_each"} | {
        f"window{r}_{how}" for r in (2, 3, 5, 9) for how in ("batched_layers", "plain_forward")}
    assert all(v > 0 for v in ms.values())
    assert report["in_decode_steps"]["decode_step"] == 1.0


def test_gpu_batch_ramp_smoke() -> None:
    """bench/gpu_batch.py --ramp on the tiny model (any device): both passes time every batch
    size, after the server's warm-up and with every tail re-stacked (the A/B's two arms)."""
    import argparse

    gpu_batch = _load("gpu_batch")
    for restack in (False, True):
        args = argparse.Namespace(model="tiny", ramp=3, contexts="32", device_name="H200", warm_up=True,
                                  owned="on", restack=restack)
        report = gpu_batch.ramp(args)
        assert len(report["first_pass_ms"]) == len(report["second_pass_ms"]) == 3
        assert report["warm_up"]["error"] is None and report["warm_up"]["max_batch"] == 3
        assert report["restack"] is restack and report["worst_first_ms"] > 0


@pytest.mark.model
def test_random_model_dir_is_served(tmp_path: Path) -> None:
    """bench/random_model_dir.py writes an mlx-lm directory the server loads and chats with
    (the embedded model's tokenizer and chat template)."""
    from mlx_lm.models.cache import make_prompt_cache

    from segserve.config.settings import load_settings
    from segserve.server.runner import load_model, logits_last

    rmd = _load("random_model_dir")
    out = tmp_path / "m"
    rmd.write_tokenizer(out, 512)
    assert rmd.write_model(out, "tiny", 512, seed=0) > 0
    loaded = load_model(load_settings({"model": str(out), "bank_dir": "none"}, environ={}))
    prompt = loaded.tokenizer.render([{"role": "user", "content": "hi"}])
    ids = loaded.tokenizer.encode(prompt)
    assert "hi" in prompt and len(ids) > 3 and loaded.context_length == 512
    assert logits_last(loaded.model, ids, make_prompt_cache(loaded.model)).shape[-1] == 49152
