"""Route factory: which attention route serves a loaded model.

Owns: the `AttentionRoute` call signature every route implements, `RouteChoice` (the
factory's typed answer), the fused-route registry (`FUSED_ROUTES`, the one place a fused
kernel is plugged in) and `select_route`.

Called once at model load (engine thread), never per token: the chosen route object is
what the attention hook calls for every layer. Nothing here is mutated at run time; the
registry is a tuple edited in source, and tests pass their own via `registry=`.

Invariants:
- `select_route` always returns a usable route: a registered fused route whose predicate
  accepts the model, else the composed reference route (any backend, any shape).
- Registered routes are consulted in order, before the composed route.
- `segserve.kernels.hook.support_check` is the gate for segmented mode as a whole; when it fails the
  server runs stock (contiguous) mode instead, so `select_route` is only asked about
  supported shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from segserve.kernels.composed import KVPair, attend_segments


class AttentionRoute(Protocol):
    """Attention over segments + tail; same contract as `segserve.kernels.composed.attend_segments`
    (`window`: a sliding-window layer's W, passed by the hook for those layers only; a
    `softcap` keyword is passed only to a route chosen for a soft-capped model: the CPU op
    or the composed route)."""

    @property
    def name(self) -> str: ...  # read-only, so frozen dataclasses and plain attributes fit

    def __call__(
        self,
        queries: mx.array,
        segments: Sequence[KVPair],
        tail: KVPair | None,
        *,
        scale: float,
        causal: bool,
        window: int | None = None,
    ) -> mx.array: ...


@dataclass(frozen=True, slots=True)
class ComposedRoute:
    """The reference route as an `AttentionRoute` object (stateless)."""

    name: str = "composed"
    compiled: bool = True

    def __call__(
        self,
        queries: mx.array,
        segments: Sequence[KVPair],
        tail: KVPair | None,
        *,
        scale: float,
        causal: bool,
        window: int | None = None,
        softcap: float = 0.0,
    ) -> mx.array:
        return attend_segments(
            queries, segments, tail, scale=scale, causal=causal, compiled=self.compiled,
            window=window, softcap=softcap,
        )


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """The fused GPU route's settings (`--fused-wide`, `--fused-inflight`, `--cuda-sm-count`,
    `--fused-owned`); None = auto. Built from the settings at start-up and carried by
    `RouteQuery`."""

    fused_wide: str = "paired"  # "paired", "single" or "off"
    fused_inflight: int | None = None
    sm_count: int | None = None
    fused_owned: bool = False


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What a fused route's predicate and constructor get to see about the model."""

    backend: str  # "cpu", "cuda" or "metal" (see `current_backend`)
    head_dim: int
    n_q_heads: int
    n_kv_heads: int
    dtype: mx.Dtype
    options: KernelOptions = KernelOptions()
    softcap: float = 0.0  # the attention logits' soft cap (Gemma 2), 0: none


@dataclass(frozen=True, slots=True)
class FusedRouteSpec:
    """A registered fused route: if `applies(query)`, `build(query)` makes the route."""

    name: str
    applies: Callable[[RouteQuery], bool]
    build: Callable[[RouteQuery], AttentionRoute]


@dataclass(frozen=True, slots=True)
class RouteChoice:
    route: AttentionRoute
    name: str
    reason: str


# ---------------------------------------------------------------------------------------
# FUSED ROUTES REGISTER HERE. Add one FusedRouteSpec per fused kernel, most specific first,
# e.g. FusedRouteSpec("cuda-fused", applies=lambda q: q.backend == "cuda", build=...).
# `build` should import its module lazily so CPU-only installs never load CUDA code.
# A new route must pass `segserve.kernels.selfcheck.self_check` at start-up before it serves.
# ---------------------------------------------------------------------------------------
def _fused_cuda_applies(query: RouteQuery) -> bool:
    if query.backend != "cuda":
        return False  # never import the CUDA module's kernels on other backends
    from segserve.kernels import fused_cuda

    return fused_cuda.applies(query)


def _fused_cuda_build(query: RouteQuery) -> AttentionRoute:
    from segserve.kernels import fused_cuda

    return fused_cuda.build(query)


def _fused_cpu_applies(query: RouteQuery) -> bool:
    if query.backend != "cpu":
        return False
    from segserve.kernels import fused_cpu  # imports the built extension only when asked, once

    return fused_cpu.applies(query)


def _fused_cpu_build(query: RouteQuery) -> AttentionRoute:
    from segserve.kernels import fused_cpu

    return fused_cpu.build(query)


FUSED_ROUTES: tuple[FusedRouteSpec, ...] = (
    FusedRouteSpec("fused_cuda", applies=_fused_cuda_applies, build=_fused_cuda_build),
    FusedRouteSpec("fused_cpu", applies=_fused_cpu_applies, build=_fused_cpu_build),
)


def current_backend() -> str:
    """The backend MLX runs on by default here: "cuda", "metal" or "cpu"."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.cuda.is_available():
        return "cuda"
    return "metal" if mx.metal.is_available() else "cpu"


def select_route(
    backend: str,
    *,
    head_dim: int,
    n_q_heads: int,
    n_kv_heads: int,
    dtype: mx.Dtype,
    registry: Sequence[FusedRouteSpec] | None = None,
    compile: bool = True,
    options: KernelOptions | None = None,
    softcap: float = 0.0,
) -> RouteChoice:
    """Pick the route for one model: the first registered fused route that applies, else
    the composed reference route. `registry` defaults to `FUSED_ROUTES` (tests pass fakes).
    `softcap` > 0 (soft-capped attention logits): the CPU op caps its scores per call, the
    CUDA route compiles the cap into its kernels (`RouteQuery.softcap`); elsewhere the
    composed route serves.
    """
    query = RouteQuery(backend, head_dim, n_q_heads, n_kv_heads, dtype, options or KernelOptions(), softcap)
    if softcap and backend not in ("cpu", "cuda"):
        capped = ComposedRoute(compiled=compile)
        return RouteChoice(capped, capped.name, (
            f"composed reference route: attention logits soft-capped at {softcap:g}, which only "
            "it computes"))
    specs = FUSED_ROUTES if registry is None else registry
    for spec in specs:
        if spec.applies(query):
            route = spec.build(query)
            return RouteChoice(route, route.name, f"fused route {spec.name!r} accepts {query}")
    reason = (
        f"no fused route registered for backend {backend!r}"
        if not specs
        else f"none of the {len(specs)} fused routes accepts {query}"
    )
    route = ComposedRoute(compiled=compile)
    how = "compiled" if compile else "not compiled"
    return RouteChoice(route, route.name, f"composed reference route ({how}): {reason}")
