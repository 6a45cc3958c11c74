"""When a tenant may be served: windows opened on demand, kept while used, given back when idle.

An engine model with no window open: the gateway takes a lease for its profile at
``gateway.priority``, bound to its connection (it ends if the gateway dies), and the request waits
until the window is READY, at most ``gateway.hold``. Every request for that profile waits on the
same acquire; when the last of them goes away, the acquire is withdrawn (a window nobody else
wants is rolled back). The lease is renewed while requests flow, and released ``gateway.idle``
after the last one ended; a renewal capped by gpuswapd is taken as it comes (the lease ends at its
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
from gpuswapd.errors import GpuswapError, LeaseNotFound
from gpuswapd.gateway.errors import TooManyWaiting, Unavailable
from gpuswapd.gateway.follow import Follow
from gpuswapd.gateway.meters import Meters
from gpuswapd.gateway.tenants import RESIDENT, Tenant
from gpuswapd.logs import log
from gpuswapd.tasks import reap, spawn

HEARTBEAT_S = 3.0  # a waiting stream gets an SSE comment this often
RENEW_MARGIN_S = 60.0  # a lease lasts idle plus this; it is renewed when less than half of it is left
STATUS_FRESH_S = 0.5  # a status read is reused this long by the resident requests that wait

Tell = Callable[[str, float], Awaitable[None]]  # (phase, seconds waited): a waiting request's heartbeat


class HeldLease(Protocol):
    """A lease bound to its acquire connection (``link.Held``, or a fake)."""

    lease: dict[str, Any]

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
                      progress: Callable[[dict[str, Any]], None]) -> HeldLease:
        """Acquire a connection-bound lease, waiting for READY."""
        ...

    async def request(self, message: dict[str, Any], timeout: float = ...) -> dict[str, Any]:
        """Send one request and return its reply."""
        ...


@dataclass(eq=False)
class Flight:
    """One request being answered by a tenant."""

    tenant: str
    lease: OurLease | None = None
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

    def usable(self) -> bool:
        """Tell whether a new request may be served under this lease."""
        return not self.doomed and not self.ending and clock.now() < self.expires_at


@dataclass(eq=False)
class Opening:
    """An acquire on the way, and the requests waiting on it."""

    profile: str
    task: asyncio.Task[OurLease]
    phase: str = "QUEUED"
    since: float = field(default_factory=clock.monotonic)


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
        self.resident_flights: set[Flight] = set()
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

    async def start(self) -> None:
        """Release the leases an earlier gateway left bound to this unit (a unit's leases are found by its cgroup)."""
        if self.holder is not None:
            return  # not a unit: an earlier gateway's leases ended with its connections
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
    def _queue_place(self) -> Any:
        if self.waiting >= self.config.max_waiting:
            raise TooManyWaiting(f"{self.waiting} requests wait for a window already (gateway.max_waiting = "
                                 f"{self.config.max_waiting}); try again later")
        self.waiting += 1
        self.meters.waiting.inc()
        try:
            yield
        finally:
            self.waiting -= 1
            self.meters.waiting.dec()

    async def _engine(self, profile: str, tell: Tell) -> Flight:
        lease = self.leases.get(profile)
        if lease is not None and lease.usable():
            return self._board(lease)
        started = clock.monotonic()
        deadline = started + self.config.hold
        try:
            with self._queue_place():
                self.wanting[profile] = self.wanting.get(profile, 0) + 1
                try:
                    return await self._wait_engine(profile, tell, started, deadline)
                finally:
                    self.wanting[profile] -= 1
                    opening = self.openings.get(profile)
                    if not self.wanting[profile] and opening is not None and not opening.task.done():
                        log.info("gateway_acquire_withdrawn", profile=profile, reason="nobody waits for it")
                        opening.task.cancel()
        finally:
            self.meters.window_wait.labels(profile).observe(clock.monotonic() - started)

    async def _wait_engine(self, profile: str, tell: Tell, started: float, deadline: float) -> Flight:
        opening = self._opening(profile)
        while True:
            lease = self.leases.get(profile)
            if lease is not None and lease.usable():
                return self._board(lease)
            if opening.task.done():
                if opening.task.cancelled() or opening.task.exception() is not None:
                    raise _unavailable(profile, opening.task)
                opening = self._opening(profile)  # granted, and ended since: acquire again
                continue
            left = deadline - clock.monotonic()
            if left <= 0:
                raise Unavailable(f"the window of profile {profile!r} did not open within gateway.hold = "
                                  f"{self.config.hold:g}s (gpuswapd phase {self.follow.phase}); the request was "
                                  "withdrawn")
            await asyncio.wait({opening.task}, timeout=min(HEARTBEAT_S, left))
            if not opening.task.done():
                await tell(opening.phase, clock.monotonic() - started)

    async def _resident(self, tell: Tell) -> Flight:
        if self.follow.resident_serves():
            return self._board(None)
        started = clock.monotonic()
        deadline = started + self.config.hold
        try:
            with self._queue_place():
                while True:
                    changed = self.follow.changed()
                    if self.follow.resident_serves():
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
                    if not self.follow.resident_serves():
                        await tell(self.follow.phase or "UNKNOWN", clock.monotonic() - started)
        finally:
            self.meters.window_wait.labels(RESIDENT).observe(clock.monotonic() - started)

    async def _make_way(self) -> None:
        """For a waiting resident request: give back the gateway's idle leases, or judge who holds the card."""
        phase = self.follow.phase
        if phase in (None, "DRAINING") or not self.follow.reachable:
            return  # the drain passes, or the window opens (then it is judged), or gpuswapd comes back
        status = await self._fresh_status()
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
                    await self._release(lease, "swap back to the resident")
                self._status = None
            return  # the gateway's own requests keep it: they end, then it is given back
        if self.config.on_resident_busy == "fail":
            until = ", ".join(f"{x.get('holder')} until {_until(x.get('expires_at'))}" for x in others)
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
        return self._status[1]

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
            lease.wake.set()
        return flight

    def _done(self, flight: Flight) -> None:
        if flight.lease is None:
            self.resident_flights.discard(flight)
            return
        lease = flight.lease
        lease.flights.discard(flight)
        lease.last_end = clock.monotonic()
        lease.wake.set()

    # -- the leases ----------------------------------------------------------------------------

    def _opening(self, profile: str) -> Opening:
        opening = self.openings.get(profile)
        if opening is None or opening.task.done():
            task = spawn(self._acquire(profile), f"gateway-acquire-{profile}")
            opening = self.openings[profile] = Opening(profile, task)
            task.add_done_callback(partial(self._opened, opening))
        return opening

    def _opened(self, opening: Opening, _task: asyncio.Task[OurLease]) -> None:
        if self.openings.get(opening.profile) is opening:
            del self.openings[opening.profile]
        self.follow.poke()  # wake resident requests that wait behind it

    async def _acquire(self, profile: str) -> OurLease:
        """Take a lease for ``profile``; first give back the gateway's idle leases of other profiles."""
        for other in [x for x in self.leases.values()
                      if x.profile != profile and not x.flights and not self._wanted(x.profile)]:
            log.info("gateway_switching", from_profile=other.profile, to_profile=profile)
            await self._release(other, f"a request for profile {profile!r}")
        opening = self.openings.get(profile)

        def progress(event: dict[str, Any]) -> None:
            if opening is not None and isinstance(event.get("phase"), str):
                opening.phase = str(event["phase"])
            elif opening is not None and event.get("event") == "queued":
                opening.phase = f"QUEUED {event.get('position')}"

        log.info("gateway_acquiring", profile=profile, priority=self.config.priority, for_s=self.lease_s)
        held = await self.daemon.acquire(profile, self.lease_s, self.config.priority, self.holder, progress)
        expires = held.lease.get("expires_at")
        lease = OurLease(held, profile, ends_at(held.lease))
        previous = self.leases.get(profile)
        self.leases[profile] = lease
        if previous is not None and previous is not lease:
            previous.ending = True  # a preempted one whose flights still run out their grace
        lease.tasks = [spawn(self._keep(lease), f"gateway-keep-{profile}"),
                       spawn(self._listen(lease), f"gateway-lease-{profile}")]
        log.info("gateway_lease_granted", profile=profile, lease=held.id, expires_at=expires)
        return lease

    async def _keep(self, lease: OurLease) -> None:
        """Renew the lease while it is used; release it ``idle`` after its last request ended."""
        idle = self.config.idle
        while not lease.ending:
            now = clock.monotonic()
            if not lease.flights and not self._wanted(lease.profile) and now - lease.last_end >= idle:
                await self._release(lease, f"idle for {idle:g}s")
                return
            left = lease.expires_at - clock.now()
            if left <= 0:
                log.info("gateway_lease_expired", profile=lease.profile, lease=lease.held.id)
                self._forget(lease)
                return
            if left < self.lease_s / 2 and not lease.doomed:
                await self._renew(lease)
                left = lease.expires_at - clock.now()
            wake_in = [max(0.0, left - self.lease_s / 2) if left > self.lease_s / 2 else left]
            if not lease.flights:
                wake_in.append(lease.last_end + idle - now)
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
        except GpuswapError as err:  # gpuswapd is busy or away: try again soon; the lease still runs
            log.warning("gateway_renew_failed", lease=lease.held.id, error=err.message)
            return
        got = reply.get("lease") or {}
        expires = got.get("expires_at")
        lease.expires_at = ends_at(got)
        if reply.get("capped"):
            log.info("gateway_renew_capped", lease=lease.held.id, expires_at=expires)

    async def _listen(self, lease: OurLease) -> None:
        """Follow the lease's events on its connection: a preemption's notice, then its revoking."""
        async for event in lease.held.events():
            name = event.get("event")
            if name == "preempting":
                lease.doomed = True
                log.warning("gateway_preempting", profile=lease.profile, by=event.get("by"),
                            grace_s=event.get("grace_s"), in_flight=len(lease.flights))
            elif name == "preempted":
                why = (f"the window of profile {lease.profile!r} was preempted by {event.get('by')} (priority "
                       f"{event.get('priority')}) and its grace has ended")
                for flight in list(lease.flights):
                    flight.cut_off(why)
                self._forget(lease)
                break
            elif name == "preemption_abandoned":
                lease.doomed = False
        self._forget(lease)
        with contextlib.suppress(Exception):
            await lease.held.close()

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


def _until(expires_at: Any) -> str:
    if not isinstance(expires_at, (int, float)):
        return "released"
    left = expires_at - clock.wall()  # another holder's expiry, from the wire: a wall-clock time
    return f"in {max(0, round(left))}s"
