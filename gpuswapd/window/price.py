"""The price of a swap, as history has it: each profile's open, boot, wake and close, the resident's restart.

A swap costs the card seconds (a parked engine's wake) to minutes (a cold boot, the resident's
restart). Every finished window teaches its timings here; ``status`` shows them per profile
(``price``), the queue's ETAs use the open times, and the schedule grows a tenant's share of the
card with what moving it away would cost (``Times.swap_price``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuswapd.phases import Phase
from gpuswapd.protocol import JsonObject
from gpuswapd.record import Finished

TIMES_KEPT = 20  # windows per profile whose timings estimate the next


def _median(values: Iterable[float] | None) -> float | None:
    seen = list(values or ())
    return float(statistics.median(seen)) if seen else None


def _kept() -> deque[float]:
    return deque(maxlen=TIMES_KEPT)


class Times:
    """What history says windows take: the open time of each profile, its boots, and the resident's restore."""

    def __init__(self) -> None:
        self._open: dict[str, deque[float]] = {}
        self._restore: deque[float] = _kept()
        self._close: deque[float] = _kept()
        self._boots: dict[str, Boots] = {}
        self._booted: dict[str, deque[float]] = {}  # the recent boots to healthy, for the price
        self._woke: dict[str, deque[float]] = {}  # the recent wakes from park
        self._closed: dict[str, deque[float]] = {}  # the recent closes back to the resident, per profile
        self._switched: dict[str, deque[float]] = {}  # the recent closes straight into another window
        self._medians: dict[int, float | None] = {}  # by id of a deque above; cleared when one learns

    def _median(self, values: deque[float] | None) -> float | None:
        """Return the median of ``values``, as computed once since the last window was learnt."""
        if values is None:
            return None
        key = id(values)
        if key not in self._medians:
            self._medians[key] = _median(values)
        return self._medians[key]

    def learn(self, record: Finished) -> None:
        """Take the timings of one finished window (a history record)."""
        self._medians.clear()
        timings = record.timings
        ready = next((t for t in timings if t.phase == str(Phase.READY)), None)
        opened = record.opened_at
        if ready is not None and opened is not None and ready.started_at is not None:
            self._open.setdefault(record.profile, _kept()).append(ready.started_at - opened)
        restored = [t.took_s for t in timings if t.phase == str(Phase.RESTORING)
                    and t.stage == "close" and t.took_s is not None]
        if restored and record.outcome == "closed" and not record.degraded:
            self._restore.append(sum(restored))
        closed = [t.took_s for t in timings if t.stage == "close" and t.took_s is not None]
        if closed and restored and record.outcome == "closed" and not record.switched_to:
            self._close.append(sum(closed))
            self._closed.setdefault(record.profile, _kept()).append(sum(closed))
        if closed and record.switched_to and record.outcome == "closed":
            self._switched.setdefault(record.profile, _kept()).append(sum(closed))
        booted = boot_took(record)
        if booted is not None:
            self._boots.setdefault(record.profile, Boots()).add(booted)
            self._booted.setdefault(record.profile, _kept()).append(booted)
        woke = [t.took_s for t in timings if t.phase == str(Phase.WAKING) and t.stage == "open"
                and t.took_s is not None]
        if woke and ready is not None:
            self._woke.setdefault(record.profile, _kept()).append(woke[-1])

    def close_time(self) -> float | None:
        """Return the median close of a window back to the resident (start of the close to IDLE); None if never seen."""
        return self._median(self._close)

    def boots(self) -> dict[str, JsonObject]:
        """Describe each profile's boots to healthy (BOOTING): the last two, the longest, how many."""
        return {profile: boots.to_dict() for profile, boots in sorted(self._boots.items())}

    def open_time(self, profile: str) -> float | None:
        """Return the median open time of ``profile`` (first acquire to READY); None if never seen."""
        return self._median(self._open.get(profile))

    def saved(self) -> JsonObject | None:
        """Say what a direct switch saves: the resident's start and verify, as last measured."""
        if not self._restore:
            return None
        return {"resident_restore_s": round(float(self._median(self._restore) or 0.0), 3),
                "measured_windows": len(self._restore)}

    def swap_price(self, leaving: str | None, coming: str) -> float:
        """Estimate what moving the card from ``leaving`` (None: the resident) to ``coming`` costs, in seconds.

        The close of the window on the card (straight into the next: its switch close, else its
        close back to the resident) and the open of the next; what history has not seen counts 0.
        """
        close = 0.0
        if leaving is not None:
            close = self._median(self._switched.get(leaving)) or self._median(self._closed.get(leaving)) or 0.0
        return close + (self.open_time(coming) or 0.0)

    def price(self, profiles: Iterable[str]) -> dict[str, JsonObject]:
        """Describe each profile's price of a swap for ``status``: medians of its recent windows (null: never seen)."""
        restart = self._median(self._restore)

        def r(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        out: dict[str, JsonObject] = {}
        for name in profiles:
            opened, closed = self.open_time(name), self._median(self._closed.get(name))
            out[name] = {"open_s": r(opened), "boot_s": r(self._median(self._booted.get(name))),
                         "wake_s": r(self._median(self._woke.get(name))), "close_s": r(closed),
                         "switch_close_s": r(self._median(self._switched.get(name))),
                         "resident_restart_s": r(restart),
                         "swap_s": None if opened is None or closed is None else r(opened + closed),
                         "windows": len(self._open.get(name) or ())}
        return out


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
