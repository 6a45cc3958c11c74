"""Failpoints: let the crash tests stop gpuswapd in a chosen phase. Costs nothing when unset.

``GPUSWAPD_FAILPOINT_DELAY="PHASE=SECONDS"`` makes the window wait that long right after it has
persisted its entry into PHASE, before it acts, so a test can kill the daemon there. Phases
after CLOSING are named ``PHASE:closing`` (WAITING_VRAM happens on both ways). One more point is
not a phase: ``prefetch:measured``, between the close's measure of the resident's model files and
its read of them (where a test swaps a file).

``GPUSWAPD_FAILPOINT_SHUTDOWN_BOUND=SECONDS`` shortens the shutdown's bound (never lengthens it:
the units' ``TimeoutStopSec=`` is sized for the real one), so a test can see it run out.
"""

from __future__ import annotations

import asyncio
import os

_ENV = "GPUSWAPD_FAILPOINT_DELAY"
_BOUND_ENV = "GPUSWAPD_FAILPOINT_SHUTDOWN_BOUND"


def _delays() -> dict[str, float]:
    spec = os.environ.get(_ENV, "")
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        phase, _, seconds = item.partition("=")
        try:
            out[phase.strip()] = float(seconds)
        except ValueError:
            continue
    return out


_DELAYS = _delays()


async def failpoint(phase: str) -> None:
    """Pause at ``phase`` if a test asked for it."""
    delay = _DELAYS.get(phase)
    if delay:
        await asyncio.sleep(delay)


def shutdown_bound(bound: float) -> float:
    """Return the shutdown's bound: ``bound``, or less if a test asked for less."""
    try:
        asked = float(os.environ.get(_BOUND_ENV, ""))
    except ValueError:
        return bound
    return min(bound, asked) if asked > 0 else bound
