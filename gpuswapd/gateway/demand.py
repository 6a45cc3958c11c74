"""When a tenant may be served: windows opened on demand, kept while used, given back when idle.

An engine model with no window open: the gateway takes a lease for its profile at
``gateway.priority``, bound to its connection (it ends if the gateway dies), and the request waits
until the window is READY, at most ``gateway.hold``. Every request for that profile waits on the
same acquire (if its engine fails while the window opens, they ask once more before their 503:
one retry, as a client's own); when the last of them goes away, the acquire is withdrawn: gpuswapd keeps the
opening for ``daemon.abandon_grace`` so that a client's retry rejoins the boot, then rolls it
back. The lease is renewed while requests flow, and released ``gateway.idle`` after the last one
ended; a renewal capped by gpuswapd is taken as it comes (the lease ends at its
real expiry, and the next request acquires again).

A resident request while a window is open: if the only leases are the gateway's own and nothing
is in flight on them, they are released at once (the swap back on demand); if others hold the
card, the request waits (``on_resident_busy = "wait"``, up to ``hold``) or gets 503 with
Retry-After from gpuswapd's estimate of when the resident serves again (``"fail"``).

A preemption: the ``preempting`` notice stops new requests from using the lease (they acquire
again, and so wait for the preemptor's window to end); requests in flight go on until the grace
ends, when ``preempted`` cuts them with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from gpuswapd import clock, naps
from gpuswapd.config import GatewayConfig
from gpuswapd.errors import EngineFailed, GpuswapError, LeaseNotFound
from gpuswapd.gateway.errors import TooManyWaiting, Unavailable
from gpuswapd.gateway.follow import Follow
from gpuswapd.gateway.link import LinkDown
from gpuswapd.gateway.meters import Meters
from gpuswapd.gateway.tenants import RESIDENT, Tenant
from gpuswapd.logs import log
from gpuswapd.retry import backoff
from gpuswapd.tasks import reap, spawn

HEARTBEAT_S = 3.0  # a waiting stream gets an SSE comment this often
RENEW_MARGIN_S = 60.0  # a lease lasts idle plus this; it is renewed when less than half of it is left
RENEW_RETRY_S = (0.5, 5.0)  # a failed renewal is tried again after this backoff, until the lease ends
BOARD_MIN_S = 10.0  # a request boards a lease only with this much of it left, or its longest request's 1.5x
REACQUIRE_S = (0.2, 2.0)  # gpuswapd away (a restart): the acquire is made again after this backoff
# The last waiter gone, the acquire is withdrawn after this: gpuswapd keeps the opening for its own
# daemon.abandon_grace, and a retry's acquire rejoins it there (0: the gateway adds no grace of its own).
WITHDRAW_GRACE_S = 0.0
# A tenant of the gateway's keeps the card this many times the price of the swaps (at most
# RESIDENCY_MAX_S): gpuswapd's daemon.residency_factor and residency_max, from its status, once read.
RESIDENCY_PER_SWAP = 6.0
RESIDENCY_MAX_S = 900.0
RESIDENCY_MIN_S = 10.0
# A tenant whose last request ended this recently still uses the card (a client's next comes), as
# long as the two swaps its waiting saves cost as much: a move seen to take milliseconds waits no second.
BATCH_GAP_S = 1.0
STATUS_FRESH_S = 0.5  # a status read is reused this long by the resident requests that wait

Tell = Callable[[str, float], Awaitable[None]]  # (phase, seconds waited): a waiting request's heartbeat


class HeldLease(Protocol):
    """A lease bound to its acquire connection (``link.Held``, or a fake)."""

    lease: dict[str, Any]
    token: str | None  # its reclaim token (after a restart of gpuswapd, the lease is taken back with it)

    @property
    def id(self) -> str:
        """Return the lease id."""
        ...

    def events(self) -> AsyncIterator[dict[str, Any]]:
        """Yield the lease's events until its connection ends."""
        ...

    async def close(self) -> None:
        """Hang up (gpuswapd ends the lease)."""
        ...


class Daemon(Protocol):
    """What the on-demand logic asks of gpuswapd (``link.Link``, or a fake)."""

    async def acquire(self, profile: str, duration: float, priority: int, holder: str | None,
                      progress: Callable[[dict[str, Any]], None], reclaim: str | None = None) -> HeldLease:
        """Acquire a connection-bound lease, waiting for READY (``reclaim``: an earlier acquire's token)."""
        ...

    async def request(self, message: dict[str, Any], timeout: float = ...) -> dict[str, Any]:
        """Send one request and return its reply."""
        ...


@dataclass(eq=False)
class Flight:
    """One request being answered by a tenant."""

    tenant: str
    lease: OurLease | None = None
    since: float = field(default_factory=clock.monotonic)
    cut: str | None = None  # why the gateway cut it (a preemption's grace ended)
    on_cut: Callable[[], object] | None = None  # set by the forwarder: stop relaying now

    def cut_off(self, why: str) -> None:
        """Stop this request with an error (its stream gets an error event)."""
        self.cut = why
        if self.on_cut is not None:
            self.on_cut()


@dataclass(eq=False)
class OurLease:
    """The gateway's lease on one profile's window."""

    held: HeldLease
    profile: str
    expires_at: float  # the gateway's clock.now() (ends_at: from the wire's remaining_s); math.inf for none
    last_end: float = field(default_factory=clock.monotonic)
    flights: set[Flight] = field(default_factory=set)
    doomed: bool = False  # preempting: new requests acquire again
    ending: bool = False  # being released, expired, or revoked
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    span: float = math.inf  # the lease's length as last granted (max_lease may cap it below the gateway's ask)
    renew_failures: int = 0
    retry_at: float = 0.0  # monotonic: a failed renewal is tried again from then
    boarded: bool = False  # a request has been served under it
    margin: float = BOARD_MIN_S  # a request boards only with this much of the lease left

    def usable(self) -> bool:
        """Tell whether a new request may be served under this lease (and it will outlive the request)."""
        return not self.doomed and not self.ending and clock.now() < self.expires_at - self.margin


@dataclass(eq=False)
class Opening:
    """An acquire on the way, and the requests waiting on it."""

    profile: str
    task: asyncio.Task[OurLease]
    phase: str = "QUEUED"
    since: float = field(default_factory=clock.monotonic)
    withdraw: asyncio.TimerHandle | None = None  # nobody waits: the acquire is withdrawn then
    withdrawn: bool = False  # it was: a request that comes now makes a new acquire (it rejoins gpuswapd's opening)
    retried: bool = False  # its engine failed, and the requests waiting on it asked once more


class Demand:
    """The gateway's leases, and who may be served when."""

    def __init__(self, config: GatewayConfig, daemon: Daemon, follow: Follow, meters: Meters,
                 holder: str | None = None) -> None:
        self.config = config
        self.daemon = daemon
        self.follow = follow
        self.meters = meters
        # Under systemd the lease's holder is the gateway's unit (gpuswapd finds it); else a name.
        self.holder = holder if holder is not None else (
            None if os.environ.get("INVOCATION_ID") else f"gpuswapd-gateway[{os.getpid()}]")
        self.lease_s = max(config.idle, 30.0) + RENEW_MARGIN_S
        self.leases: dict[str, OurLease] = {}
        self.openings: dict[str, Opening] = {}
        self.wanting: dict[str, int] = {}  # requests waiting for each profile's window
        self.waits: dict[str, list[float]] = {}  # tenant: when each of its waiting requests began to wait
        self.price: dict[str, float] = {}  # tenant: seconds the card took to move to it, last time
        self.residency_factor, self.residency_max = RESIDENCY_PER_SWAP, RESIDENCY_MAX_S  # gpuswapd's, once read
        self.longest: dict[str, float] = {}  # profile: its longest request of late (for the boarding margin)
        self.lost: dict[str, float] = {}  # tenant: when it last gave the card up for another of the gateway's
        self.resident_flights: set[Flight] = set()
        self.resident_last_end = -math.inf
        self.waiting = 0
        self._status: tuple[float, dict[str, Any]] | None = None
        follow.listeners.append(self._event)

    # -- what the routes ask ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serving(self, tenant: Tenant, tell: Tell) -> AsyncIterator[Flight]:
        """Wait until ``tenant`` may be served (at most ``hold``); hold its place while the request runs."""
        flight = await (self._engine(tenant.name, tell) if tenant.engine else self._resident(tell))
        self.meters.in_flight.labels(tenant.name).inc()
        try:
            yield flight
        finally:
            self.meters.in_flight.labels(tenant.name).dec()
            self._done(flight)

    def resident_in_flight(self) -> int:
        """Count the resident requests being answered now (gpuswapd's drain asks)."""
        return len(self.resident_flights)

    def queue(self) -> dict[str, int]:
        """Count the requests waiting for each tenant now."""
        return {tenant: len(starts) for tenant, starts in self.waits.items() if starts}

    def on_card(self) -> str | None:
        """Return the tenant of the gateway's on the card, as it sees it (None: another holder's, or moving)."""
        if self.follow.resident_serves():
            return RESIDENT
        ready = [lease.profile for lease in self.leases.values() if not lease.ending]
        return ready[0] if ready else None

    def sample(self, tenants: list[str]) -> None:
        """Set the schedule's gauges: the tenant on the card, the queue per tenant, the residency left."""
        on = self.on_card()
        self.meters.residency_left.clear()
        for tenant in tenants:
            self.meters.on_card.labels(tenant).set(1 if tenant == on else 0)
            self.meters.queue.labels(tenant).set(len(self.waits.get(tenant, [])))
        if on is not None:
            left = self.residency_left(on)
            self.meters.residency_left.labels(on).set(math.inf if left is None else left)

    def residency_left(self, tenant: str) -> float | None:
        """Return how long ``tenant`` may still keep the card before a waiting tenant is owed it (None: unbounded)."""
        oldest = self._oldest_other(tenant)
        if oldest is None:
            return None
        waiter, since = oldest
        return max(0.0, self.residency(tenant, waiter) - (clock.monotonic() - since))

    def residency(self, tenant: str, waiter: str) -> float:
        """Return how long ``tenant`` keeps the card while ``waiter`` waits: RESIDENCY_PER_SWAP times the price.

        The price is what the two swaps would cost (to ``waiter``, and back): gpuswapd's medians
        from ``status`` (``price``), else what the gateway saw its own acquires take (a tenant not
        seen yet costs RESIDENCY_MIN_S). The factor and its cap are gpuswapd's
        ``daemon.residency_factor`` and ``residency_max`` (its ``status``), so one rule orders
        the card for gpuswapd's clients and the gateway's. The bound is at least RESIDENCY_MIN_S
        and at most a quarter of ``gateway.hold``: the waiter keeps the rest of its own bound for
        the move itself (a drain of what is in flight, which may be long, and a boot).
        """
        price = self.price.get(waiter, RESIDENCY_MIN_S) + self.price.get(tenant, RESIDENCY_MIN_S)
        return min(self.config.hold / 4, max(RESIDENCY_MIN_S, min(self.residency_max, self.residency_factor * price)))

    async def start(self) -> None:
        """Learn the price of each swap; release the leases an earlier gateway left bound to this unit.

        Not a unit, an earlier gateway's leases ended with its connections; a unit's are found by
        its cgroup.
        """
        with contextlib.suppress(GpuswapError):
            self.take_price(await self.daemon.request({"op": "status"}))
        if self.holder is not None:
            return
        with contextlib.suppress(GpuswapError):
            gone = await self.daemon.request({"op": "release"})
            if gone.get("released"):
                log.warning("gateway_released_stale_leases", leases=[x.get("id") for x in gone["released"]])

    async def close(self) -> None:
        """Give back every lease (the gateway is stopping)."""
        for opening in list(self.openings.values()):
            await reap(opening.task)
        for lease in list(self.leases.values()):
            await self._release(lease, "the gateway is stopping")

    # -- waiting -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _queue_place(self, tenant: str) -> Any:
        if self.waiting >= self.config.max_waiting:
            raise TooManyWaiting(f"{self.waiting} requests wait for a window already (gateway.max_waiting = "
                                 f"{self.config.max_waiting}); try again later")
        self.waiting += 1
        self.meters.waiting.inc()
        since = clock.monotonic()
        self.waits.setdefault(tenant, []).append(since)
        self._nudge()  # a lease of ours for another tenant may be given back now
        try:
            yield
        finally:
            self.waiting -= 1
            self.meters.waiting.dec()
            self.waits[tenant].remove(since)

    def _nudge(self) -> None:
        for lease in self.leases.values():
            lease.wake.set()
        self.follow.poke()

    def _waiting_since(self, tenant: str) -> float | None:
        """Return since when ``tenant`` waits for its turn: its oldest request, or the moment it last gave the card up.

        A tenant that gave the card up for another waits for its turn again from then: else its
        requests that waited through the other's residency would take the card straight back.
        """
        starts = self.waits.get(tenant)
        if not starts:
            return None
        return max(min(starts), self.lost.get(tenant, -math.inf))

    def _oldest_other(self, tenant: str) -> tuple[str, float] | None:
        """Return the tenant other than ``tenant`` whose request has waited longest for its turn, and since when."""
        found = [(since, other) for other in self.waits if other != tenant
                 and (since := self._waiting_since(other)) is not None]
        if not found:
            return None
        since, other = min(found)
        return other, since

    def _owed(self, tenant: str) -> bool:
        """Tell whether another tenant's request has waited past ``tenant``'s residency: stop boarding it."""
        oldest = self._oldest_other(tenant)
        return oldest is not None and clock.monotonic() - oldest[1] > self.residency(tenant, oldest[0])

    def batch_gap(self, tenant: str, waiter: str) -> float:
        """Return how long after its last request ``tenant`` still holds the card against ``waiter``.

        BATCH_GAP_S, or less when the two swaps that waiting saves (to ``waiter`` and back) were
        seen to cost less: a tenant not seen yet costs RESIDENCY_MIN_S, as in ``residency``.
        """
        price = self.price.get(waiter, RESIDENCY_MIN_S) + self.price.get(tenant, RESIDENCY_MIN_S)
        return min(BATCH_GAP_S, price)

    def _busy(self, waiter: str) -> str | None:
        """Return the tenant of the gateway's using the card against ``waiter`` (in flight, or just ended)."""
        now = clock.monotonic()
        for lease in self.leases.values():
            if (lease.flights or lease.last_end > now - self.batch_gap(lease.profile, waiter)) and not lease.ending:
                return lease.profile
        # The resident's requests in flight, or waiting for it to come back (then it is the tenant
        # the card is moving to: another's acquire would take it away as soon as it arrived).
        if self.resident_flights or self.waits.get(RESIDENT) or \
                self.resident_last_end > now - self.batch_gap(RESIDENT, waiter):
            return RESIDENT
        return None

    def _turn(self, profile: str) -> bool:
        """Tell whether ``profile`` may ask for the card now: nobody of ours uses it, or its residency passed."""
        busy = self._busy(profile)
        if busy is None or busy == profile:
            return True
        since = self._waiting_since(profile)
        return since is None or clock.monotonic() - since > self.residency(busy, profile)

    async def _engine(self, profile: str, tell: Tell) -> Flight:
        lease = self.leases.get(profile)
        if lease is not None and lease.usable() and not self._owed(profile):
            self.meters.no_swap.labels(profile).inc()
            return self._board(lease)
        started = clock.monotonic()
        deadline = started + self.config.hold
        try:
            with self._queue_place(profile):
                self.wanting[profile] = self.wanting.get(profile, 0) + 1
                try:
                    return await self._wait_engine(profile, tell, started, deadline)
                finally:
                    self.wanting[profile] -= 1
                    opening = self.openings.get(profile)
                    if not self.wanting[profile] and opening is not None and not opening.task.done():
                        self._withdraw_later(opening)
        finally:
            self.meters.window_wait.labels(profile).observe(clock.monotonic() - started)

    def _withdraw_later(self, opening: Opening) -> None:
        """Withdraw an acquire nobody waits for, after a grace: a client's retry rejoins the boot."""
        def withdraw() -> None:
            if not self._wanted(opening.profile) and not opening.task.done():
                log.info("gateway_acquire_withdrawn", profile=opening.profile, reason="nobody waits for it")
                opening.withdrawn = True
                if self.openings.get(opening.profile) is opening:
                    del self.openings[opening.profile]  # a retry acquires anew, not into the cancelled one
                opening.task.cancel()
        if opening.withdraw is not None:
            opening.withdraw.cancel()
        opening.withdraw = asyncio.get_running_loop().call_later(WITHDRAW_GRACE_S, withdraw)

    async def _wait_engine(self, profile: str, tell: Tell, started: float, deadline: float) -> Flight:
        opening = self.openings.get(profile)
        joined = opening is not None  # this request waited for the card to move
        told = clock.monotonic()
        retried = False
        while True:
            changed = self.follow.changed()
            lease = self.leases.get(profile)
            phase = "WAITING"
            if lease is not None and lease.usable():
                if not self._owed(profile):
                    if not joined:
                        self.meters.no_swap.labels(profile).inc()
                    return self._board(lease)
                phase = "YIELDING"  # another tenant is owed the card: this lease goes once its requests end
            else:
                if opening is not None and opening.withdrawn:
                    opening = None  # withdrawn while this request came: acquire again (it rejoins gpuswapd's)
                if opening is not None and opening.task.done():
                    failed = None if opening.task.cancelled() else opening.task.exception()
                    if isinstance(failed, EngineFailed) and not retried:
                        # The engine died or did not come up while its window opened (killed from
                        # outside, say): a waiting request asks once more, as a client's retry would.
                        retried = True
                        if not opening.retried:
                            opening.retried = True
                            log.warning("gateway_open_failed_retrying", profile=profile, error=failed.message)
                        opening = None
                    elif opening.task.cancelled() or failed is not None:
                        raise _unavailable(profile, opening.task)
                    else:
                        opening = None  # granted, and ended since: acquire again
                if opening is None and self._turn(profile):
                    opening = self._opening(profile)
                joined = joined or opening is not None
                phase = opening.phase if opening is not None else "BATCHED"
            now = clock.monotonic()
            left = deadline - now
            if left <= 0:
                raise Unavailable(f"the window of profile {profile!r} did not open within gateway.hold = "
                                  f"{self.config.hold:g}s (gpuswapd phase {self.follow.phase}, here {phase}); "
                                  "the request was withdrawn")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(HEARTBEAT_S, left)):
                    await changed.wait()
            if clock.monotonic() - told >= HEARTBEAT_S:
                told = clock.monotonic()
                await tell(opening.phase if opening is not None and phase != "YIELDING" else phase, told - started)

    def _yields(self) -> bool:
        """Tell whether the resident stops boarding: a tenant owed the card has its acquire on the way."""
        return self._owed(RESIDENT) and any(not o.task.done() for o in self.openings.values())

    async def _resident(self, tell: Tell) -> Flight:
        if self.follow.resident_serves() and not self._yields():
            return self._board(None)
        started = clock.monotonic()
        deadline = started + self.config.hold
        told = started
        try:
            with self._queue_place(RESIDENT):
                while True:
                    changed = self.follow.changed()
                    if self.follow.resident_serves() and not self._yields():
                        return self._board(None)
                    await self._make_way()
                    left = deadline - clock.monotonic()
                    if left <= 0:
                        raise Unavailable(f"the resident did not serve again within gateway.hold = "
                                          f"{self.config.hold:g}s (gpuswapd phase {self.follow.phase})",
                                          retry_after=await self._retry_after())
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(HEARTBEAT_S, left)):
                            await changed.wait()
                    await asyncio.sleep(0)  # a change that came at once: let the others run first
                    if not self.follow.resident_serves() and clock.monotonic() - told >= HEARTBEAT_S:
                        told = clock.monotonic()
                        await tell(self.follow.phase or "UNKNOWN", told - started)
        finally:
            waited = clock.monotonic() - started
            self.meters.window_wait.labels(RESIDENT).observe(waited)

    async def _make_way(self) -> None:
        """For a waiting resident request: give back the gateway's idle leases, or judge who holds the card."""
        phase = self.follow.phase
        if phase in (None, "DRAINING") or not self.follow.reachable:
            return  # the drain passes, or the window opens (then it is judged), or gpuswapd comes back
        status = await self._fresh_status()
        back = status.get("resident_back")
        if isinstance(back, dict) and isinstance(back.get("close_s"), (int, float)):
            self.price[RESIDENT] = float(back["close_s"])
        window = status.get("window") or {}
        if not window or any(t.get("stage") == "close" for t in window.get("timings") or []):
            return  # closing already: the resident comes back
        ours = {lease.held.id: lease for lease in self.leases.values()}
        holders = window.get("leases") or []
        others = [x for x in holders if x.get("id") not in ours]
        if not others:
            idle = [lease for lease in ours.values() if not lease.flights and not self._wanted(lease.profile)]
            if holders and len(idle) == len(ours):
                for lease in idle:
                    log.info("gateway_swap_back", profile=lease.profile, lease=lease.held.id,
                             reason="a resident request while only the gateway's idle lease kept the window")
                    self.lost[lease.profile] = clock.monotonic()
                    await self._release(lease, "swap back to the resident")
                self._status = None
            return  # the gateway's own requests keep it: they end, then it is given back
        if self.config.on_resident_busy == "fail":
            until = ", ".join(f"{x.get('holder')} until {_until(x)}" for x in others)
            raise Unavailable(f"the card is held by {until} (profile {window.get('profile')!r}, phase "
                              f"{window.get('phase')}): the resident is down meanwhile "
                              "(gateway.on_resident_busy = \"fail\")", retry_after=_retry_after(status),
                              holders=[{"holder": x.get("holder"), "expires_at": x.get("expires_at")} for x in others])

    async def _fresh_status(self) -> dict[str, Any]:
        now = clock.monotonic()
        if self._status is None or now - self._status[0] > STATUS_FRESH_S:
            try:
                self._status = (now, await self.daemon.request({"op": "status"}))
            except GpuswapError as err:
                raise Unavailable(f"cannot ask gpuswapd who holds the card: {err.message}") from None
            self.take_price(self._status[1])
        return self._status[1]

    def take_price(self, status: dict[str, Any]) -> None:
        """Take the price of each swap from gpuswapd's ``status`` (medians of its history), where it has one.

        And the rule a residency follows (``schedule``: ``residency_factor``, ``residency_max_s``).
        """
        rule = status.get("schedule")
        if isinstance(rule, dict):
            factor, most = rule.get("residency_factor"), rule.get("residency_max_s")
            if isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 <= factor < math.inf:
                self.residency_factor = float(factor)
            if isinstance(most, (int, float)) and not isinstance(most, bool) and 0 < most < math.inf:
                self.residency_max = float(most)
        prices = status.get("price")
        if not isinstance(prices, dict):
            return
        for profile, price in prices.items():
            if not isinstance(price, dict):
                continue
            if isinstance(price.get("open_s"), (int, float)):
                self.price[str(profile)] = float(price["open_s"])
            if isinstance(price.get("resident_restart_s"), (int, float)):
                self.price[RESIDENT] = float(price["resident_restart_s"])

    async def _retry_after(self) -> int | None:
        with contextlib.suppress(Unavailable):
            return _retry_after(await self._fresh_status())
        return None

    def _wanted(self, profile: str) -> bool:
        """Tell whether requests wait for ``profile``'s window (they board once it is READY)."""
        return self.wanting.get(profile, 0) > 0

    def _board(self, lease: OurLease | None) -> Flight:
        if lease is None:
            flight = Flight(RESIDENT)
            self.resident_flights.add(flight)
        else:
            flight = Flight(lease.profile, lease)
            lease.flights.add(flight)
            lease.boarded = True
            lease.wake.set()
        return flight

    def _done(self, flight: Flight) -> None:
        if flight.lease is None:
            self.resident_flights.discard(flight)
            self.resident_last_end = clock.monotonic()
            self.follow.poke()  # an engine request batched behind the resident may go now
            return
        lease = flight.lease
        lease.flights.discard(flight)
        now = clock.monotonic()
        took = now - flight.since
        # The longest request of late, decaying: a lease boards only what it will outlive.
        self.longest[lease.profile] = max(took, 0.9 * self.longest.get(lease.profile, 0.0))
        lease.last_end = now
        lease.wake.set()
        self.follow.poke()

    # -- the leases ----------------------------------------------------------------------------

    def _opening(self, profile: str) -> Opening:
        opening = self.openings.get(profile)
        if opening is None or opening.task.done() or opening.withdrawn:
            task = spawn(self._acquire(profile), f"gateway-acquire-{profile}")
            opening = self.openings[profile] = Opening(profile, task)
            task.add_done_callback(partial(self._opened, opening))
        return opening

    def _opened(self, opening: Opening, _task: asyncio.Task[OurLease]) -> None:
        if opening.withdraw is not None:
            opening.withdraw.cancel()
        if self.openings.get(opening.profile) is opening:
            del self.openings[opening.profile]
        self.follow.poke()  # wake resident requests that wait behind it

    async def _acquire(self, profile: str, adopt: OurLease | None = None) -> OurLease:
        """Take a lease for ``profile``; first give back the gateway's idle leases of other profiles.

        gpuswapd away (it restarted, or its socket waits for it), the acquire is made again after a
        short backoff, with its reclaim token (its place in gpuswapd's queue is kept), for as long
        as someone waits for it (they withdraw it after their bound). ``adopt``: a lease whose
        connection ended under requests in flight; it is reclaimed with its token, and they move
        to it.
        """
        for other in [x for x in self.leases.values()
                      if x.profile != profile and not x.flights and not self._wanted(x.profile)]:
            log.info("gateway_switching", from_profile=other.profile, to_profile=profile)
            self.lost[other.profile] = clock.monotonic()
            await self._release(other, f"a request for profile {profile!r}")
        opening = self.openings.get(profile)
        token = adopt.held.token if adopt is not None else None

        def progress(event: dict[str, Any]) -> None:
            nonlocal token
            if event.get("event") == "accepted" and isinstance(event.get("token"), str):
                token = str(event["token"])  # sent again after a restart: the place in the queue is kept
            elif opening is not None and isinstance(event.get("phase"), str):
                opening.phase = str(event["phase"])
            elif opening is not None and event.get("event") == "queued":
                opening.phase = f"QUEUED {event.get('position')}"

        log.info("gateway_acquiring", profile=profile, priority=self.config.priority, for_s=self.lease_s)
        failures = 0
        while True:
            asked = clock.monotonic()
            try:
                held = await self.daemon.acquire(profile, self.lease_s, self.config.priority, self.holder, progress,
                                                 reclaim=token)
                break
            except LinkDown as err:
                failures += 1
                if opening is not None:
                    opening.phase = "GPUSWAPD_AWAY"
                log.warning("gateway_acquire_again", profile=profile, error=err.message,
                            retry_in_s=backoff(REACQUIRE_S, failures))
                await asyncio.sleep(backoff(REACQUIRE_S, failures))
        took = clock.monotonic() - asked
        if opening is not None and opening.phase not in ("QUEUED", "READY"):
            self.price[profile] = took  # the card moved: what it cost
        expires = held.lease.get("expires_at")
        lease = OurLease(held, profile, ends_at(held.lease))
        left = lease.expires_at - clock.now()
        lease.span = left
        lease.margin = min(self.lease_s / 3, left / 2, max(BOARD_MIN_S, 1.5 * self.longest.get(profile, 0.0)))
        previous = self.leases.get(profile)
        if not any(x.profile != profile and not x.ending for x in self.leases.values()):
            self.lost[RESIDENT] = clock.monotonic()  # the card came from the resident (or another holder)
        self.leases[profile] = lease
        if previous is not None and previous is not lease:
            previous.ending = True  # a preempted one whose flights still run out their grace
        if adopt is not None:
            lease.boarded = True
            for flight in list(adopt.flights):
                flight.lease = lease
                lease.flights.add(flight)
            adopt.flights.clear()
        lease.tasks = [spawn(self._keep(lease), f"gateway-keep-{profile}"),
                       spawn(self._listen(lease), f"gateway-lease-{profile}")]
        log.info("gateway_lease_granted", profile=profile, lease=held.id, expires_at=expires,
                 adopted=len(lease.flights))
        return lease

    async def _keep(self, lease: OurLease) -> None:
        """Renew the lease while it is used; release it ``idle`` after its last request ended.

        A renewal that fails is tried again after a backoff of seconds, until the lease ends. The
        lease is given back at once when its last request ends while a request of the gateway's
        for another tenant waits: the card goes to it without waiting for ``idle``.
        """
        idle = self.config.idle
        while not lease.ending:
            now = clock.monotonic()
            # Another tenant's request waits: the lease goes once its own requests are done (none
            # in flight, and no next one within BATCH_GAP_S), or at once past its residency.
            other = self._oldest_other(lease.profile)
            gap = lease.last_end + (BATCH_GAP_S if other is None else self.batch_gap(lease.profile, other[0])) - now
            if not lease.flights and (self._owed(lease.profile) or (
                    not self._wanted(lease.profile) and other is not None and gap <= 0)):
                self.lost[lease.profile] = now
                await self._release(lease, "its last request ended while another tenant's request waits")
                return
            # A lease granted after its waiters went away (their clients hung up) is kept only for
            # the grace their retries had: a window nobody came back for is not held for ``idle``.
            keep = idle if lease.boarded else min(idle, WITHDRAW_GRACE_S)
            if not lease.flights and not self._wanted(lease.profile) and now - lease.last_end >= keep:
                await self._release(lease, f"idle for {keep:g}s")
                return
            left = lease.expires_at - clock.now()
            if left <= 0:
                log.info("gateway_lease_expired", profile=lease.profile, lease=lease.held.id)
                self._forget(lease)
                return
            # Renewed when less than half of it is left: half of what was asked, or of what gpuswapd
            # granted when its max_lease is shorter (a 20 s lease is renewed at 10 s, not never).
            half = min(self.lease_s, lease.span) / 2
            if left < half and not lease.doomed and now >= lease.retry_at:
                await self._renew(lease)
                if lease.ending:
                    return
                left = lease.expires_at - clock.now()
                half = min(self.lease_s, lease.span) / 2
            if lease.renew_failures:
                wake_in = [max(0.0, lease.retry_at - clock.monotonic()), left]
            else:
                wake_in = [left - half if left > half else left]
            if not lease.flights:
                wake_in.append(lease.last_end + keep - now)
                if gap > 0:
                    wake_in.append(gap)
            lease.wake.clear()
            waker = asyncio.ensure_future(lease.wake.wait())
            try:
                await naps.nap(max(0.05, min(wake_in)), waker)  # a suspend meanwhile: looked at again on waking
            finally:
                waker.cancel()

    async def _renew(self, lease: OurLease) -> None:
        try:
            reply = await self.daemon.request({"op": "renew", "lease": lease.held.id, "for": self.lease_s})
        except LeaseNotFound:
            log.info("gateway_lease_gone", profile=lease.profile, lease=lease.held.id)
            self._forget(lease)
            return
        except GpuswapError as err:  # gpuswapd is busy or away: try again in seconds; the lease still runs
            lease.renew_failures += 1
            delay = backoff(RENEW_RETRY_S, lease.renew_failures)
            lease.retry_at = clock.monotonic() + delay
            self.meters.renew_failures.inc()
            log.warning("gateway_renew_failed", lease=lease.held.id, error=err.message, retry_in_s=delay,
                        left_s=round(lease.expires_at - clock.now(), 1))
            return
        if lease.renew_failures:
            log.info("gateway_renewed_after_failures", lease=lease.held.id, failures=lease.renew_failures)
        lease.renew_failures = 0
        lease.retry_at = 0.0
        got = reply.get("lease") or {}
        expires = got.get("expires_at")
        lease.expires_at = ends_at(got)
        if reply.get("capped_by") != "fair_after":  # a lease that ends at a fair claim is not renewed past it
            lease.span = lease.expires_at - clock.now()
        if reply.get("capped"):
            log.info("gateway_renew_capped", lease=lease.held.id, expires_at=expires)

    async def _listen(self, lease: OurLease) -> None:
        """Follow the lease's events on its connection: a preemption's notice, then its revoking.

        The connection ending without ``preempted`` (gpuswapd restarted) with requests in flight:
        a lease is acquired again for them (the restarted gpuswapd adopts the window, so it is
        granted at once) and they move to it.
        """
        preempted = False
        async for event in lease.held.events():
            name = event.get("event")
            if name == "preempting":
                lease.doomed = True
                log.warning("gateway_preempting", profile=lease.profile, by=event.get("by"),
                            grace_s=event.get("grace_s"), in_flight=len(lease.flights))
            elif name == "preempted":
                preempted = True
                why = (f"the window of profile {lease.profile!r} was preempted by {event.get('by')} (priority "
                       f"{event.get('priority')}) and its grace has ended")
                for flight in list(lease.flights):
                    flight.cut_off(why)
                self._forget(lease)
                break
            elif name == "preemption_abandoned":
                lease.doomed = False
        lost = not preempted and not lease.ending
        self._forget(lease)
        with contextlib.suppress(Exception):
            await lease.held.close()
        if lost and lease.flights and lease.profile not in self.openings:
            log.warning("gateway_lease_connection_lost", profile=lease.profile, lease=lease.held.id,
                        in_flight=len(lease.flights))
            task = spawn(self._acquire(lease.profile, adopt=lease), f"gateway-acquire-{lease.profile}")
            opening = self.openings[lease.profile] = Opening(lease.profile, task)
            task.add_done_callback(partial(self._opened, opening))

    def _event(self, event: dict[str, Any]) -> None:
        """Take gpuswapd's events: a lease of ours that expired or ended."""
        if event.get("event") not in ("lease_expired", "lease_ended", "lease_released"):
            return
        for lease in list(self.leases.values()):
            if lease.held.id == event.get("lease"):
                self._forget(lease)

    def _forget(self, lease: OurLease) -> None:
        lease.ending = True
        lease.wake.set()
        if self.leases.get(lease.profile) is lease:
            del self.leases[lease.profile]
            self.follow.poke()

    async def _release(self, lease: OurLease, why: str) -> None:
        """Give a lease back now (asked on its own connection first, so it is gone when this returns)."""
        self._forget(lease)
        log.info("gateway_lease_released", profile=lease.profile, lease=lease.held.id, reason=why)
        with contextlib.suppress(GpuswapError):
            await self.daemon.request({"op": "release", "lease": lease.held.id})
        await lease.held.close()
        current = asyncio.current_task()
        for task in lease.tasks:
            if task is not current:
                task.cancel()


def _unavailable(profile: str, task: asyncio.Task[Any]) -> Unavailable:
    if task.cancelled():
        return Unavailable(f"the acquire for profile {profile!r} was withdrawn (the gateway is stopping)")
    err = task.exception()
    said = err.message if isinstance(err, GpuswapError) else repr(err)
    return Unavailable(f"the window of profile {profile!r} could not be opened: {said}")


def _retry_after(status: dict[str, Any]) -> int | None:
    back = status.get("resident_back")
    if not isinstance(back, dict) or not isinstance(back.get("in_s"), (int, float)):
        return None
    return max(1, math.ceil(float(back["in_s"])))


def ends_at(lease: dict[str, Any]) -> float:
    """Say when a lease from the wire ends on this process's ``clock.now()`` (math.inf: when released).

    gpuswapd's ``remaining_s`` is measured on its CLOCK_BOOTTIME, and so is ``clock.now()`` here:
    a wall step in either process moves neither. Without it, the wall-clock ``expires_at``.
    """
    if lease.get("expires_at") is None:
        return math.inf
    left = lease.get("remaining_s")
    if isinstance(left, (int, float)):
        return clock.now() + float(left)
    return clock.from_wall(float(lease["expires_at"]))


def _until(lease: dict[str, Any]) -> str:
    left = lease.get("remaining_s")  # another holder's lease, as gpuswapd counts it
    if not isinstance(left, (int, float)):
        expires_at = lease.get("expires_at")
        if not isinstance(expires_at, (int, float)):
            return "released"
        left = expires_at - clock.wall()  # the wire's expiry is a wall-clock time
    return f"in {max(0, round(left))}s"
