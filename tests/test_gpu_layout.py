"""Fused projections (`segserve.server.runner.gpu_layout`), differential against mlx-lm's layout.

The transform is what the loader does on a GPU; it is device-independent, so it is tested
here on the CPU's MLX kernels: per family, in float32, bfloat16 and MLX's 4-bit format, the
fused model's prompt logits and batched decode steps equal the unfused model's (same
weights, same seed), parameter bytes are unchanged, and groups of mixed kinds stay apart.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from segserve.kernels.composed import attend_segments
from segserve.kernels.hook import install, layer_windows
from segserve.kernels.split_product import LayerPart
from segserve.kv.segmented import SegmentedCache
from segserve.server.runner import logits_last
from segserve.server.runner.batched import batch_support, decode_batch
from segserve.server.runner.gpu_layout import fuse_projections
from tests.conftest import decode_backend
from tests.test_batched_families import FAMILIES, make_family

FORMATS = ("float32", "bfloat16", "q4")
PROMPT = list(range(30, 49))  # longer than gemma3's window of 8


def _model(family: str, fmt: str) -> Any:
    model = make_family(family)
    if fmt == "bfloat16":
        model.set_dtype(mx.bfloat16)
    elif fmt == "q4":
        nn.quantize(model, group_size=32, bits=4)  # MLX's own layers (what a GPU serves)
    mx.eval(model.parameters())
    return model


def _bytes(model: Any) -> int:
    flat: Any = tree_flatten(model.parameters())  # [(name, array)]; its stub says str too
    return sum(int(v.nbytes) for _, v in flat)


def _rel_err(got: mx.array, want: mx.array) -> float:
    peak = float(mx.max(mx.abs(want.astype(mx.float32))).item())  # type: ignore[arg-type]
    err = float(mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item())  # type: ignore[arg-type]
    return err / max(1.0, peak)


def _caches(model: Any) -> list[Any]:
    windows = layer_windows(model)
    assert not isinstance(windows, str)
    return SegmentedCache(len(model.layers), route=attend_segments, windows=windows).layers


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_model_equals_mlx_lm_layout(family: str, fmt: str) -> None:
    plain, fused = _model(family, fmt), _model(family, fmt)
    before = _bytes(fused)
    groups = fuse_projections(fused)
    if family == "phi3":  # its own layers already hold q|k|v and gate|up
        assert groups == 0
        return
    assert groups == 2 * len(fused.layers)
    assert isinstance(fused.layers[0].self_attn.k_proj, LayerPart)
    assert isinstance(fused.layers[-1].mlp.up_proj, LayerPart)
    assert _bytes(fused) == before
    for m in (plain, fused):
        install(m)
    # bfloat16: the wider product may round its last bit apart (and gemma2's batched step
    # soft-caps its scores in float32, its forward in bfloat16: a few epsilons of the peak);
    # float32 and 4-bit: the same dot products of the same rows on the CPU; a CUDA GPU's
    # float32 products are TF32 and its tiling follows the product's width
    # (tests/test_batched_families.py's REL)
    cpu = mx.default_device() == mx.cpu
    tol = 4e-2 if fmt == "bfloat16" else (1e-5 if cpu else 5e-3)
    want = logits_last(plain, PROMPT, c_plain := _caches(plain))
    got = logits_last(fused, PROMPT, c_fused := _caches(fused))
    assert _rel_err(got, want) <= tol
    dec = decode_backend(fused)
    verdict = batch_support(dec)
    assert verdict.ok, verdict.reason
    token = int(mx.argmax(want).item())  # type: ignore[arg-type]
    for _ in range(3):
        step = decode_batch(dec, [token], [c_fused])[0]
        ref = logits_last(plain, [token], c_plain)
        assert _rel_err(step, ref) <= tol
        if fmt != "bfloat16" and cpu:
            assert int(mx.argmax(step).item()) == int(mx.argmax(ref).item())  # type: ignore[arg-type]
        token = int(mx.argmax(ref).item())  # type: ignore[arg-type]


def test_groups_of_mixed_kinds_stay_apart() -> None:
    """A q_proj quantized beside float k/v (or a bias on one part only) is left as it is;
    the MLP's group, all of one kind, is still fused."""
    model = _model("llama", "float32")
    attn = model.layers[0].self_attn
    attn.q_proj = nn.QuantizedLinear.from_linear(attn.q_proj, group_size=32, bits=4)
    attn2 = model.layers[1].self_attn
    attn2.v_proj = nn.Linear(attn2.v_proj.weight.shape[1], attn2.v_proj.weight.shape[0], bias=True)
    assert fuse_projections(model) == 2  # the two MLPs
    assert not isinstance(attn.k_proj, LayerPart) and not isinstance(attn2.k_proj, LayerPart)
    assert isinstance(model.layers[0].mlp.gate_proj, LayerPart)
