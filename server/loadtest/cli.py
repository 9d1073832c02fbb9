"""`segserve loadtest`: flags, the run (or the segmented / stock comparison), the outputs.

stdout carries only the report: the percentiles table then the JSON (`--json`: the JSON
alone; `--json-out FILE`: the JSON goes to FILE instead). Progress goes to stderr. Exit
code 0 when the load ran (failed requests are in the report), 2 for a usage problem (bad
URL, no model, missing matplotlib, a --compare server that does not start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from segserve.server.loadtest.client import LoadTestError, base_url
from segserve.server.loadtest.compare import compare
from segserve.server.loadtest.plot import check_matplotlib, write_plot
from segserve.server.loadtest.report import format_table, jsonl_lines, ratios, summarize
from segserve.server.loadtest.runner import LoadConfig, Progress, RunResult, run_load
from segserve.server.loadtest.workload import MODES

DESCRIPTION = (
    "Multi-turn load test for any OpenAI-compatible chat server (/v1/chat/completions with "
    "streaming). Simulated users each hold a conversation and resend its whole history "
    "every turn; reports TTFT, inter-token latency, end-to-end latency and per-request "
    "output tokens/s percentiles (p50/p90/p95/p99) and errors by HTTP status."
)


def _bounded(kind: type[int] | type[float], lo: float, hi: float) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text!r} is outside [{lo:g}, {hi:g}]")
        return value
    return parse


# The flags that shape the conversations; `workload_argv` writes them back in this order.
WORKLOAD_FLAGS = ("users", "turns", "conversation", "max_tokens", "words_per_turn", "max_seconds")


def add_workload_flags(
    parser: argparse._ActionsContainer, *, users: int = 4, turns: int = 6, max_tokens: int = 48,
    words_per_turn: int = 200, max_seconds: float = 600.0,
) -> None:
    """Add WORKLOAD_FLAGS with these defaults: `segserve loadtest`'s own, and those of a
    driver that runs it (bench/replicas.py), so their names, bounds and help cannot drift."""
    parser.add_argument("--users", metavar="N", type=_bounded(int, 1, 10_000), default=users,
                        help="conversations; closed loop: users at once (default %(default)s)")
    parser.add_argument("--turns", metavar="N", type=_bounded(int, 1, 10_000), default=turns,
                        help="turns per conversation; users x turns requests in all "
                             "(default %(default)s)")
    parser.add_argument("--conversation", choices=MODES, default="history",
                        help="history: resend the whole history, no session id (what OpenAI "
                             "clients do); session: the same plus an X-Session-Id per "
                             "conversation (segserve's bank hint) (default %(default)s)")
    parser.add_argument("--max-tokens", metavar="N", type=_bounded(int, 1, 1_000_000),
                        default=max_tokens, help="max_tokens of every request (default %(default)s)")
    parser.add_argument("--words-per-turn", metavar="N", type=_bounded(int, 1, 1_000_000),
                        default=words_per_turn,
                        help="words in each user message (default %(default)s)")
    parser.add_argument("--max-seconds", metavar="S", type=_bounded(float, 0.1, 86_400),
                        default=max_seconds,
                        help="hard bound on the run; requests still in flight are cut and "
                             "reported as client_deadline (default %(default)s)")


def workload_argv(args: argparse.Namespace) -> list[str]:
    """`segserve loadtest` flags repeating the workload that `add_workload_flags` parsed."""
    return [a for dest in WORKLOAD_FLAGS
            for a in ("--" + dest.replace("_", "-"), str(getattr(args, dest)))]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="segserve loadtest", description=DESCRIPTION)
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL, any host (a trailing /v1 is accepted; "
                        "default %(default)s)")
    t.add_argument("--api-key", metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY' (visible in ps: prefer "
                        "--api-key-file)")
    t.add_argument("--api-key-file", metavar="FILE",
                   help="read the API key from the first line of FILE")
    t.add_argument("--model", metavar="NAME",
                   help="model to request (default: the first id from GET /v1/models)")
    w = p.add_argument_group("workload")
    add_workload_flags(w)
    w.add_argument("--rate", type=_bounded(float, 1e-6, 1e6), metavar="REQ_PER_S",
                   help="open loop: send requests at Poisson arrivals of this mean rate "
                        "whatever the server's state (default: closed loop, each user sends "
                        "its next turn when the previous answer ends)")
    w.add_argument("--temperature", metavar="T", type=_bounded(float, 0, 2), default=0.0,
                   help="sampling temperature (default %(default)s: greedy)")
    w.add_argument("--seed", metavar="N", type=int, default=0,
                   help="seed of the user text and of the arrival times (default %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print only the JSON report on stdout (no table)")
    o.add_argument("--json-out", metavar="FILE",
                   help="write the JSON report to FILE (stdout then shows the table only)")
    o.add_argument("--jsonl", metavar="FILE",
                   help="write one JSON record per request to FILE (times, tokens, status, "
                        "error, inter-token gaps)")
    o.add_argument("--plot", metavar="FILE.png",
                   help="plot TTFT over time and server memory over time (needs matplotlib)")
    o.add_argument("--metrics-interval", type=_bounded(float, 0, 3600), default=1.0,
                   metavar="S",
                   help="sample the server's /metrics for memory every S seconds during the "
                        "run, if it has one (0: off; default %(default)s)")
    o.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr")
    c = p.add_argument_group("segmented against stock (segserve only)")
    c.add_argument("--compare", action="store_true",
                   help="start --server-cmd twice, with SEGSERVE_SEGMENTED_KV=1 then =0, run "
                        "the same load against each and report both with ratios (--url is "
                        "ignored)")
    c.add_argument("--server-cmd", metavar="CMD", default="segserve serve",
                   help="server command for --compare; {port} is substituted if present, "
                        "else --host 127.0.0.1 --port N is appended (default %(default)r)")
    c.add_argument("--bank-max-bytes", metavar="SIZE",
                   help="SEGSERVE_BANK_MAX_BYTES for both --compare servers")
    c.add_argument("--startup-timeout", type=_bounded(float, 1, 3600), default=300.0,
                   metavar="S",
                   help="seconds to wait for each --compare server's /health "
                        "(default %(default)s)")
    return p


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key and args.api_key_file:
        raise LoadTestError("--api-key and --api-key-file: pass one")
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as exc:
            raise LoadTestError(f"--api-key-file {args.api_key_file!r}: {exc.strerror}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise LoadTestError(f"--api-key-file {args.api_key_file!r} is empty")
        return key
    return str(args.api_key) if args.api_key else None


def _config(args: argparse.Namespace, url: str) -> LoadConfig:
    return LoadConfig(
        url=url, users=args.users, turns=args.turns, max_tokens=args.max_tokens,
        words_per_turn=args.words_per_turn, max_seconds=args.max_seconds, seed=args.seed,
        model=args.model, rate=args.rate, conversation=args.conversation,
        temperature=args.temperature, metrics_interval=args.metrics_interval,
    )


def _run(args: argparse.Namespace) -> dict[str, tuple[LoadConfig, RunResult]]:
    key = _api_key(args)
    if args.plot:
        check_matplotlib()  # before the load, not after it
    if args.compare:
        return compare(_config(args, args.url), args.server_cmd, args.bank_max_bytes,
                       args.startup_timeout, key, progress=not args.no_progress)
    cfg = _config(args, base_url(args.url))  # a bad URL fails before any output
    bar = Progress(cfg.total_requests, enabled=not args.no_progress)
    return {"run": (cfg, asyncio.run(run_load(cfg, key, bar)))}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runs = _run(args)
    except LoadTestError as exc:
        print(f"segserve loadtest: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("segserve loadtest: interrupted", file=sys.stderr)
        return 130
    reports = {label: summarize(result, cfg) for label, (cfg, result) in runs.items()}
    out: dict[str, Any] = reports["run"] if "run" in reports else {
        **reports, "ratios": ratios(reports["segmented"], reports["stock"])}
    if args.jsonl:
        with open(args.jsonl, "w") as fh:
            for label, (_, result) in runs.items():
                for line in jsonl_lines(label, result.records):
                    fh.write(line + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        write_plot(args.plot, {label: result for label, (_, result) in runs.items()})
    if not args.json:
        print(format_table(reports))
    if args.json or not args.json_out:
        print(json.dumps(out, indent=2))
    return 0
