"""A finished request's KV memory is freed when its last reference goes, not by Python's GC.

In a soak, MLX "other" memory (active - weights - bank - tails) grew to 1.47 GB in
8 minutes. Cause: `SegmentedCache.layers` held `SegmentedLayerCache`s that pointed back at
the cache, a reference cycle, so every finished request's tail buffers waited for a
generation-2 collection of the cyclic GC (rare under load: it is counted in Python object
allocations, not bytes). These tests run with the cyclic GC off and bound MLX's active
bytes; with the cycle back they fail (each iteration's tails stay alive).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import mlx.core as mx
import pytest

from segserve.kv.segmented import SegmentedCache
from segserve.server.engine import GenerationRequest
from segserve.server.runner import ChatTokenizer
from tests.conftest import make_tiny_model, ram_store, tiny_loaded
from tests.engine_support import make_engine, run


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _active() -> int:
    mx.synchronize()
    return int(mx.get_active_memory())


def test_dropped_segmented_cache_frees_its_tails(no_cyclic_gc: None) -> None:
    layers, rows = 4, 300
    one = 0
    base = _active()
    for _ in range(20):
        c = SegmentedCache(layers)
        for layer in c.layers:
            k = mx.ones((1, 2, rows, 16))
            layer.update_and_fetch(k, k)
        c.record_tokens(list(range(rows)))
        mx.eval([t for t in (*c._k, *c._v) if t is not None])
        one = c.tail_nbytes()
        del c, layer, k
    assert one > 0
    # 20 caches alive would be 20 * one; freed ones leave at most a little scratch.
    assert _active() - base < one


def test_engine_requests_do_not_accumulate(
    no_cyclic_gc: None, gguf_tokenizer: ChatTokenizer, make_request: Callable[..., GenerationRequest]
) -> None:
    store = ram_store(1 << 20)  # the bank keeps little: what stays is what leaks
    loaded = tiny_loaded(gguf_tokenizer, make_tiny_model(seed=3))
    eng = make_engine(loaded, segmented=True, store=store)
    try:
        def other() -> int:
            return _active() - store.ram_bytes()

        prompts = [[100 + (7 * i + j) % 900 for j in range(40 + 23 * i)] for i in range(4)]
        run(eng, [make_request(p, 8) for p in prompts])
        first = other()
        for _ in range(12):
            run(eng, [make_request(p, 8) for p in prompts])
        # One round's rows as KV bytes: 12 rounds kept alive would be >= 12 of these.
        round_bytes = sum(len(p) + 8 for p in prompts) * loaded.kv_bytes_per_token
        assert round_bytes > 0
        assert other() - first < 2 * round_bytes
    finally:
        eng.stop()
