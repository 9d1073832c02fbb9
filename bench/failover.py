"""Failover: the first turn on replica B after replica A died, shared SSD tier vs re-prefill.

For each mode, two `segserve serve` processes on loopback:
- shared:     both on one `--bank-dir` with `--bank-shared true` (B restores A's blocks);
- re-prefill: each with its own bank directory (B has never seen the conversation).
Per history length, one conversation turn runs on A (its history becomes N tokens); once
A's blocks are published (shared mode: its chain entries are on disk), A is killed with
SIGKILL, and the conversation's next turn is sent to B: its wall time (max_tokens 1,
non-streamed: prefill or restore + one token), prompt and cached tokens are recorded.
Both replicas are warmed up first (one short request each: compile and first-call costs).

    .venv/bin/python bench/failover.py --out bench/results/failover.json
    .venv/bin/python bench/failover.py --model tiny        # a 2-layer random llama instead

Default model: the embedded SmolLM2-135M (what `segserve serve` runs). Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.process_support import ServerProcess, write_tiny_model_dir  # noqa: E402

BLOCK_ROWS = 256  # the bank's aligned block: only full blocks are shared
SENTENCE = "Note {i}: the {c} valve on line {i} reads {v} bar and must be checked again."
COLORS = ("red", "green", "blue", "amber", "violet")


def chat(url: str, messages: list[dict[str, str]]) -> tuple[float, dict[str, Any]]:
    body = {"model": "default", "messages": messages, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=900, trust_env=False)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return wall, out


def history_text(tag: str, sentences: int) -> str:
    return f"Log {tag}. " + " ".join(
        SENTENCE.format(i=i, c=COLORS[i % 5], v=(i * 7) % 13) for i in range(sentences)
    )


def tokens_per_sentence(url: str) -> float:
    """Calibrate the prompt size (also B's warm-up request)."""
    _, a = chat(url, [{"role": "user", "content": history_text("calibrate", 10)}])
    _, b = chat(url, [{"role": "user", "content": history_text("calibrate", 40)}])
    return (int(b["usage"]["prompt_tokens"]) - int(a["usage"]["prompt_tokens"])) / 30


def wait_published(root: Path, entries: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(list((root / "chains").glob("*/*.chn"))) < entries:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {entries} chain entries after {timeout}s")
        time.sleep(0.2)


def run_mode(mode: str, model_args: list[str], lengths: list[int], tmp: Path) -> list[dict[str, Any]]:
    shared = tmp / f"{mode}-bank"
    dirs = [shared, shared] if mode == "shared" else [tmp / f"{mode}-a", tmp / f"{mode}-b"]
    extra = ["--bank-shared", "true"] if mode == "shared" else []
    a, b = (ServerProcess(tmp / f"{mode}-{n}.log", *model_args, "--bank-dir", str(d), *extra)
            for n, d in zip("ab", dirs, strict=True))
    try:
        a.wait_healthy(600)
        b.wait_healthy(600)
        per = tokens_per_sentence(b.url)
        chat(a.url, [{"role": "user", "content": "warm up"}])
        time.sleep(2)  # the warm-up turns' own chain entries are written by now
        before = len(list((shared / "chains").glob("*/*.chn")))
        convs: list[tuple[int, list[dict[str, str]], float, int]] = []
        for n in lengths:
            msgs = [{"role": "user", "content": history_text(f"{mode}-{n}", int(n / per))}]
            wall, r = chat(a.url, msgs)
            msgs += [r["choices"][0]["message"],
                     {"role": "user", "content": "Which valve reads the highest pressure?"}]
            convs.append((n, msgs, wall, r["usage"]["prompt_tokens"]))
        if mode == "shared":
            wait_published(shared, before + sum(p // BLOCK_ROWS for _, _, _, p in convs))
        a.kill()  # SIGKILL
        rows = []
        for n, msgs, a_wall, a_prompt in convs:
            wall, r = chat(b.url, msgs)
            details = r["usage"].get("prompt_tokens_details") or {}
            rows.append({
                "history_tokens": a_prompt, "target": n, "a_first_turn_s": round(a_wall, 3),
                "b_prompt_tokens": r["usage"]["prompt_tokens"],
                "b_cached_tokens": int(details.get("cached_tokens") or 0),
                "b_first_turn_s": round(wall, 3),
            })
        return rows
    finally:
        a.kill()
        b.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded",
                   help="'embedded' (segserve's default model), 'tiny', or a --model value")
    p.add_argument("--lengths", default="512,2048,4096")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="segserve-failover-") as t:
        tmp = Path(t)
        if args.model == "embedded":
            model_args: list[str] = []
        elif args.model == "tiny":
            model_args = ["--model", str(write_tiny_model_dir(tmp / "model"))]
        else:
            model_args = ["--model", args.model]
        results = {m: run_mode(m, model_args, lengths, tmp) for m in ("shared", "re-prefill")}
    rows = []
    for s, r in zip(results["shared"], results["re-prefill"], strict=True):
        rows.append({
            "history_tokens": s["history_tokens"],
            "restore_s": s["b_first_turn_s"], "restore_cached_tokens": s["b_cached_tokens"],
            "reprefill_s": r["b_first_turn_s"], "reprefill_cached_tokens": r["b_cached_tokens"],
            "speedup": round(r["b_first_turn_s"] / s["b_first_turn_s"], 2),
        })
    report = {
        "bench": "failover", "model": args.model, "block_rows": BLOCK_ROWS,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "what": "wall time of the first turn on B after A was killed (max_tokens 1); restore "
                "= shared SSD tier on, reprefill = shared tier off",
        "rows": rows, "runs": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
