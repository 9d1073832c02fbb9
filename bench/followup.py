"""Follow-up turns at growing context: segmented KV against stock, side by side, one run.

Issue: "a conversation of follow-up turns at contexts from 1K to 8K tokens on the embedded
model and a larger random-weight model, segments against stock, median of 3: peak memory
above the turn start, time per decode step, time to first token, greedy output identical".

How: one loaded model, two in-process engines (segmented and stock mode), each over its own
RAM-only session bank. One conversation grows turn by turn (a user chunk of at most
`--chunk-tokens`, a reply of `--decode-tokens`); like an OpenAI client the bench resends the
whole history each turn with no session id, so each engine finds the reused prefix itself.
Both engines get the same prompts; the history continues with the segmented engine's reply
(the stock one is compared). Each bank keeps only the latest turn's session, so superseded
snapshots do not pile up. At each target context a follow-up (a new user chunk of
`--followup-tokens`) runs `--warmup` + `--repeats` times per mode, interleaved (seg, stock,
stock, seg, ...) so drift on a shared machine hits both alike. Each run's stored turn is
deleted afterwards, so every repeat starts from the same stored state and reuses the
history, never the previous repeat's follow-up (`Started.cached_tokens` is checked).
EOS is disabled (see `bench.common.load_bench_model`) so every turn decodes the same count.

Run (full, embedded model; then the larger random-weight model):
    python bench/followup.py --json-out bench/out/followup_embedded.json \
        --plot bench/out/followup_embedded.png
    python bench/followup.py --model random8l --json-out bench/out/followup_random8l.json \
        --plot bench/out/followup_random8l.png
The JSON report goes to stdout (and --json-out); progress goes to stderr. Exit code 1 when
a measurement is invalid: greedy outputs differ or the history was not reused.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    MODELS,
    Conversation,
    TurnResult,
    bank_store,
    bench_route,
    emit_json,
    exit_now,
    greedy,
    grow_to,
    load_bench_model,
    log,
    model_info,
    new_conversation,
    on_engine,
    plot_panels,
    ratio,
    run_turn,
    start_engine,
    summarize,
)
from segserve.bank import Bank  # noqa: E402
from segserve.server.engine import Engine  # noqa: E402

# The embedded model's context is 8192: the last target leaves room for the reply.
FULL: dict[str, Any] = {
    "model": "embedded", "contexts": "1024,2048,4096,7500", "repeats": 3, "warmup": 1,
    "decode_tokens": 16, "followup_tokens": 128, "chunk_tokens": 512, "prefill_chunk": 256,
}
# Smoke: a tiny random model and a few hundred tokens, for tests/test_bench_smoke.py.
SMOKE: dict[str, Any] = {
    "model": "tiny", "contexts": "96,192", "repeats": 2, "warmup": 1,
    "decode_tokens": 4, "followup_tokens": 16, "chunk_tokens": 48, "prefill_chunk": 32,
}


@dataclass(frozen=True, slots=True)
class Config:
    model: str
    contexts: tuple[int, ...]
    repeats: int
    warmup: int
    decode_tokens: int
    followup_tokens: int
    chunk_tokens: int
    prefill_chunk: int
    bank_bytes: int
    smoke: bool
    json_out: str | None
    plot: str | None


@dataclass(eq=False)
class Mode:
    """One engine under test and the session of its conversation's latest turn."""

    name: str
    engine: Engine
    store: Bank
    latest: str | None = None

    def forget(self, session_id: str | None) -> None:
        """Delete a session; nodes other sessions share stay (the bank refcounts them)."""
        if session_id is not None:
            bank = self.store
            on_engine(self.engine, lambda: bank.delete(session_id))

    def keep_latest(self, session_id: str | None) -> None:
        """The new turn's session shares the history; the previous one only holds what the
        new turn superseded (stock: the old full buffer; segmented: pre-merge segments)."""
        if self.latest is not None and self.latest != session_id:
            self.forget(self.latest)
        self.latest = session_id


def parse_args(argv: Sequence[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, help="embedded | random8l | tiny")
    p.add_argument("--contexts", help="target contexts in tokens, comma-separated")
    p.add_argument("--repeats", type=int, help="measured follow-ups per context and mode")
    p.add_argument("--warmup", type=int, help="unmeasured follow-ups first (compiled graphs)")
    p.add_argument("--decode-tokens", type=int, help="tokens decoded per turn")
    p.add_argument("--followup-tokens", type=int, help="new user tokens of the follow-up")
    p.add_argument("--chunk-tokens", type=int, help="user tokens per turn while growing")
    p.add_argument("--prefill-chunk", type=int, help="engine prefill chunk (server default)")
    p.add_argument("--bank-gib", type=float, default=8.0, help="RAM cap of each bank")
    p.add_argument("--json-out", help="also write the JSON report here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for the smoke test)")
    a = p.parse_args(argv)
    base = SMOKE if a.smoke else FULL
    val = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in base.items()}
    contexts = tuple(sorted(int(c) for c in str(val["contexts"]).split(",") if c.strip()))
    if not contexts or val["repeats"] < 1 or val["decode_tokens"] < 2:
        p.error("need at least one context, --repeats >= 1 and --decode-tokens >= 2")
    return Config(str(val["model"]), contexts, int(val["repeats"]), int(val["warmup"]),
                  int(val["decode_tokens"]), int(val["followup_tokens"]),
                  int(val["chunk_tokens"]), int(val["prefill_chunk"]),
                  int(a.bank_gib * (1 << 30)), bool(a.smoke), a.json_out, a.plot)


def _grow_step(modes: Sequence[Mode], cfg: Config, mismatches: list[int]
               ) -> Callable[[list[int]], list[int]]:
    """One growth turn on every engine (same prompt); returns the segmented reply."""

    def step(prompt: list[int]) -> list[int]:
        replies = []
        for m in modes:
            r = run_turn(m.engine, greedy(prompt, cfg.decode_tokens, f"{m.name}-grow"))
            m.keep_latest(r.session_id)
            replies.append(r.tokens)
        if any(r != replies[0] for r in replies):
            mismatches.append(len(prompt))
        return replies[0]

    return step


def _measure(modes: Sequence[Mode], prompt: list[int], cfg: Config, target: int
             ) -> dict[str, list[TurnResult]]:
    runs: dict[str, list[TurnResult]] = {m.name: [] for m in modes}
    for rep in range(cfg.warmup + cfg.repeats):
        # Alternate who goes first: slow drift on a shared machine then hits both alike.
        for m in modes if rep % 2 == 0 else list(reversed(modes)):
            res = run_turn(m.engine, greedy(prompt, cfg.decode_tokens, f"{m.name}-{target}"))
            m.forget(res.session_id)  # back to the same stored state for the next repeat
            if rep >= cfg.warmup:
                runs[m.name].append(res)
    return runs


def _context_report(target: int, context: int, history: int,
                    runs: dict[str, list[TurnResult]]) -> dict[str, Any]:
    seg, stock = runs["segmented"], runs["stock"]
    s, k = summarize(seg), summarize(stock)
    every = seg + stock
    same_state = all(len({r.cached_tokens for r in rs}) == 1 for rs in runs.values())
    return {
        "target_context": target,
        "context_tokens": context,
        "history_tokens": history,  # the previous prompt: what every run must reuse
        "segmented": s,
        "stock": k,
        "ratio_segmented_over_stock": {
            "ttft": ratio(s["ttft_s"], k["ttft_s"]),
            "decode_step": ratio(s["decode_step_s"], k["decode_step_s"]),
            "peak_above_start": ratio(s["peak_above_start_bytes"], k["peak_above_start_bytes"]),
        },
        "greedy_identical": all(r.tokens == seg[0].tokens for r in every),
        "history_reused": same_state and all(r.cached_tokens >= history for r in every),
    }


def _check_fits(cfg: Config, context_length: int) -> None:
    top = max(cfg.contexts) + cfg.decode_tokens
    if top > context_length:
        raise SystemExit(f"context {max(cfg.contexts)} + {cfg.decode_tokens} decoded tokens "
                         f"exceeds the model context {context_length}")


def _conversation_runs(modes: Sequence[Mode], conv: Conversation, cfg: Config,
                       on_result: Callable[[list[dict[str, Any]]], None] | None = None,
                       ) -> tuple[list[dict[str, Any]], list[int]]:
    results: list[dict[str, Any]] = []
    mismatches: list[int] = []
    history = 0
    step = _grow_step(modes, cfg, mismatches)
    for target in cfg.contexts:
        # Reserve room for the follow-up's user chunk and the last growth reply after it.
        grown = grow_to(conv, target, chunk=cfg.chunk_tokens,
                        reserve=cfg.followup_tokens + cfg.decode_tokens,
                        step=step, label=f"grow{target}")
        history = grown if grown is not None else history
        prompt = conv.prompt(conv.user(cfg.followup_tokens, f"followup-{target}"))
        log(f"measuring a follow-up at {len(prompt)} tokens")
        runs = _measure(modes, prompt, cfg, target)
        results.append(_context_report(target, len(prompt), history, runs))
        if on_result is not None:
            on_result(results)
    return results, mismatches


def run(cfg: Config,
        on_result: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
        ) -> dict[str, Any]:
    """The report; `on_result(model_info, results so far)` after each context (a long run
    cut short by a time limit then still leaves what it measured)."""
    loaded = load_bench_model(cfg.model)
    _check_fits(cfg, loaded.context_length)
    route = bench_route(loaded)[0]
    modes: list[Mode] = []
    try:
        for name in ("segmented", "stock"):
            store = bank_store(loaded, cfg.bank_bytes)
            eng = start_engine(loaded, store, segmented=name == "segmented",
                               prefill_chunk=cfg.prefill_chunk)
            modes.append(Mode(name, eng, store))
        info = model_info(loaded, route)
        each = None if on_result is None else (lambda rows: on_result(info, rows))
        results, mismatches = _conversation_runs(modes, new_conversation(loaded), cfg, each)
        evictions = {m.name: dict(m.engine.bank_state().get("evictions_by_reason", {}))
                     for m in modes}
    finally:
        for m in modes:
            m.engine.stop()
    return {
        "bench": "followup",
        "model": model_info(loaded, route),
        "config": {**asdict(cfg), "contexts": list(cfg.contexts)},
        "results": results,
        "all_greedy_identical": all(r["greedy_identical"] for r in results),
        "all_history_reused": all(r["history_reused"] for r in results),
        "growth_reply_mismatch_at": mismatches,  # prompt lengths where growth replies differed
        "bank_evictions": evictions,  # should be empty: an eviction would skew a measurement
    }


def plot(report: dict[str, Any], path: str) -> None:
    rows = report["results"]
    x = [r["context_tokens"] for r in rows]

    def series(key: str, scale: float) -> Mapping[str, Sequence[float | None]]:
        return {mode: [None if r[mode][key] is None else r[mode][key] * scale for r in rows]
                for mode in ("segmented", "stock")}

    plot_panels(path, x, "context (tokens)", [
        ("peak above turn start (MiB)", series("peak_above_start_bytes", 1 / (1 << 20))),
        ("decode step (ms)", series("decode_step_s", 1e3)),
        ("time to first token (s)", series("ttft_s", 1.0)),
    ], f"follow-up turn, {report['model']['id']}: segmented vs stock KV "
       f"(median of {report['config']['repeats']})")


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    report = run(cfg)
    emit_json(report, cfg.json_out)
    if cfg.plot:
        plot(report, cfg.plot)
    ok = report["all_greedy_identical"] and report["all_history_reused"]
    if not ok:
        log("invalid measurement: greedy outputs differ or the history was not reused")
    return 0 if ok else 1


if __name__ == "__main__":
    exit_now(main())
