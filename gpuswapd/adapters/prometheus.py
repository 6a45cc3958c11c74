"""The Prometheus text exposition format, read just well enough to sum a gauge over its labels."""

from __future__ import annotations

import re

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def parse_prometheus(text: str) -> dict[str, float]:
    """Read Prometheus text exposition: each metric name and its value summed over label sets."""
    return scan_prometheus(text)[0]


def scan_prometheus(text: str) -> tuple[dict[str, float], list[str]]:
    """Parse what parses; return the sums and the sample lines that did not."""
    sums: dict[str, float] = {}
    bad: list[str] = []
    # Only \n ends a line: str.splitlines() would also split label values at \x1c or \u2028.
    for raw in text.split("\n"):
        line = raw.strip(" \t\r")
        if not line or line.startswith("#"):  # HELP, TYPE, EOF, comments
            continue
        sample = _parse_sample(line)
        if sample is None:
            bad.append(line)
        else:
            name, value = sample
            sums[name] = sums.get(name, 0.0) + value
    return sums, bad


def _parse_sample(line: str) -> tuple[str, float] | None:
    """Parse ``name{labels} value [timestamp] [# exemplar]``; None if malformed."""
    match = _METRIC_NAME.match(line)
    name, i = (match.group(), match.end()) if match else ("", 0)
    brace = _skip_blanks(line, i)
    if brace < len(line) and line[brace] == "{":
        labels = _parse_labels(line, brace)
        if labels is None:
            return None
        quoted_name, i = labels
        if quoted_name is not None:
            if name:
                return None
            name = quoted_name
    elif i < len(line) and line[i] not in " \t":  # e.g. "foo-1 2": not a name, then a value
        return None
    if not name:
        return None
    fields = line[i:].split()
    if "#" in fields:  # an OpenMetrics exemplar follows
        fields = fields[: fields.index("#")]
    if len(fields) not in (1, 2) or any(_number(f) is None for f in fields):
        return None
    value = _number(fields[0])
    return None if value is None else (name, value)


def _parse_labels(line: str, i: int) -> tuple[str | None, int] | None:
    """Skip ``{...}`` from ``line[i]``; return a quoted metric name found inside and the end."""
    i += 1
    quoted_name: str | None = None
    first = True
    while True:
        i = _skip_blanks(line, i)
        if i < len(line) and line[i] == "}":
            return quoted_name, i + 1
        if i < len(line) and line[i] == '"':
            read = _read_quoted(line, i)
            if read is None:
                return None
            label, i = read
            i = _skip_blanks(line, i)
            if first and i < len(line) and line[i] in ",}":
                quoted_name = label  # Prometheus 3 spells UTF-8 names {"name", label="v"}
                if line[i] == ",":
                    i += 1
                first = False
                continue
        else:
            match = _LABEL_NAME.match(line, i)
            if match is None:
                return None
            i = _skip_blanks(line, match.end())
        if i >= len(line) or line[i] != "=":
            return None
        i = _skip_blanks(line, i + 1)
        read = _read_quoted(line, i)
        if read is None:
            return None
        i = _skip_blanks(line, read[1])
        first = False
        if i < len(line) and line[i] == ",":
            i += 1
        elif i >= len(line) or line[i] != "}":
            return None


def _skip_blanks(line: str, i: int) -> int:
    while i < len(line) and line[i] in " \t":
        i += 1
    return i


def _read_quoted(line: str, i: int) -> tuple[str, int] | None:
    """Read a double-quoted string with backslash escapes at ``line[i]``; None if unterminated."""
    if i >= len(line) or line[i] != '"':
        return None
    out: list[str] = []
    i += 1
    while i < len(line):
        ch = line[i]
        if ch == "\\" and i + 1 < len(line):
            nxt = line[i + 1]
            out.append("\n" if nxt == "n" else nxt)
            i += 2
        elif ch == '"':
            return "".join(out), i + 1
        else:
            out.append(ch)
            i += 1
    return None


def _number(token: str) -> float | None:
    """Parse a sample value or timestamp (Go float syntax: ``NaN``, ``+Inf``, ``1.5e3``)."""
    if "_" in token:  # Python's float() takes 1_000; Prometheus does not
        return None
    try:
        return float(token)
    except ValueError:
        return None


# -- the HTTP client ---------------------------------------------------------------------------
