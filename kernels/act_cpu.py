"""The gated MLP activation on the CPU: act(gate) * up as one native op.

Owns: `install(model)` (route a loaded model's MLP activation to the op), `installed`,
`available`, `gated` (the op with MLX's own ops as the fallback) and `uninstall` (benchmarks
compare both in one process).

Why: MLX's CPU build evaluates exp, sigmoid and tanh one element at a time through libm:
SiLU(gate) * up over a 512 x 2816 prefill chunk took ~25 ms where the native op
(`kernels/native/act_op.cpp`, a vectorized exp split over the worker pool) takes ~3.5 ms
on the same core; in a Q4_K_M prefill that was ~20 % of the step (`python
bench/act_cpu.py`). Decode steps with native layers never reach this code (the native
block computes its own activation).

How: mlx-lm's families call `swiglu(gate, up)`, imported by name from
`mlx_lm.models.activations` into each model module (llama, mistral, qwen2/3, phi3, olmo2,
granite, smollm3, ...); `install` replaces that name in the modules the model's layers come
from, as the attention hook does. Gemma 2/3 write `nn.gelu_approx(gate) * up` inside their
MLP's `__call__`: their MLP instances get a subclass whose `__call__` uses the op. The
replacement routes on the inputs: float32 on the CPU with the extension built takes the op,
anything else MLX's own ops, unchanged. The op reads rows at any stride in place: the two
halves of a fused gate|up product (`segserve.kernels.qmm_cpu`'s fused projections) are views
of it, and copying them first took 7.1 against 3.7 ms and 16.5 against 5.5 MB over 512 rows
of a 2816-wide MLP (`python bench/act_cpu.py`, `views_x_copied`). Same values as MLX to float32 rounding (SiLU within
1e-6 relative; GELU-tanh closer to the exact value than MLX's, whose 1 + tanh cancels in
the negative tail: tests/test_act_cpu.py).
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations, gemma2, gemma3_text

_STOCK_SWIGLU = activations.swiglu
_NAME = "swiglu"
SILU, GELU_TANH = 0, 1


def available() -> tuple[bool, str]:
    """Can the op run here? (ok, reason)."""
    from segserve.kernels.fused_cpu import available as ext_available

    ok, why = ext_available()
    if not ok:
        return False, why
    from segserve.kernels.native import _segattn

    if not hasattr(_segattn, "gated_act"):
        return False, "extension lacks gated_act (rebuild: `python -m segserve.kernels.native.build --force`)"
    return True, "segserve.kernels.native._segattn.gated_act"


def gated(gate: mx.array, up: mx.array, act: int) -> mx.array | None:
    """act(gate) * up through the op, or None where it does not serve (then MLX's ops)."""
    if mx.default_device() != mx.cpu or gate.dtype != mx.float32 or up.dtype != mx.float32:
        return None
    if not available()[0]:
        return None
    from segserve.kernels.native import _segattn

    return _segattn.gated_act(gate, up, act)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu` (silu(gate) * x), through the op where it serves."""
    out = gated(gate, x, SILU)
    return out if out is not None else _STOCK_SWIGLU(gate, x)


def _gelu_mlp_call(self: Any, x: mx.array) -> mx.array:
    """Gemma 2/3's MLP forward (`down(gelu_approx(gate(x)) * up(x))`), the gate through the op."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    out = gated(gate, up, GELU_TANH)
    y: mx.array = self.down_proj(out if out is not None else nn.gelu_approx(gate) * up)
    return y


class _Gemma3MLP(gemma3_text.MLP):
    __call__ = _gelu_mlp_call


class _Gemma2MLP(gemma2.MLP):
    __call__ = _gelu_mlp_call


_GELU_MLPS: dict[type, type] = {gemma3_text.MLP: _Gemma3MLP, gemma2.MLP: _Gemma2MLP}


def stock_type(cls: type) -> type:
    """The mlx-lm class a routed MLP stands for (itself for any other class): code that
    checks a layer's structure by exact type sees the MLP it computes the same as."""
    for stock, routed in _GELU_MLPS.items():
        if cls is routed:
            return stock
    return cls


def _swiglu_modules(model: nn.Module) -> list[Any]:
    mods: dict[str, Any] = {}
    for _, m in model.named_modules():
        name = type(m).__module__
        mod = sys.modules.get(name)
        if mod is not None and name != __name__ and getattr(mod, _NAME, None) in (_STOCK_SWIGLU, swiglu):
            mods[name] = mod
    return list(mods.values())


def install(model: nn.Module) -> list[str]:
    """Route the model's MLP activation to the op; returns what was routed (module names,
    and `Class x count` for swapped MLP instances). Idempotent; a no-op (empty list) when
    the op is not available."""
    if not available()[0]:
        return []
    done = []
    for mod in _swiglu_modules(model):
        setattr(mod, _NAME, swiglu)
        done.append(mod.__name__)
    swapped: dict[str, int] = {}
    for _, m in model.named_modules():
        routed = _GELU_MLPS.get(type(m))
        if routed is not None:
            m.__class__ = routed  # same layout: only __call__ differs
        if type(m) in _GELU_MLPS.values():
            swapped[type(m).__name__] = swapped.get(type(m).__name__, 0) + 1
    done += [f"{name} x {n}" for name, n in swapped.items()]
    return done


def uninstall(model: nn.Module) -> None:
    """MLX's own ops again (benchmarks time both in one process)."""
    for mod in _swiglu_modules(model):
        setattr(mod, _NAME, _STOCK_SWIGLU)
    stock = {v: k for k, v in _GELU_MLPS.items()}
    for _, m in model.named_modules():
        if type(m) in stock:
            m.__class__ = stock[type(m)]


def installed(model: nn.Module) -> bool:
    mods = _swiglu_modules(model)
    gelu = [m for _, m in model.named_modules() if type(m) in _GELU_MLPS or type(m) in _GELU_MLPS.values()]
    return bool(mods or gelu) and all(getattr(m, _NAME) is swiglu for m in mods) and all(
        type(m) in _GELU_MLPS.values() for m in gelu)
