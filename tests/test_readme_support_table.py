"""The README's family table against the family matrices the tests run.

Every family the matrices test (mlx-lm directories: `tests/test_model_families.py`; GGUF
files: `tests/gguf_support.py`) has a row in the README's table, every row names only
families the matrices test, and a row says "yes" for segmented KV and batched decode only
where the matrix expects both (`test_model_families.EXPECTED`). No model is loaded.
"""

from __future__ import annotations

from pathlib import Path

from tests import gguf_support
from tests.test_model_families import EXPECTED, FAMILIES

README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = "| family | GGUF | mlx-lm dir | quantization | segmented KV | batched decode | native CPU ops |"

# README row -> (GGUF matrix families, mlx-lm directory matrix families) it stands for.
ROWS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "Llama 1-3 / SmolLM": (("llama", "llama3"), ("llama", "llama3-rope", "llama-4bit")),
    "Mistral / Mistral-Nemo": (("mistral_nemo",), ("mistral",)),
    "Qwen2": (("qwen2",), ("qwen2",)),
    "Qwen3": (("qwen3",), ("qwen3",)),
    "Phi-3 (4k)": (("phi3",), ("phi3",)),
    # the GGUF architecture is phi3, with rope_factors_{short,long} (tests/test_longrope.py)
    "Phi-3 128k / Phi-3.5 (LongRoPE)": (("phi3",), ("phi3-longrope",)),
    "OLMo 2": (("olmo2",), ("olmo2",)),
    "Granite 3": (("granite",), ("granite",)),
    "SmolLM3 (no RoPE every 4th layer)": (("smollm3",), ("smollm3",)),
    "Gemma 3": (("gemma3",), ("gemma3",)),
    "Gemma 2": (("gemma2",), ("gemma2",)),
}


def _table() -> dict[str, list[str]]:
    lines = README.read_text().splitlines()
    start = lines.index(HEADER) + 2  # past the header and its rule
    rows: dict[str, list[str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_every_tested_family_has_a_row_and_every_row_is_tested() -> None:
    table = _table()
    assert set(table) == set(ROWS), set(table) ^ set(ROWS)
    gguf = {f for g, _ in ROWS.values() for f in g}
    dirs = {f for _, d in ROWS.values() for f in d}
    assert gguf == set(gguf_support.FAMILIES) | set(gguf_support.GEMMA)
    assert dirs == set(FAMILIES)


def test_a_row_claims_only_what_its_families_pass() -> None:
    for name, cells in _table().items():
        gguf_cell, dir_cell, _, segmented, batched, _ = cells
        gguf, dirs = ROWS[name]
        assert gguf_cell.startswith("yes") == bool(gguf), name
        for family in dirs:
            seg, bat = EXPECTED[family]
            assert segmented.startswith("yes") == seg, (name, family)
            assert batched.startswith("yes") == bat, (name, family)
