"""Speculative decoding through the server: decode tok/s with `--speculative auto` vs `off`.

Both servers up at once (the same build, the embedded model, CPU), the same requests,
greedy (temperature 0), each workload run on one server then the other, `--rounds` times
with the order alternating (medians reported); `--clients N` runs each workload from N
clients at once (their sessions decode in one batch, each row verifying its own drafts).
Three workloads:

- edit: a ~1K-token document in the prompt, "copy this text exactly, writing X for Y";
- json: a JSON object in the history, echoed back with one field patched, over two turns
  of one session (the second patches the first answer);
- chat: plain chat (little to draft from).

Decode tok/s of one answer = (tokens - 1) / (time of the last token - time of the first),
read from the SSE stream (`stream_options.include_usage` gives the token count).
Acceptance = the change of `segserve_spec_accepted_tokens_total` over
`segserve_spec_draft_tokens_total` across the workload (from /metrics). Each server first
answers one warm-up request. Output: JSON (stdout and --out).

`--peer`: the same workloads, requests and token counts against llama.cpp's llama-server on
the same GGUF (the embedded model's file), with its n-gram speculation (`--spec-type
ngram-simple`, drafting from the request's own tokens) and without (`none`), interleaved
the same way; its acceptance is not read. Needs `make bench-peers-setup`.

`--window-cost`: what a verify window costs against a decode step, in one process (the
embedded model loaded as the server loads it, or `--model`, a segmented cache on this
device's route over a `--history`-token history; median of --repeats, the variants
interleaved): a decode step (one row through the batched step's layers), windows of 2 / 3 /
5 / 9 rows through those same layers with the rows as the batch (`decode_window`, what the
server runs) and through the model's plain forward (`logits_window`, the fallback for
models without batched decode), and 4 sessions in one step: one token each against a window
of 5 each (`decode_windows`, a shared verify step).

    .venv/bin/python bench/speculative.py --out bench/results/speculative_cpu.json
    .venv/bin/python bench/speculative.py --window-cost --out bench/results/spec_window_cpu.json
    python bench/speculative.py --window-cost --model random:llama3:bf16 --history 2048   # a GPU
    .venv/bin/python bench/speculative.py --peer --out bench/results/speculative_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cpu_model  # noqa: E402
from bench.servers import (  # noqa: E402
    free_loopback_port,
    llama_server_argv,
    llama_server_binary,
    running_server,
    segserve_argv,
)

CHAT = "/v1/chat/completions"


def document(seed: int = 0, sentences: int = 64) -> str:
    """A varied ~1K-token text (seeded): no sentence repeats another."""
    rnd = random.Random(seed)
    adj = ["quiet", "old", "bright", "narrow", "busy", "cold", "green", "tall", "small", "warm"]
    noun = ["river", "market", "bridge", "library", "garden", "station", "harbor", "school"]
    who = ["the baker", "a teacher", "the mayor", "two children", "an engineer", "my uncle"]
    verb = ["visits", "repairs", "paints", "describes", "watches", "cleans", "measures"]
    when = ["every morning", "after lunch", "on Sundays", "in the spring", "before the rain"]
    out = []
    for i in range(sentences):
        out.append(f"{rnd.choice(who).capitalize()} {rnd.choice(verb)} the {rnd.choice(adj)} "
                   f"{rnd.choice(noun)} {rnd.choice(when)}, and item {i} is noted in the log.")
    return " ".join(out)


def json_doc(seed: int = 1) -> str:
    rnd = random.Random(seed)
    items = [{"id": i, "name": f"part-{rnd.randint(100, 999)}", "qty": rnd.randint(1, 50),
              "status": "open"} for i in range(12)]
    return json.dumps({"order": 4711, "customer": "ACME", "items": items}, indent=1)


def stream_turn(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int,
                session: str | None = None) -> dict[str, Any]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"X-Session-Id": session} if session else {}
    times: list[float] = []
    text: list[str] = []
    tokens = 0
    with client.stream("POST", CHAT, json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices", []):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    times.append(time.perf_counter())
                    text.append(piece)
    tokens = tokens or len(times)  # a server without a usage chunk: one piece per token
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"tokens": tokens, "decode_s": decode_s, "text": "".join(text),
            "tok_s": (tokens - 1) / decode_s if decode_s > 0 else None}


def spec_counters(client: httpx.Client) -> tuple[float, float]:
    m = client.get("/metrics").text

    def read(name: str) -> float:
        found = re.search(rf"^{name} ([0-9.e+]+)$", m, re.M)
        return float(found.group(1)) if found else 0.0

    return read("segserve_spec_draft_tokens_total"), read("segserve_spec_accepted_tokens_total")


def workloads(max_tokens: int) -> dict[str, list[tuple[list[dict[str, str]], str | None]]]:
    doc = document()
    # The document in the user's message: given as an earlier assistant turn ("repeat your
    # log, changing ...") the embedded model answers ~20 tokens instead of repeating it.
    edit = [{"role": "user", "content": "Copy the following text exactly, word for word, but write "
             f"'canal' instead of 'river':\n\n{doc}"}]
    js = json_doc()
    j1 = [{"role": "user", "content": "Return this JSON unchanged except that item 3 gets "
           f"\"status\": \"done\". Output only JSON.\n\n{js}"}]
    chat = [{"role": "user", "content": "Write a short story about a lighthouse keeper who "
             "learns to play the violin."}]
    return {"edit": [(edit, None)], "json": [(j1, "json-session")], "chat": [(chat, None)]}


def segserve_servers(max_tokens: int, extra: list[str]) -> dict[str, list[str]]:
    """The two servers compared: speculation auto and off, otherwise alike."""
    return {f"segserve-spec-{mode}": segserve_argv(free_loopback_port(), ["--speculative", mode, *extra])
            for mode in ("auto", "off")}


def llama_servers() -> dict[str, list[str]]:
    from segserve.server.runner.gguf import embedded_model_path

    binary = llama_server_binary()
    if binary is None:
        raise SystemExit("llama-server is not built: run `make bench-peers-setup`")
    out = {}
    for spec_type in ("ngram-simple", "none"):
        argv = llama_server_argv(binary, embedded_model_path(), free_loopback_port(), slots=4,
                                 ctx_per_slot=4096, threads=os.cpu_count() or 1)
        out[f"llama-server-{spec_type}"] = [*argv, "--spec-type", spec_type]
    return out


def _client_turns(client: httpx.Client, name: str, turns: list[tuple[list[dict[str, str]], str | None]],
                  max_tokens: int, tag: str) -> list[dict[str, Any]]:
    """One client's turns of a workload (`tag` keeps concurrent clients' sessions apart)."""
    results = []
    for messages, session in turns:
        sid = f"{session}-{tag}" if session else None
        res = stream_turn(client, messages, max_tokens, sid)
        results.append(res)
        if name == "json":  # the second turn patches the first answer again
            follow = [*messages, {"role": "assistant", "content": res["text"]},
                      {"role": "user", "content": "Now also set item 7's \"qty\" to 0. "
                       "Output the whole JSON again."}]
            results.append(stream_turn(client, follow, max_tokens, sid))
    return results


def run_workloads(argvs: dict[str, list[str]], max_tokens: int, *, counters: bool, clients: int = 1,
                  rounds: int = 1) -> dict[str, dict[str, Any]]:
    """Every server up at once; each round runs every workload on each server in turn (the
    order alternating from round to round), so machine drift hits both alike. Per server
    and workload: the median over rounds of the decode rate, and the acceptance over all
    rounds (segserve's counters)."""
    import contextlib
    import statistics
    from concurrent.futures import ThreadPoolExecutor

    # A new connection per request: llama-server may close a kept-alive connection as the next
    # request goes out on it (the timing runs from the first token to the last either way).
    fresh = httpx.Limits(max_keepalive_connections=0)
    names = list(argvs)
    got: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in names}
    with contextlib.ExitStack() as stack:
        servers = {n: stack.enter_context(running_server(n, argvs[n])) for n in names}
        admin = {n: stack.enter_context(httpx.Client(base_url=srv.base_url, timeout=600, limits=fresh))
                 for n, srv in servers.items()}
        for n in names:
            stream_turn(admin[n], [{"role": "user", "content": "Say hello."}], 16)  # warm-up
        for r in range(rounds):
            for name, turns in workloads(max_tokens).items():  # the workload's name
                for n in names if r % 2 == 0 else names[::-1]:
                    d0, a0 = spec_counters(admin[n]) if counters else (0.0, 0.0)
                    base = servers[n].base_url

                    def one(i: int, name: str = name, base: str = base, r: int = r,
                            turns: list[tuple[list[dict[str, str]], str | None]] = turns) -> list[dict[str, Any]]:
                        with httpx.Client(base_url=base, timeout=600, limits=fresh) as c:
                            return _client_turns(c, name, turns, max_tokens, f"{r}-{i}")

                    with ThreadPoolExecutor(clients) as pool:  # every client at once
                        per_client = list(pool.map(one, range(clients)))
                    d1, a1 = spec_counters(admin[n]) if counters else (0.0, 0.0)
                    # Aggregate decode rate: each client's (tokens - turns) over its own decode
                    # time, summed over the clients (they stream at the same time).
                    rates = []
                    for results in per_client:
                        secs = sum(x["decode_s"] for x in results)
                        toks = sum(x["tokens"] for x in results)
                        rates.append((toks - len(results)) / secs if secs else 0.0)
                    got[n].setdefault(name, []).append({
                        "tok_s": sum(rates) if all(rates) else None, "drafted": d1 - d0, "accepted": a1 - a0,
                        "tokens": sum(x["tokens"] for rs in per_client for x in rs),
                        "text_head": per_client[0][-1]["text"][:160]})
    out: dict[str, dict[str, Any]] = {}
    for n in names:
        out[n] = {}
        for name, runs in got[n].items():
            rates = [x["tok_s"] for x in runs if x["tok_s"]]
            drafted, accepted = sum(x["drafted"] for x in runs), sum(x["accepted"] for x in runs)
            out[n][name] = {
                "clients": clients, "rounds": len(runs), "tokens": runs[0]["tokens"],
                "decode_tok_s": round(statistics.median(rates), 2) if rates else None,
                "runs_tok_s": [round(x, 2) for x in rates],
                # segserve's counters (/metrics); None for a server without them
                "drafted": drafted if counters else None, "accepted": accepted if counters else None,
                "acceptance": round(accepted / drafted, 3) if counters and drafted else None,
                "text_head": runs[0]["text_head"],
            }
    return out


def window_cost(repeats: int, model: str | None = None, history: int = 300, sessions: int = 4) -> dict[str, Any]:
    import statistics

    import mlx.core as mx

    from bench.families_gpu import load_spec
    from segserve.config.settings import load_settings
    from segserve.kernels.hook import install
    from segserve.kv.segmented import SegmentedCache
    from segserve.server.runner import logits_last
    from segserve.server.runner.batched import (
        batch_supported,
        decode_batch,
        decode_window,
        decode_windows,
    )
    from segserve.server.runtime import choose_kv
    from segserve.server.spec import logits_window

    loaded = load_spec(model)  # e.g. random:llama3:bf16 (bench/families_gpu.py's 8B shape)
    _, route = choose_kv(load_settings({}, environ={}), loaded)  # this device's route, self-checked
    if route is None:
        raise SystemExit("segmented KV unavailable for this model here")
    shape = loaded.shape
    install(loaded.model)
    assert batch_supported(loaded.decode)
    dtype = getattr(mx, loaded.kv_dtype)

    def session() -> SegmentedCache:
        cache = SegmentedCache(shape.num_layers, None, route=route, dtype=dtype)
        mx.eval(logits_last(loaded.model, [(7 * i + 100) % 1000 for i in range(history)], cache.layers))
        return cache

    cache = session()
    others = [session() for _ in range(sessions - 1)]
    every = [cache, *others]
    variants: dict[str, Any] = {"decode_step": lambda: decode_batch(loaded.decode, [5], [cache.layers])}
    for rows in (2, 3, 5, 9):
        toks = list(range(5, 5 + rows))
        variants[f"window{rows}_batched_layers"] = lambda t=toks: decode_window(loaded.decode, t, cache.layers)
        variants[f"window{rows}_plain_forward"] = lambda t=toks: logits_window(loaded.model, t, cache.layers)
    # B sessions in one step: one token each (a plain batched step), then each with a window
    # of 1 + 4 tokens (a shared verify step, `decode_windows`).
    variants[f"batch{sessions}_decode_step"] = lambda: decode_batch(
        loaded.decode, [5] * sessions, [c.layers for c in every])
    variants[f"batch{sessions}_window5_each"] = lambda: decode_windows(
        loaded.decode, [list(range(5, 10))] * sessions, [c.layers for c in every])
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - t0)
            for c in every:  # back to the history: every variant sees the same caches
                for layer in c.layers:
                    layer.trim(layer.offset - history)
    ms = {name: round(statistics.median(v) * 1e3, 2) for name, v in times.items()}
    step = ms["decode_step"]
    return {"machine": cpu_model(), "device": str(mx.default_device()), "model": loaded.model_id,
            "quantization": loaded.quantization, "history_tokens": history, "sessions": sessions,
            "repeats": repeats, "median_ms": ms,
            "in_decode_steps": {name: round(v / step, 2) for name, v in ms.items()},
            "shared_verify_over_batched_step": round(
                ms[f"batch{sessions}_window5_each"] / ms[f"batch{sessions}_decode_step"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for both servers (repeatable)")
    ap.add_argument("--window-cost", action="store_true",
                    help="only the verify window's cost against a decode step, in this process")
    ap.add_argument("--repeats", type=int, default=12, help="--window-cost: runs per variant")
    ap.add_argument("--model", default=None,
                    help="--window-cost: a model the server can load (default: the embedded one), "
                         "or random:FAMILY:FORMAT for bench/families_gpu.py's random 8B shape")
    ap.add_argument("--history", type=int, default=300, help="--window-cost: history tokens")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of every workload on each server, interleaved (medians reported)")
    ap.add_argument("--clients", type=int, default=1,
                    help="clients running each workload at once (their own sessions); decode "
                         "tok/s is then their sum")
    ap.add_argument("--peer", action="store_true",
                    help="also llama-server on the same GGUF, n-gram speculation on and off")
    args = ap.parse_args()
    if args.window_cost:
        emit(window_cost(args.repeats, args.model, args.history), args.out)
        return
    ours = run_workloads(segserve_servers(args.max_tokens, args.server_arg), args.max_tokens,
                         counters=True, clients=args.clients, rounds=args.rounds)
    on, off = ours["segserve-spec-auto"], ours["segserve-spec-off"]
    report: dict[str, Any] = {"machine": cpu_model(), "max_tokens": args.max_tokens, "clients": args.clients,
                              "rounds": args.rounds, "workloads": compare(on, off)}
    if args.peer:
        peers = run_workloads(llama_servers(), args.max_tokens, counters=False, clients=args.clients,
                              rounds=args.rounds)
        peer_on, peer_off = peers["llama-server-ngram-simple"], peers["llama-server-none"]
        report["llama_server"] = compare(peer_on, peer_off)
        report["segserve_over_llama_server"] = {
            name: {"spec_on": ratio(on[name], peer_on[name]), "spec_off": ratio(off[name], peer_off[name])}
            for name in on}
    emit(report, args.out)


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """a's decode tok/s over b's."""
    return round(a["decode_tok_s"] / b["decode_tok_s"], 3) if a["decode_tok_s"] and b["decode_tok_s"] else None


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    return {name: {"on": on[name], "off": off[name], "speedup": ratio(on[name], off[name]),
                   "same_text": on[name]["text_head"] == off[name]["text_head"]} for name in on}


def emit(report: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
