"""One forward pass that computes logits for the last position only.

Owns: `logits_last`, `trunk_hidden`, `embedding_rows`, `head_of`, `pipeline_layers`,
`decode_pipeline_layers` and their settings (`configure_pipelining`). Engine thread only.
mlx-lm models compute the vocabulary projection for every position; during a prefill
chunk of 256 tokens on SmolLM2 that is 256 x 49152 x 576 multiply-adds thrown away (about
as much as the rest of the chunk). Models that expose the usual `model.model` trunk get
the projection on the last row only; anything else falls back to the full call.

Pipelined prefill (GPU): MLX builds a forward's whole graph on the host, then runs it, so
the GPU waits while Python builds 32 layers (and the prefill's peak memory measured higher
that way, below). For mlx-lm's llama family a prefill chunk's
trunk is run layer by layer here and `mx.async_eval` starts the GPU every
`pipeline_layers()` layers while the host builds the next ones. Same ops, same order: the
logits are identical (a test compares them). Stock and segmented mode both get it, so the
A/B stays a comparison of the caches. Measured on the H200 (bench/zero_cost.py, random 8B
bf16, 512-token follow-up; pipelined / one evaluation, bench/results/zero_cost_h200_
{pipelined_decode,nopipe}.json): segmented TTFT 64.8 / 70.5 ms at
8K and 104.7 / 110.9 ms at 32K, prefill peak 1,025 / 1,507 MiB at 8K; stock TTFT
60.1 / 58.6 and 81.9 / 92.3 ms. Decode steps are not pipelined by default
(`--pipeline-decode` turns it on, `segserve.server.runner.batched.decode_batch`): measured
again on the H200 after the fused route replays its launch plan (bench/zero_cost.py
--contexts 8192,32768 --repeats 4, bench/results/zero_cost_h200_pipedecode{0,1}.json),
pipelining sped up stock (100.8 -> 128.5 tok/s at 8K, 65.5 -> 74.7 at 32K) and not the
segmented step (104.5 -> 100.4, 87.6 -> 83.0), whose host work per step (~2.6 ms against
stock's ~1.8, bench/results/kernels_gpu_model.json) the GPU then waits for. On, it would
leave the default mode at 0.78x of stock at 8K; off, both modes run as mlx-lm's forward
does and the A/B stays a comparison of the caches.

Across steps (`--pipeline-decode-steps`, `decode_steps_pipelined`) is another matter: the
next step's graph is built while the previous step runs (`segserve.server.runner.runner`),
so the host's work per step overlaps the device's instead of adding to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text, llama
from mlx_lm.models.base import create_attention_mask

from segserve.kernels.factory import current_backend


@dataclass(frozen=True, slots=True)
class Pipelining:
    """Layers per asynchronous evaluation on the GPU (`--pipeline-layers`; 0: one evaluation
    per forward, as mlx-lm does) and whether decode steps get it (`--pipeline-decode`).
    The CPU gets none: there the evaluation would run on the same cores that build the graph."""

    layers: int = 4
    decode: bool = False


# Set once at start-up from the settings (`configure_pipelining`, segserve.server.runtime); the
# defaults are the settings' defaults, so tests and benchmarks that never configure agree.
_pipelining = Pipelining()


def configure_pipelining(value: Pipelining) -> None:
    global _pipelining
    _pipelining = value


def pipeline_layers() -> int:
    """Layers between asynchronous evaluations of one forward (0: none)."""
    return _pipelining.layers if mx.default_device() == mx.gpu else 0


def decode_pipeline_layers() -> int:
    """The same for a decode step (0: none)."""
    return pipeline_layers() if _pipelining.decode else 0


def decode_steps_pipelined(setting: str, backend: str | None = None) -> bool:
    """`--pipeline-decode-steps` (`segserve.server.runner.ModelRunner`'s `pipeline_steps`):
    "on", "off", or "auto": on for a GPU `backend` (None: the default device's), off on the
    CPU. On the CPU the graph building and the ops it overlaps run on the same cores
    (bench/batch_decode.py --steps-ab measured it no faster there). On an H100 with a
    random-weight 8B bf16 model the same A/B gave 1.39x decode at one session and 1.04x at
    eight (docs/performance.md): a GPU idles while the host builds a step, and mlx-lm's own
    generation loop overlaps the two the same way."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"pipeline_decode_steps must be auto, on or off, not {setting!r}")
    if setting == "auto":
        return (current_backend() if backend is None else backend) != "cpu"
    return setting == "on"


def logits_last(
    model: nn.Module, tokens: Sequence[int], cache: Sequence[Any], every: int | None = None
) -> mx.array:
    """Run `tokens` through the model (writing the cache); return logits [V] of the last.
    `every`: layers per asynchronous evaluation (None: `pipeline_layers()` for a prefill
    chunk of several tokens, none for one)."""
    x = mx.array([list(tokens)], dtype=mx.int32)
    trunk = getattr(model, "model", None)
    head = head_of(model)
    if trunk is None or head is None:
        out: mx.array = model(x, cache=list(cache))[0, -1]
        return out
    if every is None:
        every = pipeline_layers() if len(tokens) > 1 else 0  # prefill chunks only (above)
    if every > 0 and _plain_llama(model):
        hidden = _pipelined_trunk(trunk, x, list(cache), every)
    else:
        hidden = trunk_hidden(model, x, cache)  # hidden: [1, L, H]
    return finish_logits(model, head(hidden[:, -1:, :])[0, -1])


def trunk_hidden(model: nn.Module, x: mx.array, cache: Sequence[Any]) -> mx.array:
    """The model's trunk (`model.model`) over token ids x [1, L], from `embedding_rows`."""
    trunk: Any = model["model"]
    if type(model) is gemma3_text.Model:  # the one trunk that takes the rows (and needs to)
        return trunk(x, list(cache), input_embeddings=embedding_rows(model, x))  # type: ignore[no-any-return]
    return trunk(x, list(cache))  # type: ignore[no-any-return]


def embedding_rows(model: nn.Module, ids: mx.array) -> mx.array:
    """The embedding's rows of `ids` as the residual stream starts from them: float32 where
    a quantized embedding hands out float16 rows to layers that compute in float32 (its
    float16 scales: a GGUF or a quantized directory on the CPU) and the family keeps the
    rows' dtype through its residual adds (gemma3's `clip_residual`; elsewhere the first
    norm's float32 weight promotes them). Why: gemma3 then held its whole residual stream
    in float16, unlike llama.cpp and unlike batched decode's native layers (float32), and a
    28-layer Q4_K_M prefill took ~10 % longer in the float16 clipping adds."""
    trunk: Any = model["model"]
    rows: mx.array = trunk.embed_tokens(ids)
    if type(model) is not gemma3_text.Model or rows.dtype != mx.float16:
        return rows
    norm = getattr(trunk.layers[0], "input_layernorm", None) if len(trunk.layers) else None
    weight = getattr(norm, "weight", None)
    return rows.astype(mx.float32) if isinstance(weight, mx.array) and weight.dtype == mx.float32 else rows


def finish_logits(model: nn.Module, logits: mx.array) -> mx.array:
    """What the model's own forward does to the head's output: granite divides it by its
    `logits_scaling`, gemma2 soft-caps it (cap * tanh(x / cap)); others keep it."""
    scaling = getattr(model, "logits_scaling", None)
    if scaling is not None:
        logits = logits / scaling
    if isinstance(model, gemma2.Model):  # its windowed form too (gemma2_window)
        cap = model.final_logit_softcapping
        logits = mx.tanh(logits / cap) * cap
    return logits


def _plain_llama(model: nn.Module) -> bool:
    """mlx-lm's llama with every layer full attention (the trunk `_pipelined_trunk` copies)."""
    trunk = getattr(model, "model", None)
    return type(model) is llama.Model and getattr(trunk, "swa_idx", None) is None


def _pipelined_trunk(trunk: Any, x: mx.array, cache: list[Any], every: int) -> mx.array:
    """`llama.LlamaModel.__call__` for full-attention models, evaluated every `every` layers."""
    h = trunk.embed_tokens(x)
    mask = create_attention_mask(h, cache[0])
    n = len(trunk.layers)
    for i, (layer, c) in enumerate(zip(trunk.layers, cache, strict=True)):
        h = layer(h, mask, cache=c)
        if (i + 1) % every == 0 and i + 1 < n:
            mx.async_eval(h)  # type: ignore[no-untyped-call]  # unannotated in mlx's stub
    return trunk.norm(h)  # type: ignore[no-any-return]


def head_of(model: nn.Module) -> Any:
    """The output projection (vocabulary logits) of a model, or None if not found. Read
    from the module tree alone: a CPU layout's own head (`tied_head`, installed by
    `segserve.server.runner.cpu_layout` or the extension), else the model's `lm_head`,
    else the tied embedding (an mlx-lm model builds `lm_head` only when its head is not
    tied; gemma3_text drops it when its weights tie; gemma2 never has one)."""
    if "tied_head" in model:
        return model["tied_head"]
    if "lm_head" in model:
        return model["lm_head"]
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return getattr(embed, "as_linear", None)
