"""The one clock of gpuswapd: every read of the time goes through here.

In service these are ``time.time`` and ``time.monotonic``. The deterministic simulation points
both at its virtual clock (``use``), so a history of hours runs in milliseconds and replays
exactly; asyncio's own sleeps and timeouts follow the event loop's ``time()``, which the
simulation's loop also takes from that clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_wall: Callable[[], float] = time.time
_monotonic: Callable[[], float] = time.monotonic


def wall() -> float:
    """Return the wall-clock time in seconds since the epoch (timestamps a person reads)."""
    return _wall()


def monotonic() -> float:
    """Return monotonic seconds (every deadline and duration)."""
    return _monotonic()


def stamp(when: float | None = None, fmt: str = "%Y%m%d-%H%M%S") -> str:
    """Format a wall-clock time (now by default) in local time."""
    return time.strftime(fmt, time.localtime(wall() if when is None else when))


def use(wall_clock: Callable[[], float], monotonic_clock: Callable[[], float]) -> None:
    """Read the time from these clocks from now on (the simulation's virtual time)."""
    global _wall, _monotonic
    _wall, _monotonic = wall_clock, monotonic_clock


def reset() -> None:
    """Read the real clocks again."""
    use(time.time, time.monotonic)
