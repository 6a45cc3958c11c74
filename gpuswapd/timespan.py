"""Time spans in systemd's syntax (systemd.time(7)): ``15m``, ``1h 30min``, ``1.5h``, ``90``."""

from __future__ import annotations

import math
import re

# Seconds per unit, as systemd's parse_time() knows them; "m" is minutes, "M" months.
_UNITS: dict[str, float] = {
    "us": 1e-6, "usec": 1e-6, "µs": 1e-6, "μs": 1e-6,
    "ms": 1e-3, "msec": 1e-3,
    "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
    "w": 604800.0, "week": 604800.0, "weeks": 604800.0,
    "M": 2629800.0, "month": 2629800.0, "months": 2629800.0,
    "y": 31557600.0, "year": 31557600.0, "years": 31557600.0,
}
_TERM = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([^\d\s.]*)")
# How format_span() names units, largest first (systemd's format_timespan()).
_FORMAT = (("y", 31557600.0), ("month", 2629800.0), ("w", 604800.0), ("d", 86400.0),
           ("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3))


class SpanError(ValueError):
    """A string is not a time span."""


def parse_span(text: str) -> float:
    """Parse a systemd time span into seconds; a bare number means seconds."""
    if not isinstance(text, str):
        raise SpanError(f"expected a time span string, got {type(text).__name__}")
    s = text.strip()
    if not s:
        raise SpanError("empty time span")
    if s == "infinity":
        return math.inf
    total, pos = 0.0, 0
    while pos < len(s):
        m = _TERM.match(s, pos)
        if m is None or m.end() == pos:
            raise SpanError(f"not a time span: {text!r} (try '15m', '1h 30min' or '90s')")
        number, unit = m.group(1), m.group(2)
        if unit and unit not in _UNITS:
            raise SpanError(f"unknown time unit {unit!r} in {text!r}")
        if not unit and m.end() < len(s) and not s[m.end()].isspace():
            raise SpanError(f"not a time span: {text!r} (try '15m', '1h 30min' or '90s')")
        total += float(number) * _UNITS[unit or "s"]
        pos = m.end()
        while pos < len(s) and s[pos].isspace():
            pos += 1
    return total


def format_span(seconds: float) -> str:
    """Format seconds the way systemd prints a time span (``1h 30min``, ``2.5s``)."""
    if math.isinf(seconds):
        return "infinity"
    if seconds <= 0:
        return "0"
    parts: list[str] = []
    rest = seconds
    for name, size in _FORMAT:
        if rest < size * 0.9995 and not (name == "ms" and not parts):
            continue
        if name in ("s", "ms") and not parts and rest < 60 and rest != int(rest):
            # Below a minute, systemd prints fractions of a second (2.5s) rather than ms.
            return f"{rest:.3g}s" if rest >= 1 else f"{rest * 1000:.3g}ms"
        n = int(rest // size + 1e-9)
        if n:
            parts.append(f"{n}{name}")
            rest -= n * size
        if rest < 1e-3:
            break
    return " ".join(parts) if parts else "0"
