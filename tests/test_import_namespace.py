"""One import namespace: every module of the project is imported as `segserve.<part>`.

The checkout keeps server/, kv/, kernels/, bank/ and config/ at the top level and segserve/
links to them; the wheel installs them under segserve/ only. A stray `import server...` would
work in a checkout (the repository root is on sys.path) but load a second copy of the module
under another name there, and fail outright when installed: this test keeps them out.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARTS = ("server", "kv", "kernels", "bank", "config")


def _python_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return [REPO / rel for rel in out if not rel.startswith("segserve/")]


def _top_level_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return [name for name in found if name.split(".")[0] in PARTS]


def test_no_module_imports_a_part_outside_the_namespace() -> None:
    offenders = {str(p.relative_to(REPO)): names for p in _python_files()
                 if (names := _top_level_imports(p))}
    assert not offenders, offenders


def test_namespace_links_every_part() -> None:
    for part in PARTS:
        link = REPO / "segserve" / part
        assert link.is_symlink() and link.resolve() == REPO / part, part


def test_namespace_modules_are_the_checkout_files() -> None:
    import segserve.kv.segment as segment
    import segserve.server.version as version

    assert Path(segment.__file__).resolve() == REPO / "kv" / "segment.py"
    assert version.__version__
