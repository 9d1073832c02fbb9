"""One version string everywhere: the package metadata, `segserve --version`, `/health` and
`/openapi.json` all report `segserve.server.version.__version__`."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from segserve.config.settings import load_settings
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from segserve.server.version import __version__
from tests.conftest import tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

ROOT = Path(__file__).resolve().parents[1]


def test_installed_metadata_matches() -> None:
    assert importlib.metadata.version("segserve") == __version__


def test_cli_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "segserve.server.cli", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"segserve {__version__}"


def test_license_file_and_metadata() -> None:
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    meta = importlib.metadata.metadata("segserve")
    assert "MIT" in (meta["License-Expression"] or meta["License"] or "")


@pytest.mark.model
def test_health_and_openapi_report_it(gguf_tokenizer: ChatTokenizer) -> None:
    rt = tiny_runtime(tiny_loaded(gguf_tokenizer), load_settings({}, environ={}))
    try:
        with serve_in_thread(create_app(rt.serving)) as url:
            health = httpx.get(url + "/health", timeout=30, trust_env=False).json()
            doc = httpx.get(url + "/openapi.json", timeout=30, trust_env=False).json()
    finally:
        rt.engine.stop()
    assert health["version"] == __version__
    assert doc["info"]["version"] == __version__
