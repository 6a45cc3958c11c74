"""The window record: what status shows, what the state document holds, what history keeps."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from gpuswapd import clock, ids
from gpuswapd.config import DEFAULT_PROFILE, ProfileKind
from gpuswapd.errors import ErrorRecord, GpuswapError
from gpuswapd.leases import Lease, LeaseBook
from gpuswapd.phases import Phase, check_transition
from gpuswapd.protocol import JsonObject
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


def _opt(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """Read ``key`` if it holds a ``kind`` (a bool is no number), else None: old documents still read."""
    value = data.get(key)
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        return None
    return value if isinstance(value, kind) else None


def _pid_list(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list):
        return None
    return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))


@dataclass(frozen=True)
class ContainerHandle:
    """A window's engine container, as the window records it to take it down later (or park it).

    ``Engine.bring_up`` returns name, created, image, window and spec; the window adds what it
    learns (pids, sleep, canary...) and what it did (removed, parked). Absent fields are None and
    stay out of the document.
    """

    name: str | None = None
    created: bool | None = None
    image: str | None = None
    window: str | None = None  # the window that brought it up (its Docker label)
    spec: str | None = None  # the hash of its configuration (a parked engine must match it)
    started: str | None = None  # Docker's StartedAt of the start it is (a restart changes it)
    free_before_boot: int | None = None  # the card's free bytes before it booted
    pids: tuple[int, ...] | None = None  # the host pids of its processes, all it ever had
    sleep: bool | None = None  # it offers sleep mode
    canary: str | None = None  # its answer to the canary, before it ever slept
    residual_bytes: int | None = None  # woken from park: what it kept on the card asleep
    removed: bool | None = None
    parked: bool | None = None
    # The keys in the order the document read had them (a state document's are sorted): written
    # back in that order, new ones after, as a dict updated in place would have them.
    order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Serialize for the state document and history (the fields that are set, in this order)."""
        out: dict[str, Any] = {}
        for f in _CONTAINER_FIELDS:
            value = getattr(self, f)
            if f == "canary" and self.sleep is not None:
                out[f] = value  # written beside sleep, null or not
            elif value is not None:
                out[f] = list(value) if f == "pids" else value
        return _ordered(out, self.order)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ContainerHandle:
        """Rebuild from ``to_dict`` output, or an older document's (what is missing or odd is None)."""
        before = _opt(data, "free_before_boot", (int, float))
        residual = _opt(data, "residual_bytes", (int, float))
        return cls(name=_opt(data, "name", str), created=_opt(data, "created", bool), image=_opt(data, "image", str),
                   window=_opt(data, "window", str), spec=_opt(data, "spec", str), started=_opt(data, "started", str),
                   free_before_boot=None if before is None else int(before), pids=_pid_list(data.get("pids")),
                   sleep=_opt(data, "sleep", bool), canary=_opt(data, "canary", str),
                   residual_bytes=None if residual is None else int(residual),
                   removed=_opt(data, "removed", bool), parked=_opt(data, "parked", bool), order=tuple(data))

    def without(self, *names: str) -> ContainerHandle:
        """Return it without the fields ``names`` (set again later, they come last, as in a dict)."""
        return replace(self, **dict.fromkeys(names), order=tuple(k for k in self.order if k not in names))

    @property
    def pid_list(self) -> list[int]:
        """Return the recorded pids (none recorded: empty)."""
        return list(self.pids or ())


def _ordered(out: dict[str, object], order: tuple[str, ...]) -> dict[str, object]:
    """Put the keys of ``order`` first, in that order; the rest follow as they are."""
    if not order:
        return out
    return {**{k: out[k] for k in order if k in out}, **out}


_CONTAINER_FIELDS = ("name", "created", "image", "window", "spec", "started", "free_before_boot", "pids", "sleep",
                     "canary", "residual_bytes", "removed", "parked")


@dataclass(frozen=True)
class PreemptedHolder:
    """One lease a preemption revokes, as it was noticed."""

    lease: str | None
    holder: str | None
    priority: int | None
    unit: str | None
    # The keys in the order the document read had them (a state document's are sorted): written
    # back in that order, new ones after, as a dict updated in place would have them.
    order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Serialize for the window record."""
        return _ordered({"lease": self.lease, "holder": self.holder, "priority": self.priority, "unit": self.unit},
                        self.order)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PreemptedHolder:
        """Rebuild from ``to_dict`` output."""
        return cls(_opt(data, "lease", str), _opt(data, "holder", str), _opt(data, "priority", int),
                   _opt(data, "unit", str), order=tuple(data))


@dataclass(frozen=True)
class Preemption:
    """A preemption of the window: who asked, at what priority, when the leases are revoked (``deadline``).

    It ends one of three ways: the holders let go first (``yielded_at``), the preemptor stopped
    waiting (``abandoned_at``, ``abandoned``: why), or the leases were revoked (``revoked_at``, and
    the units stopped; ``stops_pending``: those whose stop is not confirmed yet).
    """

    by: str
    profile: str
    priority: int
    at: float
    grace_s: float
    deadline: float
    holders: tuple[PreemptedHolder, ...] = ()
    revoked_at: float | None = None
    abandoned_at: float | None = None
    yielded_at: float | None = None
    abandoned: str | None = None
    stopped_units: tuple[str, ...] | None = None
    stops_pending: tuple[str, ...] | None = None
    # The keys in the order the document read had them (a state document's are sorted): written
    # back in that order, new ones after, as a dict updated in place would have them.
    order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def ended(self) -> bool:
        """Tell whether it is over: revoked, abandoned or yielded."""
        return self.revoked_at is not None or self.abandoned_at is not None or self.yielded_at is not None

    def to_dict(self) -> dict[str, Any]:
        """Serialize for the window record (the fields of its end only once it ended so)."""
        out: dict[str, Any] = {"by": self.by, "profile": self.profile, "priority": self.priority, "at": self.at,
                               "grace_s": self.grace_s, "deadline": self.deadline, "revoked_at": self.revoked_at,
                               "abandoned_at": self.abandoned_at, "holders": [h.to_dict() for h in self.holders]}
        if self.yielded_at is not None:
            out["yielded_at"] = self.yielded_at
        if self.abandoned is not None:
            out["abandoned"] = self.abandoned
        if self.stopped_units is not None:
            out["stopped_units"] = list(self.stopped_units)
        if self.stops_pending is not None:
            out["stops_pending"] = list(self.stops_pending)
        return _ordered(out, self.order)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Preemption:
        """Rebuild from ``to_dict`` output, or an older document's (what is missing is None)."""
        holders = data.get("holders")

        def units(key: str) -> tuple[str, ...] | None:
            value = data.get(key)
            return tuple(u for u in value if isinstance(u, str)) if isinstance(value, list) else None

        def number(key: str) -> float | None:
            value = _opt(data, key, (int, float))
            return None if value is None else float(value)

        return cls(by=str(data.get("by")), profile=str(data.get("profile")),
                   priority=int(_opt(data, "priority", (int, float)) or 0), at=number("at") or 0.0,
                   grace_s=number("grace_s") or 0.0, deadline=number("deadline") or 0.0,
                   holders=tuple(PreemptedHolder.from_dict(h) for h in holders if isinstance(h, dict))
                   if isinstance(holders, list) else (),
                   revoked_at=number("revoked_at"), abandoned_at=number("abandoned_at"),
                   yielded_at=number("yielded_at"), abandoned=_opt(data, "abandoned", str),
                   stopped_units=units("stopped_units"), stops_pending=units("stops_pending"), order=tuple(data))


@dataclass(frozen=True)
class BaselineRestore:
    """Why the baseline is being restored: no state could be read, or it was found broken."""

    reason: str | None = None
    at: float | None = None
    cause: str | None = None  # "state_unreadable", "found_down"...
    # The keys in the order the document read had them (a state document's are sorted): written
    # back in that order, new ones after, as a dict updated in place would have them.
    order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Serialize for status and the window record (the fields that are set)."""
        fields = (("reason", self.reason), ("at", self.at), ("cause", self.cause))
        return _ordered({k: v for k, v in fields if v is not None}, self.order)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BaselineRestore:
        """Rebuild from ``to_dict`` output."""
        at = _opt(data, "at", (int, float))
        return cls(_opt(data, "reason", str), None if at is None else float(at), _opt(data, "cause", str),
                   order=tuple(data))


@dataclass(frozen=True)
class FinishedPhase:
    """One phase of a finished window, as history keeps it."""

    phase: str | None
    stage: str  # "open" or "close" (a record of gpuswapd 0.1 has none: "open")
    started_at: float | None
    took_s: float | None  # None: it never ended


@dataclass(frozen=True)
class Finished:
    """A finished window, as history keeps it: what those who learn from history read of it.

    ``document`` is the record as written (``WindowRecord.to_dict``): history lines are written
    from it unchanged. A line of an older gpuswapd reads too; what it lacks is None.
    """

    id: str | None
    profile: str
    start: str
    outcome: str | None
    degraded: bool
    switched_to: str | None
    opened_at: float | None
    closed_at: float | None
    timings: tuple[FinishedPhase, ...]
    document: Mapping[str, object] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Return the history line's document."""
        return dict(self.document)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finished:
        """Read a history line's document (leniently: a line of any version reads)."""

        def number(d: Mapping[str, Any], key: str) -> float | None:
            value = _opt(d, key, (int, float))
            return None if value is None else float(value)

        timings = data.get("timings")
        phases = tuple(FinishedPhase(t.get("phase") if isinstance(t.get("phase"), str) else None,
                                     str(t.get("stage", "open")), number(t, "started_at"), number(t, "took_s"))
                       for t in (timings if isinstance(timings, list) else []) if isinstance(t, dict))
        return cls(id=_opt(data, "id", str), profile=str(data.get("profile") or "default"),
                   start=str(data.get("start", "cold")), outcome=None if data.get("outcome") is None
                   else str(data.get("outcome")), degraded=bool(data.get("degraded")),
                   switched_to=_opt(data, "switched_to", str) or None, opened_at=number(data, "opened_at"),
                   closed_at=number(data, "closed_at"), timings=phases, document=dict(data))


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
    # CLOCK_MONOTONIC just before it stopped them: one that became active after this (systemd's
    # ActiveEnterTimestampMonotonic) ran again since, and its stop was undone.
    stopped_mono: float | None = None
    # Not kept on disk: a stale record (its resident found up again at a start) is being closed, and
    # everything was up at that moment; one of its units down since is not gpuswapd's to start.
    found_up: bool = field(default=False, compare=False)
    # Not kept on disk: the phase this record was found in at a start when systemd could not say
    # whether its stop was undone since (window/undone.py); its restore judges it first.
    unchecked_in: Phase | None = field(default=None, compare=False)
    # Not kept on disk: CLOCK_MONOTONIC when this close's restore verified the resident (None: not yet).
    verified_at: float | None = field(default=None, compare=False)
    container: ContainerHandle | None = None
    leases: LeaseBook = field(default_factory=LeaseBook)
    restarts: int = 0
    error: ErrorRecord | None = None
    outcome: str | None = None
    degraded: str | None = None
    # Set when no state could be read and this record was made from the configuration.
    baseline: BaselineRestore | None = None
    start: str = "cold"  # "warm": the engine was woken from park
    profile: str = "default"
    kind: ProfileKind = ProfileKind.ENGINE  # BARE: no engine, the card is handed to the lease holders
    # A direct switch: the window this one took the card from (the resident stayed down), and the
    # resident's restore (start and verify) that the switch saved, as last measured.
    switched_from: str | None = None
    switched_to: str | None = None
    saved: JsonObject | None = None
    # A preemption: who asked, at what priority, when the leases are revoked (at ``deadline``).
    preempted: Preemption | None = None
    # Host pids of engines gpuswapd took down for this window (its own, or the one it switched
    # from): the card may list them, and their memory, until it comes free. Never strangers.
    freeing: list[int] = field(default_factory=list)
    freeing_unknown: bool = False  # one of them went with its pids unknown (Docker could not list them)
    # Switched to from a bare window: the holders' processes of that window may still hold memory.
    after_bare: bool = False
    # How the resident came back (gpuswapd.window.identity): "as_it_was", "smaller" (even after a restart
    # with the room it had), "unchecked" (it could not be read); None: this window did not restore it.
    restored: str | None = None
    resident_changed: JsonObject | None = None  # it came back smaller: was, now, repaired
    # The close's read of the resident's model files into the page cache (prefetch.py), and the
    # resident's time from its start to its verifying completion.
    prefetch: JsonObject | None = None
    resident_s: float | None = None
    # The resident's slots saved before its stop and restored after its verify (warm.py).
    cache: JsonObject | None = None
    # In memory only: its hold has ended, and its close begins; it takes no new lease meanwhile.
    sealed: bool = field(default=False, compare=False)

    @classmethod
    def new(cls, now: float | None = None) -> WindowRecord:
        """Start the record of a new window."""
        return cls(id=f"{clock.stamp()}-{ids.token(3)}", opened_at=now or clock.now())

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
        now = clock.now() if now is None else now
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
            self.error = ErrorRecord.of(err)

    def took(self, phase: Phase, stage: str | None = None) -> float:
        """Sum the seconds spent in ``phase`` (of one ``stage``, if given)."""
        return sum((t.ended_at or clock.now()) - t.started_at for t in self.timings
                   if t.phase is phase and (stage is None or t.stage == stage))

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """Serialize the whole record; with ``now``, leases carry their remaining time."""
        return {
            "id": self.id, "phase": str(self.phase), "opened_at": self.opened_at,
            "closed_at": self.closed_at, "timings": [t.to_dict() for t in self.timings],
            "timers": self.timers, "units": self.units, "stopped_mono": self.stopped_mono,
            "container": _out(self.container),
            "leases": [lease.to_dict(now) for lease in self.leases.all()], "restarts": self.restarts,
            "error": _out(self.error), "outcome": self.outcome, "degraded": self.degraded,
            "baseline": _out(self.baseline),
            "start": self.start, "profile": self.profile, "kind": self.kind,
            "switched_from": self.switched_from, "switched_to": self.switched_to, "saved": self.saved,
            "preempted": _out(self.preempted), "freeing": self.freeing,
            "freeing_unknown": self.freeing_unknown, "after_bare": self.after_bare,
            "restored": self.restored, "resident_changed": self.resident_changed,
            "prefetch": self.prefetch, "resident_s": self.resident_s, "cache": self.cache,
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
            timers=d.texts("timers"), units=d.texts("units"), stopped_mono=d.number("stopped_mono", optional=True),
            container=_in(ContainerHandle.from_dict, d.table("container")),
            leases=LeaseBook(leases), restarts=int(d.number("restarts", default=0)),
            error=_in(ErrorRecord.from_dict, d.table("error")),
            outcome=d.text("outcome", optional=True), degraded=d.text("degraded", optional=True),
            baseline=_in(BaselineRestore.from_dict, d.table("baseline")),
            start=_start(d.text("start", optional=True) or "cold"),
            profile=d.text("profile", optional=True) or "default", kind=_kind(d.text("kind", optional=True)),
            switched_from=d.text("switched_from", optional=True), switched_to=d.text("switched_to", optional=True),
            saved=d.table("saved"), preempted=_in(Preemption.from_dict, d.table("preempted")),
            freeing=d.pids("freeing"),
            freeing_unknown=d.flag("freeing_unknown"), after_bare=d.flag("after_bare"),
            restored=_restored(d.text("restored", optional=True)), resident_changed=d.table("resident_changed"),
            prefetch=d.table("prefetch"), resident_s=d.number("resident_s", optional=True),
            cache=d.table("cache"),
        )


    def finished(self) -> Finished:
        """Return the finished window as history keeps it."""
        return Finished.from_dict(self.to_dict())


class _Serial(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


_T = TypeVar("_T")


def _out(value: _Serial | None) -> object:
    return None if value is None else value.to_dict()


def _in(kind: Callable[[Mapping[str, Any]], _T], data: Mapping[str, Any] | None) -> _T | None:
    return None if data is None else kind(data)


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

    def table(self, key: str) -> JsonObject | None:
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
    # Written as wall-clock times (Lease.to_dict): back to the daemon's time, as the wall clock reads now.
    return Lease(d.text("id"), d.text("holder"), clock.from_wall(d.number("granted_at")), clock.from_wall(expires_at),
                 d.text("unit", optional=True), None if uid is None else int(uid),
                 int(d.number("priority", default=0)), bind == "connection", d.text("token", optional=True),
                 d.number("reclaim_by", optional=True))


# What the window's container record says that a parked engine's does not need.
_WINDOW_ONLY = ("free_before_boot", "parked", "residual_bytes", "sleep", "canary", "removed")


@dataclass
class Parked:
    """The engine left asleep by the last window."""

    container: ContainerHandle  # the window's container record: name, created, image, window, spec, pids
    since: float
    level: int
    residual_bytes: int
    canary: str
    profile: str = DEFAULT_PROFILE

    def to_dict(self) -> dict[str, Any]:
        """Serialize for the state document."""
        return {"container": self.container.to_dict(), "since": self.since, "level": self.level,
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
        return cls(container=ContainerHandle.from_dict(container), since=d.number("since"), level=level,
                   residual_bytes=int(d.number("residual_bytes")), canary=d.text("canary"),
                   profile=d.text("profile", optional=True) or DEFAULT_PROFILE)

    @property
    def pids(self) -> list[int]:
        """Return the host pids of the parked engine's processes, as recorded when it served."""
        return self.container.pid_list

    def status(self, keep: float) -> JsonObject:
        """Describe it for ``status``."""
        return {"container": self.container.name, "profile": self.profile, "since": self.since,
                "level": self.level,
                "residual_bytes": self.residual_bytes, "residual": format_size(self.residual_bytes),
                "expires_at": self.since + keep, "next_open": "warm"}


def needs_less_residual(needs: int, profile: str, parked: Parked | None) -> int:
    """Return the VRAM a window of ``profile`` that needs ``needs`` waits for.

    A parked engine of the same profile is woken, not booted: the residual it holds is the window's already.
    """
    held = parked.residual_bytes if parked is not None and parked.profile == profile else 0
    return max(0, needs - held)
