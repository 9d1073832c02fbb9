"""The model runner: everything that touches the model, on the engine thread.

Owns: model loading (GGUF, mlx-lm directories), the tokenizer and chat template, the CPU
weight layout, the forward pass and compiled batched decode, sampling, detokenizing with
stop strings, device-memory readings, and `ModelRunner`, which executes a
`segserve.server.scheduling.StepPlan` and returns a `StepOutput`. It decides nothing about order or
memory: that is the scheduler's.
May import: mlx, mlx_lm, tokenizers, `kv`, `config`, `segserve.server.scheduling` (its plan
and output types), `segserve.server.chat` (model-free: chat templates through transformers' renderer).
Never `segserve.server.engine` or the HTTP modules.
"""

from segserve.server.runner.batched import DecodeBackend, batch_supported, decode_batch
from segserve.server.runner.convert import convert_gguf, tokenizer_config
from segserve.server.runner.cpu_layout import apply_cpu_layout
from segserve.server.runner.device_memory import DeviceMemory, MemoryMeter, device_memory
from segserve.server.runner.forward import logits_last
from segserve.server.runner.gguf import ModelLoadError, embedded_model_path
from segserve.server.runner.model import (
    KV_LAYOUT_VERSION,
    LoadedModel,
    kv_bytes_per_token,
    load_model,
    model_shape,
    stock_mode,
)
from segserve.server.runner.runner import ModelRunner, RunRequest, TurnResult
from segserve.server.runner.sampling import Sampler, SamplingParams, TokenLogprob
from segserve.server.runner.textstream import TextStream
from segserve.server.runner.tokenizer import ChatTokenizer, TemplateError, from_gguf_metadata
from segserve.server.runner.warmup import WarmUpReport

__all__ = [
    "KV_LAYOUT_VERSION", "ChatTokenizer", "DecodeBackend", "DeviceMemory", "LoadedModel", "MemoryMeter",
    "ModelLoadError", "ModelRunner", "RunRequest", "Sampler", "SamplingParams", "TemplateError",
    "TextStream", "TokenLogprob", "TurnResult", "WarmUpReport", "apply_cpu_layout", "batch_supported",
    "convert_gguf", "decode_batch", "device_memory", "embedded_model_path", "from_gguf_metadata",
    "kv_bytes_per_token", "load_model", "logits_last", "model_shape", "stock_mode", "tokenizer_config",
]
