"""`compile_per_thread`: `mx.compile` kept once per calling thread.

Why: MLX keeps its compile cache per thread (mlx 0.32), keyed by the address of the
compiled Python callable. When a compiled function is destroyed it erases its entries from
the cache of the last thread that called it only. A function traced on one thread (say the
start-up check on the main thread) and called later on another (the engine thread) leaves
its first trace behind; a new callable that happens to reuse the address, called on the
first thread with inputs of the same shapes, then runs that old trace, with the old
graph's constants (another model's weights, another scale). Measured: 25 of 40 tiny models
built one after another failed the batched-decode start-up check that way
(`tests/test_thread_compile.py` reproduces it with plain closures).

One compiled function per thread keeps each function's entries in exactly one cache, so its
destruction (or its thread's end) erases them all. The per-thread lookup costs one
attribute read per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx


class compile_per_thread:  # noqa: N801 - used like the function it stands for
    """`mx.compile(fn, **options)`, compiled separately on each thread that calls it."""

    __slots__ = ("_fn", "_options", "_local")

    def __init__(self, fn: Callable[..., Any], **options: Any) -> None:
        self._fn = fn
        self._options = options
        self._local = threading.local()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled = getattr(self._local, "compiled", None)
        if compiled is None:
            compiled = self._local.compiled = mx.compile(self._fn, **self._options)
        return compiled(*args, **kwargs)
