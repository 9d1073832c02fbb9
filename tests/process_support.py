"""Run `segserve serve` as a real process on a tiny random-weight model (seconds to start).

`write_tiny_model_dir` writes an mlx-lm model directory (config, safetensors, the embedded
model's tokenizer and chat template) for `--model`; `ServerProcess` starts the CLI on a
free loopback port, waits for /health, and keeps its combined log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
from mlx.utils import tree_flatten

from segserve.server.runner import embedded_model_path, from_gguf_metadata, tokenizer_config
from tests.conftest import make_tiny_model, tiny_args
from tests.http_support import free_port

REPO = Path(__file__).resolve().parents[1]


def write_tiny_model_dir(out: Path, *, context: int = 8192) -> Path:
    """A 2-layer llama (hidden 64) with SmolLM2's tokenizer. The end-of-text rows of the
    (tied) embedding are zeroed: their logit is 0 while the best other logit is positive,
    so greedy decoding never stops early and a long stream stays in flight."""
    out.mkdir(parents=True, exist_ok=True)
    _, meta = mx.load(str(embedded_model_path()), return_metadata=True)
    assert isinstance(meta, dict)
    chat, tok = from_gguf_metadata(meta)
    model = make_tiny_model(seed=11, max_position_embeddings=context)
    emb = model.model.embed_tokens.weight
    for i in chat.eos_ids:
        emb[i] = 0.0
    model.model.embed_tokens.weight = emb
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    args = tiny_args(max_position_embeddings=context)
    config: dict[str, Any] = {
        k: getattr(args, k)
        for k in (
            "model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "vocab_size",
            "head_dim", "max_position_embeddings", "rope_theta", "rope_traditional",
            "tie_word_embeddings",
        )
    }
    (out / "config.json").write_text(json.dumps(config))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(chat, context)))
    return out


class ServerProcess:
    """`python -m segserve.server.cli serve ARGS` on a free port; `log()` is its stdout+stderr."""

    def __init__(self, log_path: Path, *args: str, append: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("SEGSERVE_")}
        with log_path.open("a" if append else "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "segserve.server.cli", "serve", "--port", str(self.port), *args],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
            )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.log())
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy:\n" + self.log())
            time.sleep(0.2)

    def wait_exit(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError("server did not exit in time:\n" + self.log()) from None

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
