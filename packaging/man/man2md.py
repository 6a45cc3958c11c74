r"""Write the site's reference pages (docs/reference/) from the man pages, the one source of what they say.

The man pages (roff, packaging/man/*.[158]) are what the package ships and what `man` reads; the site
shows the same text, made here from the roff the pages use: .TH, .SH, .SS, .PP, .TP/.TQ, .IP, .RS/.RE,
.nf/.fi, .br, the font macros (.B, .I, .BR, .RB, .IR, .RI, .BI, .IB) and the escapes \fB \fI \fR
\fP \- \e \& \(dq \(em \(en \(bu \(aq. Headings become Markdown (the site's table of contents
and anchors); what lies under them, HTML. A request it does not know is an error, not lost text.

    python packaging/man/man2md.py            # write docs/reference/NAME.SECTION.md for every page
    python packaging/man/man2md.py --check    # exit 1, naming each page that is not up to date

tests/unit/test_docs.py fails when a reference page differs from what this script writes.
"""

from __future__ import annotations

import html
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = ROOT / "docs" / "reference"
PAGES = ("gpuswapd.8", "gpuswapctl.1", "gpuswapd.toml.5", "gpuswapd-gateway.8")

_CHARS = {"dq": '"', "em": "\u2014", "en": "\u2013", "bu": "\u2022", "aq": "'", "lq": "\u201c", "rq": "\u201d"}
_FONTS = {"B": "code", "I": "em"}


@dataclass
class Block:
    """One paragraph, term, list item or preformatted run, at an indentation level."""

    kind: str  # "p", "dt", "li", "pre"
    level: int
    text: str  # roff text: escapes and font changes still in it


def _args(line: str) -> list[str]:
    r"""Split a request's arguments as roff does: spaces part them, double quotes group, ``\ `` joins."""
    lexer = shlex.shlex(line.replace("\\ ", "\x00"), posix=True)
    lexer.whitespace_split, lexer.quotes, lexer.escape = True, '"', ""
    return [a.replace("\x00", "\\ ") for a in lexer]


def _font_macro(name: str, args: list[str]) -> str:
    """Return the text of a font request: .B/.I set one font, .BR and the like alternate two."""
    if name in ("B", "I"):
        return f"\\f{name}{' '.join(args)}\\fR"
    fonts = name
    return "".join(f"\\f{fonts[i % 2]}{a}" for i, a in enumerate(args)) + "\\fR"


def inline(text: str) -> str:
    """Return the HTML of a run of roff text: its escapes resolved, its font changes as elements."""
    out, font, previous = [], "R", "R"
    pos = 0
    for m in re.finditer(r"\\(f[BIRP]|\(..|[-e&~|^ ])", text):
        out.append(html.escape(text[pos:m.start()], quote=False))
        pos = m.end()
        esc = m.group(1)
        if esc.startswith("f"):
            new = previous if esc[1] == "P" else esc[1]
            if new != font:
                if font in _FONTS:
                    out.append(f"</{_FONTS[font]}>")
                if new in _FONTS:
                    out.append(f"<{_FONTS[new]}>")
                previous, font = font, new
        elif esc.startswith("("):
            if esc[1:] not in _CHARS:
                raise ValueError(f"man2md.py does not know the character \\{esc}: add it to _CHARS")
            out.append(html.escape(_CHARS[esc[1:]], quote=False))
        else:
            out.append({"-": "-", "e": "\\", "&": "", "~": "\u00a0", "|": "", "^": "", " ": "\u00a0"}[esc])
    out.append(html.escape(text[pos:], quote=False))
    if font in _FONTS:
        out.append(f"</{_FONTS[font]}>")
    if "\\" in text[pos:]:
        raise ValueError(f"man2md.py does not know an escape in {text!r}")
    return "".join(out)


def parse(roff: str) -> tuple[str, str, list[tuple[str, int, list[Block]]]]:
    """Return the page's name, section, and its headings (text, depth) each with the blocks under it."""
    name = section = ""
    parts: list[tuple[str, int, list[Block]]] = [("", 0, [])]
    blocks = parts[-1][2]
    level = 0
    body = 0  # 1 under a .TP term or after .IP: the text is indented one more
    pending: Block | None = None  # a paragraph or item still taking lines
    want_term = False  # the next line is a .TP or .TQ term
    fill = True

    def add(kind: str, lvl: int, text: str = "") -> Block:
        nonlocal pending
        block = Block(kind, lvl, text)
        blocks.append(block)
        pending = block
        return block

    def text_line(text: str) -> None:
        nonlocal want_term, pending, body
        if want_term:
            add("dt", level, text)
            want_term, pending, body = False, None, 1
        elif not fill:
            assert pending is not None and pending.kind == "pre"
            pending.text += text + "\n"
        elif pending is None:
            add("p", level + body, text)
        else:
            pending.text += (" " if pending.text and not pending.text.endswith("\n") else "") + text

    for raw in roff.splitlines():
        if raw.startswith(('.\\"', "'\\\"")) or raw.strip() == ".":
            continue
        if not raw.startswith("."):
            text_line(raw)
            continue
        request, _, rest = raw[1:].partition(" ")
        args = _args(rest)
        if request == "TH":
            name, section = args[0].lower(), args[1]
        elif request in ("nh", "ad", "hy"):
            continue
        elif request in ("SH", "SS"):
            parts.append((" ".join(args), 2 if request == "SH" else 3, []))
            blocks, level, body, pending, want_term = parts[-1][2], 0, 0, None, False
        elif request in ("PP", "LP", "P"):
            pending, body = None, 0
        elif request in ("TP", "TQ"):
            if request == "TP" or not (blocks and blocks[-1].kind == "dt"):
                pending = None
            want_term = True
        elif request == "IP":
            if args and args[0]:  # a bullet: an item of a list, at the text's own indent
                add("li", level + body, "")
            else:  # no tag: a paragraph indented as a term's text is
                add("p", level + 1, "")
                body = 1
        elif request in ("RS", "RE") and not fill:
            continue  # an indent inside preformatted text: the text keeps its own
        elif request == "RS":
            level, body, pending = level + 1, 0, None
        elif request == "RE":
            level, body, pending = max(0, level - 1), 0, None
        elif request == "br":
            if pending is not None:
                pending.text += "\n"
        elif request == "nf":
            fill = False
            add("pre", level + body, "")
        elif request == "fi":
            fill, pending = True, None
        elif request in ("B", "I", "BR", "RB", "IR", "RI", "BI", "IB"):
            text_line(_font_macro(request, args))
        else:
            raise ValueError(f"man2md.py does not know the request .{request}: {raw!r}")
    return name, section, parts


def _render(blocks: list[Block], i: int, level: int) -> tuple[list[str], int]:
    out: list[str] = []
    while i < len(blocks) and blocks[i].level >= level:
        b = blocks[i]
        if b.level > level:
            inner, i = _render(blocks, i, level + 1)
            out += ['<div class="man-indent">', *inner, "</div>"]
        elif b.kind == "dt":
            terms = []
            while i < len(blocks) and blocks[i].kind == "dt" and blocks[i].level == level:
                terms.append(f"<dt>{inline(blocks[i].text)}</dt>")
                i += 1
            inner, i = _render(blocks, i, level + 1)
            if out and out[-1] == "</dl>":
                out.pop()
            else:
                out.append("<dl>")
            out += [*terms, "<dd>", *inner, "</dd>", "</dl>"]
        elif b.kind == "li":
            item = [f"<p>{_lines(b.text)}</p>"] if b.text.strip() else []
            inner, i = _render(blocks, i + 1, level + 1)
            if out and out[-1] == "</ul>":
                out.pop()
            else:
                out.append("<ul>")
            out += ["<li>", *item, *inner, "</li>", "</ul>"]
        elif b.kind == "pre":
            out.append(f"<pre><code>{inline(b.text.rstrip(chr(10)))}</code></pre>")
            i += 1
        else:
            if b.text.strip():
                out.append(f"<p>{_lines(b.text)}</p>")
            i += 1
    return out, i


def _lines(text: str) -> str:
    """Return a paragraph's HTML, its .br breaks kept."""
    return "<br>\n".join(inline(line) for line in text.strip("\n").split("\n"))


def render(roff: str, source: str) -> str:
    """Return the Markdown page of a man page."""
    name, section, parts = parse(roff)
    out = [f"# {name}({section})", "",
           f"<!-- Written by packaging/man/man2md.py from {source}: edit the man page, then run the script. -->", ""]
    for heading, depth, blocks in parts:
        if heading:
            out += [f"{'#' * depth} {heading}", ""]
        body, _ = _render(blocks, 0, 0)
        if body:
            # One HTML block, without blank lines (Markdown would end the block there).
            out += ["\n".join(line for line in "\n".join(body).split("\n") if line.strip()), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def pages() -> dict[Path, str]:
    """Return every reference page and the text it should have."""
    return {OUT / f"{page}.md": render((HERE / page).read_text(), f"packaging/man/{page}") for page in PAGES}


def main(argv: list[str]) -> int:
    """Write the reference pages, or with --check say which are not up to date."""
    if argv[1:] == ["--check"]:
        stale = [str(p.relative_to(ROOT)) for p, text in pages().items() if not p.exists() or p.read_text() != text]
        for name in stale:
            print(f"{name} is not up to date: run python packaging/man/man2md.py", file=sys.stderr)
        return 1 if stale else 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    for path, text in pages().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
