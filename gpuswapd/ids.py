"""Identifiers of windows and leases: random in service, drawn from a seed in the simulation."""

from __future__ import annotations

import secrets
from collections.abc import Callable

_token: Callable[[int], str] = secrets.token_hex


def token(nbytes: int) -> str:
    """Return a fresh identifier of ``nbytes`` random bytes, in hex."""
    return _token(nbytes)


def use(source: Callable[[int], str]) -> None:
    """Draw identifiers from ``source`` from now on (a seeded generator replays exactly)."""
    global _token
    _token = source


def reset() -> None:
    """Draw identifiers from the system's randomness again."""
    use(secrets.token_hex)
