"""The documentation builds: the MkDocs site with no broken link or anchor and no page outside its nav, and
the README's links (the front page, read on the forge and in /usr/share/doc) lead somewhere."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extras (makepkg's check() runs without it)")
    pytest.importorskip("material", reason="mkdocs-material is in the dev extras")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=120, cwd=config.parent,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strict(tmp_path: Path) -> None:
    out = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "site" / "operating" / "troubleshooting" / "index.html").is_file()


def test_the_sites_checks_report_a_page_outside_the_nav_and_a_broken_link_or_anchor(tmp_path: Path) -> None:
    # The project's own settings (validation, strict), on a site of three pages: one in the nav with a
    # link to a page that is not there and an anchor that is not there, one outside the nav.
    config = (REPO / "mkdocs.yml").read_text()
    config = config[:config.index("\nnav:")] + "\nnav:\n  - Home: index.md\n  - Other: other.md\n"
    (tmp_path / "mkdocs.yml").write_text(config)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](gone.md), [other](other.md#nowhere)\n")
    (docs / "other.md").write_text("# Other\n")
    (docs / "stray.md").write_text("# Stray\n")
    out = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0
    assert re.search(r"not included in the \"nav\" configuration:\s+- stray\.md", out.stderr), out.stderr
    assert "'gone.md'" in out.stderr and "'#nowhere'" in out.stderr, out.stderr


def anchors(page: Path) -> set[str]:
    """Return the anchors of a Markdown page's headings, as MkDocs (and the forge) make them."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    heads = re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)
    return {re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", h.lower()).strip()) for h in heads}


def broken_links(page: Path) -> list[str]:
    """Return each relative link of a Markdown page whose file, or heading, is not there."""
    broken = []
    for _, target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    return broken


def test_the_readmes_links_lead_to_files_and_headings_that_exist() -> None:
    assert broken_links(REPO / "README.md") == []
    assert broken_links(REPO / "CONTRIBUTING.md") == []


def test_a_broken_link_is_told_apart(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## The one\n\n[x](b.md) [y](a.md#the-one) [z](#nope) [w](https://x/y)\n")
    assert broken_links(tmp_path / "a.md") == ["b.md", "#nope"]


def man2md() -> ModuleType:
    spec = importlib.util.spec_from_file_location("man2md", REPO / "packaging" / "man" / "man2md.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("man2md", module)  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_are_written_from_the_man_pages_as_they_are() -> None:
    pages = man2md().pages()
    assert len(pages) == 4
    for path, text in pages.items():
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale: run python packaging/man/man2md.py"


def test_the_reference_keeps_the_man_pages_text_and_structure() -> None:
    m = man2md()
    page = m.render('.TH X 8 2026\n.SH NAME\nx \\- does \\fBthis\\fR\n.SH OPTIONS\n.TP\n.BI \\-\\-for " SPAN"\n'
                    'Hold it.\n.IP\nStill held.\n.RS\n.nf\na < b\n.fi\n.RE\n.PP\nAfter.\n', "x.8")
    assert page.startswith("# x(8)\n")
    assert "## NAME\n\n<p>x - does <code>this</code></p>\n" in page
    assert ("<dl>\n<dt><code>--for</code><em> SPAN</em></dt>\n<dd>\n<p>Hold it.</p>\n<p>Still held.</p>\n"
            '<pre><code>a &lt; b</code></pre>\n</dd>\n</dl>\n<p>After.</p>') in page
    with pytest.raises(ValueError, match=r"\.SY"):
        m.render(".SY x\n", "x.1")
