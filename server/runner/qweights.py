"""Which weight format to serve (`--weights`), and quantized weights on the CPU.

Owns: `weights_plan` (settings + device + extension -> float32 | q4 | q8 | quantized),
`requantize` (a loaded model's quantized layers to another bit width) and `route_cpu`
(the start-up self-check of the CPU quantized matmul extension on the model's own shapes,
then `segserve.kernels.qmm_cpu.install`). Called by `segserve.server.runner.model.load_model` on the main
thread, once.

Why: on the 2-core CPU decode reads every weight once per token; 4-bit weights are ~98 MB
per token on SmolLM2 against 538 MB as float32, but MLX's own CPU quantized matmul is slow
(no SIMD dequantization). With the extension (kernels/native qmm_*), 4-bit weights decode
faster than float32 from a sixth of the bytes, and its prefill path is a packed-panel GEMM
(W dequantized once per panel into an L1-sized float buffer shared by all rows), measured
at 1.3-2.1x BLAS float32 per layer at 512 rows on the shared 2-core machine
(bench/qmm_cpu.py; bench/cpu_peers.py end to end: prefill 275 vs 200 tok/s, decode 27.5 vs
13.0, peak RSS 500 vs 1,299 MB). So `auto` on CPU serves the file's quantized weights
through the extension where it is built and passes its self-check, else float32 + BLAS
(a float model is never quantized by `auto`: lossy).
When q4/q8 is asked for and the extension is missing or fails its self-check, the server
logs the reason once and serves those weights through MLX's own (slow) kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from segserve.bank.writer import release_free_heap
from segserve.config.settings import Settings
from segserve.kv.shape import ModelShape

log = logging.getLogger("segserve.runner")

QUANT_BITS = {"q4": 4, "q8": 8}


@dataclass(frozen=True, slots=True)
class WeightsPlan:
    mode: str  # "float32" | "q4" | "q8" | "quantized"
    cpu: bool
    auto: bool  # chosen by `--weights auto` (a failed self-check may fall back)
    note: str = ""


def weights_plan(settings: Settings) -> WeightsPlan:
    cpu = mx.default_device() == mx.cpu
    if settings.weights != "auto":
        return WeightsPlan(settings.weights, cpu, False)
    if not cpu:
        return WeightsPlan("quantized", cpu, True)
    # CPU: the file's 4-bit (or 8-bit) weights through the extension when it is built;
    # `load_model` falls back to float32 + BLAS if its self-check fails on the model.
    from segserve.kernels import qmm_cpu

    ok, why = qmm_cpu.available()
    if ok:
        return WeightsPlan("q4", cpu, True)
    return WeightsPlan("float32", cpu, True, f"CPU quantized matmul unavailable ({why})")


def requantize(model: nn.Module, bits: int, group_size: int = 32) -> int:
    """Re-quantize every affine quantized linear layer (and quantized embedding) of another
    bit width to `bits` (float16 scales and biases). Returns how many were changed."""
    from segserve.kernels.qmm_cpu import (
        K8Linear,
        Q6KEmbedding,
        Q6KLinear,
        dequantize_q6k,
        expand_k8,
    )

    changed = 0
    for _, mod in model.named_modules():
        for name, child in list(mod.children().items()):
            q6k = type(child) in (Q6KLinear, Q6KEmbedding)
            k8 = type(child) is K8Linear and int(child.bits) != bits  # compact scales (GGUF Q4_K/Q5_K)
            if not (q6k or k8) and (type(child) not in (nn.QuantizedLinear, nn.QuantizedEmbedding)
                                    or int(child.bits) == bits):
                continue
            if q6k or k8:  # GGUF Q6_K blocks or compact scales: an affine layer of `bits` takes their place
                if k8:
                    w = mx.dequantize(child.weight, expand_k8(child.scales), expand_k8(child.biases),
                                      group_size=child.group_size, bits=child.bits)
                else:
                    w = dequantize_q6k(child.weight, child.scales, child.biases)
                if type(child) is Q6KEmbedding:
                    layer = nn.QuantizedEmbedding(1, group_size, group_size=group_size, bits=bits)
                    layer.num_embeddings, layer.dims = (int(n) for n in w.shape)
                else:
                    layer = nn.QuantizedLinear(group_size, 1, bias=False, group_size=group_size, bits=bits)
                if "bias" in child:
                    layer.bias = child.bias
                setattr(mod, name, layer)
            else:
                w = mx.dequantize(child.weight, child.scales, child.biases,
                                  group_size=child.group_size, bits=child.bits).astype(mx.float32)
                layer = child
            q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
            layer.weight, layer.scales, layer.biases = q, s.astype(mx.float16), b.astype(mx.float16)
            layer.bits, layer.group_size = bits, group_size
            changed += 1
    mx.eval(model.parameters())
    return changed


def quantize_float(model: nn.Module, bits: int, group_size: int = 64) -> None:
    """Quantize a float model's linear layers (mlx-lm unquantized directories), activations
    kept float32 so the CPU op serves them."""
    model.set_dtype(mx.float32)
    nn.quantize(model, group_size=group_size, bits=bits)


def route_cpu(model: nn.Module, shape: ModelShape, x8: str = "") -> tuple[bool, str]:
    """Self-check the extension on the model's quantized shapes, then route the model's
    quantized products through it (`x8`: their own rounding of x, `qmm_cpu.install`):
    (ok, description or reason)."""
    from segserve.kernels import qmm_cpu

    ok, why = qmm_cpu.available()
    if not ok:
        return False, f"CPU quantized matmul unavailable ({why})"
    shapes = qmm_cpu.quantized_shapes(model)
    if not shapes:
        return False, "no affine 4/8-bit layers to route"
    ok, why = qmm_cpu.self_check(shapes)
    if not ok:
        return False, f"CPU quantized matmul self-check failed ({why})"
    routed = qmm_cpu.install(model, shape, x8=x8, after_fusing=release_free_heap)
    rounded = {"gemm": ", x rounded to 8 bits in prefill products",
               "on": ", x rounded to 8 bits in the products that have an 8-bit-x body"}.get(x8, "")
    return True, f"{routed} products via {qmm_cpu.available()[1]}{rounded}"


def float32_activations(model: nn.Module) -> None:
    """Cast every float parameter to float32 except quantized layers' `scales`/`biases`
    (CPU: the layers then compute in float32, which the extension serves, while the
    quantized rows keep the file's bytes; both ops take any float scale dtype)."""
    from mlx.utils import tree_map_with_path

    def cast(path: str, p: mx.array) -> mx.array:
        if path.rsplit(".", 1)[-1] in ("scales", "biases") or not mx.issubdtype(p.dtype, mx.floating):
            return p
        return p.astype(mx.float32)

    model.update(tree_map_with_path(cast, model.parameters()))


def file_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """An mlx-lm directory's `quantization` entry (config.json; `quantization_config` in
    older conversions): {group_size, bits, mode, per-module overrides}, or None."""
    q = config.get("quantization") or config.get("quantization_config")
    return q if isinstance(q, dict) and "bits" in q else None


def describe_bits(model: nn.Module) -> str:
    bits: set[int] = set()
    groups: set[int] = set()
    for _, mod in model.named_modules():
        b: Any = getattr(mod, "bits", None)
        if isinstance(b, int) and hasattr(mod, "scales"):
            bits.add(b)
            groups.add(int(getattr(mod, "group_size", 0)))
    g = "/".join(f"g{x}" for x in sorted(groups))
    return "affine " + g + " " + "/".join(f"{x}-bit" for x in sorted(bits))
