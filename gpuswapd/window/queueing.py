"""The requests waiting for a window: who joins the open one, who queues for a later one, and when.

One window is open at a time: its profile is the card's tenant. A request for the tenant joins
its window (the card stays: a batch costs no swap); a request for another profile queues, by
priority and first come first served within one, so the next tenant is the one with the oldest
waiting request. A queued request gains one level of effective priority per ``daemon.aging`` it
waits, so none starves (aging orders the queue; preemption looks at the base priority only).

Every wait is bounded by a *share*: a queued request for another profile waits at most

    share = max(fair_after, min(residency_max, residency_factor * price))

where ``price`` is what the swaps it costs took in history: the tenant's close and its own
open, and back again (``Times.swap_price``, the round trip). Once it has waited its share, new
requests for the tenant queue behind it instead of joining (the mirror of the drain guard), a
renewal may extend a lease only up to that moment, never past it (a lease that already ends later
keeps its expiry), and the window closes when its leases in flight end. With nobody waiting for
another profile, the tenant keeps the card; the window closes at once when its last lease ends
while another profile waits (no linger for nobody).

Waiting requests live in memory and in the state document's ``queue``: after a restart of
gpuswapd, a client that sends its acquire again with its token (``"reclaim"``) within
``daemon.reclaim_grace`` keeps the time it had waited, so its place.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuswapd import clock
from gpuswapd.config import DEFAULT_PROFILE
from gpuswapd.protocol import JsonObject
from gpuswapd.window.price import Times

Listener = Callable[[JsonObject], None]


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
    token: str | None = None  # the hash of its reclaim token (protocol.token_hash)
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def to_dict(self) -> dict[str, Any]:
        """Describe it for the state document."""
        return {"holder": self.holder, "profile": self.profile, "since": self.since, "unit": self.unit,
                "uid": self.uid, "priority": self.priority, "token": self.token}


@dataclass(frozen=True)
class Kept:
    """A request that waited in the queue of the gpuswapd before a restart, kept for its client to reclaim."""

    since: float
    profile: str
    until: float  # its client reclaims it by then, or it is forgotten
    holder: str | None = None

    def to_dict(self, token: str) -> dict[str, Any]:
        """Describe it for the state document, as a waiting request (so a later start keeps it too)."""
        return {"holder": self.holder, "profile": self.profile, "since": self.since, "token": token, "kept": True}


class Queue:
    """The waiting acquires, in arrival order."""

    def __init__(self, fair_after: float, aging: float = 0.0, factor: float = 0.0, most: float = 0.0,
                 times: Times | None = None) -> None:
        self.fair_after = fair_after
        self.aging = aging  # seconds of waiting per level of effective priority (0: no aging)
        self.factor = factor  # daemon.residency_factor
        self.most = most  # daemon.residency_max
        self.times = times or Times()
        self.waiters: list[Waiter] = []
        self.kept: dict[str, Kept] = {}  # token hash -> a request of the gpuswapd before a restart

    def keep(self, entries: list[Any], now: float, grace: float) -> int:
        """Keep the queue a state document held for its clients to reclaim within ``grace``; return how many."""
        for entry in entries:
            token, since, profile = (entry.get(k) for k in ("token", "since", "profile")) \
                if isinstance(entry, dict) else (None, None, None)
            if isinstance(token, str) and isinstance(since, (int, float)) and isinstance(profile, str):
                holder = entry.get("holder")
                self.kept[token] = Kept(float(since), profile, now + grace, holder if isinstance(holder, str) else None)
        return len(self.kept)

    def keep_waiters(self) -> None:
        """Keep every waiting request with a token for the next start of gpuswapd (it is stopping)."""
        for w in self.waiters:
            if w.token is not None:
                self.kept[w.token] = Kept(w.since, w.profile, math.inf, w.holder)

    def kept_now(self, now: float) -> list[dict[str, Any]]:
        """Describe the kept requests not reclaimed yet, for the state document."""
        return [k.to_dict(token) for token, k in self.kept.items() if k.until > now]

    def reclaim(self, token: str, profile: str, now: float) -> float | None:
        """Return when a kept request of this token (and profile) began waiting, and forget it; None if none."""
        self.kept = {k: v for k, v in self.kept.items() if v.until > now}
        kept = self.kept.pop(token, None)
        return kept.since if kept is not None and kept.profile == profile else None

    def share(self, tenant: str, profile: str) -> float:
        """Return how long a request for ``profile`` waits at most while ``tenant`` holds the card."""
        price = self.times.swap_price(tenant, profile) + self.times.swap_price(profile, tenant)
        return max(self.fair_after, min(self.most, self.factor * price))

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
        """Return a queued request for another profile that has waited its share, if any."""
        for w in self.queued():
            if w.profile != profile and now - w.since >= self.share(profile, w.profile):
                return w
        return None

    def fair_claim(self, profile: str) -> tuple[float, Waiter] | None:
        """Return the earliest fair claim on a window of ``profile``: its moment and its request.

        The moment is when a request for another profile has waited its share; None while
        nobody waits for another profile. A renewal of a lease of that window may not extend it
        past that moment (see ``Window.renew``).
        """
        claims = [(w.since + self.share(profile, w.profile), w) for w in self.queued() if w.profile != profile]
        return min(claims, key=lambda c: c[0], default=None)

    def per_profile(self) -> dict[str, int]:
        """Count the requests waiting, per profile (queued for a later window, or joined to the opening one)."""
        out: dict[str, int] = {}
        for w in self.waiters:
            out[w.profile] = out.get(w.profile, 0) + 1
        return dict(sorted(out.items()))

    def wants_other(self, profile: str) -> bool:
        """Tell whether anybody queues for a window of another profile (the open one should not linger)."""
        return any(w.profile != profile for w in self.queued())

    def take(self, window: str, profile: str, now: float) -> list[Waiter]:
        """Let the queued requests for ``profile`` join ``window``, except those behind a fair claim."""
        taken, behind = [], False
        for w in self.queued():
            if w.profile != profile:
                behind = behind or now - w.since >= self.share(profile, w.profile)
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
