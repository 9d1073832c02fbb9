"""`python -m segserve.kernels.native.build`: --soft never fails set-up, --strict fails CI loudly."""

from __future__ import annotations

from pathlib import Path

import pytest

from segserve.kernels.native import build


@pytest.fixture
def failing_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    log = tmp_path / "build.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "fatal error: mlx/mlx.h: no such file\n")

    def fail(force: bool = False) -> Path:
        raise build.BuildError("c++ failed: fatal error: mlx/mlx.h: no such file")

    monkeypatch.setattr(build, "build", fail)
    monkeypatch.setattr(build, "up_to_date", lambda: False)
    monkeypatch.setattr(build, "LOG", log)
    monkeypatch.setattr(build, "REPO", tmp_path)
    return log


def test_soft_exits_zero_with_one_line(failing_build: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert build.main(["--soft"]) == 0
    out = capsys.readouterr()
    assert out.out.count("\n") == 1 and "CPU extension unavailable" in out.out
    assert out.err == ""


def test_strict_exits_one_with_the_log_tail(failing_build: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert build.main(["--strict"]) == 1
    err = capsys.readouterr().err
    assert "fatal error: mlx/mlx.h" in err and "line 99" in err and "line 0\n" not in err


def test_soft_and_strict_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        build.main(["--soft", "--strict"])


def test_ci_builds_strictly_and_setup_softly() -> None:
    root = Path(build.__file__).resolve().parents[2]
    assert "segserve.kernels.native.build --strict" in (root / ".ci" / "run").read_text()
    assert "segserve.kernels.native.build --soft" in (root / "Makefile").read_text()
