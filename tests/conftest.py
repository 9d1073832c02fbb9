"""Shared fixtures: tiny random-weight models, fake segments, requests, a bank in tmp.

The unit layer never needs the real model; tests that do are marked `model` and use
the session-scoped `real_runtime`/`real_server` fixtures in tests/e2e_support.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from segserve.bank import Bank, bank_namespace
from segserve.config.settings import Settings, load_settings
from segserve.kv.segment import ROOT_DIGEST, Segment
from segserve.server.engine import GenerationRequest
from segserve.server.runner import (
    ChatTokenizer,
    DecodeBackend,
    LoadedModel,
    SamplingParams,
    embedded_model_path,
    from_gguf_metadata,
    kv_bytes_per_token,
    model_shape,
)


@pytest.fixture(autouse=True, scope="session")
def _cache_home_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The server's default `--bank-dir` is under $XDG_CACHE_HOME: point it (for this
    process and every server it starts) at a temporary directory, never the real home."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


TINY_NAMESPACE = bank_namespace(model="tiny", revision="r0", dtype="float32", quantization="none", kv_layout="t", tokenizer="t", chat_template="t")


def ram_store(max_bytes: int = 1 << 30) -> Bank:
    """The real session bank, RAM tier only, for engine and HTTP tests."""
    return Bank(TINY_NAMESPACE, max_bytes)


def tiny_args(**over: Any) -> llama.ModelArgs:
    base: dict[str, Any] = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=49152,
        head_dim=64,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rope_traditional=True,
        tie_word_embeddings=True,
    )
    base.update(over)
    return llama.ModelArgs(**base)


def make_tiny_model(seed: int = 0, **over: Any) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(tiny_args(**over))
    # Larger-than-default weights so greedy choices are well separated (no near ties).
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def gguf_tokenizer() -> ChatTokenizer:
    _, meta = mx.load(str(embedded_model_path()), return_metadata=True)
    assert isinstance(meta, dict)
    chat, _ = from_gguf_metadata(meta)
    return chat


@pytest.fixture
def tiny_model() -> llama.Model:
    return make_tiny_model()


def decode_backend(model: Any, *, native_layers: bool = True) -> DecodeBackend:
    """A bare model's batched decode, as `load_model` builds it (`LoadedModel.decode`)."""
    return DecodeBackend(model, model_shape(model), native_layers=native_layers)


def tiny_loaded(tok: ChatTokenizer, model: llama.Model | None = None, context: int = 1024) -> LoadedModel:
    m = model or make_tiny_model()
    shape = model_shape(m)
    return LoadedModel(
        model=m,
        tokenizer=tok,
        model_id="tiny-test",
        source="random",
        revision="r0",
        quantization="float32",
        shape=shape,
        context_length=context,
        kv_dtype="float32",
        kv_bytes_per_token=kv_bytes_per_token(shape.num_layers, shape.n_kv_heads, shape.head_dim, 4),
        weights_bytes=0,
    )


@pytest.fixture
def fake_segment() -> Callable[..., Segment]:
    def make(rows: int, layers: int = 2, heads: int = 2, dim: int = 8, parent: str = ROOT_DIGEST, start: int = 0) -> Segment:
        ks = [mx.random.normal((1, heads, rows, dim)) for _ in range(layers)]
        vs = [mx.random.normal((1, heads, rows, dim)) for _ in range(layers)]
        mx.eval(ks, vs)
        return Segment.seal(ks, vs, list(range(start, start + rows)), parent)

    return make


@pytest.fixture
def make_request() -> Callable[..., GenerationRequest]:
    counter = iter(range(1_000_000))

    def make(prompt: list[int], max_tokens: int = 8, **kw: Any) -> GenerationRequest:
        sampling = kw.pop("sampling", SamplingParams(temperature=0.0))
        return GenerationRequest(f"req-{next(counter)}", tuple(prompt), max_tokens, sampling, **kw)

    return make


@pytest.fixture
def settings_factory() -> Callable[..., Settings]:
    def make(**over: Any) -> Settings:
        over.setdefault("bank_dir", "none")  # tests never default to the per-user cache
        return load_settings({k: str(v) for k, v in over.items()}, environ={})

    return make


@pytest.fixture
def bank_dir(tmp_path: Any) -> Iterator[Any]:
    d = tmp_path / "bank"
    d.mkdir()
    yield d


def bigram_model(seed: int, vocab: int) -> object:
    """A tiny model whose attention output is zero: each next token is a function of the
    current one only, so greedy text enters a cycle within a few dozen tokens (with a
    small vocabulary) and the n-gram drafts are right most of the time. (A random model
    with attention never repeats itself; the verify forward's attention is checked
    against one-token steps in tests/test_speculative.py.)"""
    m = make_tiny_model(seed=seed, vocab_size=vocab)
    for layer in m.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 0.0
    mx.eval(m.parameters())
    return m


def cycling_loaded(tok: ChatTokenizer) -> LoadedModel:
    """`bigram_model(5, 256)` as the engine loads a model, without an end of text: every
    answer runs to max_tokens and its drafts verify (speculation tests)."""
    lm = tiny_loaded(tok, bigram_model(5, 256), context=4096)  # type: ignore[arg-type]
    return dataclasses.replace(lm, tokenizer=dataclasses.replace(lm.tokenizer, eos_ids=frozenset()))
