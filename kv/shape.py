"""`ModelShape`: the model's dimensions, as the cache, the kernels and the runner read them.

Owns: the one typed record of what a loaded model is shaped like (layers, heads, head size,
widths, vocabulary, context, each layer's sliding window, a tied output head). It lives
here, below the kernels and the runner, so that both can be handed it; it is built once at
load from mlx-lm's model args by `segserve.server.runner.model.model_shape` (the one reader
of those args for these facts) and carried by `LoadedModel.shape`.
Who mutates: nobody (frozen); any thread may read it.
Invariants: `len(windows) == num_layers` when the model's caches are served by segments
(`cache_refusal == ""`); 0 stands for "the model does not say" in `intermediate_size`,
`vocab_size` and `max_position_embeddings`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int = 0  # the MLP's width; 0: not given
    vocab_size: int = 0  # width of the logits; 0: not given (the tokenizer's then)
    max_position_embeddings: int = 0  # 0: not given
    # Each layer's sliding window (None: global attention), as the model's own caches keep
    # it (`segserve.kernels.hook.layer_windows`); empty when `cache_refusal` says why not.
    windows: tuple[int | None, ...] = ()
    cache_refusal: str = ""  # why the model's caches cannot be served by segments ("": they can)
    tie_word_embeddings: bool = False  # the output head is the embedding table
    # Soft-capped attention logits (gemma2), computed inside the model's own attention; 0: none.
    attn_logit_softcapping: float = 0.0
