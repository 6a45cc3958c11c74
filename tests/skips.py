"""Skips are accounted for: a run fails when a test is skipped that the allowlist does not name.

``bash tests/run test`` loads this plugin (``-p tests.skips``). "585 passed" says nothing about
what did not run: here every skip must be on ``tests/allowed_skips.txt``, one per line::

    NODE ID | MACHINE | REASON

``MACHINE`` is the machine the entry is for: an entry applies only on a run whose
``$GPUSWAPD_TEST_MACHINE`` names that machine (say ``arch-builder``, a makepkg build without the
test world). Unset, the machine is ``reference``: the README's Debian 12 as root with the test
world up, where nothing is skipped and no entry may apply (an entry for ``reference`` is refused).
``REASON`` must appear in the skip's own reason, so an allowed skip that starts skipping for
another reason fails the run too. ``#`` starts a comment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

DEFAULT = Path(__file__).with_name("allowed_skips.txt")
REFERENCE = "reference"
_XDIST_GROUP = re.compile(r"@[\w-]+$")  # --dist loadgroup appends "@GROUP" to a grouped test's id


@dataclass(frozen=True)
class Allowed:
    """One entry of the allowlist."""

    nodeid: str
    machine: str
    reason: str


def parse(text: str, where: str) -> list[Allowed]:
    """Read an allowlist; a malformed line is a usage error naming the line."""
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split("|")]
        if len(fields) != 3 or not all(fields):
            raise pytest.UsageError(f"{where}:{number}: expected 'NODE ID | MACHINE | REASON', got {raw!r}")
        if fields[1] == REFERENCE:
            raise pytest.UsageError(f"{where}:{number}: nothing may be skipped on the {REFERENCE} machine: "
                                    "make the test run there instead")
        out.append(Allowed(*fields))
    return out


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped report gives."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def machine() -> str:
    """The machine this run is on, as the allowlist names machines."""
    return os.environ.get("GPUSWAPD_TEST_MACHINE") or REFERENCE


def unlisted(skipped: dict[str, str], allowed: list[Allowed], on: str) -> dict[str, str]:
    """The skips (node id -> reason) that no entry for machine ``on`` allows."""
    out = {}
    for nodeid, reason in skipped.items():
        bare = _XDIST_GROUP.sub("", nodeid)
        if not any(a.nodeid == bare and a.machine == on and a.reason in reason for a in allowed):
            out[bare] = reason
    return out


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add --allowed-skips."""
    parser.addoption("--allowed-skips", default=str(DEFAULT), metavar="FILE",
                     help=f"fail the run if a test is skipped that FILE does not list (default {DEFAULT})")


class SkipLedger:
    """Collects every skip the run reports (on xdist's controller, from every worker)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.machine = machine()
        self.allowed = parse(path.read_text(), str(path)) if path.exists() else []
        self.skipped: dict[str, str] = {}
        self.failing: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Note a skip (an xfail is not one: it ran)."""
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped[report.nodeid] = skip_reason(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Fail a run that skipped what the allowlist does not name."""
        self.failing = unlisted(self.skipped, self.allowed, self.machine)
        if self.failing and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """Say which skips were allowed, and which fail the run."""
        allowed = {n: r for n, r in self.skipped.items() if _XDIST_GROUP.sub("", n) not in self.failing}
        if allowed:
            terminalreporter.section(f"skips allowed by {self.path.name} on machine {self.machine}")
            for nodeid, reason in sorted(allowed.items()):
                terminalreporter.line(f"{nodeid}: {reason}")
        if self.failing:
            terminalreporter.section(f"skips {self.path.name} does not allow on machine {self.machine}",
                                     red=True, bold=True)
            for nodeid, reason in sorted(self.failing.items()):
                terminalreporter.line(f"{nodeid}: {reason}", red=True)
            terminalreporter.line(f"{len(self.failing)} unlisted skip(s): the run fails. Make the test run "
                                  f"here, or (not on the {REFERENCE} machine: GPUSWAPD_TEST_MACHINE names it) "
                                  f"add 'NODE ID | MACHINE | REASON' to {self.path}.", red=True)


def pytest_configure(config: pytest.Config) -> None:
    """Register the ledger on the controller (or a run without xdist), not on xdist's workers."""
    if hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(SkipLedger(Path(config.getoption("--allowed-skips"))), "skip-ledger")
