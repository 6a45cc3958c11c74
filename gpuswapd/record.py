"""The window record: what status shows, what the state file holds, what history keeps."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from gpuswapd.errors import GpuswapError
from gpuswapd.leases import Lease, LeaseBook
from gpuswapd.phases import Phase, check_transition


@dataclass
class PhaseTiming:
    """When the window entered and left one phase (wall clock, seconds)."""

    phase: Phase
    started_at: float
    ended_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Serialize, with the duration when the phase has ended."""
        out: dict[str, Any] = {"phase": str(self.phase), "started_at": self.started_at,
                               "ended_at": self.ended_at}
        if self.ended_at is not None:
            out["took_s"] = round(self.ended_at - self.started_at, 3)
        return out


@dataclass
class WindowRecord:
    """One GPU window, from acquire to the resident restored."""

    id: str
    phase: Phase = Phase.IDLE
    opened_at: float = 0.0
    closed_at: float | None = None
    timings: list[PhaseTiming] = field(default_factory=list)
    # What the window changed, written before it is changed, so it can always be undone.
    timers: list[str] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    container: dict[str, Any] | None = None
    leases: LeaseBook = field(default_factory=LeaseBook)
    restarts: int = 0
    error: dict[str, Any] | None = None
    outcome: str | None = None
    degraded: str | None = None

    @classmethod
    def new(cls, now: float | None = None) -> WindowRecord:
        """Start the record of a new window."""
        return cls(id=time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3), opened_at=now or time.time())

    def enter(self, phase: Phase, now: float | None = None) -> None:
        """Move to ``phase`` (checked against the transition table) and time it."""
        check_transition(self.phase, phase)
        now = time.time() if now is None else now
        if self.timings and self.timings[-1].ended_at is None:
            self.timings[-1].ended_at = now
        self.phase = phase
        if phase is Phase.IDLE:
            self.closed_at = now
        else:
            self.timings.append(PhaseTiming(phase, now))

    def fail(self, err: GpuswapError) -> None:
        """Remember the first error, tagged with the phase it happened in."""
        if err.phase is None:
            err.phase = str(self.phase)
        if self.error is None:
            self.error = err.to_dict()

    def took(self, phase: Phase) -> float:
        """Sum the seconds spent in ``phase`` (it may be entered twice: WAITING_VRAM)."""
        return sum((t.ended_at or time.time()) - t.started_at for t in self.timings if t.phase is phase)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """Serialize the whole record; with ``now``, leases carry their remaining time."""
        return {
            "id": self.id, "phase": str(self.phase), "opened_at": self.opened_at,
            "closed_at": self.closed_at, "timings": [t.to_dict() for t in self.timings],
            "timers": self.timers, "units": self.units, "container": self.container,
            "leases": [lease.to_dict(now) for lease in self.leases.all()], "restarts": self.restarts,
            "error": self.error, "outcome": self.outcome, "degraded": self.degraded,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WindowRecord:
        """Rebuild a record from ``to_dict`` output (as read from the state file)."""
        return cls(
            id=str(data["id"]), phase=Phase(data["phase"]), opened_at=float(data["opened_at"]),
            closed_at=data.get("closed_at"),
            timings=[PhaseTiming(Phase(t["phase"]), t["started_at"], t.get("ended_at"))
                     for t in data.get("timings", [])],
            timers=list(data.get("timers", [])), units=list(data.get("units", [])),
            container=data.get("container"),
            leases=LeaseBook([Lease.from_dict(d) for d in data.get("leases", [])]),
            restarts=int(data.get("restarts", 0)), error=data.get("error"),
            outcome=data.get("outcome"), degraded=data.get("degraded"),
        )
