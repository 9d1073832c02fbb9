"""Loading routes agree: GGUF (quantized) vs the same weights through mlx-lm's loader, and
the CPU float32 route (dequantized, [in,out] layout) vs the plain quantized one."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from segserve.config.settings import load_settings
from segserve.server.runner import (
    LoadedModel,
    convert_gguf,
    embedded_model_path,
    load_model,
    logits_last,
)
from segserve.server.runner.gguf import ModelLoadError
from tests.gguf_support import FAMILIES as GGUF_FAMILIES
from tests.gguf_support import GEMMA, write_gguf

pytestmark = pytest.mark.model

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _greedy(lm: LoadedModel, n: int = 12) -> list[int]:
    from mlx_lm.models.cache import KVCache

    ids = lm.tokenizer.encode(lm.tokenizer.render(PROMPT))
    cache = [KVCache() for _ in range(lm.num_layers)]
    logits = logits_last(lm.model, ids, cache)
    out: list[int] = []
    for _ in range(n):
        tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
        out.append(tok)
        logits = logits_last(lm.model, [tok], cache)
    return out


@pytest.fixture(scope="module")
def quantized_gguf() -> LoadedModel:
    return load_model(load_settings({"weights": "quantized"}, environ={}))


def test_gguf_matches_mlx_lm_loader_on_converted_dir(tmp_path: Path, quantized_gguf: LoadedModel) -> None:
    out = convert_gguf(None, tmp_path / "smol")
    via_mlx_lm = load_model(load_settings({"model": str(out), "weights": "quantized"}, environ={}))
    ours = _greedy(quantized_gguf)
    assert ours == _greedy(via_mlx_lm)
    assert "Paris" in quantized_gguf.tokenizer.decode(ours)
    # The tokenizer saved for mlx-lm (loaded by transformers) agrees with ours.
    text = "Tabs\tand émojis 🎉 and digits 12345"
    assert via_mlx_lm.tokenizer.encode(text) == quantized_gguf.tokenizer.encode(text)


def test_cpu_float32_route_same_greedy_tokens(quantized_gguf: LoadedModel) -> None:
    fast = load_model(load_settings({"weights": "float32"}, environ={}))
    assert "float32" in fast.quantization and "[in,out]" in fast.quantization
    # Dequantizing is exact (affine q4/q8 -> float32); only the summation order differs.
    assert _greedy(fast) == _greedy(quantized_gguf)


# The families whose config carries more than llama's fields (plain llama, Mistral-Nemo and
# Qwen2 take the same path as qwen3 with fewer fields).
CONVERTED = [f for f in (*GGUF_FAMILIES, *GEMMA) if f not in ("llama", "mistral_nemo", "qwen2")]


@pytest.mark.slow
@pytest.mark.parametrize("family", CONVERTED)
def test_converted_directory_serves_the_gguf_model(family: str, tmp_path: Path) -> None:
    """`segserve convert` writes a directory mlx-lm loads into the same model as the GGUF:
    the family's own config fields (multipliers, no-RoPE layers, windows, LongRoPE factors)
    and unpermuted granite Q/K rows. A Llama 3 `rope_freqs` vector has no mlx-lm config
    field: refused by name."""
    path = write_gguf(tmp_path / "m.gguf", family, "Q8_0", tokenizer_from=embedded_model_path())
    if family == "llama3":
        with pytest.raises(ModelLoadError, match="rope_freqs"):
            convert_gguf(path, tmp_path / "dir")
        return
    out = convert_gguf(path, tmp_path / "dir")
    gguf = load_model(load_settings({"model": str(path), "weights": "quantized"}, environ={}))
    via_dir = load_model(load_settings({"model": str(out), "weights": "quantized"}, environ={}))
    ids = mx.array([[(37 * i) % 4000 + 10 for i in range(40)]])
    want = gguf.model(ids).astype(mx.float32)
    got = via_dir.model(ids).astype(mx.float32)
    tol = 2e-2 * float(mx.max(mx.abs(want)).item())  # type: ignore[arg-type]
    assert float(mx.max(mx.abs(got - want)).item()) <= tol, family  # type: ignore[arg-type]
