"""The skip ledger (tests/skips.py): a run with a skip the allowlist does not name fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skips import Allowed, parse, unlisted

REPO = Path(__file__).resolve().parents[2]
TESTS = """
import pytest

def test_runs():
    pass

def test_skips_here():
    pytest.skip("no frobnicator on this host")
"""


def _run(tmp_path: Path, allowlist: str, machine: str = "") -> subprocess.CompletedProcess[str]:
    # In front of the caller's own path: makepkg's check() brings pytest on PYTHONPATH.
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    (tmp_path / "test_x.py").write_text(TESTS)
    (tmp_path / "allowed.txt").write_text(allowlist)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.skips", "--allowed-skips",
                           str(tmp_path / "allowed.txt"), "-q", "-p", "no:cacheprovider", "test_x.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GPUSWAPD_TEST_MACHINE": machine, "PYTHONPATH": path})


def test_an_unlisted_skip_fails_the_run_and_a_listed_one_does_not(tmp_path: Path) -> None:
    out = _run(tmp_path, "# nothing allowed\n")
    assert out.returncode == 1, out.stdout
    assert "1 passed, 1 skipped" in out.stdout
    assert "test_x.py::test_skips_here: no frobnicator on this host" in out.stdout
    assert "1 unlisted skip(s): the run fails" in out.stdout

    entry = "test_x.py::test_skips_here | bare-ci | no frobnicator\n"
    out = _run(tmp_path, entry, machine="bare-ci")
    assert out.returncode == 0, out.stdout
    assert "skips allowed by allowed.txt on machine bare-ci" in out.stdout
    out = _run(tmp_path, entry)  # the reference machine: an entry for another machine does not apply
    assert out.returncode == 1, out.stdout
    assert "does not allow on machine reference" in out.stdout


def test_an_entry_allows_its_test_only_for_its_reason() -> None:
    allowed = [Allowed("t.py::a", "nonroot", "needs root")]
    assert unlisted({"t.py::a": "needs root and unshare"}, allowed, "nonroot") == {}
    assert unlisted({"t.py::a@world": "needs root"}, allowed, "nonroot") == {}  # xdist's group suffix
    assert unlisted({"t.py::a": "needs root"}, allowed, "reference") == {"t.py::a": "needs root"}
    assert unlisted({"t.py::a": "unshare --pid failed"}, allowed, "nonroot") == {"t.py::a": "unshare --pid failed"}
    assert unlisted({"t.py::b": "needs root"}, allowed, "nonroot") == {"t.py::b": "needs root"}


def test_a_malformed_entry_names_its_line() -> None:
    assert parse("# c\n\nt.py::a | ci | why  # note\n", "f") == [Allowed("t.py::a", "ci", "why")]
    with pytest.raises(pytest.UsageError, match=r"f:2: expected 'NODE ID \| MACHINE \| REASON'"):
        parse("t.py::a | ci | why\nt.py::b | needs root\n", "f")
    with pytest.raises(pytest.UsageError, match="f:1: nothing may be skipped on the reference machine"):
        parse("t.py::a | reference | why\n", "f")


def test_the_allowlist_reads() -> None:
    # An entry for the reference machine would not even parse: there, nothing is allowed to skip.
    parse((REPO / "tests" / "allowed_skips.txt").read_text(), "allowed_skips.txt")
