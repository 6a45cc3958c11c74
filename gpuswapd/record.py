"""The window record: what status shows, what the state document holds, what history keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpuswapd import clock, ids
from gpuswapd.config import DEFAULT_PROFILE, ProfileKind
from gpuswapd.errors import GpuswapError
from gpuswapd.leases import Lease, LeaseBook
from gpuswapd.phases import Phase, check_transition
from gpuswapd.sizes import format_size


@dataclass
class PhaseTiming:
    """When the window entered and left one phase (wall clock, seconds), opening or closing."""

    phase: Phase
    started_at: float
    ended_at: float | None = None
    stage: str = "open"  # "open" until the window starts closing, then "close"

    def to_dict(self) -> dict[str, Any]:
        """Serialize, with the duration when the phase has ended."""
        out: dict[str, Any] = {"phase": str(self.phase), "stage": self.stage, "started_at": self.started_at,
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
    # Set when no state could be read and this record was made from the configuration.
    baseline: dict[str, Any] | None = None
    start: str = "cold"  # "warm": the engine was woken from park
    profile: str = "default"
    kind: ProfileKind = ProfileKind.ENGINE  # BARE: no engine, the card is handed to the lease holders
    # A direct switch: the window this one took the card from (the resident stayed down), and the
    # resident's restore (start and verify) that the switch saved, as last measured.
    switched_from: str | None = None
    switched_to: str | None = None
    saved: dict[str, Any] | None = None
    # A preemption: who asked, at what priority, when the leases are revoked (at ``deadline``).
    preempted: dict[str, Any] | None = None
    # Host pids of engines gpuswapd took down for this window (its own, or the one it switched
    # from): the card may list them, and their memory, until it comes free. Never strangers.
    freeing: list[int] = field(default_factory=list)
    freeing_unknown: bool = False  # one of them went with its pids unknown (Docker could not list them)
    # Switched to from a bare window: the holders' processes of that window may still hold memory.
    after_bare: bool = False
    # How the resident came back (gpuswapd.window.identity): "as_it_was", "smaller" (even after a restart
    # with the room it had), "unchecked" (it could not be read); None: this window did not restore it.
    restored: str | None = None
    resident_changed: dict[str, Any] | None = None  # it came back smaller: was, now, repaired
    # The close's read of the resident's model files into the page cache (prefetch.py), and the
    # resident's time from its start to its verifying completion.
    prefetch: dict[str, Any] | None = None
    resident_s: float | None = None
    # In memory only: its hold has ended, and its close begins; it takes no new lease meanwhile.
    sealed: bool = field(default=False, compare=False)

    @classmethod
    def new(cls, now: float | None = None) -> WindowRecord:
        """Start the record of a new window."""
        return cls(id=f"{clock.stamp()}-{ids.token(3)}", opened_at=now or clock.wall())

    @property
    def pending_switch(self) -> bool:
        """Tell whether this is a switched window that has not begun opening yet."""
        return self.switched_from is not None and not self.timings

    @property
    def closing(self) -> bool:
        """Tell whether the window has started closing (or rolling back), or is about to."""
        return self.sealed or any(t.stage == "close" for t in self.timings)

    def enter(self, phase: Phase, now: float | None = None) -> None:
        """Move to ``phase`` (checked against the transition table) and time it."""
        check_transition(self.phase, phase)
        now = clock.wall() if now is None else now
        if self.timings and self.timings[-1].ended_at is None:
            self.timings[-1].ended_at = now
        stage = "close" if self.closing or phase is Phase.CLOSING else "open"
        self.phase = phase
        if phase is Phase.IDLE:
            self.closed_at = now
        else:
            self.timings.append(PhaseTiming(phase, now, stage=stage))

    def fail(self, err: GpuswapError) -> None:
        """Remember the first error, tagged with the phase it happened in."""
        if err.phase is None:
            err.phase = str(self.phase)
        if self.error is None:
            self.error = err.to_dict()

    def took(self, phase: Phase, stage: str | None = None) -> float:
        """Sum the seconds spent in ``phase`` (of one ``stage``, if given)."""
        return sum((t.ended_at or clock.wall()) - t.started_at for t in self.timings
                   if t.phase is phase and (stage is None or t.stage == stage))

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """Serialize the whole record; with ``now``, leases carry their remaining time."""
        return {
            "id": self.id, "phase": str(self.phase), "opened_at": self.opened_at,
            "closed_at": self.closed_at, "timings": [t.to_dict() for t in self.timings],
            "timers": self.timers, "units": self.units, "container": self.container,
            "leases": [lease.to_dict(now) for lease in self.leases.all()], "restarts": self.restarts,
            "error": self.error, "outcome": self.outcome, "degraded": self.degraded, "baseline": self.baseline,
            "start": self.start, "profile": self.profile, "kind": self.kind,
            "switched_from": self.switched_from, "switched_to": self.switched_to, "saved": self.saved,
            "preempted": self.preempted, "freeing": self.freeing,
            "freeing_unknown": self.freeing_unknown, "after_bare": self.after_bare,
            "restored": self.restored, "resident_changed": self.resident_changed,
            "prefetch": self.prefetch, "resident_s": self.resident_s,
        }

    @classmethod
    def from_dict(cls, data: Any) -> WindowRecord:
        """Rebuild a record from ``to_dict`` output; ValueError names what is wrong."""
        d = _Fields(data, "window")
        timings = [_timing(t, f"window.timings[{i}]") for i, t in enumerate(d.items("timings"))]
        closing = False
        for t in timings:  # a record of gpuswapd 0.1 has no stage: CLOSING starts the close
            closing = closing or t.phase is Phase.CLOSING or t.stage == "close"
            t.stage = "close" if closing else "open"
        leases = [_lease(x, f"window.leases[{i}]") for i, x in enumerate(d.items("leases"))]
        return cls(
            id=d.text("id"), phase=d.phase("phase"), opened_at=d.number("opened_at"),
            closed_at=d.number("closed_at", optional=True), timings=timings,
            timers=d.texts("timers"), units=d.texts("units"), container=d.table("container"),
            leases=LeaseBook(leases), restarts=int(d.number("restarts", default=0)), error=d.table("error"),
            outcome=d.text("outcome", optional=True), degraded=d.text("degraded", optional=True),
            baseline=d.table("baseline"), start=_start(d.text("start", optional=True) or "cold"),
            profile=d.text("profile", optional=True) or "default", kind=_kind(d.text("kind", optional=True)),
            switched_from=d.text("switched_from", optional=True), switched_to=d.text("switched_to", optional=True),
            saved=d.table("saved"), preempted=d.table("preempted"), freeing=d.pids("freeing"),
            freeing_unknown=d.flag("freeing_unknown"), after_bare=d.flag("after_bare"),
            restored=_restored(d.text("restored", optional=True)), resident_changed=d.table("resident_changed"),
            prefetch=d.table("prefetch"), resident_s=d.number("resident_s", optional=True),
        )


class _Fields:
    """Typed reads of one JSON object, each failure a ValueError that names the field."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        self.data, self.where = data, where

    def _get(self, key: str, optional: bool, default: Any = None) -> Any:
        if key not in self.data or self.data[key] is None:
            if optional:
                return default
            raise ValueError(f"{self.where}.{key}: missing")
        return self.data[key]

    def text(self, key: str, optional: bool = False) -> Any:
        value = self._get(key, optional)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{self.where}.{key}: expected a string")
        return value

    def number(self, key: str, optional: bool = False, default: float | None = None) -> Any:
        value = self._get(key, optional or default is not None, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{self.where}.{key}: expected a number")
        return None if value is None else float(value)

    def phase(self, key: str) -> Phase:
        value = self.text(key)
        try:
            return Phase(value)
        except ValueError:
            raise ValueError(f"{self.where}.{key}: unknown phase {value!r} (written by another version?)") from None

    def items(self, key: str) -> list[Any]:
        value = self._get(key, True, [])
        if not isinstance(value, list):
            raise ValueError(f"{self.where}.{key}: expected a list")
        return value

    def texts(self, key: str) -> list[str]:
        value = self.items(key)
        if not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.where}.{key}: expected a list of strings")
        return list(value)

    def pids(self, key: str) -> list[int]:
        value = self.items(key)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            raise ValueError(f"{self.where}.{key}: expected a list of process ids")
        return list(value)

    def flag(self, key: str) -> bool:
        value = self._get(key, True, False)
        if not isinstance(value, bool):
            raise ValueError(f"{self.where}.{key}: expected true or false")
        return value

    def table(self, key: str) -> dict[str, Any] | None:
        value = self._get(key, True)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{self.where}.{key}: expected an object")
        return value


def _start(value: str) -> str:
    if value not in ("cold", "warm"):
        raise ValueError(f"window.start: expected 'cold' or 'warm', got {value!r}")
    return value


def _restored(value: str | None) -> str | None:
    if value not in (None, "as_it_was", "smaller", "unchecked"):
        raise ValueError(f"window.restored: expected 'as_it_was', 'smaller' or 'unchecked', got {value!r}")
    return value


def _kind(value: str | None) -> ProfileKind:
    if value not in (None, "engine", "bare"):
        raise ValueError(f"window.kind: expected 'engine' or 'bare', got {value!r}")
    return ProfileKind(value or "engine")


def _timing(data: Any, where: str) -> PhaseTiming:
    d = _Fields(data, where)
    stage = d.text("stage", optional=True) or "open"
    if stage not in ("open", "close"):
        raise ValueError(f"{where}.stage: expected 'open' or 'close'")
    return PhaseTiming(d.phase("phase"), d.number("started_at"), d.number("ended_at", optional=True), stage)


def _infinite(expires_at: float | None) -> float:
    return math.inf if expires_at is None else expires_at  # null: a lease for infinity


def _lease(data: Any, where: str) -> Lease:
    d = _Fields(data, where)
    uid = d.number("uid", optional=True)
    expires_at = _infinite(d.number("expires_at", optional=True))
    bind = d.text("bind", optional=True)
    if bind not in (None, "connection"):
        raise ValueError(f"{where}.bind: expected null or 'connection', got {bind!r}")
    return Lease(d.text("id"), d.text("holder"), d.number("granted_at"), expires_at,
                 d.text("unit", optional=True), None if uid is None else int(uid),
                 int(d.number("priority", default=0)), bind == "connection")


# What the window's container record says that a parked engine's does not need.
_WINDOW_ONLY = ("free_before_boot", "parked", "residual_bytes", "sleep", "canary", "removed")


@dataclass
class Parked:
    """The engine left asleep by the last window."""

    container: dict[str, Any]  # the window's container record: name, created, image, window, spec
    since: float
    level: int
    residual_bytes: int
    canary: str
    profile: str = DEFAULT_PROFILE

    def to_dict(self) -> dict[str, Any]:
        """Serialize for the state document."""
        return {"container": self.container, "since": self.since, "level": self.level,
                "residual_bytes": self.residual_bytes, "canary": self.canary, "profile": self.profile}

    @classmethod
    def from_dict(cls, data: Any) -> Parked:
        """Rebuild from the state document; ValueError names what is wrong."""
        d = _Fields(data, "parked")
        container = d.table("container")
        if container is None or not isinstance(container.get("name"), str):
            raise ValueError("parked.container: expected the parked container's record")
        level = int(d.number("level"))
        if level not in (1, 2):
            raise ValueError("parked.level: expected 1 or 2")
        return cls(container=container, since=d.number("since"), level=level,
                   residual_bytes=int(d.number("residual_bytes")), canary=d.text("canary"),
                   profile=d.text("profile", optional=True) or DEFAULT_PROFILE)

    @property
    def pids(self) -> list[int]:
        """Return the host pids of the parked engine's processes, as recorded when it served."""
        return [pid for pid in self.container.get("pids") or [] if isinstance(pid, int) and not isinstance(pid, bool)]

    def status(self, keep: float) -> dict[str, Any]:
        """Describe it for ``status``."""
        return {"container": self.container.get("name"), "profile": self.profile, "since": self.since,
                "level": self.level,
                "residual_bytes": self.residual_bytes, "residual": format_size(self.residual_bytes),
                "expires_at": self.since + keep, "next_open": "warm"}


def needs_less_residual(needs: int, profile: str, parked: Parked | None) -> int:
    """Return the VRAM a window of ``profile`` that needs ``needs`` waits for.

    A parked engine of the same profile is woken, not booted: the residual it holds is the window's already.
    """
    held = parked.residual_bytes if parked is not None and parked.profile == profile else 0
    return max(0, needs - held)
