"""The bank namespace changes when the chat template or the weight files change.

A model directory replaced in place (same path, other weights) or a new template must never
reuse stored KV rows: both are in `LoadedModel.namespace` (the weights through `revision`,
a content identity of the files: see `segserve.server.runner.model.dir_revision`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx

from segserve.server.runner.model import _load_mlx_lm, dir_revision
from segserve.server.runner.tokenizer import ChatTokenizer
from tests.conftest import tiny_loaded
from tests.test_model_families import write_family_dir


def test_template_changes_namespace(gguf_tokenizer: ChatTokenizer) -> None:
    loaded = tiny_loaded(gguf_tokenizer)
    other = dataclasses.replace(
        loaded, tokenizer=dataclasses.replace(gguf_tokenizer, chat_template=gguf_tokenizer.chat_template + " ")
    )
    assert loaded.namespace != other.namespace
    assert loaded.namespace == tiny_loaded(gguf_tokenizer).namespace  # deterministic


def test_weights_replaced_in_place_change_revision(tmp_path: Path) -> None:
    model_dir = write_family_dir(tmp_path / "m", "llama")
    first = _load_mlx_lm(str(model_dir), "float32", False).revision
    assert _load_mlx_lm(str(model_dir), "float32", False).revision == first  # stable
    # Same path, same size, other weights (one value changed): a new revision.
    shard = model_dir / "model.safetensors"
    weights = mx.load(str(shard))
    assert isinstance(weights, dict)
    name = sorted(weights)[-1]
    weights[name] = weights[name] + 1
    mx.save_safetensors(str(shard), weights, metadata={"format": "mlx"})
    assert _load_mlx_lm(str(model_dir), "float32", False).revision != first


def test_revision_covers_every_shard_and_the_config(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"a" * 3_000_000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"b" * 10)
    (tmp_path / "config.json").write_text("{}")
    base = dir_revision(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"c" * 10)
    second = dir_revision(tmp_path)
    assert second != base
    (tmp_path / "config.json").write_text('{"rope_theta": 1}')
    assert dir_revision(tmp_path) != second
    # A copy elsewhere (other mtimes, other path) has the same identity: replicas share.
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in tmp_path.glob("*.*"):
        (copy / p.name).write_bytes(p.read_bytes())
    assert dir_revision(copy) == dir_revision(tmp_path)
