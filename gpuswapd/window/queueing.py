"""The requests waiting for a window: who joins the open one, who queues for a later one, and when.

One window is open at a time. A request for the open window's profile joins it; a request for
another profile queues, by priority and first come first served within one. A queued request
gains one level of effective priority per ``daemon.aging`` it waits, so none starves (aging
orders the queue; preemption looks at the base priority only). Fairness: once a queued request
for another profile has waited ``daemon.fair_after``, new requests for the open profile queue
behind it instead of joining, so the open window closes when its current leases end. Renewals
follow the same claim: while a request for another profile waits, a renewal may extend a lease
only up to the moment that request has waited ``fair_after``, never past it (a lease that already
ends later keeps its expiry). A holder that keeps renewing cannot keep the other profile out.

Waiting requests live only in memory (and in the state document's ``queue``, for the record):
they do not survive a restart of gpuswapd, whose clients then see their connection drop.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuswapd import clock
from gpuswapd.config import DEFAULT_PROFILE
from gpuswapd.phases import Phase
from gpuswapd.protocol import JsonObject
from gpuswapd.record import Finished

Listener = Callable[[JsonObject], None]
TIMES_KEPT = 20  # windows per profile whose open times estimate the next


@dataclass(eq=False)
class Waiter:
    """An acquire waiting for a window to be READY."""

    holder: str
    duration: float
    unit: str | None
    uid: int | None
    profile: str = DEFAULT_PROFILE
    listener: Listener | None = None
    priority: int = 0
    since: float = field(default_factory=clock.now)
    window: str | None = None  # the window it joined; None while it queues for a later one
    bound: bool = False  # its lease ends with its connection ("bind": "connection")
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def to_dict(self) -> dict[str, Any]:
        """Describe it for the state document."""
        return {"holder": self.holder, "profile": self.profile, "since": self.since, "unit": self.unit,
                "uid": self.uid, "priority": self.priority}


class Times:
    """What history says windows take: the open time of each profile, its boots, and the resident's restore."""

    def __init__(self) -> None:
        self._open: dict[str, deque[float]] = {}
        self._restore: deque[float] = deque(maxlen=TIMES_KEPT)
        self._close: deque[float] = deque(maxlen=TIMES_KEPT)
        self._boots: dict[str, Boots] = {}

    def learn(self, record: Finished) -> None:
        """Take the timings of one finished window (a history record)."""
        timings = record.timings
        ready = next((t for t in timings if t.phase == str(Phase.READY)), None)
        opened = record.opened_at
        if ready is not None and opened is not None and ready.started_at is not None:
            self._open.setdefault(record.profile, deque(maxlen=TIMES_KEPT)).append(ready.started_at - opened)
        restored = [t.took_s for t in timings if t.phase == str(Phase.RESTORING)
                    and t.stage == "close" and t.took_s is not None]
        if restored and record.outcome == "closed" and not record.degraded:
            self._restore.append(sum(restored))
        closed = [t.took_s for t in timings if t.stage == "close" and t.took_s is not None]
        if closed and restored and record.outcome == "closed" and not record.switched_to:
            self._close.append(sum(closed))
        booted = boot_took(record)
        if booted is not None:
            self._boots.setdefault(record.profile, Boots()).add(booted)

    def close_time(self) -> float | None:
        """Return the median close of a window back to the resident (start of the close to IDLE); None if never seen."""
        return float(statistics.median(self._close)) if self._close else None

    def boots(self) -> dict[str, JsonObject]:
        """Describe each profile's boots to healthy (BOOTING): the last two, the longest, how many."""
        return {profile: boots.to_dict() for profile, boots in sorted(self._boots.items())}

    def open_time(self, profile: str) -> float | None:
        """Return the median open time of ``profile`` (first acquire to READY); None if never seen."""
        seen = self._open.get(profile)
        return float(statistics.median(seen)) if seen else None

    def saved(self) -> JsonObject | None:
        """Say what a direct switch saves: the resident's start and verify, as last measured."""
        if not self._restore:
            return None
        return {"resident_restore_s": round(float(statistics.median(self._restore)), 3),
                "measured_windows": len(self._restore)}


@dataclass
class Boots:
    """How long one profile's engine took to boot to healthy, as history has it."""

    last: deque[float] = field(default_factory=lambda: deque(maxlen=2))
    longest: float = 0.0
    count: int = 0

    def add(self, seconds: float) -> None:
        """Take one boot's duration."""
        self.last.append(seconds)
        self.longest = max(self.longest, seconds)
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        """Describe them for ``status``: the newest boot first."""
        return {"last_s": [round(s, 3) for s in reversed(self.last)], "longest_s": round(self.longest, 3),
                "count": self.count}


def boot_took(record: Finished) -> float | None:
    """Return how long a finished window's engine booted to healthy (BOOTING); None if it did not boot.

    A window that woke a parked engine did not boot; one whose boot failed never became healthy.
    """
    timings = [t for t in record.timings if t.stage == "open"]
    phases = [t.phase for t in timings]
    if str(Phase.BOOTING) not in phases or str(Phase.WARMING) not in phases:
        return None
    return timings[phases.index(str(Phase.BOOTING))].took_s


class Queue:
    """The waiting acquires, in arrival order."""

    def __init__(self, fair_after: float, aging: float = 0.0) -> None:
        self.fair_after = fair_after
        self.aging = aging  # seconds of waiting per level of effective priority (0: no aging)
        self.waiters: list[Waiter] = []

    def __len__(self) -> int:
        return len(self.waiters)

    def effective(self, waiter: Waiter, now: float) -> int:
        """Return a request's priority with what it gained by waiting."""
        gained = int((now - waiter.since) // self.aging) if self.aging > 0 else 0
        return waiter.priority + max(0, gained)

    def queued(self, now: float | None = None) -> list[Waiter]:
        """List the requests waiting for a later window: highest effective priority first, then oldest."""
        now = clock.now() if now is None else now
        waiting = [w for w in self.waiters if w.window is None]
        return sorted(waiting, key=lambda w: (-self.effective(w, now), w.since))

    def preemptor(self, profile: str, leases: list[int]) -> Waiter | None:
        """Return the request that preempts a window of ``profile`` whose leases have these priorities.

        It wants another profile and its base priority is above every lease's; aging never preempts.
        """
        if not leases:
            return None
        top = max(leases)
        candidates = [w for w in self.waiters if w.window is None and w.profile != profile and w.priority > top]
        return max(candidates, key=lambda w: (w.priority, -w.since), default=None)

    def joined(self, window: str) -> list[Waiter]:
        """List the requests waiting for ``window`` to be READY."""
        return [w for w in self.waiters if w.window == window]

    def blocked(self, profile: str, now: float) -> Waiter | None:
        """Return a queued request for another profile that has waited ``fair_after``, if any."""
        for w in self.queued():
            if w.profile != profile and now - w.since >= self.fair_after:
                return w
        return None

    def fair_claim(self, profile: str) -> tuple[float, Waiter] | None:
        """Return the earliest fair claim on a window of ``profile``: its moment and its request.

        The moment is when a request for another profile has waited ``fair_after``; None while
        nobody waits for another profile. A renewal of a lease of that window may not extend it
        past that moment (see ``Window.renew``).
        """
        claims = [(w.since + self.fair_after, w) for w in self.queued() if w.profile != profile]
        return min(claims, key=lambda c: c[0], default=None)

    def wants_other(self, profile: str) -> bool:
        """Tell whether anybody queues for a window of another profile (the open one should not linger)."""
        return any(w.profile != profile for w in self.queued())

    def take(self, window: str, profile: str, now: float) -> list[Waiter]:
        """Let the queued requests for ``profile`` join ``window``, except those behind a fair claim."""
        taken, behind = [], False
        for w in self.queued():
            if w.profile != profile:
                behind = behind or now - w.since >= self.fair_after
            elif not behind:
                w.window = window
                taken.append(w)
        return taken

    def remove(self, waiter: Waiter) -> None:
        """Forget a request (granted, failed, or gone)."""
        if waiter in self.waiters:
            self.waiters.remove(waiter)

    def describe(self, times: Times, ahead_s: float, now: float) -> list[JsonObject]:
        """Describe the queue for ``status``: holder, profile, position, waited and an ETA.

        The ETA is ``ahead_s`` (the open window's remaining lease time plus linger) plus the
        median open time of each window to open before and with this request's; null when history
        has no open time for one of them yet.
        """
        out: list[JsonObject] = []
        windows: list[str] = []
        for position, w in enumerate(self.queued(now), start=1):
            if not windows or windows[-1] != w.profile:
                windows.append(w.profile)
            opens = [times.open_time(p) for p in windows]
            eta = None if any(t is None for t in opens) else round(ahead_s + sum(t or 0.0 for t in opens), 1)
            out.append({"holder": w.holder, "profile": w.profile, "position": position, "priority": w.priority,
                        "effective_priority": self.effective(w, now), "waited_s": round(now - w.since, 1),
                        "eta_s": eta})
        return out
