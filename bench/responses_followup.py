"""Follow-up cost: a Responses turn (`previous_response_id`) vs a chat-completions turn that
resends the whole history, on the embedded model over HTTP with the official SDK.

How: one server (`python -m segserve.server.cli serve`, RAM-only bank). A conversation of `--turns`
turns is built through `/v1/responses` (greedy, `--answer-tokens` per answer). Then a
follow-up question is asked `--repeats` times in each of three ways, interleaved:
  responses   - `previous_response_id` = the last turn, only the new question sent;
  chat_warm   - chat completions with the whole history resent (same tenant: the bank's
                prefix index finds the stored rows);
  chat_cold   - the same, under another `X-Cache-Salt` each time (nothing reusable: what a
                server without a KV store pays).
Each follow-up starts with a distinct word, so none reuses another one's question rows.
Reported per mode (median): input tokens, cached tokens, prefilled tokens (input - cached),
request body bytes, wall time of the request (non-streaming, `--followup-tokens` out).

Run:  python bench/responses_followup.py [--turns 8] [--json-out bench/out/responses_followup.json]
The JSON report goes to stdout; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.servers import free_loopback_port  # noqa: E402

QUESTIONS = [
    "Tell me about the history of Paris.",
    "What are the most famous museums there?",
    "Which river runs through the city?",
    "How do people usually get around?",
    "What food is the city known for?",
    "Name a few parks worth visiting.",
    "What is the weather like in spring?",
    "Which neighbourhoods are good for a walk?",
    "What happens on Bastille Day?",
    "Recommend a day trip from the city.",
    "What are the opening hours of the Louvre?",
    "Is the metro expensive?",
]

LEADS = ["Briefly", "Quickly", "Now", "Please", "Finally", "Lastly", "Kindly", "Also", "Then", "So", "Okay",
         "Next", "Well", "Right", "Great", "Good", "Sure", "Fine"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def start_server(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEGSERVE_")}
    out = (workdir / "server.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "segserve.server.cli", "serve", "--port", str(port), "--bank-dir", "none"],
        stdout=out, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[1],
    )


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=8, help="turns of history before the follow-up")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--followup-tokens", type=int, default=4, help="answer tokens of the measured follow-up")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    args = ap.parse_args()
    if 3 * args.repeats > len(LEADS):
        ap.error(f"--repeats is at most {len(LEADS) // 3}")

    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url
        if url is None:
            port = free_loopback_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_server(port, Path(tmp))
        try:
            if proc is not None:
                wait_healthy(url, proc)
            report = run(url, args)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")


def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    sizes: list[int] = []

    def record(request: httpx.Request) -> None:
        sizes.append(len(request.content))

    http = httpx.Client(trust_env=False, timeout=600, event_hooks={"request": [record]})
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)  # type: ignore[arg-type]
    n = args.answer_tokens
    history: list[dict[str, Any]] = []
    prev: str | None = None
    for i in range(args.turns):
        q = QUESTIONS[i % len(QUESTIONS)]
        r = client.responses.create(model="default", input=q, previous_response_id=prev, temperature=0,
                                    max_output_tokens=n)
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.output_text}]
        prev = r.id
        log(f"history turn {i + 1}: {r.usage.input_tokens if r.usage else '?'} input tokens")

    runs: dict[str, list[dict[str, Any]]] = {"responses": [], "chat_warm": [], "chat_cold": []}
    for k in range(args.repeats):
        for mode in ("responses", "chat_warm", "chat_cold", "responses", "chat_warm", "chat_cold")[k % 3:][:3]:
            # a distinct first word: no follow-up shares a token prefix with another one
            q = f"{LEADS[len(sum(runs.values(), []))]}, summarise our conversation in one sentence."
            m = args.followup_tokens
            t0 = time.perf_counter()
            if mode == "responses":
                r = client.responses.create(model="default", input=q, previous_response_id=prev,
                                            temperature=0, max_output_tokens=m)
                assert r.usage is not None
                inp, cached, out = r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens
            else:
                extra = {"X-Cache-Salt": f"cold-{k}-{time.time_ns()}"} if mode == "chat_cold" else None
                c = client.chat.completions.create(
                    model="default", messages=[*history, {"role": "user", "content": q}],  # type: ignore[list-item]
                    temperature=0, max_tokens=m, extra_headers=extra,
                )
                assert c.usage is not None
                inp, out = c.usage.prompt_tokens, c.usage.completion_tokens
                det = c.usage.prompt_tokens_details
                cached = (det.cached_tokens or 0) if det is not None else 0
            seconds = time.perf_counter() - t0
            runs[mode].append({"input_tokens": inp, "cached_tokens": cached, "prefilled_tokens": inp - cached,
                               "output_tokens": out, "request_bytes": sizes[-1], "seconds": seconds})
            log(f"{mode}: input {inp} cached {cached} in {seconds:.3f}s ({sizes[-1]} request bytes)")

    def med(mode: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[mode]))

    summary = {m: {k: med(m, k) for k in runs[m][0]} for m in runs}
    return {
        "bench": "responses_followup",
        "turns": args.turns,
        "answer_tokens": n,
        "followup_tokens": args.followup_tokens,
        "repeats": args.repeats,
        "health_model": httpx.get(url + "/health", trust_env=False).json().get("model"),
        "median": summary,
        "speedup_vs_chat_warm": summary["chat_warm"]["seconds"] / summary["responses"]["seconds"],
        "speedup_vs_chat_cold": summary["chat_cold"]["seconds"] / summary["responses"]["seconds"],
        "runs": runs,
    }


if __name__ == "__main__":
    main()
