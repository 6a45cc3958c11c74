"""The skip ledger (tests/skips.py): a run with a skip the allowlist does not name fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.skips import Allowed, parse, unlisted

pytest_plugins = ("pytester",)

REPO = Path(__file__).resolve().parents[2]
TESTS = """
import pytest

def test_runs():
    pass

def test_skips_here():
    pytest.skip("no frobnicator on this host")
"""


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, allowlist: str,
         machine: str = "") -> pytest.RunResult:
    """Run a pytest session with the plugin, in this process (a subprocess costs a second of imports)."""
    pytester.makepyfile(test_x=TESTS)
    allowed = pytester.makefile(".txt", allowed=allowlist)
    monkeypatch.setenv("GPUSWAPD_TEST_MACHINE", machine)
    return pytester.runpytest_inprocess("-p", "tests.skips", "--allowed-skips", str(allowed), "-q",
                                        "-p", "no:cacheprovider", "-p", "no:xdist", "test_x.py")


def test_an_unlisted_skip_fails_the_run_and_a_listed_one_does_not(pytester: pytest.Pytester,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    out = _run(pytester, monkeypatch, "# nothing allowed\n")
    text = str(out.stdout)
    assert out.ret == 1, text
    assert "1 passed, 1 skipped" in text
    assert "test_x.py::test_skips_here: no frobnicator on this host" in text
    assert "1 unlisted skip(s): the run fails" in text

    entry = "test_x.py::test_skips_here | bare-ci | no frobnicator\n"
    out = _run(pytester, monkeypatch, entry, machine="bare-ci")
    assert out.ret == 0, str(out.stdout)
    assert "skips allowed by allowed.txt on machine bare-ci" in str(out.stdout)
    out = _run(pytester, monkeypatch, entry)  # the reference machine: an entry for another machine does not apply
    assert out.ret == 1, str(out.stdout)
    assert "does not allow on machine reference" in str(out.stdout)


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
