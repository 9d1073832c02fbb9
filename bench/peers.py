"""segserve against mlx-lm's own server on the same weights, same workloads, one run.

The peer is `python -m mlx_lm.server` on the directory `segserve convert` writes from the
embedded GGUF (same 4-bit weights; segserve dequantizes them to float32 on CPU by default,
which is part of what is compared). The servers run one after the other, never together,
so they do not share the CPU; each is started on a free loopback port, warmed up with one
tiny request (mlx_lm.server loads its model lazily) and always stopped at the end.

Workloads, per server:
  (b) conversation: `--turns` turns, resending the whole history every turn as OpenAI
      clients do (no session id). Turn 0 is a ~`--prompt-tokens` document; later turns
      add ~`--turn-tokens` of new notes. Per turn: TTFT, decode tok/s, prompt tokens
      actually processed (prompt_tokens - usage.prompt_tokens_details.cached_tokens, or
      "not reported"), and the server's resident memory (VmRSS) after the turn.
  (a) single prompt: turn 0 of that conversation is the cold ~1,500-token prompt; its TTFT
      and decode tok/s are reported on their own (a separate request would cost the slow
      peer another full prefill and measure the same thing).
  (c) concurrency: `--users` conversations of `--concurrent-turns` turns at once
      (asyncio + httpx); aggregate completion tokens / wall seconds, and errors.
Ratios are segserve / mlx_lm for every figure (TTFT below 1 and tok/s above 1 favour
segserve). JSON on stdout (and `--json-out`), progress on stderr, `--plot` writes a PNG of
TTFT and RSS per turn. Every request has a timeout (`--timeout`) and each server a total
time bound (`--max-seconds`); requests past the bound are recorded as skipped.
Run from the repository root: `python bench/peers.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import servers
from speed import (
    StreamResult,
    log,
    median,
    nonce,
    notes_document,
    prompt_messages,
    stream_chat,
    warm_up,
)

NOT_REPORTED = "not reported"
SERVERS = ("segserve", "mlx_lm")


@dataclass(frozen=True, slots=True)
class Budget:
    """A per-server deadline: each request gets min(--timeout, time left)."""

    deadline: float
    per_request_s: float

    def next_timeout(self) -> float | None:
        left = self.deadline - time.monotonic()
        return min(self.per_request_s, left) if left > 1 else None


def follow_up_text(turn: int, tokens: int) -> str:
    notes = notes_document(tokens, f"peers-turn-{turn}")
    return f"Here are more notes (part {turn + 1}).\n{notes}\nExplain these notes in detail too."


async def _turn(client: httpx.AsyncClient, base: str, msgs: list[dict[str, str]],
                salt: str, args: argparse.Namespace, budget: Budget) -> StreamResult:
    timeout = budget.next_timeout()
    if timeout is None:
        return StreamResult(error="skipped: --max-seconds reached")
    return await stream_chat(client, base, msgs, max_tokens=args.max_tokens,
                             timeout_s=timeout, salt=salt)


def turn_record(turn: int, res: StreamResult, rss: int | None) -> dict[str, Any]:
    processed = res.processed_tokens
    return {
        "turn": turn, "status": res.status, "error": res.error, "ttft_s": res.ttft_s,
        "decode_tok_s": res.decode_tok_s, "completion_tokens": res.completion_tokens,
        "prompt_tokens": res.prompt_tokens,
        "cached_tokens": NOT_REPORTED if res.cached_tokens is None else res.cached_tokens,
        "prompt_tokens_processed": NOT_REPORTED if processed is None else processed,
        "total_s": res.total_s, "rss_bytes": rss,
    }


async def conversation(client: httpx.AsyncClient, srv: servers.ManagedServer,
                       args: argparse.Namespace, budget: Budget) -> list[dict[str, Any]]:
    """Workload (b): one growing conversation; a failed turn is dropped from the history."""
    salt = nonce()
    msgs = prompt_messages("long", salt, args.prompt_tokens)
    records: list[dict[str, Any]] = []
    for turn in range(args.turns):
        if turn:
            msgs.append({"role": "user", "content": follow_up_text(turn, args.turn_tokens)})
        res = await _turn(client, srv.base_url, list(msgs), salt, args, budget)
        records.append(turn_record(turn, res, srv.rss_bytes()))
        log(f"{srv.name} turn {turn}: ttft {res.ttft_s} s, prompt {res.prompt_tokens}, "
            f"cached {res.cached_tokens}, {res.completion_tokens} tokens {res.error or ''}")
        if res.ok:
            msgs.append({"role": "assistant", "content": res.text})
        elif turn:
            msgs.pop()
        else:
            break  # without turn 0 there is no conversation to continue
    return records


async def _user(client: httpx.AsyncClient, base: str, user: int, args: argparse.Namespace,
                budget: Budget) -> list[StreamResult]:
    salt = nonce()
    msgs = prompt_messages("long", salt, args.concurrent_prompt_tokens)
    out: list[StreamResult] = []
    for turn in range(args.concurrent_turns):
        if turn:
            msgs.append({"role": "user",
                         "content": follow_up_text(100 * user + turn, args.turn_tokens)})
        res = await _turn(client, base, list(msgs), salt, args, budget)
        out.append(res)
        if res.ok:
            msgs.append({"role": "assistant", "content": res.text})
        elif turn:
            msgs.pop()
    return out


async def concurrent(client: httpx.AsyncClient, srv: servers.ManagedServer,
                     args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """Workload (c): `--users` conversations at once; aggregate tok/s over the wall time."""
    t0 = time.perf_counter()
    per_user = await asyncio.gather(*(_user(client, srv.base_url, u, args, budget)
                                      for u in range(args.users)))
    wall = time.perf_counter() - t0
    results = [r for rs in per_user for r in rs]
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    log(f"{srv.name} concurrent: {tokens} tokens in {wall:.1f} s, "
        f"{len(results) - len(ok)} errors")
    return {
        "users": args.users, "turns_per_user": args.concurrent_turns,
        "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "error_messages": sorted({str(r.error) for r in results if not r.ok})[:10],
        "completion_tokens": tokens, "wall_s": wall,
        "aggregate_tok_s": tokens / wall if wall > 0 else None,
        "ttft_s_median": median([r.ttft_s for r in ok]),
        "rss_bytes_after": srv.rss_bytes(),
    }


def single_prompt(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Workload (a), read from turn 0 of the conversation."""
    if not turns:
        return {"error": "no turn ran"}
    t0 = turns[0]
    keys = ("status", "error", "ttft_s", "decode_tok_s", "prompt_tokens", "completion_tokens")
    return {k: t0[k] for k in keys}


async def _workloads(srv: servers.ManagedServer, args: argparse.Namespace) -> dict[str, Any]:
    budget = Budget(time.monotonic() + args.max_seconds, args.timeout)
    limits = httpx.Limits(max_connections=args.users + 1)
    # trust_env=False: an HTTP(S)_PROXY in the environment must not capture loopback traffic.
    async with httpx.AsyncClient(trust_env=False, timeout=args.timeout, limits=limits) as c:
        warm = await warm_up(c, srv.base_url, args.timeout)
        rss_idle = srv.rss_bytes()
        turns = await conversation(c, srv, args, budget)
        conc = await concurrent(c, srv, args, budget) if args.users else None
    return {"warmup": warm, "rss_bytes_after_warmup": rss_idle,
            "single_prompt": single_prompt(turns), "conversation": turns,
            "concurrent": conc, "peak_rss_bytes": srv.peak_rss_bytes()}


def measure(name: str, argv: list[str], env: dict[str, str],
            args: argparse.Namespace) -> dict[str, Any]:
    log(f"starting {name}: {' '.join(argv)}")
    t0 = time.monotonic()
    with servers.running_server(name, argv, env=env,
                                startup_timeout_s=args.startup_timeout) as srv:
        report = asyncio.run(_workloads(srv, args))
    report["wall_s"] = time.monotonic() - t0
    report["command"] = argv
    return report


def _ratio(a: Any, b: Any) -> float | None:
    ok = isinstance(a, int | float) and isinstance(b, int | float)
    return a / b if ok and b else None


def _dig(report: dict[str, Any], *path: str | int) -> Any:
    cur: Any = report
    for key in path:
        try:
            cur = cur[key]
        except (KeyError, IndexError, TypeError):
            return None
    return cur


def ratios(seg: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """segserve / mlx_lm, figure by figure; None where either side has no number."""
    n = max(len(seg.get("conversation") or []), len(peer.get("conversation") or []))

    def per_turn(key: str) -> list[float | None]:
        return [_ratio(_dig(seg, "conversation", i, key), _dig(peer, "conversation", i, key))
                for i in range(n)]

    def follow_ttft(r: dict[str, Any]) -> float | None:
        m: float | None = median([t["ttft_s"] for t in (r.get("conversation") or [])[1:]])
        return m

    return {
        "single_prompt_ttft_s": _ratio(_dig(seg, "single_prompt", "ttft_s"),
                                       _dig(peer, "single_prompt", "ttft_s")),
        "single_prompt_decode_tok_s": _ratio(_dig(seg, "single_prompt", "decode_tok_s"),
                                             _dig(peer, "single_prompt", "decode_tok_s")),
        "conversation_ttft_s_per_turn": per_turn("ttft_s"),
        "conversation_rss_bytes_per_turn": per_turn("rss_bytes"),
        "conversation_follow_up_ttft_s_median": _ratio(follow_ttft(seg), follow_ttft(peer)),
        "concurrent_aggregate_tok_s": _ratio(_dig(seg, "concurrent", "aggregate_tok_s"),
                                             _dig(peer, "concurrent", "aggregate_tok_s")),
        "peak_rss_bytes": _ratio(seg.get("peak_rss_bytes"), peer.get("peak_rss_bytes")),
    }


def write_plot(path: str, reports: dict[str, dict[str, Any]]) -> None:
    """Two panels: TTFT per turn (log scale: the peers differ by orders) and RSS per turn."""
    from matplotlib.figure import Figure  # lazy, and no pyplot global state
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_ttft, ax_rss = fig.subplots(1, 2)
    for name, rep in reports.items():
        turns = rep.get("conversation") or []
        xs = [t["turn"] for t in turns if t["ttft_s"] is not None]
        ax_ttft.plot(xs, [t["ttft_s"] for t in turns if t["ttft_s"] is not None],
                     marker="o", label=name)
        xr = [t["turn"] for t in turns if t["rss_bytes"] is not None]
        ax_rss.plot(xr, [t["rss_bytes"] / 2**20 for t in turns if t["rss_bytes"] is not None],
                    marker="o", label=name)
    ax_ttft.set_yscale("log")
    ax_ttft.set(title="time to first token per turn", xlabel="turn", ylabel="TTFT (s)")
    ax_rss.set(title="server resident memory after each turn", xlabel="turn",
               ylabel="RSS (MiB)")
    for ax in (ax_ttft, ax_rss):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # turns are whole numbers
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = SERVERS if args.only == "both" else (args.only,)
    reports: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="segserve-peers-") as tmp:
        starters: dict[str, Callable[[], tuple[list[str], dict[str, str]]]] = {
            "segserve": lambda: (servers.segserve_argv(servers.free_loopback_port()), {}),
            "mlx_lm": lambda: (servers.mlx_lm_argv(_mlx_model(args, tmp),
                                                   servers.free_loopback_port()),
                               servers.blas_env()),
        }
        for name in names:
            argv, env = starters[name]()
            reports[name] = measure(name, argv, env, args)
    out: dict[str, Any] = {"config": vars(args), **reports}
    if len(reports) == 2:
        out["ratios_segserve_over_mlx_lm"] = ratios(reports["segserve"], reports["mlx_lm"])
    return out


def _mlx_model(args: argparse.Namespace, tmp: str) -> str:
    if args.mlx_lm_model:
        return str(args.mlx_lm_model)
    out = f"{tmp}/model"
    log(f"segserve convert {out}")
    servers.convert_model(out)
    return out


def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=("segserve", "mlx_lm", "both"), default="both")
    p.add_argument("--turns", type=_positive(int), default=8)
    p.add_argument("--prompt-tokens", type=_positive(int), default=1500,
                   help="size of turn 0 (the single-prompt workload)")
    p.add_argument("--turn-tokens", type=_positive(int), default=100,
                   help="new user tokens per later turn")
    p.add_argument("--max-tokens", type=_positive(int), default=64)
    p.add_argument("--users", type=int, default=4, help="concurrent conversations (0: skip)")
    p.add_argument("--concurrent-turns", type=_positive(int), default=2)
    p.add_argument("--concurrent-prompt-tokens", type=_positive(int), default=200)
    p.add_argument("--timeout", type=_positive(float), default=600.0,
                   help="seconds per request")
    p.add_argument("--max-seconds", type=_positive(float), default=1800.0,
                   help="time bound per server for all its requests")
    p.add_argument("--startup-timeout", type=_positive(float), default=300.0)
    p.add_argument("--mlx-lm-model", help="existing mlx-lm directory (skip segserve convert)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny: ~60-token prompts, 2 turns, max_tokens 4, 1 concurrent turn")
    p.add_argument("--json-out", help="also write the JSON report here")
    p.add_argument("--plot", metavar="PATH.png", help="write TTFT and RSS per turn")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servers.exit_on_sigterm()
    if args.smoke:
        args.turns, args.max_tokens, args.concurrent_turns = 2, 4, 1
        args.prompt_tokens = args.concurrent_prompt_tokens = 60
        args.turn_tokens = 20
    try:
        report = run(args)
    except servers.ServerError as exc:
        print(f"peers: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    if args.plot:
        write_plot(args.plot, {k: report[k] for k in SERVERS if k in report})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
