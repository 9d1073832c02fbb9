"""CPU, per GGUF family: segserve against llama.cpp's llama-server on the same file.

For each family (llama3, qwen2, qwen3, mistral, phi3, gemma2, gemma3) and recipe (Q4_K_M, Q8_0) a
random-weight GGUF of a ~0.4B shape (hidden 1024, 28 layers, FF 2816, 16 heads, 4 KV heads,
head size 64; K-quant rows must be whole 256-weight blocks, so not Qwen2-0.5B's 896) is
written with gguf-py (tests/gguf_support.py), with the embedded SmolLM2 GGUF's tokenizer and
chat template (llama.cpp accepts a byte-level BPE vocabulary for every one of these
architectures). Both servers serve it at once on loopback ports and the requests interleave
(bench/cpu_peers.py `measure_interleaved`: drift on a shared VM hits both alike): prefill
tok/s (prompt tokens / TTFT), decode tok/s, peak RSS (VmHWM), and RSS once up, before the
first request (`rss_started`: the peak also holds what serving keeps, segserve's session bank
holding each finished conversation). segserve runs `--weights
auto`. Ratios are segserve / llama-server; goals: decode >= 1.0, prefill >= 1.0, RSS <= 1.0.
`--with-stock` adds segserve in stock KV mode (`--segmented-kv false`) as a third server of
the same run, and the ratios segmented / stock (`vs_stock`; goal: decode and prefill >= 1.0).
`--variant "ARGS"` adds segserve with these extra arguments likewise (`segserve_variant`),
and the ratios variant / default (`variant_vs_default`): the A/B of one setting, in one run.
Without the llama-server binary its rows say so and segserve's still run.

    make bench-peers-setup   # once: bench/out/llama.cpp/bin/llama-server
    .venv/bin/python bench/families_cpu.py --json-out bench/results/families_cpu.json
    .venv/bin/python bench/families_cpu.py --smoke   # 2-layer shapes, short prompts
    .venv/bin/python bench/families_cpu.py --layers 8 ...   # the same shape, fewer layers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import cpu_peers
import servers
from speed import log

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"llama3": "llama3", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "phi3": "phi3",
            "gemma2": "gemma2", "gemma3": "gemma3"}  # bench name -> tests/gguf_support.py family
RECIPES = ("Q4_K_M", "Q8_0")
SHAPE = {"hidden": 1024, "ff": 2816, "heads": 16, "kv_heads": 4, "head_dim": 64}
LAYERS = 28


def write_model(out: Path, family: str, recipe: str, layers: int, shape: dict[str, int]) -> Path:
    sys.path.insert(0, str(ROOT))
    from segserve.server.runner.gguf import embedded_model_path
    from tests.gguf_support import write_gguf

    path = write_gguf(out / f"{family}-{recipe}.gguf", FAMILIES[family], recipe, seed=1,
                      tokenizer_from=embedded_model_path(), layers=layers, shape=shape)
    return unname_phi3(path)


def unname_phi3(path: Path) -> Path:
    """llama.cpp marks Phi-3's special tokens (<|end|>, ...) when general.name contains
    "phi3" and fails to load ("unordered_map::at") a vocabulary without them, as the SmolLM2
    one here; the same-length rename leaves every other byte of the file alone."""
    data = path.read_bytes()
    if b"tiny-phi3-" in data[:65536]:
        path.write_bytes(data.replace(b"tiny-phi3-", b"tiny-p_hi3", 1))
    return path


def argvs(path: Path, args: argparse.Namespace) -> dict[str, list[str] | str]:
    out: dict[str, list[str] | str] = {}
    binary = servers.llama_server_binary()
    if binary is None:
        out["llama_server"] = f"llama-server not built ({servers.LLAMA_SERVER_BIN}): run `make bench-peers-setup`"
    else:
        out["llama_server"] = servers.llama_server_argv(
            binary, path, servers.free_loopback_port(), slots=args.slots, ctx_per_slot=args.ctx_per_slot,
            threads=os.cpu_count() or 1, poll=0)
    out["segserve"] = servers.segserve_argv(servers.free_loopback_port(), ["--model", str(path), "--weights", "auto"])
    if args.with_stock:
        out["segserve_stock"] = servers.segserve_argv(
            servers.free_loopback_port(), ["--model", str(path), "--weights", "auto", "--segmented-kv", "false"])
    if args.variant:
        out["segserve_variant"] = servers.segserve_argv(
            servers.free_loopback_port(), ["--model", str(path), "--weights", "auto", *args.variant.split()])
    return out


def _ratios(num: dict[str, Any], den: dict[str, Any]) -> dict[str, float | None]:
    """num / den for each figure both runs have (None where either lacks it)."""
    pairs = {"decode": "decode_tok_s", "prefill": "prefill_tok_s", "peak_rss": "peak_rss_bytes",
             "rss_started": "rss_started_bytes"}
    return {name: num[key] / den[key] if num.get(key) and den.get(key) else None for name, key in pairs.items()}


def measure(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"file_bytes": path.stat().st_size}
    runnable = {}
    for name, argv in argvs(path, args).items():
        if isinstance(argv, str):
            report[name] = {"skipped": argv}
        else:
            runnable[name] = argv
    with contextlib.ExitStack() as stack:
        running = {n: stack.enter_context(servers.running_server(n, a)) for n, a in runnable.items()}
        started = {n: s.rss_bytes() for n, s in running.items()}  # up, before any request
        results = asyncio.run(cpu_peers.measure_interleaved(running, args))
    for name, r in results.items():
        report[name] = {k: r[k] for k in ("warmup_error", "prompt_tokens", "prefill_tok_s", "decode_tok_s",
                                          "peak_rss_bytes")}
        report[name]["rss_started_bytes"] = started[name]
        report[name]["errors"] = [x["error"] for x in r["single_runs"] if x["error"]]
    ours = report.get("segserve", {})
    report["ratios"] = _ratios(ours, report.get("llama_server", {}))
    if "segserve_stock" in report:
        report["vs_stock"] = _ratios(ours, report["segserve_stock"])
    if report.get("segserve_variant"):
        report["variant_vs_default"] = _ratios(report["segserve_variant"], ours)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--ctx-per-slot", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of the ~0.4B shape (shorter runs)")
    p.add_argument("--smoke", action="store_true", help="2-layer shapes, tiny prompts (tests)")
    p.add_argument("--with-stock", action="store_true",
                   help="also serve the file in stock KV mode; report segmented / stock")
    p.add_argument("--variant", default="",
                   help="extra segserve arguments for a third server of the same run (e.g. "
                        "'--pipeline-decode-steps on'); report variant / default")
    p.add_argument("--json-out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servers.exit_on_sigterm()
    for key in [k for k in os.environ if k.startswith("SEGSERVE_")]:
        del os.environ[key]  # the caller's shell must not change the servers under test
    layers, shape = args.layers, SHAPE
    if args.smoke:
        args.prompt_tokens, args.max_tokens, args.repeats = 60, 4, 1
        layers, shape = 2, {**SHAPE, "hidden": 256, "ff": 512, "heads": 4, "kv_heads": 2}
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json_out"},
                              "layers": layers, "shape": shape, "cpus": os.cpu_count(), "results": {}}
    with tempfile.TemporaryDirectory(prefix="families-cpu-") as tmp:
        for family in args.families.split(","):
            for recipe in args.recipes.split(","):
                key = f"{family}/{recipe}"
                log(f"{key}: writing the GGUF")
                path = write_model(Path(tmp), family, recipe, layers, shape)
                try:
                    report["results"][key] = measure(path, args)
                except servers.ServerError as exc:
                    report["results"][key] = {"error": str(exc)}
                log(f"{key}: {json.dumps(report['results'][key].get('ratios'))} vs stock "
                    f"{json.dumps(report['results'][key].get('vs_stock'))} variant / default "
                    f"{json.dumps(report['results'][key].get('variant_vs_default'))}")
                path.unlink()
    text = json.dumps(report, indent=2)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
