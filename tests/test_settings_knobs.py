"""Every knob is a setting: the kernels' and the CPU extension's included, none read from
the environment outside config/, all documented in docs/configuration.md."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest

from segserve.config.launcher import apply_native_settings, native_environment
from segserve.config.settings import (
    ENV_PREFIX,
    NATIVE_KNOBS,
    Settings,
    SettingsError,
    load_settings,
)
from segserve.server.runner import forward

ROOT = Path(__file__).resolve().parents[1]


def test_native_knobs_are_settings_and_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"SEGSERVE_SEGATTN_ISA": "generic", "SEGSERVE_SEGATTN_THREADS": "3", "SEGSERVE_QMM_ISA": "avx2",
           "SEGSERVE_QMM_THREADS": "2", "SEGSERVE_QMM_SPIN_US": "0", "SEGSERVE_QMM_GEMM_MIN_ROWS": "32"}
    s = load_settings({}, environ=env)
    assert native_environment(s) == {"SEGATTN_ISA": "generic", "SEGATTN_THREADS": "3", "QMM_ISA": "avx2",
                                     "QMM_THREADS": "2", "QMM_SPIN_US": "0", "QMM_GEMM_MIN_ROWS": "32"}
    for var in NATIVE_KNOBS.values():
        monkeypatch.delenv(var, raising=False)
    assert apply_native_settings(load_settings({"qmm_threads": "4"}, environ={})) == {"QMM_THREADS": "4"}
    import os

    assert os.environ["QMM_THREADS"] == "4" and "SEGATTN_ISA" not in os.environ
    assert native_environment(load_settings({}, environ={})) == {}  # auto: left alone


def test_qmm_x8_setting_reaches_the_extension() -> None:
    """`--qmm-x8 off` is exported as QMM_X8 before the extension's first op and read there
    (a fresh process: the extension reads its variables once)."""
    import subprocess
    import sys

    from segserve.kernels import qmm_cpu

    if not qmm_cpu.available()[0]:
        pytest.skip(qmm_cpu.available()[1])
    code = ("from segserve.config.settings import load_settings\n"
            "from segserve.config.launcher import apply_native_settings\n"
            "import sys\n"
            "apply_native_settings(load_settings({}, environ={'SEGSERVE_QMM_X8': sys.argv[1]}))\n"
            "from segserve.kernels.native import _segattn\n"
            "print(_segattn.qmm_x8(), _segattn.qmm_x8_takes(1, 256, 6), _segattn.qmm_x8_takes(1, 256, 4))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "QMM_X8"}
    seen = {mode: subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env,
                                 check=True).stdout.split() for mode in ("off", "on")}
    assert seen == {"off": ["off", "False", "False"], "on": ["on", "True", "True"]}
    default = subprocess.run([sys.executable, "-c", code.replace("{'SEGSERVE_QMM_X8': sys.argv[1]}", "{}"), "-"],
                             capture_output=True, text=True, env=env, check=True).stdout.split()
    assert default == ["auto", "True", "False"]  # Q6_K rows only


@pytest.mark.parametrize(("key", "value"), [
    ("SEGSERVE_QMM_X8", "maybe"), ("SEGSERVE_QMM_ISA", "sse"), ("SEGSERVE_QMM_THREADS", "0"), ("SEGSERVE_QMM_GEMM_MIN_ROWS", "1"),
    ("SEGSERVE_FUSED_WIDE", "1"), ("SEGSERVE_PIPELINE_LAYERS", "-1"), ("SEGSERVE_CUDA_SM_COUNT", "0"),
])
def test_bad_knob_values_name_the_variable(key: str, value: str) -> None:
    with pytest.raises(SettingsError, match=key):
        load_settings({}, environ={key: value})


def test_auto_means_unset() -> None:
    s = load_settings({"fused_inflight": "auto", "cuda_sm_count": "auto"}, environ={"SEGSERVE_QMM_SPIN_US": "auto"})
    assert s.fused_inflight is None and s.cuda_sm_count is None and s.qmm_spin_us is None


def test_pipelining_comes_from_configuration_not_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEGSERVE_PIPELINE_LAYERS", "9")  # no longer read by the runner
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(forward, "_pipelining", forward.Pipelining())
    assert forward.pipeline_layers() == 4 and forward.decode_pipeline_layers() == 0
    forward.configure_pipelining(forward.Pipelining(layers=2, decode=True))
    assert forward.pipeline_layers() == 2 and forward.decode_pipeline_layers() == 2


def test_no_environment_reads_outside_config() -> None:
    pattern = re.compile(r"os\.environ|os\.getenv|getenv\(")
    offenders = []
    for folder in ("kernels", "kv", "bank", "server/runner", "server/engine", "server/scheduling"):
        for path in (ROOT / folder).rglob("*.py"):
            if pattern.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_every_setting_is_in_the_configuration_table() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [name for name in Settings.model_fields if f"`{ENV_PREFIX}{name.upper()}`" not in doc]
    assert missing == []
    for var in NATIVE_KNOBS.values():
        assert f"`{var}`" in doc


def test_configuration_table_says_what_the_settings_say() -> None:
    """Each row's default is the setting's own, and each setting has exactly one row."""
    from segserve.config.settings import flag_of

    doc = (ROOT / "docs" / "configuration.md").read_text()
    for name, field in Settings.model_fields.items():
        main = doc.split("\n## ", 1)[0]  # before the first section: the settings table
        rows = [line for line in main.splitlines() if line.startswith(f"| `{flag_of(name)}` |")]
        assert len(rows) == 1, name
        assert f"| `{field.default!r}` |" in rows[0], name
