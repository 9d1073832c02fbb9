"""Tiny random-weight GGUF files for every supported family, written with gguf-py.

Legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized by `gguf.quants.quantize`; gguf-py
cannot quantize K-quants, so their blocks are random bytes with chosen float16 `d`/`dmin`
(every byte pattern is a valid block). Recipes follow llama.cpp's mixes: Q4_K_M / Q5_K_M
put attn_v, ffn_down and the output head (the embedding when tied) in Q6_K.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, quants

HIDDEN, FF, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64
SMALL_VOCAB = 512
Q6_NAMES = ("attn_v", "ffn_down", "output")

RECIPES: dict[str, tuple[T, T]] = {  # name → (most matrices, the Q6_NAMES matrices)
    "Q4_K_M": (T.Q4_K, T.Q6_K),
    "Q5_K_M": (T.Q5_K, T.Q6_K),
    "Q6_K": (T.Q6_K, T.Q6_K),
    "Q8_0": (T.Q8_0, T.Q8_0),
    "Q4_0": (T.Q4_0, T.Q4_0),
    "Q5_1": (T.Q5_1, T.Q5_1),
    "Q5_0": (T.Q5_0, T.Q5_0),
    "Q5_K": (T.Q5_K, T.Q5_K),  # every matrix Q5_K (no Q6_K mix): the 5-bit size checks
    "F16": (T.F16, T.F16),
}
FAMILIES = ("llama", "llama3", "mistral_nemo", "qwen2", "qwen3", "phi3", "olmo2", "granite", "smollm3")
# layers each family's tests need: smollm3's 4th layer is its first without RoPE
MIN_LAYERS = {"smollm3": 4}
GRANITE_SCALES = {"attention.scale": 0.125, "embedding_scale": 4.0, "residual_scale": 0.5, "logit_scale": 2.0}
GEMMA = ("gemma2", "gemma3")  # norms stored as 1 + w, sandwich norms, tied embeddings
GEMMA3_WINDOW = 8
_BLOCK_BYTES = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}


def k_blocks(kind: T, rows: int, cols: int, rng: np.random.Generator, *, equal_pairs: bool = False) -> np.ndarray:
    """Random K-quant rows [rows, bytes]: random codes and sub-block scales, d/dmin set."""
    nb = rows * cols // 256
    raw = rng.integers(0, 256, (nb, _BLOCK_BYTES[kind]), dtype=np.uint8)
    if kind == T.Q6_K:
        raw[:, 208:210] = rng.uniform(2e-4, 1e-3, (nb, 1)).astype(np.float16).view(np.uint8)
        if equal_pairs:  # sub-blocks 2g and 2g+1 share a scale: the 8-bit grid is exact
            raw[:, 193:208:2] = raw[:, 192:208:2]
    else:
        raw[:, 0:2] = rng.uniform(1e-3, 4e-3, (nb, 1)).astype(np.float16).view(np.uint8)
        raw[:, 2:4] = rng.uniform(1e-3, 4e-3, (nb, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def tensor_data(kind: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    if kind in _BLOCK_BYTES:
        return k_blocks(kind, rows, cols, rng)
    w = rng.normal(0, 0.08, (rows, cols)).astype(np.float32)
    if kind == T.F32:
        return w
    if kind == T.F16:
        return w.astype(np.float16)
    return quants.quantize(w, kind)


def _layer_shapes(family: str, heads: int) -> dict[str, tuple[int, int]]:
    q_rows, kv_rows = heads * HEAD_DIM, KV_HEADS * HEAD_DIM
    if family in GEMMA:
        return {"attn_q": (q_rows, HIDDEN), "attn_k": (kv_rows, HIDDEN), "attn_v": (kv_rows, HIDDEN),
                "attn_output": (HIDDEN, q_rows), "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN),
                "ffn_down": (HIDDEN, FF)}
    if family == "olmo2":  # no pre-norms: the norms are separate tensors (see `_write`)
        return {"attn_q": (q_rows, HIDDEN), "attn_k": (kv_rows, HIDDEN), "attn_v": (kv_rows, HIDDEN),
                "attn_output": (HIDDEN, q_rows), "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN),
                "ffn_down": (HIDDEN, FF)}
    if family == "phi3":
        return {"attn_qkv": (q_rows + 2 * kv_rows, HIDDEN), "attn_output": (HIDDEN, q_rows),
                "ffn_up": (2 * FF, HIDDEN), "ffn_down": (HIDDEN, FF)}
    return {"attn_q": (q_rows, HIDDEN), "attn_k": (kv_rows, HIDDEN), "attn_v": (kv_rows, HIDDEN),
            "attn_output": (HIDDEN, q_rows), "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN),
            "ffn_down": (HIDDEN, FF)}


def _copy_tokenizer(w: GGUFWriter, source: Path) -> int:
    r = GGUFReader(str(source))

    def get(key: str) -> Any:
        return r.fields[key].contents()

    w.add_tokenizer_model(get("tokenizer.ggml.model"))
    w.add_tokenizer_pre(get("tokenizer.ggml.pre"))
    tokens = get("tokenizer.ggml.tokens")
    w.add_token_list(tokens)
    w.add_token_merges(get("tokenizer.ggml.merges"))
    w.add_token_types(get("tokenizer.ggml.token_type"))
    for key in ("bos", "eos", "unknown", "padding"):
        name = f"tokenizer.ggml.{key}_token_id"
        if name in r.fields:
            w.add_uint32(name, int(get(name)))
    w.add_chat_template(get("tokenizer.chat_template"))
    return len(tokens)


def write_gguf(
    path: Path, family: str, recipe: str, *, seed: int = 0, tokenizer_from: Path | None = None, tied: bool = False,
    vocab_meta: dict[str, Any] | None = None, layers: int = LAYERS, shape: dict[str, int] | None = None,
    longrope: tuple[list[float], list[float], int, int] | None = None, gemma2_window: int = 512,
) -> Path:
    """A `layers`-layer model of `family` in `recipe` (RECIPES); with `tokenizer_from`, that
    GGUF's tokenizer and chat template (and its vocabulary size); with `vocab_meta`, those
    tokenizer fields (`sentencepiece_vocab`); else a 512-token vocabulary. `shape` overrides
    hidden / ff / heads / kv_heads / head_dim (bench/families_cpu.py's ~0.5B shapes).
    Gemma files are tied (no output tensor), as llama.cpp writes them. `longrope` (phi3):
    (short factors, long factors, original context, context) as llama.cpp's converter writes
    Phi-3 128k: the two factor tensors, the original context and the attention factor.
    `gemma2_window`: a Gemma 2 file's sliding window (its even layers)."""
    global HIDDEN, FF, HEADS, KV_HEADS, HEAD_DIM
    saved = (HIDDEN, FF, HEADS, KV_HEADS, HEAD_DIM)
    if shape:
        HIDDEN, FF, HEADS, KV_HEADS, HEAD_DIM = (shape.get(k, v) for k, v in zip(
            ("hidden", "ff", "heads", "kv_heads", "head_dim"), saved, strict=True))
    try:
        return _write(path, family, recipe, seed, tokenizer_from, tied or family in GEMMA, vocab_meta, layers,
                      longrope, gemma2_window)
    finally:
        HIDDEN, FF, HEADS, KV_HEADS, HEAD_DIM = saved


def _write(path: Path, family: str, recipe: str, seed: int, tokenizer_from: Path | None, tied: bool,
           vocab_meta: dict[str, Any] | None, layers: int,
           longrope: tuple[list[float], list[float], int, int] | None = None, gemma2_window: int = 512) -> Path:
    rng = np.random.default_rng(seed)
    arch = {"llama3": "llama", "mistral_nemo": "llama"}.get(family, family)
    heads = 8 if family == "mistral_nemo" else HEADS  # Nemo: head size != hidden / heads
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{family}-{recipe}")
    vocab = _copy_tokenizer(w, tokenizer_from) if tokenizer_from else SMALL_VOCAB
    if vocab_meta:
        vocab = _add_vocab(w, vocab_meta)
    w.add_context_length(longrope[3] if longrope else 1024)
    if longrope:
        short, long, original, context = longrope
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(context / original) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.array(long, dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(short, dtype=np.float32))
    w.add_embedding_length(HIDDEN)
    w.add_block_count(layers)
    w.add_feed_forward_length(FF)
    w.add_head_count(heads)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1_000_000.0 if family == "gemma3" else 10000.0)
    if family == "gemma3":
        w.add_sliding_window(GEMMA3_WINDOW)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2)  # global layers 1, 3, ...
        w.add_float32("gemma3.rope.freq_base_swa", 10000.0)
    if family == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
        w.add_sliding_window(gemma2_window)
    if family == "granite":
        for key, value in GRANITE_SCALES.items():
            w.add_float32(f"granite.{key}", value)
    if family in ("qwen3", "mistral_nemo", *GEMMA):
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    main, q6 = RECIPES[recipe]

    def add(name: str, rows: int, cols: int, kind: T) -> None:
        data = tensor_data(kind, rows, cols, rng)
        w.add_tensor(name, data, raw_dtype=kind if data.dtype == np.uint8 else None)

    def norm() -> Any:
        return (1.0 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32)
    add("token_embd.weight", vocab, HIDDEN, q6 if tied else main)
    w.add_tensor("output_norm.weight", norm())
    if not tied:
        add("output.weight", vocab, HIDDEN, q6)
    if family == "llama3":  # llama.cpp's rope_freqs: the divisor of each frequency
        w.add_tensor("rope_freqs.weight", llama3_factors(HEAD_DIM, 10000.0))
    for i in range(layers):
        if family != "olmo2":
            w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
            w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        if family in (*GEMMA, "olmo2"):
            w.add_tensor(f"blk.{i}.post_attention_norm.weight", norm())
            w.add_tensor(f"blk.{i}.post_ffw_norm.weight", norm())
        for part, (rows, cols) in _layer_shapes(family, heads).items():
            add(f"blk.{i}.{part}.weight", rows, cols, q6 if part in Q6_NAMES else main)
        if family == "qwen2":
            for part, rows in (("attn_q", heads * HEAD_DIM), ("attn_k", KV_HEADS * HEAD_DIM), ("attn_v", KV_HEADS * HEAD_DIM)):
                w.add_tensor(f"blk.{i}.{part}.bias", rng.normal(0, 0.1, rows).astype(np.float32))
        if family in ("qwen3", "gemma3"):
            for part in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{part}.weight", (1.0 + rng.normal(0, 0.1, HEAD_DIM)).astype(np.float32))
        if family == "olmo2":  # q/k RMSNorm over all heads at once: one weight per row
            for part, rows in (("attn_q_norm", heads * HEAD_DIM), ("attn_k_norm", KV_HEADS * HEAD_DIM)):
                w.add_tensor(f"blk.{i}.{part}.weight", (1.0 + rng.normal(0, 0.1, rows)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_factors(head_dim: int, base: float, factor: float = 8.0, low: float = 1.0,
                   high: float = 4.0, original: int = 8192) -> np.ndarray:
    """What llama.cpp's converter writes for Llama 3.1 scaling (its `rope_freqs`)."""
    freqs = base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)  # periods / 2pi
    wavelen = 2 * np.pi * freqs
    low_wl, high_wl = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    out = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _add_vocab(w: GGUFWriter, meta: dict[str, Any]) -> int:
    w.add_tokenizer_model(meta["model"])
    w.add_token_list(meta["tokens"])
    w.add_token_scores(meta["scores"])
    w.add_token_types(meta["types"])
    w.add_bos_token_id(meta["bos"])
    w.add_eos_token_id(meta["eos"])
    w.add_unk_token_id(meta["unk"])
    w.add_add_space_prefix(meta["add_space_prefix"])
    w.add_chat_template(meta["template"])
    return len(meta["tokens"])


def sentencepiece_vocab(model_proto: bytes, *, gemma: bool = False) -> dict[str, Any]:
    """What llama.cpp's converter writes for a SentencePiece `tokenizer.model`
    (`_create_vocab_sentencepiece`: pieces, scores, types 1 normal / 2 unknown / 3 control /
    5 unused / 6 byte); Gemma files turn the space prefix off."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        kind = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i) else 1
        types.append(kind)
    template = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] }}"
                "{{ '<end_of_turn>\\n' }}{% endfor %}{{ '<start_of_turn>model\\n' }}")
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "bos": sp.bos_id(),
            "eos": sp.eos_id(), "unk": sp.unk_id(), "add_space_prefix": not gemma, "template": template}


def _ids(gemma: bool) -> dict[str, Any]:
    """Gemma's special pieces and ids (<pad> 0, <eos> 1, <bos> 2, <unk> 3); Llama's are
    SentencePiece's defaults (<unk> 0, <s> 1, </s> 2). Gemma's <mask> is 4."""
    if not gemma:
        return {}
    return {"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3, "pad_piece": "<pad>", "eos_piece": "<eos>",
            "bos_piece": "<bos>", "unk_piece": "<unk>"}


def train_sentencepiece(text: str, *, vocab: int = 400, gemma: bool = False, extra: tuple[str, ...] = ()) -> bytes:
    """A tiny SentencePiece BPE model trained on `text` with Llama 2's settings (byte fallback,
    identity normalization, whitespace kept; Gemma: no dummy prefix); `extra`: control tokens."""
    import io

    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_writer=out, vocab_size=vocab, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=not gemma, split_digits=True, allow_whitespace_only_pieces=True,
        control_symbols=["<mask>", *extra] if gemma else list(extra), character_coverage=1.0, minloglevel=2, **_ids(gemma),
    )
    return out.getvalue()
