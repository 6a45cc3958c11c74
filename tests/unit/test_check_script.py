"""scripts/check runs every step and fails if one does; CI runs it and then exactly the README's test command."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check"


def fake_python(tmp_path: Path, failing: tuple[str, ...]) -> Path:
    """Write an interpreter that records every call, fails ``-m MODULE`` for the modules named, passes the rest."""
    fake = tmp_path / "python"
    cases = "".join(f"    {m}) echo \"$2 failed on purpose\"; exit 1 ;;\n" for m in failing)
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/calls\n[ \"$1\" = -m ] || exit 0\ncase \"$2\" in\n"
                    f"{cases}    *) exit 0 ;;\nesac\n")
    fake.chmod(0o755)
    return fake


def check(*args: str, python: Path, root: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(root / "scripts" / "check"), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": str(python)})


def test_every_step_runs_and_the_check_fails_naming_each_that_failed(tmp_path: Path) -> None:
    out = check("ruff", "mypy", "imports", python=fake_python(tmp_path, ("ruff", "mypy")))
    assert out.returncode == 1, out.stderr
    assert "== ruff: FAILED" in out.stderr and "== mypy: FAILED" in out.stderr and "== imports: ok" in out.stderr
    assert "== scripts/check: ruff mypy failed" in out.stderr, out.stderr
    assert check("ruff", "--skip", "ruff", python=fake_python(tmp_path, ("ruff",))).returncode == 0
    unknown = check("lint", python=fake_python(tmp_path, ()))
    assert unknown.returncode == 2 and "no step 'lint'" in unknown.stderr


def test_the_docs_step_runs_only_where_the_checkout_has_a_site(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "check")
    python = fake_python(tmp_path, ())
    out = check("docs", python=python, root=root)
    assert out.returncode == 0 and "== docs: not here (no mkdocs.yml)" in out.stderr, out.stderr
    (root / "mkdocs.yml").write_text("site_name: x\n")
    out = check("docs", python=python, root=root)
    assert out.returncode == 0 and "== docs: ok" in out.stderr, out.stderr
    assert re.search(r"^-m mkdocs build --strict --site-dir ", (tmp_path / "calls").read_text(), re.M)


def test_ci_runs_the_checks_then_exactly_the_readmes_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    [test_command] = re.findall(r"^(bash tests/run test)\b", readme, re.M)
    commands = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd "))]
    assert commands == ["bash tests/run check --skip unit", f"exec {test_command}"], commands
    assert "    check)\n        shift\n        exec bash scripts/check \"$@\"" in (REPO / "tests" / "run").read_text()
