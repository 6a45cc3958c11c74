"""The window's phases and the one table of transitions between them."""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """Where a GPU window stands."""

    IDLE = "IDLE"
    DRAINING = "DRAINING"
    PAUSING_TIMERS = "PAUSING_TIMERS"
    STOPPING_RESIDENT = "STOPPING_RESIDENT"
    WAITING_VRAM = "WAITING_VRAM"
    BOOTING = "BOOTING"
    WARMING = "WARMING"
    WAKING = "WAKING"
    READY = "READY"
    RECOVERING = "RECOVERING"
    CLOSING = "CLOSING"
    RESTORING = "RESTORING"
    DEGRADED = "DEGRADED"
    RESUMING_TIMERS = "RESUMING_TIMERS"


P = Phase
# IDLE ─acquire→ DRAINING → PAUSING_TIMERS → STOPPING_RESIDENT → WAITING_VRAM → BOOTING → WARMING → READY
# With a parked engine: WAITING_VRAM → WAKING → READY; a wake that fails (or answers the canary
# differently) goes back to WAITING_VRAM for a cold BOOTING.
# READY ─engine fails→ RECOVERING → (WARMING → READY) | CLOSING; a restart that fails warming goes back
# to RECOVERING for the next restart.
# READY ─last lease gone + linger→ CLOSING → WAITING_VRAM → RESTORING → RESUMING_TIMERS → IDLE
# A bare window (no engine): WAITING_VRAM → READY once its memory is free.
# A direct switch: the closing window goes CLOSING → IDLE once its engine is down, and the next one,
# which takes over the paused timers and stopped units, goes DRAINING → WAITING_VRAM; if it cannot
# open, DRAINING → CLOSING restores them.
# Any failure before READY rolls back through CLOSING; DRAINING changed nothing, so it returns to IDLE.
# RESTORING that fails waits in DEGRADED and tries again; the timers stay paused meanwhile.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    P.IDLE: frozenset({P.DRAINING}),
    P.DRAINING: frozenset({P.PAUSING_TIMERS, P.IDLE, P.WAITING_VRAM, P.CLOSING}),
    P.PAUSING_TIMERS: frozenset({P.STOPPING_RESIDENT, P.CLOSING}),
    P.STOPPING_RESIDENT: frozenset({P.WAITING_VRAM, P.CLOSING}),
    P.WAITING_VRAM: frozenset({P.BOOTING, P.WAKING, P.READY, P.RESTORING, P.CLOSING}),
    P.WAKING: frozenset({P.READY, P.WAITING_VRAM, P.CLOSING}),
    P.BOOTING: frozenset({P.WARMING, P.CLOSING}),
    P.WARMING: frozenset({P.READY, P.CLOSING, P.RECOVERING}),
    P.READY: frozenset({P.RECOVERING, P.CLOSING}),
    P.RECOVERING: frozenset({P.WARMING, P.CLOSING}),
    P.CLOSING: frozenset({P.WAITING_VRAM, P.RESTORING, P.IDLE}),
    P.RESTORING: frozenset({P.RESUMING_TIMERS, P.DEGRADED}),
    P.DEGRADED: frozenset({P.RESTORING}),
    # Calls that outlived their deadline landed after the timers resumed: the restore is made sure again.
    P.RESUMING_TIMERS: frozenset({P.IDLE, P.RESTORING}),
}

class TransitionError(AssertionError):
    """A phase change the table does not allow: a bug in gpuswapd."""


def check_transition(old: Phase, new: Phase) -> None:
    """Fail loudly on a phase change the table does not allow."""
    if new not in TRANSITIONS[old]:
        raise TransitionError(f"phase {old} cannot go to {new}")
