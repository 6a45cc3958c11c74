"""Facts the docs repeat agree with their one source: the lease drop-in, gpuswapctl's commands."""

from __future__ import annotations

import re
from pathlib import Path

from gpuswapd.ctl import main as ctl

REPO = Path(__file__).resolve().parents[2]
DROPIN = REPO / "units" / "examples" / "gpuswap-lease.conf"
SYSTEMD_PAGE = REPO / "docs" / "operating" / "systemd.md"
CTL_PAGE = REPO / "docs" / "using" / "gpuswapctl.md"


def settings(text: str) -> list[str]:
    """Return a unit file's section headers and settings, in order (no comments, no blank lines)."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def docs_dropin() -> str:
    [block] = [b for b in re.findall(r"```ini\n(.*?)```", SYSTEMD_PAGE.read_text(), re.S)
               if "ExecStartPre=/usr/bin/gpuswapctl acquire" in b]
    return block


def man_dropin() -> str:
    page = (REPO / "packaging" / "man" / "gpuswapctl.1").read_text()
    [block] = [b for b in re.findall(r"^\.nf\n(.*?)^\.fi$", page, re.S | re.M) if "ExecStartPre=" in b]
    return block.replace("\\-", "-")


def test_the_docs_and_gpuswapctl_1_show_the_lease_drop_in_as_the_file_has_it() -> None:
    shipped = settings(DROPIN.read_text())
    assert "SupplementaryGroups=gpuswap" in shipped  # a service with User= may acquire too
    assert settings(docs_dropin()) == shipped, "docs/operating/systemd.md's drop-in differs from gpuswap-lease.conf"
    assert settings(man_dropin()) == shipped, "gpuswapctl(1)'s drop-in differs from units/examples/gpuswap-lease.conf"


def test_a_copy_that_lacks_a_line_is_told_apart() -> None:
    shipped = DROPIN.read_text()
    assert settings(shipped.replace("SupplementaryGroups=gpuswap\n", "")) != settings(shipped)
    assert settings("# a comment\n\n[Service]\n  X=1\n") == ["[Service]", "X=1"]


def test_the_docs_name_every_gpuswapctl_command() -> None:
    parser = ctl.build_parser()
    [commands] = [a.choices for a in parser._actions if a.dest == "command"]
    assert commands is not None
    usage = "\n".join(re.findall(r"^gpuswapctl (.*)$", CTL_PAGE.read_text(), re.M))
    missing = [name for name in commands if not re.search(rf"(^|[\s|]){re.escape(name)}\b", usage, re.M)]
    assert missing == [], f"docs/using/gpuswapctl.md's command list lacks {missing}"
