"""Time to first token and decode speed of a chat server on this machine, streaming.

What it measures, per workload (a short prompt and a ~1,500-token prompt), `--repeats` times:
  * cold TTFT: request sent -> first content chunk, with a prompt the server has never seen
    (a fresh nonce in the system message, which comes first in the chat template, plus a
    fresh `X-Cache-Salt` header for segserve), so no prompt-cache hit can help;
  * decode tokens/s: (completion_tokens - 1) / (t_last - t_first), where completion_tokens
    is the server's own count from the usage chunk (`stream_options.include_usage`),
    t_first is the arrival of the first content chunk and t_last that of the last chunk
    that carries a choice (the finish chunk: its token, e.g. EOS, is counted in usage);
  * warm TTFT: a follow-up turn that resends the conversation plus a short new message,
    with the same salt, so the server can reuse the prefix; with the prompt tokens it
    actually processed (prompt_tokens - cached_tokens, when the server reports them).
Medians over the repeats are reported. There is no "ignore EOS" in the OpenAI API, so the
prompts ask for long answers and the report gives the real completion counts.

Memory-bandwidth limit: decoding one token reads every weight once, so
bytes/token ~= weights read per step (all parameters except an embedding table that is
only gathered from, when a separate output head exists). It is computed in a side process
by segserve's own loader while the server starts (`--weights-bytes` overrides). The machine's bandwidth is
measured in the same run: np.copyto of a `--copy-mib` array, bytes read + written / time,
best of 5, with 1 thread and with one thread per CPU (numpy releases the GIL in copies);
the larger is the limit. fraction = tok/s * bytes/token / limit.

Starts `segserve serve` on a free loopback port (or measures `--url`), one warm-up request
first (loading and compiling are start-up costs, not TTFT). JSON on stdout, progress on
stderr. Run from the repository root: `python bench/speed.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np
import servers  # sibling modules: these files run as scripts from bench/
from loadtest import LoadTestError, check_loopback_url

_WORDS = ("copper lantern harbor meadow river window garden engine signal orbit ladder "
          "thunder pocket silver marble canyon falcon compass winter quartz timber ember "
          "saddle beacon glacier velvet anchor cobalt prairie").split()
_TOKENS_PER_NOTE = 13  # measured with the SmolLM2 tokenizer on the notes below
_TEMPLATE_OVERHEAD = 60  # system message, instruction and chat markup, in tokens
SHORT_PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a map "
                "in a bottle. Describe every step of the journey.")
LONG_INSTRUCTION = ("Above are numbered notes. Write a long, detailed report that goes "
                    "through the notes one by one and explains each of them.")
FOLLOW_UP = "Thank you. Please continue in the same detail."


@dataclass(slots=True)
class StreamResult:
    """One streamed chat completion, as the client saw it (times from request start)."""

    status: int = 0  # HTTP status; 0 when no response arrived
    ttft_s: float | None = None
    last_s: float | None = None  # arrival of the last chunk with a choice
    total_s: float = 0.0
    content_chunks: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not report it
    text: str = field(default="", repr=False)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def decode_tok_s(self) -> float | None:
        n = self.completion_tokens
        if n is None or n < 2 or self.ttft_s is None or self.last_s is None:
            return None
        span = self.last_s - self.ttft_s
        return (n - 1) / span if span > 0 else None

    @property
    def processed_tokens(self) -> int | None:
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        del out["text"]
        out["decode_tok_s"] = self.decode_tok_s
        out["prompt_tokens_processed"] = self.processed_tokens
        return out


def _apply_chunk(res: StreamResult, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:  # a mid-stream failure: the HTTP status is already 200
        err = chunk["error"]
        res.error = json.dumps(err)[:300] if not isinstance(err, str) else err[:300]
        return
    choices = chunk.get("choices") or []
    for choice in choices:
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            res.ttft_s = now if res.ttft_s is None else res.ttft_s
            res.content_chunks += 1
            res.text += piece
    if choices:
        res.last_s = now
    usage = chunk.get("usage")
    if usage:
        res.completion_tokens = usage.get("completion_tokens")
        res.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = details.get("cached_tokens")


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                  headers: dict[str, str], res: StreamResult, t0: float) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        res.status = resp.status_code
        if resp.status_code != 200:
            res.error = (await resp.aread()).decode("utf-8", "replace")[:300]
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            _apply_chunk(res, json.loads(data), time.perf_counter() - t0)


async def stream_chat(
    client: httpx.AsyncClient, base: str, messages: list[dict[str, str]], *,
    max_tokens: int, timeout_s: float, salt: str | None = None,
) -> StreamResult:
    """POST one streaming chat completion; never raises for HTTP or timeout failures."""
    # No "model" field: segserve maps a missing one to its model, mlx_lm.server to the
    # model it was started with (any other name makes mlx_lm.server try to download it).
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"X-Cache-Salt": salt} if salt else {}
    res = StreamResult()
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(
            _stream(client, f"{base}/v1/chat/completions", body, headers, res, t0), timeout_s)
    except asyncio.TimeoutError:
        res.error = f"client timeout after {timeout_s:g}s"
    except (httpx.HTTPError, ValueError) as exc:  # transport failure or malformed stream
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.total_s = time.perf_counter() - t0
    return res


def notes_document(target_tokens: int, seed: str) -> str:
    """Deterministic numbered notes of about `target_tokens` tokens (SmolLM2 tokenizer)."""
    import random

    rng = random.Random(seed)  # str seed: same text in every process and run
    count = max(1, target_tokens // _TOKENS_PER_NOTE)
    return " ".join(f"Note {i}: the {rng.choice(_WORDS)} {rng.choice(_WORDS)} is near the "
                    f"{rng.choice(_WORDS)}." for i in range(1, count + 1))


def system_message(nonce: str) -> dict[str, str]:
    # The nonce comes first in the template, so two requests share at most the few markup
    # tokens before it: each repeat is a cold prompt on any prefix cache.
    return {"role": "system", "content": f"Session {nonce}. You are a helpful assistant."}


def prompt_messages(kind: str, nonce: str, long_tokens: int) -> list[dict[str, str]]:
    if kind == "short":
        return [system_message(nonce), {"role": "user", "content": SHORT_PROMPT}]
    doc = notes_document(long_tokens - _TEMPLATE_OVERHEAD, "speed-notes")
    return [system_message(nonce), {"role": "user", "content": f"{doc}\n\n{LONG_INSTRUCTION}"}]


def nonce() -> str:
    return uuid.uuid4().hex[:12]


def median(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.median(real) if real else None


def measure_copy_bandwidth(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """Best-of-`repeats` np.copyto bandwidth (read + written bytes / s), 1 and N threads."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.zeros_like(src)  # zeros_like touches the pages, so faults are not timed
    threads = os.cpu_count() or 1

    def timed(run: Any) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        return 2 * src.nbytes / best / 1e9

    single = timed(lambda: np.copyto(dst, src))
    parts = np.array_split(np.arange(src.size), threads)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts if p.size]
    with ThreadPoolExecutor(threads) as pool:
        multi = timed(lambda: list(pool.map(
            lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds)))
    return {"copy_bytes": int(src.nbytes), "repeats": repeats, "threads": threads,
            "single_thread_gb_s": single, "all_threads_gb_s": multi,
            "limit_gb_s": max(single, multi)}


def _print_model_bytes() -> int:
    """Side-process entry: load the model as `segserve serve` would and print its bytes."""
    from mlx.utils import tree_flatten

    from segserve.config.settings import load_settings
    from segserve.server.runner import load_model

    loaded = load_model(load_settings())
    params = dict(tree_flatten(loaded.model.parameters()))
    total = sum(int(v.nbytes) for v in params.values())
    table = params.get("model.embed_tokens.weight")
    # With a separate output head (untied lm_head, or segserve's transposed copy of a tied
    # one) decode only gathers one row of the embedding table, so the table is not read.
    separate_head = any(k.startswith(("lm_head.", "tied_head.")) for k in params)
    read = total - int(table.nbytes) if table is not None and separate_head else total
    print(json.dumps({"weights_bytes": total, "bytes_per_decoded_token": read,
                      "quantization": loaded.quantization, "source": "segserve load_model"}))
    return 0


def start_model_bytes(override: int | None) -> subprocess.Popen[str] | None:
    """Start the side process that loads the model; None when `--weights-bytes` is given.

    It runs while the server starts (both are start-up work) and is waited for before the
    first timed request, so it never competes with a measurement.
    """
    if override is not None:
        return None
    return subprocess.Popen([sys.executable, __file__, "--print-model-bytes"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish_model_bytes(proc: subprocess.Popen[str] | None, override: int | None,
                       timeout_s: float = 300.0) -> dict[str, Any]:
    if proc is None:
        return {"weights_bytes": None, "bytes_per_decoded_token": override,
                "source": "--weights-bytes"}
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:  # timed out, or we are unwinding: it is ours, end it
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise servers.ServerError(f"model side process failed:\n{err[-2000:]}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


async def warm_up(client: httpx.AsyncClient, base: str, timeout_s: float) -> dict[str, Any]:
    # mlx_lm.server loads its model on the first request; segserve compiles its decode
    # route. Neither belongs in a TTFT figure.
    msgs = [system_message(nonce()), {"role": "user", "content": "Say hello."}]
    res = await stream_chat(client, base, msgs, max_tokens=2, timeout_s=timeout_s,
                            salt=nonce())
    return res.summary()


async def measure_workload(
    client: httpx.AsyncClient, base: str, kind: str, args: argparse.Namespace
) -> dict[str, Any]:
    cold: list[StreamResult] = []
    warm: list[StreamResult] = []
    for rep in range(args.repeats):
        salt = nonce()
        msgs = prompt_messages(kind, salt, args.prompt_tokens)
        first = await stream_chat(client, base, msgs, max_tokens=args.max_tokens,
                                  timeout_s=args.timeout, salt=salt)
        cold.append(first)
        log(f"{kind} #{rep}: ttft {first.ttft_s} s, {first.completion_tokens} tokens, "
            f"{first.decode_tok_s} tok/s {first.error or ''}")
        if not first.ok:
            continue
        follow = [*msgs, {"role": "assistant", "content": first.text},
                  {"role": "user", "content": FOLLOW_UP}]
        warm.append(await stream_chat(client, base, follow, max_tokens=args.max_tokens,
                                      timeout_s=args.timeout, salt=salt))
    return {
        "prompt_tokens": median([r.prompt_tokens for r in cold]),
        "completion_tokens": [r.completion_tokens for r in cold],
        "ttft_s": median([r.ttft_s for r in cold if r.ok]),
        "decode_tok_s": median([r.decode_tok_s for r in cold if r.ok]),
        "warm_ttft_s": median([r.ttft_s for r in warm if r.ok]),
        "warm_prompt_tokens_processed": [r.processed_tokens for r in warm],
        "errors": [r.error for r in cold + warm if not r.ok],
        "runs": [r.summary() for r in cold],
        "warm_runs": [r.summary() for r in warm],
    }


def bandwidth_fraction(tok_s: float | None, bytes_per_token: int | None,
                       limit_gb_s: float) -> float | None:
    if tok_s is None or not bytes_per_token or limit_gb_s <= 0:
        return None
    return tok_s * bytes_per_token / (limit_gb_s * 1e9)


async def measure_server(base: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=4)
    async with httpx.AsyncClient(trust_env=False, timeout=args.timeout, limits=limits) as c:
        out: dict[str, Any] = {"warmup": await warm_up(c, base, args.timeout)}
        for kind in ("short", "long"):
            out[kind] = await measure_workload(c, base, kind, args)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    log("measuring copy bandwidth")
    bandwidth = measure_copy_bandwidth(args.copy_mib << 20)
    side = start_model_bytes(args.weights_bytes)
    try:
        if args.url:
            base = args.url
            weights = finish_model_bytes(side, args.weights_bytes)
            server: dict[str, Any] = {"url": base}
            workloads = asyncio.run(measure_server(base, args))
        else:
            argv = servers.segserve_argv(servers.free_loopback_port())
            with servers.running_server("segserve", argv,
                                        startup_timeout_s=args.startup_timeout) as srv:
                weights = finish_model_bytes(side, args.weights_bytes)
                workloads = asyncio.run(measure_server(srv.base_url, args))
                server = {"url": srv.base_url, "rss_bytes": srv.rss_bytes(),
                          "peak_rss_bytes": srv.peak_rss_bytes()}
    finally:
        if side is not None and side.poll() is None:
            side.kill()
            side.wait()
    for kind in ("short", "long"):
        workloads[kind]["bandwidth_fraction"] = bandwidth_fraction(
            workloads[kind]["decode_tok_s"], weights["bytes_per_decoded_token"],
            bandwidth["limit_gb_s"])
    config = {k: v for k, v in vars(args).items() if k != "print_model_bytes"}
    return {"config": config, "server": server, "model": weights, "bandwidth": bandwidth,
            **workloads}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="measure this loopback server instead of starting segserve")
    p.add_argument("--prompt-tokens", type=int, default=1500, help="size of the long prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--weights-bytes", type=int, help="bytes read per decoded token")
    p.add_argument("--copy-mib", type=int, default=512, help="bandwidth test array size")
    p.add_argument("--smoke", action="store_true",
                   help="tiny run: 1 repeat, ~100-token long prompt, 4 tokens, 64 MiB copy")
    p.add_argument("--json-out", help="also write the JSON report here")
    p.add_argument("--print-model-bytes", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_model_bytes:
        return _print_model_bytes()
    servers.exit_on_sigterm()
    if args.smoke:
        args.repeats, args.prompt_tokens, args.max_tokens, args.copy_mib = 1, 100, 4, 64
    try:
        if args.url:  # refuse a non-loopback URL before any work
            args.url = check_loopback_url(args.url)
        report = run(args)
    except (servers.ServerError, LoadTestError) as exc:
        print(f"speed: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
