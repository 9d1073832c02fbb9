"""Time to resume a long conversation: from the RAM tier, from the SSD tier, and cold.

Issue: "time to resume a 6K-token conversation from RAM, from SSD and cold, on the embedded
model, JSON".

How: one in-process engine (segmented mode unless `--kv stock`) over a session bank with
an SSD tier in `--bank-dir` (a temporary directory by default). A conversation under the
session id "conv" grows to about `--tokens` tokens (user chunks of `--chunk-tokens`,
replies of `--decode-tokens`). Then the next turn (a new user chunk of `--followup-tokens`,
the same prompt every time) is timed three ways, interleaved per repeat:
  ram  - the bank that holds the conversation in RAM;
  ssd  - after a restart: engine stopped, bank closed (queued SSD writes finished), the
         block files dropped from the OS page cache (posix_fadvise, per file, so the read
         really comes from the disk; `--keep-page-cache` skips it), a new Bank opened over
         the same directory; the lookup restores the history from the block files (checked
         with the bank's restore counters);
  cold - a fresh salt, so nothing is reused: a full prefill of the whole prompt.
The client keeps token ids (`ChatConversation(exact=True)`): the stored history is then a
whole prefix of the next prompt, so the timed turns differ only in where the history comes
from. `--resend-text` re-encodes replies from text as an HTTP client would; then the
stored last reply matches only in part, and an SSD restore of a partly used segment
currently kills the engine thread (the bank reports more restored rows than it reuses,
and `Engine._cost` refuses a negative history).
Each ram/ssd run continues a fork of "conv" that is deleted afterwards (a cold run's own
session likewise), and queued SSD writes are flushed between runs, so every repeat starts
from the same stored state and no background write overlaps a measurement. TTFT is
submit -> first token (so it includes the lookup and any SSD restore); decode step and
peak memory are reported too. Greedy tokens of every run must be identical.

Run (full, embedded model):
    python bench/resume.py --json-out bench/out/resume_embedded.json
The JSON report goes to stdout (and --json-out); progress goes to stderr. Exit code 1 when
a measurement is invalid (tokens differ, history not reused, or nothing restored from SSD).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    MODELS,
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
    ratio,
    run_turn,
    start_engine,
    summarize,
)
from segserve.bank import Bank  # noqa: E402
from segserve.server.engine import Engine  # noqa: E402
from segserve.server.runner import LoadedModel  # noqa: E402

T = TypeVar("T")
SESSION = "conv"
FULL: dict[str, Any] = {
    "model": "embedded", "tokens": 6000, "repeats": 3, "warmup": 1, "decode_tokens": 16,
    "followup_tokens": 128, "chunk_tokens": 512, "prefill_chunk": 256,
}
# Smoke: a tiny random model and a few hundred tokens, for tests/test_bench_smoke.py.
SMOKE: dict[str, Any] = {
    "model": "tiny", "tokens": 160, "repeats": 2, "warmup": 1, "decode_tokens": 4,
    "followup_tokens": 16, "chunk_tokens": 48, "prefill_chunk": 32,
}


@dataclass(frozen=True, slots=True)
class Config:
    model: str
    tokens: int
    repeats: int
    warmup: int
    decode_tokens: int
    followup_tokens: int
    chunk_tokens: int
    prefill_chunk: int
    segmented: bool
    bank_bytes: int
    bank_dir: str | None
    drop_page_cache: bool
    resend_text: bool
    smoke: bool
    json_out: str | None


@dataclass(eq=False)
class Server:
    """An engine and its bank over one SSD directory; `restart()` is a server restart."""

    loaded: LoadedModel
    cfg: Config
    root: Path
    store: Bank = field(init=False)
    engine: Engine = field(init=False)

    def __post_init__(self) -> None:
        self.open()

    def open(self) -> None:
        self.store = bank_store(self.loaded, self.cfg.bank_bytes, self.root)
        self.engine = start_engine(self.loaded, self.store, segmented=self.cfg.segmented,
                                   prefill_chunk=self.cfg.prefill_chunk)

    def close(self) -> None:
        self.engine.stop()
        lost = self.store.close(timeout=300.0)  # waits for queued SSD writes
        if lost:
            log(f"warning: {lost} queued SSD writes were lost at close")

    def restart(self) -> int:
        """Close, drop the block files from the page cache, reopen; returns files dropped."""
        self.close()
        dropped = drop_page_cache(self.root) if self.cfg.drop_page_cache else 0
        self.open()
        return dropped

    def on_bank(self, fn: Callable[[Bank], T]) -> T:
        """`fn(bank)` on the engine thread (the bank is engine-thread only)."""
        bank = self.store
        return on_engine(self.engine, lambda: fn(bank))

    def flush(self) -> None:
        """Wait for queued SSD writes, so that none overlaps the next measurement."""
        self.on_bank(lambda b: b.flush(300.0))

    def ssd_restores(self) -> int:
        return int(self.engine.bank_state().get("restores_by_tier", {}).get("ssd", 0))


def drop_page_cache(root: Path) -> int:
    """Ask the kernel to drop the cached pages of every block file (they were fsynced by
    the bank's writer, so the pages are clean and can go). Per file: harmless to others."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    n = 0
    for path in root.rglob("*.blk"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def parse_args(argv: Sequence[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, help="embedded | random8l | tiny")
    p.add_argument("--tokens", type=int, help="conversation length to resume, in tokens")
    p.add_argument("--repeats", type=int, help="measured runs per way of resuming")
    p.add_argument("--warmup", type=int, help="unmeasured ram + ssd rounds first")
    p.add_argument("--decode-tokens", type=int, help="tokens decoded per turn")
    p.add_argument("--followup-tokens", type=int, help="new user tokens of the resumed turn")
    p.add_argument("--chunk-tokens", type=int, help="user tokens per turn while growing")
    p.add_argument("--prefill-chunk", type=int, help="engine prefill chunk (server default)")
    p.add_argument("--kv", choices=("segmented", "stock"), default="segmented")
    p.add_argument("--bank-gib", type=float, default=8.0, help="RAM cap of the bank")
    p.add_argument("--bank-dir", help="SSD tier directory (default: a temporary one)")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="do not drop the block files from the page cache before ssd runs")
    p.add_argument("--resend-text", action="store_true",
                   help="resend replies as re-encoded text (see the module docstring)")
    p.add_argument("--json-out", help="also write the JSON report here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for the smoke test)")
    a = p.parse_args(argv)
    base = SMOKE if a.smoke else FULL
    v = {k: getattr(a, k) if getattr(a, k) is not None else d for k, d in base.items()}
    if v["repeats"] < 1 or v["decode_tokens"] < 2 or v["tokens"] <= v["followup_tokens"]:
        p.error("need --repeats >= 1, --decode-tokens >= 2 and --tokens > --followup-tokens")
    return Config(str(v["model"]), int(v["tokens"]), int(v["repeats"]), int(v["warmup"]),
                  int(v["decode_tokens"]), int(v["followup_tokens"]), int(v["chunk_tokens"]),
                  int(v["prefill_chunk"]), a.kv == "segmented", int(a.bank_gib * (1 << 30)),
                  a.bank_dir, not a.keep_page_cache, bool(a.resend_text), bool(a.smoke),
                  a.json_out)


def _resumed(srv: Server, prompt: list[int], tag: str) -> TurnResult:
    """The next turn of a fork of the conversation; the fork goes afterwards."""
    fork = srv.on_bank(lambda b: b.fork(SESSION, new_id=f"{SESSION}-{tag}"))
    res = run_turn(srv.engine, greedy(prompt, srv.cfg.decode_tokens, tag, session_id=fork))
    srv.on_bank(lambda b: b.delete(fork))
    srv.flush()
    return res


def _cold(srv: Server, prompt: list[int], tag: str) -> TurnResult:
    salt = f"cold-{tag}"  # a new tenant scope: nothing stored is visible
    res = run_turn(srv.engine, greedy(prompt, srv.cfg.decode_tokens, tag, salt=salt))
    sid = res.session_id
    if sid is not None:
        srv.on_bank(lambda b: b.delete(sid, salt))
    srv.flush()
    return res


def _round(srv: Server, prompt: list[int], rep: int, out: dict[str, list[Any]],
           cold: bool) -> None:
    # From the second round on, "ram" runs on the bank the previous ssd run reopened: the
    # history it restored is in RAM again, as on a server that resumed it once.
    out["ram"].append(_resumed(srv, prompt, f"ram{rep}"))
    dropped = srv.restart()
    before = srv.ssd_restores()
    out["ssd"].append(_resumed(srv, prompt, f"ssd{rep}"))
    out["restored"].append(srv.ssd_restores() - before)
    out["dropped"].append(dropped)
    if cold:
        out["cold"].append(_cold(srv, prompt, f"{rep}"))


def _new_out() -> dict[str, list[Any]]:
    return {"ram": [], "ssd": [], "cold": [], "restored": [], "dropped": []}


def _build(srv: Server, cfg: Config) -> tuple[list[int], int]:
    """Grow the conversation; returns the resumed turn's prompt and the history length."""
    conv = new_conversation(srv.loaded, exact=not cfg.resend_text)

    def step(prompt: list[int]) -> list[int]:
        req = greedy(prompt, cfg.decode_tokens, "grow", session_id=SESSION)
        return run_turn(srv.engine, req).tokens

    # Reserve room for the resumed turn's user chunk and the last growth reply after it.
    history = grow_to(conv, cfg.tokens, chunk=cfg.chunk_tokens,
                      reserve=cfg.followup_tokens + cfg.decode_tokens, step=step, label="grow")
    srv.flush()
    prompt = conv.prompt(conv.user(cfg.followup_tokens, "resume"))
    return prompt, history or 0


def _report(prompt: list[int], history: int, out: dict[str, list[Any]]) -> dict[str, Any]:
    ram, ssd, cold = summarize(out["ram"]), summarize(out["ssd"]), summarize(out["cold"])
    every: list[TurnResult] = out["ram"] + out["ssd"] + out["cold"]
    warm = out["ram"] + out["ssd"]
    return {
        "conversation": {
            "history_tokens": history,  # the last stored prompt: what ram/ssd runs must reuse
            "prompt_tokens": len(prompt),
            "new_tokens_when_resumed": len(prompt) - min(r.cached_tokens for r in warm),
        },
        "ram": ram,
        "ssd": {**ssd, "restored_segments": out["restored"],
                "page_cache_dropped_files": out["dropped"]},
        "cold": cold,
        "ratios_ttft": {"ssd_over_ram": ratio(ssd["ttft_s"], ram["ttft_s"]),
                        "cold_over_ram": ratio(cold["ttft_s"], ram["ttft_s"]),
                        "cold_over_ssd": ratio(cold["ttft_s"], ssd["ttft_s"])},
        "greedy_identical": all(r.tokens == every[0].tokens for r in every),
        "history_reused": all(r.cached_tokens >= history for r in warm)
        and all(r.cached_tokens == 0 for r in out["cold"]),
        "ssd_restored": all(n > 0 for n in out["restored"]),
    }


def run(cfg: Config) -> dict[str, Any]:
    loaded = load_bench_model(cfg.model)
    if cfg.tokens + cfg.decode_tokens > loaded.context_length:
        raise SystemExit(f"--tokens {cfg.tokens} exceeds the model context")
    route = bench_route(loaded)[0] if cfg.segmented else "mlx-lm sdpa"
    if cfg.bank_dir and Path(cfg.bank_dir).exists() and any(Path(cfg.bank_dir).iterdir()):
        # A stored "conv" from another run would be continued, not rebuilt.
        raise SystemExit(f"--bank-dir {cfg.bank_dir} must be new or empty")
    with tempfile.TemporaryDirectory(prefix="segserve-resume-") as tmp:
        srv = Server(loaded, cfg, Path(cfg.bank_dir or tmp))
        try:
            prompt, history = _build(srv, cfg)
            for rep in range(cfg.warmup):  # compiled graphs, first-use costs: not measured
                _round(srv, prompt, -1 - rep, _new_out(), cold=False)
            out = _new_out()
            for rep in range(cfg.repeats):
                log(f"resume round {rep + 1}/{cfg.repeats} at {len(prompt)} tokens")
                _round(srv, prompt, rep, out, cold=True)
        finally:
            srv.close()
    return {"bench": "resume", "model": model_info(loaded, route),
            "config": asdict(cfg), **_report(prompt, history, out)}


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    report = run(cfg)
    emit_json(report, cfg.json_out)
    ok = report["greedy_identical"] and report["history_reused"] and report["ssd_restored"]
    if not ok:
        log("invalid measurement: tokens differ, history not reused or no SSD restore")
    return 0 if ok else 1


if __name__ == "__main__":
    exit_now(main())
