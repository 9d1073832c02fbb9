"""`compile_per_thread` against `mx.compile` when compiled functions come and go across
threads (segserve.kernels.thread_compile says why)."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from segserve.kernels.thread_compile import compile_per_thread

sys.path.insert(0, str(Path(__file__).parent))
from conftest import decode_backend, make_tiny_model  # noqa: E402


def _closure(c: float) -> Callable[[mx.array], mx.array]:
    k = mx.array(c)  # a constant of the traced graph, as a layer's weights are

    def f(x: mx.array) -> mx.array:
        return x * k + 1.0

    return f


def _closure_at(address: int, c: float) -> Callable[[mx.array], mx.array] | None:
    """A closure over `c` whose object sits at `address` (a dropped closure's), if the
    allocator hands that block out again within a few thousand allocations."""
    held = []
    for _ in range(5000):
        f = _closure(c)
        if id(f) == address:
            return f
        held.append(f)
    return None


def _on_another_thread(fn: Callable[[mx.array], mx.array], x: mx.array) -> None:
    t = threading.Thread(target=lambda: mx.eval(fn(x)))
    t.start()
    t.join()


def _wrong_results(compile_fn: Callable[..., Any], rounds: int = 12) -> tuple[int, int]:
    """(wrong, tried): each round compiles a closure, calls it on this thread and on another,
    drops it, then compiles a new closure (another constant) at the same address and calls
    it here; wrong counts answers with the dropped closure's constant."""
    x = mx.ones((4,))
    wrong = tried = 0
    for i in range(rounds):
        f = _closure(float(i))
        address = id(f)
        fn = compile_fn(f)
        mx.eval(fn(x))
        _on_another_thread(fn, x)
        del f, fn  # no cycle: the closure is freed here
        g = _closure_at(address, 100.0 + i)
        if g is None:
            continue
        tried += 1
        wrong += int(compile_fn(g)(x)[0].item() != 101.0 + i)
    return wrong, tried


def test_plain_compile_reuses_a_dropped_functions_trace_and_per_thread_does_not() -> None:
    # The plain case shows the hazard exists on this MLX (else the per-thread check would
    # prove nothing); the per-thread compile never answers with another closure's constant.
    wrong, tried = _wrong_results(mx.compile)
    assert tried > 0 and wrong > 0
    wrong, tried = _wrong_results(compile_per_thread)
    assert tried > 0 and wrong == 0


def test_per_thread_compile_gives_each_thread_the_same_answer() -> None:
    fn = compile_per_thread(_closure(3.0), shapeless=True)
    out: list[list[float]] = []
    for n in (2, 5):
        t = threading.Thread(target=lambda n=n: out.append(fn(mx.ones((n,))).tolist()))
        t.start()
        t.join()
    assert out == [[4.0, 4.0], [4.0] * 5]
    assert fn(mx.zeros((3,))).tolist() == [1.0, 1.0, 1.0]


def test_batched_decode_check_holds_for_models_built_one_after_another() -> None:
    # The case this guards: the start-up check runs on the thread that builds the runner,
    # decoding on the engine thread; a later model's check must compare its own weights.
    from mlx_lm.models.cache import KVCache

    from segserve.server.runner import batched

    for seed in range(12):
        model = make_tiny_model(seed=seed)
        backend = decode_backend(model, native_layers=False)
        assert batched._compiled_layers(backend) is not None
        assert batched._agrees_with_forward(backend) is None, seed

        def decode(model: Any = model, backend: Any = backend) -> None:
            caches = [[KVCache() for _ in model.model.layers] for _ in range(2)]
            for c in caches:
                model(mx.array([[1, 2, 3]]), cache=c)
            mx.eval(batched.decode_batch(backend, [4, 5], caches))

        t = threading.Thread(target=decode)
        t.start()
        t.join()
        del model, backend, decode
        gc.collect()
