"""`--weights` (float32 | q4 | q8 | quantized | auto) and its CPU fallback rules.

auto on CPU = the file's quantized weights through the extension where it is built (its
self-check failing falls back to float32 + BLAS), float32 + BLAS without it; q4/q8 go through the
quantized matmul extension when it is available and passes its start-up self-check, else
through MLX's own kernels with one logged reason. Runs with or without the extension built
(availability and the self-check are replaced where needed).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from segserve.config.settings import SettingsError, load_settings
from segserve.server.runner import qweights


def test_weights_values() -> None:
    for value in ("auto", "float32", "q4", "q8", "quantized"):
        assert load_settings({"weights": value}, environ={}).weights == value
    with pytest.raises(SettingsError, match="--weights"):
        load_settings({"weights": "q3"}, environ={})


def test_auto_plan_on_cpu_follows_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    from segserve.kernels import qmm_cpu

    if mx.default_device() != mx.cpu:
        pytest.skip("CPU rule")
    auto = load_settings({}, environ={})
    monkeypatch.setattr(qmm_cpu, "available", lambda: (True, "test"))
    plan = qweights.weights_plan(auto)
    assert (plan.mode, plan.auto, plan.note) == ("q4", True, "")
    monkeypatch.setattr(qmm_cpu, "available", lambda: (False, "not built"))
    plan = qweights.weights_plan(auto)
    assert plan.mode == "float32" and "not built" in plan.note
    # An explicit choice is kept (q4 without the extension = MLX's own kernels).
    assert qweights.weights_plan(load_settings({"weights": "q4"}, environ={})).mode == "q4"


@pytest.mark.model
def test_failed_self_check_is_logged_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from segserve.kernels import qmm_cpu
    from segserve.server.runner import load_model
    from segserve.server.runner import model as model_mod

    if mx.default_device() != mx.cpu:
        pytest.skip("CPU rule")
    monkeypatch.setattr(qmm_cpu, "available", lambda: (True, "test"))
    monkeypatch.setattr(model_mod, "route_cpu", lambda m, shape, x8="": (False, "self-check failed (test)"))
    with caplog.at_level(logging.WARNING, logger="segserve.runner"):
        lm = load_model(load_settings({"weights": "q4"}, environ={}))
    assert "CPU qmm extension" not in lm.quantization and "bit" in lm.quantization
    assert sum("self-check failed (test)" in r.getMessage() for r in caplog.records) == 1
