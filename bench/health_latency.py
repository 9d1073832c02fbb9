"""/health latency while other clients send heavy requests (prints JSON).

Starts the server on the embedded model (`python -m segserve.server.cli serve`, as the other
benches do) with `--max-request-bytes`, then measures GET /health every `--poll-ms` while:
- a body just under the limit (a prompt of digits) is sent to chat, completions and
  responses (each is refused as over the context; what matters is that nobody waits);
- the first grammar request of the process (llguidance's vocabulary is built at start-up,
  so it no longer stalls anyone);
- 16 grammar requests (`response_format` json_schema, each its own schema, so none is a
  cache hit) compile concurrently.
Goal: p99 and max under 100 ms in every phase.

    .venv/bin/python bench/health_latency.py            # ~1 minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.servers import free_loopback_port, running_server, segserve_argv  # noqa: E402

GOAL_MS = 100.0


def _stats(samples: list[float]) -> dict[str, Any]:
    ms = sorted(s * 1000 for s in samples)
    if not ms:
        return {"n": 0}
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 1), "p99_ms": round(p99, 1),
            "max_ms": round(ms[-1], 1)}


def _while(base: str, poll_s: float, work: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
    """/health latencies sampled while `work()` runs in another thread."""
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.setdefault("result", work()))
    samples: list[float] = []
    with httpx.Client(base_url=base, trust_env=False, timeout=60) as c:
        t.start()
        while t.is_alive():
            t0 = time.perf_counter()
            c.get("/health").raise_for_status()
            samples.append(time.perf_counter() - t0)
            time.sleep(poll_s)
    t.join()
    return _stats(samples), out.get("result")


def _big(base: str, route: str, size: int) -> dict[str, Any]:
    digits = "7" * (size - 400)  # the JSON around it stays under the limit
    path, body = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": digits}], "max_tokens": 1}),
        "completions": ("/v1/completions", {"prompt": digits, "max_tokens": 1}),
        "responses": ("/v1/responses", {"input": digits, "max_output_tokens": 1}),
    }[route]
    raw = json.dumps(body).encode()
    assert len(raw) < size, (len(raw), size)
    t0 = time.perf_counter()
    with httpx.Client(base_url=base, trust_env=False, timeout=120) as c:
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
    return {"body_bytes": len(raw), "status": r.status_code, "seconds": round(time.perf_counter() - t0, 3),
            "code": (r.json().get("error") or {}).get("code") if r.status_code != 200 else None}


def _schema(k: int) -> dict[str, Any]:
    props = {f"field_{k}_{i}": {"type": "string", "enum": [f"v{j}" for j in range(10)]} for i in range(40)}
    return {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": {
        "type": "object", "properties": props, "required": list(props)}}}


def _grammar(base: str, n: int, offset: int) -> dict[str, Any]:
    statuses: list[int] = []

    def one(k: int) -> None:
        with httpx.Client(base_url=base, trust_env=False, timeout=300) as c:
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "answer in JSON"}], "max_tokens": 1,
                "response_format": _schema(offset + k)})
            statuses.append(r.status_code)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": n, "statuses": sorted(set(statuses)), "seconds": round(time.perf_counter() - t0, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-request-bytes", type=int, default=4_000_000)
    ap.add_argument("--body-bytes", type=int, default=3_900_000)
    ap.add_argument("--poll-ms", type=float, default=5.0)
    a = ap.parse_args()
    port = free_loopback_port()
    argv = segserve_argv(port, ["--max-request-bytes", str(a.max_request_bytes)])
    result: dict[str, Any] = {"goal_ms": GOAL_MS, "argv": argv[1:], "phases": {}}
    with running_server("segserve", argv) as server:
        base = server.base_url
        poll = a.poll_ms / 1000
        result["phases"]["idle"], _ = _while(base, poll, lambda: time.sleep(2.0))
        for route in ("chat", "completions", "responses"):
            stats, req = _while(base, poll, lambda r=route: _big(base, r, a.body_bytes))  # type: ignore[misc]
            result["phases"][f"big_{route}"] = {**stats, "request": req}
        stats, req = _while(base, poll, lambda: _grammar(base, 1, 0))
        result["phases"]["grammar_first"] = {**stats, "requests": req}
        stats, req = _while(base, poll, lambda: _grammar(base, 16, 1))
        result["phases"]["grammar_16"] = {**stats, "requests": req}
    result["met"] = {k: v.get("max_ms", 0) <= GOAL_MS for k, v in result["phases"].items()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
