"""SentencePiece GGUF tokenizers, Gemma 2 / Gemma 3 GGUF architectures and 5-bit codes
widened to 8 bits.

Tokenizer references, strongest first: llama.cpp's own test vectors
(`models/ggml-vocab-{llama-spm,phi-3}.gguf` with `.inp` / `.out`, in the llama.cpp sources
`make bench-peers-setup` unpacks under bench/out; skipped, with that reason, where they are
absent); SentencePiece itself on tiny models trained here with Llama 2's settings (llama.cpp's
SPM tokenizer reimplements it) and Gemma's; decode(encode(text)) == text.
Gemma references: an mlx-lm model built here from gguf-py's float dequantization of the same
file with the norms' stored 1 + w turned back into w (llama.cpp's `conversion/gemma.py` adds 1).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants
from mlx.utils import tree_flatten
from mlx_lm.models import gemma2, gemma3_text

from segserve.config.settings import load_settings
from segserve.kernels import qmm_cpu
from segserve.kernels.hook import support_check
from segserve.server.http.app import create_app
from segserve.server.runner import load_model, model_shape
from segserve.server.runner.gguf import load_gguf
from segserve.server.runner.gguf_arch import FAMILIES as ARCHS
from segserve.server.runner.gguf_arch import map_name
from segserve.server.runner.gguf_file import GGUFFile
from segserve.server.runner.gguf_quant import AffineTensor, convert
from segserve.server.runner.tokenizer import from_gguf_metadata
from tests.gguf_support import (
    GEMMA,
    sentencepiece_vocab,
    tensor_data,
    train_sentencepiece,
    write_gguf,
)
from tests.http_support import serve_in_thread, tiny_runtime

ROOT = Path(__file__).resolve().parent.parent
VOCABS = sorted(ROOT.glob("bench/out/llama.cpp/src-*/vendor/llama.cpp/models"))

CORPUS = "\n".join([
    "The quick brown fox jumps over the lazy dog. Hello world, hello again!",
    "def main():\n    return {'a': 1, 'b': [2, 3]}  # code with   runs of spaces",
    "Numbers 12345 and 2024-12-02, prices $3.50; emails a.b@example.com.",
    "Les élèves étudient à l'école. Über Straße. Ça va?",
] * 20)
TEXTS = [
    "Hello world", " Hello world", "  two leading", "trailing  ", "line\nbreak\n\n  indented",
    "unseen 🦙 emoji and 漢字", "digits 9876543210", "tab\tseparated", "", " ", "x",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
]
TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")


def _meta_of(path: Path) -> dict[str, Any]:
    return GGUFFile(path).metadata


@pytest.mark.skipif(not VOCABS, reason="llama.cpp's vocabulary test files come with `make bench-peers-setup`")
@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_llama_cpp_test_vectors(name: str) -> None:
    base = VOCABS[-1] / f"ggml-vocab-{name}.gguf"
    meta = _meta_of(base)
    meta.setdefault("tokenizer.chat_template", "{{ messages }}")
    chat, _ = from_gguf_metadata(meta)
    texts = base.with_suffix(".gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    ids = base.with_suffix(".gguf.out").read_text().split("\n")
    assert len(texts) >= 40
    for text, want in zip(texts, ids, strict=False):
        assert chat.encode(text) == [int(x) for x in want.split()], text
        assert chat.decode(chat.encode(text)) == text


@pytest.fixture(scope="module")
def sp_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, bytes]]:
    out = {}
    base = tmp_path_factory.mktemp("sp")
    for family in ("llama", "gemma3"):
        gemma = family.startswith("gemma")
        proto = train_sentencepiece(CORPUS, gemma=gemma, extra=TURN_TOKENS)
        path = write_gguf(base / f"{family}.gguf", family, "Q8_0", vocab_meta=sentencepiece_vocab(proto, gemma=gemma))
        out[family] = (path, proto)
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_ids_equal_sentencepiece(family: str, sp_files: dict[str, tuple[Path, bytes]]) -> None:
    import sentencepiece as spm

    path, proto = sp_files[family]
    sp = spm.SentencePieceProcessor(model_proto=proto)
    chat, _ = from_gguf_metadata(_meta_of(path))
    for text in TEXTS:
        got = chat.encode(text)
        if TURN_TOKENS[0] in text:
            # llama.cpp: control tokens stay whole and each text fragment is tokenized alone,
            # with the space prefix where the vocabulary has one (SentencePiece's dummy prefix)
            want: list[int] = []
            for part in re.split("(" + "|".join(TURN_TOKENS) + ")", text):
                want += [sp.piece_to_id(part)] if part in TURN_TOKENS else sp.encode(part) if part else []
            assert got == want
        else:
            assert got == sp.encode(text), text
            assert chat.decode(got) == text
    assert any(int(i) > 3 and sp.is_byte(int(i)) for i in chat.encode("🦙"))  # byte fallback used
    piece_bytes = b"".join(chat.token_bytes(i) for i in chat.encode("漢字"))
    assert piece_bytes.strip() == "漢字".encode()


def test_gemma_turn_end_is_an_eos(sp_files: dict[str, tuple[Path, bytes]]) -> None:
    import sentencepiece as spm

    path, proto = sp_files["gemma3"]
    sp = spm.SentencePieceProcessor(model_proto=proto)
    chat, _ = from_gguf_metadata(_meta_of(path))
    assert chat.eos_ids == {sp.eos_id(), sp.piece_to_id("<end_of_turn>")}
    path, proto = sp_files["llama"]
    sp = spm.SentencePieceProcessor(model_proto=proto)
    llama, _ = from_gguf_metadata(_meta_of(path))
    assert llama.eos_ids == {sp.eos_id(), sp.piece_to_id("<end_of_turn>")}  # llama.cpp's end-of-turn texts


def test_unsupported_tokenizer_is_named(sp_files: dict[str, tuple[Path, bytes]]) -> None:
    meta = _meta_of(sp_files["llama"][0])
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(ValueError, match="'bert'"):
        from_gguf_metadata(meta)


def _reference(path: Path) -> Any:
    """The file's family built by mlx-lm from gguf-py's float32 dequantization, norms - 1."""
    g = load_gguf(path, dequantize=True)
    arch = str(g.metadata["general.architecture"])
    module = {"gemma2": gemma2, "gemma3": gemma3_text}[arch]
    model = module.Model(g.args)
    weights = {}
    for t in GGUFReader(str(path)).tensors:
        value = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        if t.name.endswith("norm.weight"):
            value = value - 1.0
        weights[map_name(ARCHS[arch], t.name)] = mx.array(value.reshape(tuple(int(n) for n in reversed(t.shape))))
    if hasattr(model, "sanitize"):  # gemma3: no lm_head means tied
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    return g.model, model


def _peak(x: mx.array) -> float:
    return float(np.abs(np.array(x)).max())


@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("family", GEMMA)
def test_gemma_matches_mlx_lm_on_gguf_py_weights(family: str, recipe: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "g.gguf", family, recipe, seed=5, layers=4)
    ours, ref = _reference(path)
    tokens = mx.array([[(13 * i) % 500 + 3 for i in range(20)]])  # longer than gemma3's window (8)
    got, want = ours(tokens), ref(tokens)
    # Q8_0's codes are exact but the dequantized path rounds d*q to float16 (relative 2^-11 per
    # weight); Q4_K_M's Q6_K tensors are re-gridded (tests/test_gguf_families.py). A norm read
    # as w instead of 1 + w, or a mapping slip, moves the logits by their own size.
    tol = {"Q8_0": 1e-2, "Q4_K_M": 0.1}[recipe] * _peak(want)
    assert _peak(got - want) <= tol
    compact = load_gguf(path, dequantize=False)
    assert "GGUF" in compact.quantization
    assert _peak(compact.model(tokens) - want) <= tol


def test_gemma_args_follow_llama_cpp(tmp_path: Path) -> None:
    g3 = load_gguf(write_gguf(tmp_path / "g3.gguf", "gemma3", "Q8_0", layers=4), dequantize=False)
    assert (g3.args.sliding_window, g3.args.sliding_window_pattern) == (8, 2)
    assert (g3.args.rope_theta, g3.args.rope_local_base_freq) == (1_000_000.0, 10000.0)
    assert [layer.self_attn.is_sliding for layer in g3.model.layers] == [True, False, True, False]
    assert g3.model.tie_word_embeddings and support_check(g3.model, model_shape(g3.model)).ok
    g2 = load_gguf(write_gguf(tmp_path / "g2.gguf", "gemma2", "Q8_0"), dequantize=False)
    # The file's context, its even layers windowed (segserve.server.runner.gemma2_window).
    assert (g2.args.max_position_embeddings, g2.args.sliding_window) == (1024, 512)
    assert g2.args.attn_logit_softcapping == 50.0 and g2.args.query_pre_attn_scalar == 64
    verdict = support_check(g2.model, model_shape(g2.model))
    assert verdict.ok and verdict.softcap == 50.0 and verdict.windows == (512,)
    assert "sliding-window layers (window 512)" in verdict.reason and "soft-capped at 50" in verdict.reason


@pytest.mark.parametrize("kind", [T.Q5_0, T.Q5_1, T.Q5_K])
def test_five_bit_widened_to_eight_is_exact(kind: T) -> None:
    raw = tensor_data(kind, 8, 512, np.random.default_rng(int(kind)))
    five, eight = convert("t", kind, raw, (8, 512)), convert("t", kind, raw, (8, 512), widen_5bit=True)
    assert isinstance(five, AffineTensor) and isinstance(eight, AffineTensor)
    assert (five.bits, eight.bits, eight.widened) == (5, 8, True)
    a = mx.dequantize(five.weight, five.scales, five.biases, group_size=32, bits=5)
    b = mx.dequantize(eight.weight, eight.scales, eight.biases, group_size=32, bits=8)
    assert mx.array_equal(a, b).item()


def test_five_bit_file_widened_on_cpu_memory_ratio(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "q5.gguf", "llama", "Q5_K_M")
    compact = load_gguf(path, dequantize=False, widen_5bit=False)
    wide = load_gguf(path, dequantize=False, widen_5bit=True)

    def size(m: Any) -> int:
        flat: Any = tree_flatten(m.parameters())
        return sum(int(v.nbytes) for _, v in flat)

    q5 = [t for t in GGUFReader(str(path)).tensors if t.tensor_type == T.Q5_K]
    codes = sum(int(t.n_elements) for t in q5) * 3 // 8  # 5 -> 8 code bits
    # Where the CPU extension serves them, the widened matrices (not the embedding table)
    # keep Q5_K's compact scales: 20 bytes per 256 weights against float16's 32.
    compact_scales = mx.default_device() == mx.cpu and qmm_cpu.available()[0]
    saved = sum(int(t.n_elements) // 256 * 12 for t in q5 if t.name != "token_embd.weight") if compact_scales else 0
    assert size(wide.model) - size(compact.model) == codes - saved
    assert "5-bit stored as 8-bit" in wide.quantization
    tokens = mx.array([[5, 9, 77, 300]])
    # Widening alone changes no value (the compact scales are exact where float16 rounds,
    # so they are compared with float16 scales on both sides).
    same_scales = load_gguf(path, dequantize=False, widen_5bit=True, k_scales=False)
    assert mx.allclose(same_scales.model(tokens), compact.model(tokens), atol=1e-4).item()


@pytest.mark.parametrize("family", GEMMA)
def test_first_request_gemma_with_sentencepiece(family: str, tmp_path: Path) -> None:
    proto = train_sentencepiece(CORPUS, gemma=True, extra=TURN_TOKENS)
    path = write_gguf(tmp_path / "m.gguf", family, "Q4_K_M", vocab_meta=sentencepiece_vocab(proto, gemma=True))
    settings = load_settings({"model": str(path), "bank_dir": "none", "max_tokens_default": "4"}, environ={})
    loaded = load_model(settings)
    texts = []
    for segmented in ((True, False) if family == "gemma3" else (False,)):
        rt = tiny_runtime(loaded, settings, segmented=segmented)
        try:
            with serve_in_thread(create_app(rt.serving)) as url:
                body = {"messages": [{"role": "user", "content": "hello world " * 3}], "max_tokens": 6, "temperature": 0}
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120, trust_env=False)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        finally:
            rt.engine.stop()
    assert len(set(texts)) == 1  # gemma3: segmented (windows) equals stock
