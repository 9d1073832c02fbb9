"""A burst of prompts arriving at once: time to first token under each prefill order.

What it measures: N streaming chat requests sent together to one segserve server, each a
fresh prompt of about P tokens (a nonce first, so nothing is reused) and M new tokens;
per request its time to first token (TTFT) and the wall time of the burst. One server per
`--prefill-order` value, started in turn, the orders alternating for `--rounds` rounds (the
machine's drift falls on both alike); per order the medians over rounds of TTFT p50 / p90 /
max and mean. Ratios are shortest / round-robin (lower is better).

    python bench/burst.py --clients 8 --prompt-tokens 600 --max-tokens 16 --rounds 3 \\
        --json-out bench/results/burst_cpu.json
    python bench/burst.py --model FILE ...        # any model the server takes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import servers  # noqa: E402
from speed import nonce, notes_document, stream_chat, system_message  # noqa: E402

from bench.common import emit_json  # noqa: E402

ORDERS = ("shortest", "round-robin")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _burst(base: str, clients: int, prompt_tokens: int, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    doc = notes_document(prompt_tokens, "burst-notes")
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            stream_chat(client, base, [system_message(nonce()), {"role": "user", "content": f"{doc}\n\nSummarise."}],
                        max_tokens=max_tokens, timeout_s=timeout_s)
            for _ in range(clients)))
        wall = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {clients} requests failed: {errors[0]}")
    ttft = [float(r.ttft_s) for r in results if r.ttft_s is not None]
    return {"ttft_p50_s": _percentile(ttft, 0.5), "ttft_p90_s": _percentile(ttft, 0.9),
            "ttft_max_s": max(ttft), "ttft_mean_s": statistics.mean(ttft), "wall_s": wall,
            "prompt_tokens": results[0].prompt_tokens}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {o: [] for o in ORDERS}
    for r in range(args.rounds):
        for order in ORDERS if r % 2 == 0 else ORDERS[::-1]:
            extra = ["--prefill-order", order, *(["--model", args.model] if args.model else [])]
            argv = servers.segserve_argv(servers.free_loopback_port(), extra)
            with servers.running_server(f"segserve {order}", argv) as srv:
                asyncio.run(_burst(srv.base_url, 2, 64, 4, args.timeout))  # warm the process
                got = asyncio.run(_burst(srv.base_url, args.clients, args.prompt_tokens, args.max_tokens,
                                         args.timeout))
            print(json.dumps({"round": r, "order": order, **got}), flush=True)
            rounds[order].append(got)
    keys = ("ttft_p50_s", "ttft_p90_s", "ttft_max_s", "ttft_mean_s", "wall_s")
    medians = {o: {k: round(statistics.median(x[k] for x in rounds[o]), 3) for k in keys} for o in ORDERS}
    return {
        "bench": "burst", "command": " ".join(sys.argv), "clients": args.clients,
        "prompt_tokens": rounds[ORDERS[0]][0]["prompt_tokens"], "max_tokens": args.max_tokens,
        "model": args.model or "embedded", "rounds": rounds, "medians": medians,
        "shortest_over_round_robin": {k: round(medians["shortest"][k] / medians["round-robin"][k], 3) for k in keys},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="GGUF file or mlx-lm directory (default: the embedded model)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    emit_json(run(args), args.json_out)


if __name__ == "__main__":
    main()
