"""Memory sizes with IEC suffixes (``21GiB``, ``512MiB``); SI suffixes are decimal."""

from __future__ import annotations

import re
from decimal import Decimal

_SUFFIX: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gib": 1024**3, "t": 1024**4, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
MAX_SIZE = 2**63 - 1  # bytes: far beyond any card; what a signed 64-bit count holds
_MAX_DIGITS = 40  # a longer number is out of range whatever its suffix


class SizeError(ValueError):
    """A string is not a memory size."""


def parse_size(text: str) -> int:
    """Parse a size such as ``21GiB`` or ``21.5G`` (IEC) or ``20GB`` (SI) into bytes."""
    if not isinstance(text, str):
        raise SizeError(f"expected a size string such as '21GiB', got {type(text).__name__}")
    m = _SIZE.fullmatch(text)
    if m is None or m.group(2).lower() not in _SUFFIX:
        raise SizeError(f"not a size: {text[:80]!r} (try '21GiB' or '512MiB')")
    number = m.group(1)
    # Exact arithmetic: a float would overflow on hundreds of digits (and round large sizes).
    size = None if len(number) > _MAX_DIGITS else int(Decimal(number) * _SUFFIX[m.group(2).lower()])
    if size is None or size > MAX_SIZE:
        raise SizeError(f"size out of range: {text[:40]!r}{'...' if len(text) > 40 else ''} is more than "
                        f"{MAX_SIZE} bytes")
    return size


def format_size(nbytes: int | float) -> str:
    """Format bytes for people: ``21.0 GiB``, ``512 MiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit == "GiB" else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
