"""The package's layering, as pyproject.toml's import-linter contracts state it.

Imports under TYPE_CHECKING count: a step that names the Window in a type depends on it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

REPO = Path(__file__).resolve().parents[2]


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on the package under ``root`` with the repository's contracts."""
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold() -> None:
    out = lint(REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_an_upward_import_under_type_checking_breaks_them(tmp_path: Path) -> None:
    shutil.copytree(REPO / "gpuswapd", tmp_path / "gpuswapd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    closing = tmp_path / "gpuswapd" / "window" / "closing.py"
    text = closing.read_text()
    assert "if TYPE_CHECKING:\n" in text
    upward = "    from gpuswapd.window.window import Window  # noqa: F401\n"
    closing.write_text(text.replace("if TYPE_CHECKING:\n", "if TYPE_CHECKING:\n" + upward, 1))
    out = lint(tmp_path)
    assert out.returncode != 0, out.stdout[-4000:]
    assert "gpuswapd.window.closing -> gpuswapd.window.window" in out.stdout
