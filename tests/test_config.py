"""config/: one settings object, strict parsing, errors name the key."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from segserve.config.settings import Settings, SettingsError, add_cli_flags, load_settings


def test_defaults() -> None:
    s = load_settings({}, environ={})
    assert s.host == "127.0.0.1" and s.port == 8000 and s.segmented_kv is True


def test_env_and_cli_precedence() -> None:
    s = load_settings({"port": "9001"}, environ={"SEGSERVE_PORT": "9000", "SEGSERVE_SEGMENTED_KV": "0"})
    assert s.port == 9001 and s.segmented_kv is False


@pytest.mark.parametrize("raw", ["yes", "on", "", "2"])
def test_bool_accepts_only_true_false_1_0(raw: str) -> None:
    with pytest.raises(SettingsError, match="SEGSERVE_COMPILE"):
        load_settings({}, environ={"SEGSERVE_COMPILE": raw})


def test_bad_value_names_key() -> None:
    with pytest.raises(SettingsError, match="SEGSERVE_PORT"):
        load_settings({}, environ={"SEGSERVE_PORT": "abc"})


def test_unknown_env_key_is_an_error() -> None:
    with pytest.raises(SettingsError, match="SEGSERVE_NOPE"):
        load_settings({}, environ={"SEGSERVE_NOPE": "1"})


def test_other_env_ignored() -> None:
    assert load_settings({}, environ={"HOME": "/x", "SEGSERVE_INTERNAL_REEXEC": "1"}).port == 8000


def test_kernel_knobs_are_settings() -> None:
    env = {"SEGSERVE_FUSED_WIDE": "single", "SEGSERVE_PIPELINE_LAYERS": "0", "SEGSERVE_FUSED_INFLIGHT": "2",
           "SEGSERVE_PIPELINE_DECODE": "1"}
    s = load_settings({}, environ=env)
    assert (s.fused_wide, s.pipeline_layers, s.fused_inflight, s.pipeline_decode) == ("single", 0, 2, True)
    with pytest.raises(SettingsError, match="SEGSERVE_FUSED_WIDTH"):
        load_settings({}, environ={"SEGSERVE_FUSED_WIDTH": "1"})  # a misspelling still fails


def test_frozen() -> None:
    s = load_settings({}, environ={})
    with pytest.raises(ValidationError):
        s.port = 1


def test_every_setting_has_a_documented_flag() -> None:
    p = argparse.ArgumentParser()
    add_cli_flags(p)
    text = p.format_help()
    for name, info in Settings.model_fields.items():
        assert "--" + name.replace("_", "-") in text
        assert info.description
