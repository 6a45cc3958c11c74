"""Failpoints: let the crash tests stop gpuswapd in a chosen phase. Costs nothing when unset.

``GPUSWAPD_FAILPOINT_DELAY="PHASE=SECONDS"`` makes the window wait that long right after it has
persisted its entry into PHASE, before it acts, so a test can kill the daemon there. Phases
after CLOSING are named ``PHASE:closing`` (WAITING_VRAM happens on both ways).
"""

from __future__ import annotations

import asyncio
import os

_ENV = "GPUSWAPD_FAILPOINT_DELAY"


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
