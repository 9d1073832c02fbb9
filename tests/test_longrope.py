"""Phi-3 LongRoPE against mlx-lm's own `SuScaledRoPE` and phi3 forward.

mlx-lm rotates every position with the long factors; segserve rotates positions below
`original_max_position_embeddings` with the short ones (segserve.server.runner.longrope says
why). So the references are mlx-lm's module / model built with the long factors (positions
from the switch on) and with the short factors in their place (positions before it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, quants
from mlx_lm.models import phi3
from mlx_lm.models.rope_utils import SuScaledRoPE

from segserve.config.settings import load_settings
from segserve.server.runner import load_model
from segserve.server.runner.gguf import load_gguf
from segserve.server.runner.gguf_arch import FAMILIES as ARCHS
from segserve.server.runner.gguf_arch import map_name
from segserve.server.runner.longrope import (
    LongRoPE,
    default_mscale,
    install_longrope,
    longrope_for_phi3,
)
from tests.gguf_support import write_gguf
from tests.test_model_families import FAMILIES, write_family_dir

DIMS, BASE, ORIG, MAX = 64, 10000.0, 16, 2048
SHORT = [1.0 + 0.1 * i for i in range(DIMS // 2)]
LONG = [1.0 + 2.0 * i for i in range(DIMS // 2)]


def _su(factors: list[float]) -> SuScaledRoPE:
    return SuScaledRoPE(DIMS, BASE, MAX, ORIG, short_factor=SHORT, long_factor=factors)


def _ours() -> LongRoPE:
    m = default_mscale(MAX, ORIG)
    return LongRoPE(DIMS, BASE, ORIG, SHORT, LONG, m, m)


def test_short_before_the_switch_long_from_it() -> None:
    x = mx.random.normal((1, 4, 10, DIMS), key=mx.random.key(1))
    rope, short, long = _ours(), _su(SHORT), _su(LONG)
    assert mx.allclose(rope(x, offset=0), short(x, offset=0), atol=1e-5).item()  # rows 0-9
    assert mx.allclose(rope(x, offset=ORIG), long(x, offset=ORIG), atol=1e-5).item()  # rows 16-25
    got = rope(x, offset=ORIG - 3)  # rows 13-22: three short, seven long
    want = mx.concatenate([short(x, offset=ORIG - 3)[..., :3, :], long(x, offset=ORIG - 3)[..., 3:, :]], axis=-2)
    assert mx.allclose(got, want, atol=1e-5).item()
    assert not mx.allclose(short(x, offset=ORIG - 3), long(x, offset=ORIG - 3), atol=1e-2).item()


def test_one_offset_per_row_equals_each_row_alone() -> None:
    x = mx.random.normal((3, 4, 1, DIMS), key=mx.random.key(2))
    rope = _ours()
    offsets = [3, ORIG - 1, ORIG + 40]
    got = rope(x, offset=mx.array(offsets, dtype=mx.int32))
    for i, off in enumerate(offsets):
        assert mx.allclose(got[i : i + 1], rope(x[i : i + 1], offset=off), atol=1e-5).item(), off


def _phi3_reference(model_dir: Path, factors: list[float]) -> Any:
    """mlx-lm's phi3 from the directory's config with `factors` as its long factors."""
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {**config["rope_scaling"], "long_factor": factors}
    model = phi3.Model(phi3.ModelArgs.from_dict(config))
    model.load_weights(str(model_dir / "model.safetensors"))
    model.set_dtype(mx.float32)
    assert type(model.layers[0].self_attn.rope) is SuScaledRoPE
    return model


def test_phi3_directory_matches_mlx_lm_forward(tmp_path: Path) -> None:
    model_dir = write_family_dir(tmp_path / "phi3", "phi3-longrope")
    loaded = load_model(load_settings({"model": str(model_dir), "bank_dir": "none"}, environ={}))
    assert all(type(layer.self_attn.rope) is LongRoPE for layer in loaded.model.layers)
    scaling = FAMILIES["phi3-longrope"][0]["rope_scaling"]
    short, long = _phi3_reference(model_dir, scaling["short_factor"]), _phi3_reference(model_dir, scaling["long_factor"])
    ids = mx.array([[(13 * i + 7) % 4000 + 10 for i in range(ORIG)]])
    got = loaded.model(ids)
    # Up to the switch: mlx-lm's forward with the short factors (and HF's for this length).
    assert mx.allclose(got, short(ids), atol=1e-3, rtol=1e-4).item()
    assert not mx.allclose(got, long(ids), atol=1e-1).item()
    # With the long factors on both sides of the switch it is mlx-lm's own forward at any
    # length (same frequencies, same attention factor).
    m = default_mscale(MAX, ORIG)
    install_longrope(short, LongRoPE(DIMS, BASE, ORIG, LONG, LONG, m, m))
    ids = mx.array([[(13 * i + 7) % 4000 + 10 for i in range(ORIG + 20)]])
    assert mx.allclose(short(ids), long(ids), atol=1e-3, rtol=1e-4).item()


def _gguf_phi3(path: Path) -> Path:
    return write_gguf(path, "phi3", "Q8_0", seed=4, layers=2, longrope=(SHORT, LONG, ORIG, MAX))


def test_phi3_gguf_longrope_matches_the_config_route(tmp_path: Path) -> None:
    path = _gguf_phi3(tmp_path / "p.gguf")
    g = load_gguf(path, dequantize=True)
    rope = g.model.layers[0].self_attn.rope
    assert type(rope) is LongRoPE and rope.original == ORIG
    assert rope.long_mscale == pytest.approx(default_mscale(MAX, ORIG), rel=1e-6)
    # The same weights through mlx-lm's phi3 with the config's LongRoPE, switched as ours.
    args = phi3.ModelArgs.from_dict({
        "model_type": "phi3", "hidden_size": g.args.hidden_size, "num_hidden_layers": 2,
        "intermediate_size": g.args.intermediate_size, "num_attention_heads": g.args.num_attention_heads,
        "num_key_value_heads": g.args.num_key_value_heads, "rms_norm_eps": g.args.rms_norm_eps,
        "vocab_size": g.args.vocab_size, "max_position_embeddings": MAX,
        "original_max_position_embeddings": ORIG, "tie_word_embeddings": False,
        "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
    })
    ref = phi3.Model(args)
    weights = {}
    for t in GGUFReader(str(path)).tensors:
        if t.name.startswith("rope_factors"):
            continue
        value = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        weights[map_name(ARCHS["phi3"], t.name)] = mx.array(value.reshape(tuple(int(n) for n in reversed(t.shape))))
    ref.load_weights(list(weights.items()), strict=True)
    config_rope = longrope_for_phi3(ref)
    assert config_rope is not None
    for layer in ref.layers:
        layer.self_attn.rope = config_rope
    ids = mx.array([[(7 * i) % 500 + 3 for i in range(ORIG + 9)]])  # across the switch
    want = ref(ids)
    assert mx.allclose(g.model(ids), want, atol=1e-2 * float(mx.max(mx.abs(want)).item())).item()  # type: ignore[arg-type]


def test_phi3_gguf_longrope_batched_equals_one_by_one(tmp_path: Path) -> None:
    """Sessions on both sides of the switch in one batch (prompts of 24, 7 and 5 tokens, a
    switch at 16): each row rotated with its own factors. LongRoPE keeps MLX's ops (the
    native decode layers take one frequency vector)."""
    from tests.test_gguf_reference import check_batched

    path = write_gguf(tmp_path / "b.gguf", "phi3", "Q4_K_M", seed=6, longrope=(SHORT, LONG, ORIG, MAX))
    check_batched(load_gguf(path, dequantize=False).model, "phi3", native=False)


def test_converted_phi3_longrope_directory_equals_the_gguf(tmp_path: Path) -> None:
    """`segserve convert` writes the file's two factor vectors and its switch point into the
    directory's rope_scaling, and the directory loads with the same LongRoPE."""
    from segserve.config.settings import load_settings
    from segserve.server.runner import convert_gguf, embedded_model_path, load_model

    path = write_gguf(tmp_path / "p.gguf", "phi3", "Q8_0", seed=4, layers=2, longrope=(SHORT, LONG, ORIG, MAX),
                      tokenizer_from=embedded_model_path())
    out = convert_gguf(path, tmp_path / "dir")
    gguf = load_model(load_settings({"model": str(path), "weights": "quantized"}, environ={}))
    via_dir = load_model(load_settings({"model": str(out), "weights": "quantized"}, environ={}))
    rope = via_dir.model.layers[0].self_attn.rope
    assert type(rope) is LongRoPE and rope.original == ORIG
    ids = mx.array([[(7 * i) % 500 + 3 for i in range(ORIG + 9)]])  # across the switch
    want = gguf.model(ids)
    assert mx.allclose(via_dir.model(ids), want, atol=1e-2 * float(mx.max(mx.abs(want)).item())).item()  # type: ignore[arg-type]
