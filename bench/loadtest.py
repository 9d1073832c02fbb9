"""Long-conversation load test for an OpenAI-compatible chat server (`segserve loadtest`).

Owns: simulated users, per-request measurements, the JSON report, the PNG plot, and the
A/B mode that starts the server twice (segmented KV on, then off) and compares the runs.

Each of N users holds one conversation of T turns and resends the full history every turn,
as OpenAI clients do (no `X-Session-Id`), so context grows turn by turn and the server must
find the reused prefix itself. User text is deterministic per (seed, user, turn). A failed
turn is dropped from that user's history and the next turn goes on; there are no retries,
so the request count is exactly users * turns unless the time bound cuts it short.

Invariants: only loopback URLs are ever contacted (this tool generates load; it must not be
pointed at someone else's host by a typo); the run stops by itself after `--max-seconds`;
stdout carries only the report (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import IO, Any
from urllib.parse import urlsplit

import httpx

_WORDS = (
    "memory segment tail snapshot river mountain lantern copper garden window violet "
    "harbor engine signal orbit ladder meadow thunder pocket silver marble canyon falcon "
    "compass winter quartz timber ember saddle beacon glacier velvet anchor cobalt prairie"
).split()


class LoadTestError(Exception):
    """A problem the user must fix (bad URL, server that does not start); exit code 2."""


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str
    users: int
    turns: int
    max_tokens: int
    words_per_turn: int
    max_seconds: float
    seed: int = 0


@dataclass(slots=True)
class RequestResult:
    user: int
    turn: int
    start_s: float  # since the run started
    status: int = 0  # HTTP status; 0 when no response arrived
    ttft_s: float | None = None
    duration_s: float = 0.0
    tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_code is None


def check_loopback_url(url: str) -> str:
    """Return the base URL (no trailing `/` or `/v1`) or raise LoadTestError if not loopback."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise LoadTestError(f"--url {url!r}: expected http://HOST:PORT")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise LoadTestError(
                f"--url {url!r}: refusing non-loopback host {host!r}; the load test only "
                f"targets 127.0.0.0/8, localhost or ::1"
            )
    return url.rstrip("/").removesuffix("/v1")


def user_text(seed: int, user: int, turn: int, words: int) -> str:
    # A str seed hashes with SHA-512, so the text is the same in every process and run.
    rng = random.Random(f"{seed}/{user}/{turn}")
    return f"User {user}, turn {turn}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def parse_metric(text: str, name: str, labels: dict[str, str]) -> float | None:
    """First sample of `name` whose labels include `labels`, from Prometheus text; else None."""
    sample = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
    label = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        match = sample.match(line.strip())
        if line.startswith("#") or match is None or match.group(1) != name:
            continue
        found = dict(label.findall(match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            try:
                return float(match.group(3))
            except ValueError:
                return None
    return None


def _set_error(rec: RequestResult, error: object) -> None:
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        rec.error_code = str(code) if code is not None else "unknown"
        rec.error_message = str(error.get("message", ""))[:300]
    else:
        rec.error_code, rec.error_message = "unknown", str(error)[:300]


def _apply_chunk(rec: RequestResult, chunk: dict[str, Any], parts: list[str], t0: float) -> None:
    if "error" in chunk:  # a mid-stream failure: the status is already 200
        _set_error(rec, chunk["error"])
        return
    for choice in chunk.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            if rec.ttft_s is None:
                rec.ttft_s = time.perf_counter() - t0
            parts.append(piece)
            rec.tokens += 1
    usage = chunk.get("usage")
    if usage:
        rec.tokens = int(usage.get("completion_tokens", rec.tokens))
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def _stream_turn(
    client: httpx.AsyncClient, base: str, messages: list[dict[str, str]],
    cfg: LoadConfig, rec: RequestResult, t0: float,
) -> str:
    body = {
        "model": "default", "messages": messages, "max_tokens": cfg.max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            raw = await resp.aread()
            try:
                _set_error(rec, json.loads(raw).get("error"))
            except (ValueError, AttributeError):
                _set_error(rec, raw.decode("utf-8", "replace"))
            return ""
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError(f"SSE data is not a JSON object: {data[:80]!r}")
            _apply_chunk(rec, chunk, parts, t0)
    return "".join(parts)


class Progress:
    """A one-line text bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self, total: int, stream: IO[str] | None = None) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = self.last = time.perf_counter()

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.perf_counter()
        if now - self.last >= 0.2 or self.done == self.total:
            self.last = now
            filled = 30 * self.done // max(self.total, 1)
            self.stream.write(
                f"\rloadtest [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
                f" failed {self.failed}  {now - self.t0:.1f}s"
            )
            self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


async def _user(
    client: httpx.AsyncClient, base: str, cfg: LoadConfig, user: int,
    results: list[RequestResult], clock: tuple[float, float], progress: Progress,
) -> None:
    run_t0, deadline = clock
    messages: list[dict[str, str]] = []
    for turn in range(cfg.turns):
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        messages.append({"role": "user", "content": user_text(cfg.seed, user, turn,
                                                              cfg.words_per_turn)})
        t0 = time.perf_counter()
        rec = RequestResult(user, turn, start_s=t0 - run_t0)
        reply = ""
        try:
            reply = await asyncio.wait_for(
                _stream_turn(client, base, list(messages), cfg, rec, t0), timeout=remaining
            )
        except asyncio.TimeoutError:
            rec.error_code = "client_deadline"
        except (httpx.HTTPError, ValueError) as exc:  # transport failure or malformed stream
            rec.error_code, rec.error_message = type(exc).__name__, str(exc)[:300]
        rec.duration_s = time.perf_counter() - t0
        results.append(rec)
        progress.advance(rec.ok)
        if rec.ok:
            messages.append({"role": "assistant", "content": reply})
        else:
            messages.pop()  # the failed turn never happened in this conversation


@dataclass(frozen=True, slots=True)
class ServerSample:
    """What the server's /metrics said at the end of the load."""

    peak_bytes: int | None
    guard_interventions: dict[str, float]
    bank_evictions: dict[str, float]


def _sum_by_label(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    pat = re.compile(rf'^{re.escape(name)}\{{.*{label}="([^"]*)".*\}}\s+(\S+)')
    for line in text.splitlines():
        m = pat.match(line.strip())
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def server_sample(text: str) -> ServerSample:
    peak = parse_metric(text, "segserve_memory_bytes", {"kind": "peak"})
    return ServerSample(
        None if peak is None else int(peak),
        _sum_by_label(text, "segserve_guard_interventions_total", "reason"),
        _sum_by_label(text, "segserve_bank_evictions_total", "reason"),
    )


async def run_load(
    cfg: LoadConfig, progress: Progress | None = None
) -> tuple[list[RequestResult], float, ServerSample | None]:
    """Run the load; return (results in completion order, wall seconds, server sample)."""
    base = check_loopback_url(cfg.url)
    bar = progress if progress is not None else Progress(cfg.users * cfg.turns)
    results: list[RequestResult] = []
    # trust_env=False: an HTTP(S)_PROXY from the environment must not capture loopback traffic.
    limits = httpx.Limits(max_connections=cfg.users, max_keepalive_connections=cfg.users)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.max_seconds, trust_env=False) as c:
        t0 = time.perf_counter()
        clock = (t0, t0 + cfg.max_seconds)
        await asyncio.gather(*(
            _user(c, base, cfg, u, results, clock, bar) for u in range(cfg.users)
        ))
        wall = time.perf_counter() - t0
        bar.close()
        try:
            resp = await c.get(f"{base}/metrics", timeout=5.0)
            sample: ServerSample | None = server_sample(resp.text)
        except httpx.HTTPError:
            sample = None
    return results, wall, sample


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least p % of values <= it."""
    if not sorted_values:
        return None
    return sorted_values[max(math.ceil(p / 100 * len(sorted_values)), 1) - 1]


def summarize(
    results: list[RequestResult], wall_s: float, sample: ServerSample | None, cfg: LoadConfig
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    tokens = sum(r.tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    reasons = Counter((r.error_code, r.error_message) for r in results if r.status == 507)
    failures = Counter(f"{r.status} {r.error_code}" for r in results if not r.ok)
    return {
        "config": asdict(cfg),
        "requests": len(results),
        "completed": len(ok),
        "status_counts": dict(sorted(Counter(str(r.status) for r in results).items())),
        "failures": dict(sorted(failures.items())),
        "insufficient_memory_507": {
            "count": sum(reasons.values()),
            "reasons": [{"code": code, "message": msg, "count": n}
                        for (code, msg), n in reasons.most_common(20)],
        },
        "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_token_ratio": cached / prompt if prompt else None,
        "server_peak_memory_bytes": sample.peak_bytes if sample else None,
        "guard_interventions": sample.guard_interventions if sample else None,
        "bank_evictions": sample.bank_evictions if sample else None,
        "wall_s": wall_s,
    }


_TABLE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("requests", ("requests",)), ("completed", ("completed",)),
    ("HTTP 507", ("insufficient_memory_507", "count")),
    ("TTFT p50 s", ("ttft_s", "p50")), ("TTFT p95 s", ("ttft_s", "p95")),
    ("tokens/s", ("tokens_per_s",)), ("cached ratio", ("cached_token_ratio",)),
    ("peak bytes", ("server_peak_memory_bytes",)), ("wall s", ("wall_s",)),
)


def _get(report: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        report = report[key]
    return report


def ratios(seg: dict[str, Any], stock: dict[str, Any]) -> dict[str, float | None]:
    """segmented / stock for each table row; None when either side is missing or zero."""
    out: dict[str, float | None] = {}
    for label, path in _TABLE:
        a, b = _get(seg, path), _get(stock, path)
        out[label] = a / b if a is not None and b else None
    return out


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def format_table(reports: dict[str, dict[str, Any]]) -> str:
    names = list(reports)
    with_ratio = len(names) == 2
    head = ["metric", *names] + (["ratio"] if with_ratio else [])
    rows = [head]
    rat = ratios(reports[names[0]], reports[names[1]]) if with_ratio else {}
    for label, path in _TABLE:
        cells = [_get(reports[n], path) for n in names] + ([rat[label]] if with_ratio else [])
        rows.append([label] + [_cell(v) for v in cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


_COLORS = {200: "tab:green", 429: "tab:orange", 503: "tab:purple", 507: "tab:red", 0: "gray"}


def write_plot(path: str, runs: dict[str, list[RequestResult]]) -> None:
    """TTFT (failed requests: time to the error) per request against its start time."""
    from matplotlib.figure import Figure  # lazy: only --plot needs matplotlib; no pyplot state

    fig = Figure(figsize=(6 * len(runs), 4), layout="constrained")
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for ax, (label, results) in zip(axes, runs.items(), strict=True):
        for status in sorted({r.status for r in results}):
            rs = [r for r in results if r.status == status]
            ys = [r.ttft_s if r.ttft_s is not None else r.duration_s for r in rs]
            ax.scatter([r.start_s for r in rs], ys, s=12, c=_COLORS.get(status, "tab:blue"),
                       marker="o" if status == 200 else "x", label=f"{status} ({len(rs)})")
        ax.set_title(label)
        ax.set_xlabel("request start (s)")
        ax.legend(title="HTTP status")
    axes[0].set_ylabel("TTFT (s); failures: time to error")
    fig.savefig(path, dpi=100)


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log_tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-2000:]


def _wait_healthy(proc: subprocess.Popen[bytes], base: str, timeout_s: float,
                  log: IO[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise LoadTestError(f"server exited with {proc.returncode}:\n{_log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{base}/health").status_code == 200:
                    return
            time.sleep(0.25)
    raise LoadTestError(f"server not healthy after {timeout_s:.0f}s:\n{_log_tail(log)}")


@contextlib.contextmanager
def running_server(cmd: str, env: dict[str, str], startup_timeout_s: float) -> Iterator[str]:
    """Start `cmd` on a free loopback port, wait for /health 200, yield its base URL, stop it.

    `{port}` in `cmd` is replaced; without it `--host 127.0.0.1 --port N` is appended.
    """
    port = free_loopback_port()
    if "{port}" in cmd:
        argv = shlex.split(cmd.replace("{port}", str(port)))
    else:
        argv = [*shlex.split(cmd), "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        # The child inherits our environment plus the A/B switches (a tool, not the server).
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, base, startup_timeout_s, log)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _config(args: argparse.Namespace, url: str) -> LoadConfig:
    return LoadConfig(url, args.users, args.turns, args.max_tokens, args.words_per_turn,
                      args.max_seconds, args.seed)


def _compare(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list[RequestResult]]]:
    reports: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[RequestResult]] = {}
    for label, flag in (("segmented", "1"), ("stock", "0")):
        env = {"SEGSERVE_SEGMENTED_KV": flag}
        # Each mode starts cold: no SSD tier carried over from the other run (or from the
        # user's cache directory) unless the caller chose a bank directory.
        env.setdefault("SEGSERVE_BANK_DIR", os.environ.get("SEGSERVE_BANK_DIR", "none"))
        if args.bank_max_bytes is not None:
            env["SEGSERVE_BANK_MAX_BYTES"] = args.bank_max_bytes
        with running_server(args.server_cmd, env, args.startup_timeout) as base:
            cfg = _config(args, base)
            results, wall, peak = asyncio.run(run_load(cfg))
        reports[label] = summarize(results, wall, peak, cfg)
        runs[label] = results
    out = {**reports, "ratios": ratios(reports["segmented"], reports["stock"])}
    return out, runs


def _bounded(kind: type[int] | type[float], lo: float, hi: float) -> Any:
    def parse(text: str) -> int | float:
        value = kind(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text!r} is outside [{lo:g}, {hi:g}]")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="segserve loadtest", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="loopback server base URL")
    p.add_argument("--users", type=_bounded(int, 1, 1000), default=4)
    p.add_argument("--turns", type=_bounded(int, 1, 1000), default=6)
    p.add_argument("--max-tokens", type=_bounded(int, 1, 100_000), default=48)
    p.add_argument("--words-per-turn", type=_bounded(int, 1, 100_000), default=200)
    p.add_argument("--max-seconds", type=_bounded(float, 0.1, 86_400), default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print only the JSON report")
    p.add_argument("--plot", metavar="PATH.png", help="write TTFT-over-time plot")
    p.add_argument("--compare", action="store_true",
                   help="start the server with SEGSERVE_SEGMENTED_KV=1 then =0 and compare")
    p.add_argument("--server-cmd", default="segserve serve",
                   help="server command for --compare; {port} is substituted if present")
    p.add_argument("--bank-max-bytes", help="SEGSERVE_BANK_MAX_BYTES for both --compare runs")
    p.add_argument("--startup-timeout", type=_bounded(float, 1, 3600), default=300.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.compare:
            out, runs = _compare(args)
            reports = {k: out[k] for k in runs}
        else:
            cfg = _config(args, args.url)
            check_loopback_url(cfg.url)  # refuse before any progress output
            results, wall, peak = asyncio.run(run_load(cfg))
            out = summarize(results, wall, peak, cfg)
            runs, reports = {"run": results}, {"run": out}
    except LoadTestError as exc:
        print(f"segserve loadtest: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        write_plot(args.plot, runs)
    if not args.json:
        print(format_table(reports))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
