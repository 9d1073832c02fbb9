"""Load across replicas: `segserve loadtest` through nginx, 1 vs N replicas, affinity on/off.

Starts N segserve replicas on loopback (a tiny random-weight model by default, `--model`
for a real one; each with its own RAM-only bank), nginx with deploy/nginx/segserve.conf
(`affinity off` drops the `hash` line: round-robin), runs `segserve loadtest` against
nginx, and prints one row per configuration: aggregate tokens/s, TTFT p50/p90/p99 and the
cached-token ratio (cached prompt tokens / prompt tokens). On a small shared machine the
absolute figures mean little; the cached-token ratio with affinity on vs off is the point.

    .venv/bin/python bench/replicas.py --users 8 --turns 4 --out bench/out/replicas.json

Needs nginx with njs (`make test` installs them where it may). Sends traffic to loopback
only; every run is bounded by loadtest's --max-seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from segserve.server.loadtest.cli import add_workload_flags, workload_argv  # noqa: E402
from tests.nginx_support import NGINX, NJS_MODULE, NginxRouter  # noqa: E402
from tests.process_support import ServerProcess, write_tiny_model_dir  # noqa: E402


def run_load(url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "segserve.server.loadtest", "--url", url, *workload_argv(args),
           "--seed", str(args.seed), "--metrics-interval", "0", "--no-progress",
           "--json-out", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=args.max_seconds + 120)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def row(name: str, r: dict[str, Any]) -> dict[str, Any]:
    ttft = r["ttft_s"]
    return {
        "config": name, "requests": r["requests"], "completed": r["completed"],
        "tokens_per_s": r["tokens_per_s"], "ttft_p50_s": ttft["p50"], "ttft_p90_s": ttft["p90"],
        "ttft_p99_s": ttft["p99"], "cached_token_ratio": r["cached_token_ratio"],
        "wall_s": r["wall_s"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    add_workload_flags(p, users=8, turns=4, max_tokens=16, words_per_turn=60, max_seconds=300.0)
    p.add_argument("--model", help="model for the replicas (default: a tiny random llama)")
    p.add_argument("--out", type=Path, help="write the rows (and the full reports) as JSON")
    args = p.parse_args()
    if NGINX is None or NJS_MODULE is None:
        print("needs nginx with njs: apt-get install nginx libnginx-mod-http-js", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    reports: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="segserve-replicas-") as d:
        tmp = Path(d)
        model = args.model or str(write_tiny_model_dir(tmp / "model"))
        replicas = [ServerProcess(tmp / f"replica{i}.log", "--model", model, "--bank-dir", "none")
                    for i in range(args.replicas)]
        try:
            for r in replicas:
                r.wait_healthy(300)
            plans = [(f"1 replica, {args.conversation}", replicas[:1], True)]
            if args.replicas > 1:
                plans += [
                    (f"{args.replicas} replicas, affinity on, {args.conversation}", replicas, True),
                    (f"{args.replicas} replicas, affinity off (round-robin), {args.conversation}",
                     replicas, False),
                ]
            for i, (name, group, affinity) in enumerate(plans):
                router = NginxRouter(tmp / f"nginx{i}", [f"127.0.0.1:{r.port}" for r in group],
                                     affinity=affinity)
                try:
                    # A fresh seed per run: no conversation reuses another run's stored turns.
                    args_i = argparse.Namespace(**{**vars(args), "seed": 1000 + i})
                    rep = run_load(router.url, args_i, tmp / f"run{i}.json")
                finally:
                    router.stop()
                reports[name] = rep
                rows.append(row(name, rep))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            for r in replicas:
                r.kill()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "reports": reports}, indent=1))
    print(f"{'config':<58} {'tok/s':>7} {'ttft p50':>9} {'p90':>7} {'p99':>7} {'cached':>7}")
    for x in rows:
        print(f"{x['config']:<58} {x['tokens_per_s']:>7.1f} {x['ttft_p50_s']:>9.3f} "
              f"{x['ttft_p90_s']:>7.3f} {x['ttft_p99_s']:>7.3f} {x['cached_token_ratio']:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
