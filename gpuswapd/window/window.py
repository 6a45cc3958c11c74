"""The GPU window as its clients and its steps see it: leases, the waiting clients, the window's state.

Every phase change is written to the state document before the phase acts, and every change the
window makes to the system (timers paused, units stopped, a container created) is recorded
before it is made, so whatever happens next can be undone from the record. This module owns the
record, the leases, the queue and the waiting clients, and is the steps' ``Context``; its
``Driver`` (``driver.py``) takes the record through its phases and rolls back whatever escapes
a step; the steps live in ``opening``, ``holding``, ``closing`` and the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable

import structlog

from gpuswapd import clock
from gpuswapd.adapters.pagecache import Files
from gpuswapd.adapters.unitstates import UnitState
from gpuswapd.config import DEFAULT_PROFILE, Config, Profile, ProfileKind
from gpuswapd.errors import (
    Degraded,
    DockerError,
    GpuswapError,
    LeaseNotFound,
    NotFound,
    NotReady,
    PermissionDenied,
    QueueFull,
    StateError,
    Stopping,
    UnknownProfile,
)
from gpuswapd.failpoints import failpoint
from gpuswapd.leases import Lease
from gpuswapd.logs import log
from gpuswapd.notify import Notifier
from gpuswapd.outside import Outside
from gpuswapd.parts.engine import BareEngine, ContainerEngine, Engine
from gpuswapd.parts.resident import Resident
from gpuswapd.parts.vram import Vram
from gpuswapd.phases import Phase
from gpuswapd.protocol import JsonObject
from gpuswapd.record import BaselineRestore, Finished, Parked, WindowRecord
from gpuswapd.state.store import Document, StateStore
from gpuswapd.state.writer import StateWriter
from gpuswapd.tasks import reap, spawn
from gpuswapd.window import identity, opening, parking, preempting
from gpuswapd.window.baseline import Known
from gpuswapd.window.context import Backoffs
from gpuswapd.window.driver import Driver
from gpuswapd.window.prefetch import ResidentFiles
from gpuswapd.window.price import Times
from gpuswapd.window.progress import progress
from gpuswapd.window.queueing import Listener, Queue, Waiter

Owner = Callable[[Lease], bool]
# The unit file states resident.restart_crashed starts a failed unit in: never masked or disabled.
RESTARTABLE = frozenset({"enabled", "enabled-runtime", "static", "indirect", "generated", "linked",
                         "linked-runtime", "alias", "transient"})


class Window:
    """Opens, holds and closes the GPU window for the lease holders."""

    def __init__(self, config: Config, resident: Resident, engine: Engine, vram: Vram, store: StateStore,
                 notifier: Notifier, outside: Outside, backoffs: Backoffs | None = None,
                 engines: dict[str, Engine] | None = None, files: Files | None = None) -> None:
        self.config = config
        self.resident = resident
        # One engine per profile: "default" is [window]'s; a bare profile has none to speak of.
        self.engines: dict[str, Engine] = {DEFAULT_PROFILE: engine, **(engines or {})}
        for name, profile in config.profiles.items():
            if profile.kind == ProfileKind.BARE:
                self.engines.setdefault(name, BareEngine())
        self.vram = vram
        self.files = ResidentFiles(config, resident, files, outside)  # the resident's model files, read in at close
        self.store = store
        self.notifier = notifier
        self.outside = outside
        self.backoffs = backoffs or Backoffs()
        self.writer = StateWriter(store, outside.state, self.document, self.backoffs.writer)
        self.writer.on_change = self.notify_status
        self.writer.on_writable = self._writable_again
        self.record: WindowRecord | None = None
        self.last: WindowRecord | None = None
        self.baseline_restore: BaselineRestore | None = None
        self.times = Times()  # what history says a swap costs: ETAs, what a switch saves, the shares
        d = config.daemon
        self.queue = Queue(d.fair_after, d.aging, d.residency_factor, d.residency_max, self.times)
        self.lease_watchers: dict[str, Listener] = {}  # lease id -> its client's connection (run, bench)
        self.abandoning: asyncio.Task[None] | None = None  # an opening nobody waits for, given up after a grace
        self.swaps_avoided = 0  # requests that joined the tenant on the card while an older one waited for another
        self.closed_windows: set[str] = set()  # ids history shows closed (an orphan of another is a lost record)
        self._listeners: set[Listener] = set()
        # Told of every finished window, as history keeps it (metrics).
        self.finished: list[Callable[[Finished], None]] = []
        self.sweeper: asyncio.Task[None] | None = None
        self.hung_mark = (0, 0, 0, 0)  # closing.hung_mark() when the current record began
        self.unknown_baseline: WindowRecord | None = None  # a baseline record still without its units
        # What gpuswapd stopped (state/marks.py) could not be read at start: the idle reconcile reads it again.
        self.stopped_unread = False
        self.adopting: WindowRecord | None = None  # a window left by the last gpuswapd, not yet adopted or closed
        self.parked: Parked | None = None  # the engine asleep between windows
        self.held_down: dict[str, float] = {}  # resident units their operator stopped while no window was open
        self.went_down: dict[str, float] = {}  # unit: when a signal last said it went down (monotonic)
        self.resident_down: dict[str, str] = {}  # resident units the reconcile found down, and why (reported only)
        self.resident_names: dict[str, str] = {}  # another name of a resident unit (its Id, an alias) -> the configured
        self.known = Known()  # what the resident is: its baseline, its footprint, a change left
        self.park_watch: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()
        # Per lease with renewals in flight: how many (Lease.recorded_until keeps the expiry on disk).
        self._renewing: dict[str, int] = {}
        self.stopping = asyncio.Event()  # no new windows, leases or waiters; a close under way goes on
        self.abort = asyncio.Event()  # give up now: a close under way stops at its next wait, its record stays
        self.refusing = False  # told to stop (SIGTERM): no new lease or request, whatever the shutdown then does
        self.driver = Driver(self)  # takes the record through its phases (window/driver.py)

    def document(self) -> Document:
        """Return the state document as it stands in memory (the writer's snapshot)."""
        # A baseline record is written only once it says what to restore (see restore_baseline).
        return Document(window=None if self.record is self.unknown_baseline else self.record,
                        parked=self.parked.to_dict() if self.parked is not None else None,
                        queue=[w.to_dict() for w in self.queue.waiters] + self.queue.kept_now(clock.now()),
                        held_down=dict(self.held_down),
                        resident=self.known.to_dict())

    @property
    def profile(self) -> Profile:
        """Return the profile of the window open now ("default" when none is, or its profile is gone)."""
        name = self.record.profile if self.record is not None else DEFAULT_PROFILE
        try:
            return self.config.profile(name)
        except KeyError:  # a window an earlier configuration opened: closed with what there is
            return self.config.profile(DEFAULT_PROFILE)

    @property
    def resident_needs(self) -> int:
        """Return the VRAM the resident needs free: ``gpu.resident_needs``, or what it was seen to hold if more."""
        return self.known.needs(self.config.gpu.resident_needs)

    @property
    def engine(self) -> Engine:
        """Return the engine of the window open now (the default engine when none is)."""
        return self.engine_of(self.profile.name)

    @property
    def container_engine(self) -> ContainerEngine:
        """Return the container of the engine window open now: what boots, warms, sleeps and wakes.

        Only an engine window's steps ask for it (a bare window boots nothing: they check its kind first).
        """
        engine = self.engine
        assert isinstance(engine, ContainerEngine), f"profile {self.profile.name} is bare: it has no container"
        return engine

    def engine_of(self, profile: str) -> Engine:
        """Return the engine of a profile (a parked engine's, say)."""
        return self.engines.get(profile) or self.engines[DEFAULT_PROFILE]

    def engines_kept(self) -> set[str]:
        """Name the windows whose containers are still wanted: the open window's and the parked one's."""
        keep = set()
        rec = self.record
        if rec is not None and rec.container is not None:
            keep.add(str(rec.container.window if rec.container.window is not None else rec.id))
        if self.parked is not None:
            keep.add(str(self.parked.container.window))
        return keep

    # -- what clients ask ------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Return the current phase (IDLE when no window is open)."""
        return self.record.phase if self.record else Phase.IDLE

    async def acquire(self, holder: str, duration: float, *, unit: str | None = None, uid: int | None = None,
                      wait: bool = True, listener: Listener | None = None, profile: str = DEFAULT_PROFILE,
                      priority: int = 0, bound: bool = False, token: str | None = None,
                      since: float | None = None) -> Lease:
        """Get a lease: at once if a window of ``profile`` is READY, else by joining its opening or queueing.

        A request for the open window's profile joins it, unless a queued request for another
        profile has waited ``daemon.fair_after``; every other request queues for a later window.
        """
        self._check_serves(profile)
        rec, now = self.record, clock.now()
        joins = self._joins(rec, profile, now)
        waiter = Waiter(holder, duration, unit, uid, profile, listener, priority, bound=bound, token=token,
                        since=now if since is None else since)
        if joins and self.queue.wants_other(profile):
            self.swaps_avoided += 1  # first come first served would have moved the card first
        if joins and rec is not None and rec.phase is Phase.READY:
            return await self._grant(rec, waiter)
        await self._check_may_wait(rec, profile, wait=wait, joins=joins)
        self._enqueue(waiter, rec, joins, now)
        return await self._wait_for_lease(waiter)

    def _check_serves(self, profile: str) -> None:
        """Refuse every request while gpuswapd stops, and one for a profile it does not have."""
        if self.stopping.is_set() or self.refusing:
            raise Stopping("gpuswapd is stopping")
        if profile not in self.engines:
            raise UnknownProfile(f"no profile {profile!r}: this gpuswapd has {', '.join(sorted(self.engines))} "
                                 "([window] is \"default\", the others are [profiles.NAME])")

    def _joins(self, rec: WindowRecord | None, profile: str, now: float) -> bool:
        """Tell whether a request for ``profile`` joins the open window rather than queue for a later one."""
        # A window being preempted takes no new leases: they would only be revoked. Once the
        # preemption is abandoned (its request went away), it takes them again.
        # A window an earlier gpuswapd left is not joined until it is adopted: its engine may be
        # gone, and a lease granted on it would end with its roll-back (it queues meanwhile).
        return (rec is not None and rec.profile == profile and not rec.closing and not rec.pending_switch
                and rec is not self.adopting
                and not preempting.under_way(rec) and self.queue.blocked(profile, now) is None)

    async def _check_may_wait(self, rec: WindowRecord | None, profile: str, *, wait: bool, joins: bool) -> None:
        """Refuse a request that cannot be granted now and may not, or could never, wait for a window."""
        if rec is not None and rec.degraded:
            raise Degraded(f"the last window could not be closed yet, so no window opens: {rec.degraded}; "
                           "gpuswapd keeps retrying (gpuswapctl status)", phase=str(rec.phase))
        if not wait:
            raise NotReady(f"no window of profile {profile!r} is open (phase {self.phase}"
                           f"{f', profile {rec.profile!r}' if rec is not None else ''}); "
                           "acquire without --no-wait opens one")
        if not joins and len(self.queue.queued()) >= self.config.daemon.max_queue:
            raise QueueFull(f"the queue is full: {self.config.daemon.max_queue} requests wait already "
                            "(daemon.max_queue); try again later")
        if not joins and rec is not None and rec.profile != profile:
            # It would wait behind another window: say now if it could never open (an image pruned
            # while gpuswapd runs, an env file gone), not after that window has closed for it.
            await opening.preflight(self, profile)

    def _enqueue(self, waiter: Waiter, rec: WindowRecord | None, joins: bool, now: float) -> None:
        """Add a waiter to the opening window (``joins``) or to the queue, and start the driver if idle."""
        waiter.window = rec.id if joins and rec is not None else None
        self.queue.waiters.append(waiter)
        if waiter.listener is not None:
            self._listeners.add(waiter.listener)
            if rec is not None and rec.closing:
                waiter.listener({"event": "waiting", "reason": "restoring the previous window",
                                 "phase": str(rec.phase), "window": rec.id})
        if waiter.window is None and rec is not None:
            position = self.queue.queued(now).index(waiter) + 1
            log.info("request_queued", holder=waiter.holder, profile=waiter.profile, priority=waiter.priority,
                     position=position)
            self.writer.request()
            self.wake.set()  # the open window must not linger for nobody
            self.tell_queue()
        if self.driver.task is None:
            self.driver.drive()

    async def _wait_for_lease(self, waiter: Waiter) -> Lease:
        """Wait for a waiter's lease; withdraw the waiter however the wait ends."""
        try:
            lease: Lease = await asyncio.shield(waiter.future)
            return lease
        except asyncio.CancelledError:
            # The client went away (or its timeout passed): a lease granted meanwhile is nobody's.
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._drop_lease(fut.result())
            raise
        finally:
            if waiter.listener is not None:
                self._listeners.discard(waiter.listener)
            self._withdraw(waiter)

    def _withdraw(self, waiter: Waiter) -> None:
        """Forget a waiter that went away; abandon an opening window nobody waits for."""
        queued = waiter.window is None and waiter in self.queue.waiters
        self.queue.remove(waiter)
        if queued:
            self.writer.request()
            self.tell_queue()
            self.wake.set()  # a preemption it asked for is abandoned
        if waiter.future.done():
            return
        waiter.future.cancel()
        if self._nobody_waits(waiter.window):
            grace = self.config.daemon.abandon_grace
            if grace <= 0:
                self._abandon()
            elif self.abandoning is None or self.abandoning.done():
                # A client with a short timeout retries: its retry rejoins the opening under way.
                self.abandoning = spawn(self._abandon_after(grace), "window-abandon")

    def _nobody_waits(self, window: str | None) -> bool:
        """Tell whether ``window`` is the opening window and nobody waits for it or holds it any more."""
        rec = self.record
        return (rec is not None and window == rec.id and not self.queue.joined(rec.id)
                and self.driver.opening is not None and not len(rec.leases))

    async def _abandon_after(self, grace: float) -> None:
        """Abandon the opening window if, ``grace`` from now, still nobody waits for it."""
        rec = self.record
        await asyncio.sleep(grace)
        if rec is not None and self.record is rec and self._nobody_waits(rec.id):
            self._abandon()

    def _abandon(self) -> None:
        log.info("window_abandoned", reason="the last waiting client went away")
        if self.driver.opening is not None:
            self.driver.opening.cancel()

    def queue_status(self, now: float | None = None) -> list[JsonObject]:
        """Describe the queue: holder, profile, position, waited, ETA (null until history knows)."""
        now = clock.now() if now is None else now
        rec, ahead = self.record, 0.0
        if rec is not None and not rec.closing:
            ends = [lease.expires_at for lease in rec.leases.all() if math.isfinite(lease.expires_at)]
            ahead = max(0.0, max(ends, default=now) - now) + self.config.daemon.linger
        return self.queue.describe(self.times, ahead, now)

    def tell_queue(self) -> None:
        """Tell every queued client its position and ETA."""
        now = clock.now()
        for entry, waiter in zip(self.queue_status(now), self.queue.queued(now), strict=True):
            if waiter.listener is not None:
                waiter.listener({"event": "queued", **entry,
                                 "open": {"window": self.record.id, "profile": self.record.profile,
                                          "phase": str(self.record.phase)} if self.record is not None else None})

    async def release(self, lease_id: str | None = None, match: Owner | None = None,
                      allowed: Owner | None = None, reason: str | None = None) -> list[Lease]:
        """End a lease by id (if ``allowed``), or every lease ``match`` accepts."""
        rec = self._open_record()
        if lease_id is not None:
            self._check_owner(rec.leases.get(lease_id), allowed, "release")
            gone = [rec.leases.release(lease_id)]
        else:
            gone = [rec.leases.release(lease.id) for lease in rec.leases.matching(match or (lambda _: False))]
        for lease in gone:
            if reason is None:
                log.info("lease_released", lease=lease.id, holder=lease.holder)
            else:
                log.info("lease_released", lease=lease.id, holder=lease.holder, reason=reason)
        await self._leases_changed()
        return gone

    async def reclaim(self, token: str, allowed: Owner) -> Lease | None:
        """Give a lease back to the client of its reclaim token's hash (its connection is new); None if none."""
        rec = self.record
        lease = rec.leases.by_token(token) if rec is not None and not rec.sealed else None
        if lease is None:
            return None
        self._check_owner(lease, allowed, "reclaim")
        was, lease.reclaim_by = lease.reclaim_by, None
        try:
            await self._recorded(f"the reclaim of lease {lease.id}")
        except BaseException:
            lease.reclaim_by = was
            raise
        log.info("lease_reclaimed", lease=lease.id, holder=lease.holder)
        self.wake.set()
        return lease

    def reclaimed_since(self, token: str, profile: str) -> float | None:
        """Return when the request of a reclaim token's hash began waiting before a restart; None if unknown."""
        return self.queue.reclaim(token, profile, clock.now())

    async def unit_gone(self, unit: str) -> list[Lease]:
        """End the leases held by a unit that became inactive or failed (it may have crashed)."""
        rec = self.record
        if rec is None:
            return []
        gone = [rec.leases.release(lease.id) for lease in rec.leases.matching(lambda x: x.unit == unit)]
        for lease in gone:
            log.info("lease_ended", lease=lease.id, holder=lease.holder, reason="unit_gone", unit=unit)
        if gone:
            await self._leases_changed(f"its unit {unit} stopped")
        return gone

    async def renew(self, lease_id: str, duration: float,
                    allowed: Owner | None = None) -> tuple[Lease, Waiter | None]:
        """Extend a lease to end ``duration`` seconds from now, within the fairness rule.

        While a request for another profile waits, the lease may end at most when that request has
        waited ``daemon.fair_after``, or when it ended already if that is later: a renewal never
        takes the card past a fair claim. Return the lease and the waiting request that capped it.
        """
        rec = self._open_record()
        lease = rec.leases.get(lease_id)
        self._check_owner(lease, allowed, "renew")
        now = clock.now()
        until, capped_by = now + duration, None
        claim = self.queue.fair_claim(rec.profile)
        if claim is not None:
            limit = max(lease.expires_at, claim[0])
            if until > limit:
                until, capped_by = limit, claim[1]
        # Until a renewal is on disk the lease ends no sooner than the disk says (a renewal that
        # shortens it takes effect once recorded), and one that fails puts that expiry back.
        n = self._renewing.get(lease_id, 0)
        if n == 0:
            lease.recorded_until = lease.expires_at
        self._renewing[lease_id] = n + 1
        ok = False
        try:
            rec.leases.renew(lease_id, until - now, now)
            await self._recorded(f"the renewal of lease {lease_id}")
            ok = True
        finally:
            n = self._renewing.pop(lease_id) - 1
            if ok:
                lease.recorded_until = lease.expires_at  # what the write that answered it carried, or later
            if n > 0:
                self._renewing[lease_id] = n
            else:
                if not ok and lease.recorded_until is not None:
                    # None of the renewals since the last write that reached the disk did: it still
                    # ends when it did then (not when an earlier one of them, unrecorded too, said).
                    lease.expires_at = lease.recorded_until
                lease.recorded_until = None
                self.wake.set()  # its end may be past now: the holding loop looks again
        log.info("lease_renewed", lease=lease.id, holder=lease.holder,
                 expires_at=round(clock.to_wall(lease.expires_at), 3) if math.isfinite(lease.expires_at) else None,
                 capped_by=None if capped_by is None else "fair_after",
                 waiting=None if capped_by is None else capped_by.holder)
        self.wake.set()
        return lease, capped_by

    @staticmethod
    def _check_owner(lease: Lease, allowed: Owner | None, verb: str) -> None:
        if allowed is None or allowed(lease):
            return
        owner = f"unit {lease.unit}" if lease.unit else f"uid {lease.uid}" if lease.uid is not None else "its holder"
        raise PermissionDenied(f"lease {lease.id} is held by {lease.holder} ({owner}): only that owner or root "
                               f"may {verb} it")

    def leases(self) -> list[Lease]:
        """List the leases of the open window."""
        return self.record.leases.all() if self.record else []

    def status(self) -> JsonObject:
        """Describe the window now: phase, leases, waiters, the last window, what is amiss."""
        now = clock.now()
        return {
            "phase": str(self.phase),
            "window": self.record.to_dict(now) if self.record else None,
            "waiting": len(self.queue),
            "queue": self.queue_status(now),
            "last": self.last.to_dict() if self.last else None,
            "state_writable": self.writer.writable,
            "state_error": self.writer.error,
            "baseline_restore": None if self.baseline_restore is None else self.baseline_restore.to_dict(),
            "hung": self.outside.status(),
            "parked": self.parked.status(self._keep(self.parked)) if self.parked is not None else None,
            "next_open": "warm" if self.parked is not None else "cold",
            "resident_back": self.resident_back(now),
            "boots": self.times.boots(),  # per profile: each boot to healthy, as history has it
            "price": self.times.price(sorted(self.engines)),  # per profile: what a swap costs, from history
            "schedule": self.schedule(now),
            "resident": self.known.status(self.config.gpu.resident_needs),
            # Down for a reason not gpuswapd's (unit -> masked, failed, stopped): reported, never started.
            "resident_down": dict(self.resident_down),
        }

    def schedule(self, now: float) -> JsonObject:
        """Describe the schedule: the tenant on the card, the queue per profile, the residency left.

        ``residency_left_s`` is how long the tenant keeps taking new requests before the oldest
        request for another profile has waited its share (``share_s``); null while nobody waits
        for another profile (the tenant keeps the card) or no window is open.
        """
        rec = self.record
        tenant = rec.profile if rec is not None and not rec.closing else None
        claim = self.queue.fair_claim(tenant) if tenant is not None else None
        return {"tenant": tenant if tenant is not None else "resident",
                "queue": self.queue.per_profile(),
                "residency_left_s": None if claim is None else round(max(0.0, claim[0] - now), 3),
                "share_s": None if claim is None or tenant is None
                else round(self.queue.share(tenant, claim[1].profile), 3),
                "next": None if claim is None else claim[1].profile,
                "swaps_avoided": self.swaps_avoided,
                # The rule a residency follows (the gateway's batching takes it from here).
                "residency_factor": self.queue.factor, "residency_max_s": self.queue.most}

    def resident_back(self, now: float) -> JsonObject | None:
        """Estimate when the resident serves again: the last lease's expiry, the linger, the measured close.

        None while no window is open (it serves now) and when there is no estimate: a lease for
        infinity, or another profile's request queued (a direct switch keeps the resident down).
        """
        rec = self.record
        if rec is None:
            return None
        close_s = self.times.close_time()
        if rec.closing:
            # Sealed (about to close) has no close stage yet: the close starts now.
            started = next((t.started_at for t in rec.timings if t.stage == "close"), now)
            at = max(now, started + (close_s or 0.0))
        else:
            if any(w.profile != rec.profile for w in self.queue.queued(now)):
                return None
            ends = [lease.expires_at for lease in rec.leases.all()]
            if rec.phase is not Phase.READY:  # still opening: those who wait hold it from READY on
                opened = self.times.open_time(rec.profile) or 0.0
                ends += [max(now, rec.opened_at + opened) + w.duration for w in self.queue.joined(rec.id)]
            if not all(math.isfinite(end) for end in ends):
                return None
            at = max([now, *ends]) + self.config.daemon.linger + (close_s or 0.0)
        return {"at": round(at, 3), "in_s": round(at - now, 3),
                "close_s": None if close_s is None else round(close_s, 3)}

    async def remove_parked(self) -> JsonObject:
        """Remove the parked engine now (``gpuswapctl park --remove``); say what was removed."""
        parked = self.parked
        if parked is None:
            raise NotFound("no engine is parked")
        rec = self.record
        if rec is not None and not rec.closing:
            raise NotReady(f"window {rec.id} is opening or open ({rec.phase}) and may wake the parked engine: "
                           "remove it once that window has closed")
        await parking.stop_watching(self)
        try:
            if not await parking.remove(self, "removed on request (gpuswapctl park --remove)"):
                raise DockerError(f"the parked engine {parked.container.name} could not be removed: see the "
                                  "log (journalctl -u gpuswapd); gpuswapd keeps trying")
        finally:
            parking.watch(self)
        return parked.status(self._keep(parked))

    def _keep(self, parked: Parked) -> float:
        return self.config.profile(parked.profile).engine.park.keep

    def closed_because(self) -> str:
        """Say why no window is open, when the last one ended badly (for lease errors)."""
        if self.record is None and self.last is not None and self.last.error is not None:
            return f": the window closed: {self.last.error.message}"
        return ""

    def _open_record(self) -> WindowRecord:
        if self.record is None or not len(self.record.leases):
            raise LeaseNotFound(f"no lease is held{self.closed_because()}")
        return self.record

    async def _grant(self, rec: WindowRecord, w: Waiter) -> Lease:
        lease = rec.leases.grant(w.holder, w.duration, clock.now(), w.unit, w.uid, w.priority, w.bound, w.token)
        try:
            # A lease is granted once it is on disk: one that is not would be gone after a crash.
            await self._recorded(f"the lease for {w.holder}")
        except BaseException:
            self._drop_lease(lease)  # its client is gone, or it could not be recorded
            raise
        log.info("lease_granted", lease=lease.id, holder=w.holder, duration_s=w.duration,
                 waited_s=round(clock.now() - w.since, 3))
        self.wake.set()
        return lease

    async def _recorded(self, what: str) -> None:
        """Write the state now; StateError (naming ``what``) if it cannot be."""
        try:
            await self.writer.save()
        except StateError as err:
            raise StateError(f"{what} could not be recorded, so it is not granted: {err.message}; "
                             "try again once the state directory is writable (gpuswapctl status)") from err

    def _drop_lease(self, lease: Lease) -> None:
        """End a lease whose client went away before it heard of it (no waiting: it is cancelled)."""
        rec = self.record
        if rec is not None and lease.id in {x.id for x in rec.leases.all()}:
            rec.leases.release(lease.id)
            log.info("lease_released", lease=lease.id, holder=lease.holder, reason="its client went away")
            self.wake.set()
            self.writer.request()

    async def _leases_changed(self, reason: str = "released") -> None:
        self.wake.set()
        self.end_watchers(reason)
        await self.persist(required=False)

    # -- what the steps share ----------------------------------------------------------------

    async def persist(self, required: bool) -> None:
        """Write the record; ``required`` (opening) raises if that fails, else it carries on."""
        if required:
            await self.writer.save()
        elif self.writer.writable:
            try:
                await self.writer.save()
            except StateError as err:
                log.warning("state_not_saved_carrying_on", error=err.message)
        else:
            self.writer.request()  # retried in the background; the record in memory is the truth

    async def enter(self, rec: WindowRecord, phase: Phase, required: bool, overlap: bool = False) -> None:
        """Enter a phase: check and persist it, tell systemd, the log and the waiters, then act.

        With ``overlap`` (a phase that only reads: its checks, a VRAM poll) the write goes on while the
        phase acts; the next required write covers it, before anything is changed.
        """
        rec.enter(phase)
        if overlap:
            self.writer.request()
        else:
            await self.persist(required)
        structlog.contextvars.bind_contextvars(phase=str(phase))
        elapsed = round(clock.now() - rec.opened_at, 3)
        log.info("phase_entered", elapsed_s=elapsed, stage=rec.timings[-1].stage)
        self.notify_status()
        self.tell({"event": "phase", "phase": str(phase), "window": rec.id, "elapsed_s": elapsed})
        await failpoint(f"{phase}:closing" if rec.closing and phase is not Phase.CLOSING else str(phase))

    def tell_holders(self, event: JsonObject, leases: list[Lease] | None = None) -> None:
        """Send an event to the held connections of these leases (by default, every lease of the open window)."""
        if leases is None:
            self.end_watchers("ended")
            listeners = list(self.lease_watchers.values())
        else:
            listeners = [self.lease_watchers[x.id] for x in leases if x.id in self.lease_watchers]
        for listener in listeners:
            listener(event)

    def end_watchers(self, reason: str) -> None:
        """Tell the held connections of leases that have ended why, and stop telling them anything else."""
        live = {lease.id for lease in self.leases()}
        for lease_id in [x for x in self.lease_watchers if x not in live]:
            listener = self.lease_watchers.pop(lease_id)
            listener({"event": "lease_ended", "lease": lease_id, "reason": reason})

    def tell(self, event: JsonObject) -> None:
        """Send an event to every client waiting for the window."""
        for listener in list(self._listeners):
            listener(event)

    def notify_status(self) -> None:
        """Tell systemd where the window stands (the STATUS= line), with whatever is amiss."""
        rec = self.record
        line = f"{rec.phase}{progress(self, rec)} (window {rec.id})" if rec else "IDLE"
        if rec is not None and rec.degraded:
            line += f": {rec.degraded}"
        if self.baseline_restore is not None and rec is not None and rec.baseline is not None:
            line += f"; restoring the baseline: {self.baseline_restore.reason}"
        if not self.writer.writable:
            line += f"; state not writable: {self.writer.error}"
        self.notifier.send(status=line)

    def grant_waiters(self, rec: WindowRecord) -> list[tuple[Waiter, Lease]]:
        """Give every acquire that joined this window its lease (the window is READY)."""
        waiters = self.queue.joined(rec.id)
        for w in waiters:
            self.queue.remove(w)
        return [(w, rec.leases.grant(w.holder, w.duration, clock.now(), w.unit, w.uid, w.priority, w.bound, w.token))
                for w in waiters]

    async def grant_adopted(self, rec: WindowRecord) -> None:
        """Give the requests that queued for this profile while the window was being adopted their leases.

        Not while the window is being preempted (or closes, or switches): as for a join, a lease
        granted on it would only be revoked; they wait for a later window.
        """
        if rec.closing or rec.pending_switch or preempting.under_way(rec):
            return
        if not self.queue.take(rec.id, rec.profile, clock.now()):
            return
        granted = self.grant_waiters(rec)
        try:
            await self._recorded(self._whose(granted))
        except StateError as err:
            for waiter, lease in granted:
                with contextlib.suppress(LeaseNotFound):  # ended meanwhile (its unit stopped while the write hung)
                    rec.leases.release(lease.id)
                if not waiter.future.done():
                    waiter.future.set_exception(GpuswapError.from_dict(err.to_dict()))
            return
        self.writer.request()
        self.tell_queue()
        self.wake.set()
        for waiter, lease in granted:
            log.info("lease_granted", lease=lease.id, holder=lease.holder, duration_s=waiter.duration,
                     waited_s=round(clock.now() - waiter.since, 3))
            if waiter.future.done():  # it went away meanwhile
                self._drop_lease(lease)
            else:
                waiter.future.set_result(lease)

    async def ready(self, rec: WindowRecord) -> None:
        """Enter READY and give every waiting acquire its lease, once READY and the leases are on disk.

        One write covers both when the window opens; READY again after an engine restart carries on
        without a record, but its leases still need one.
        """
        granted = self.grant_waiters(rec)
        try:
            if rec.restarts:
                await self.enter(rec, Phase.READY, required=False)
                if granted:
                    await self._recorded(self._whose(granted))
            else:
                try:
                    await self.enter(rec, Phase.READY, required=True)
                except StateError as err:
                    if not granted:
                        raise
                    raise StateError(f"{self._whose(granted)} could not be recorded, so it is not granted: "
                                     f"{err.message}; try again once the state directory is writable "
                                     "(gpuswapctl status)") from err
        except StateError as err:
            for waiter, lease in granted:
                with contextlib.suppress(LeaseNotFound):  # ended meanwhile (its unit stopped while the write hung)
                    rec.leases.release(lease.id)
                if not waiter.future.done():
                    waiter.future.set_exception(GpuswapError.from_dict(err.to_dict()))
            if not rec.restarts:
                raise
            granted = []
        self.wake.set()
        for waiter, lease in granted:
            log.info("lease_granted", lease=lease.id, holder=lease.holder, duration_s=waiter.duration,
                     waited_s=round(clock.now() - waiter.since, 3))
            if waiter.future.done():  # it went away meanwhile
                self._drop_lease(lease)
            else:
                waiter.future.set_result(lease)

    @staticmethod
    def _whose(granted: list[tuple[Waiter, Lease]]) -> str:
        return f"the lease of {granted[0][0].holder}" if len(granted) == 1 else \
            f"the leases of {len(granted)} waiting clients"

    def refuse(self, waiter: Waiter, err: GpuswapError) -> None:
        """Fail one queued request with ``err`` (it could never be served)."""
        self.queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(err)
        self.writer.request()
        self.tell_queue()

    def fail_waiters(self, err: GpuswapError, window: str | None = None) -> None:
        """Fail the acquires that joined ``window`` with ``err`` (None: every waiting acquire)."""
        for waiter in list(self.queue.waiters):
            if window is not None and waiter.window != window:
                continue
            self.queue.remove(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(GpuswapError.from_dict(err.to_dict()))
        self.writer.request()

    def finish(self, rec: WindowRecord, outcome: str, switch_to: WindowRecord | None = None) -> None:
        """End the window: history and the next document go to the writer; the next may open.

        With ``switch_to``, that window takes the card over at once (a direct switch): it carries
        the paused timers and stopped units, and the resident stays down.
        """
        rec.outcome = outcome
        rec.switched_to = switch_to.id if switch_to is not None else None
        rec.enter(Phase.IDLE)
        self.last, self.record = rec, switch_to
        self.end_watchers(f"its window {rec.id} ended ({outcome})")
        record = rec.finished()
        self.closed_windows.add(rec.id)
        self.writer.add_history(record)
        self.times.learn(record)
        for listener in self.finished:
            listener(record)
        self.notify_status()
        log.info("window_finished", window=rec.id, outcome=outcome, start=rec.start, profile=rec.profile,
                 took_s=round((rec.closed_at or clock.now()) - rec.opened_at, 3), switched_to=rec.switched_to)
        structlog.contextvars.unbind_contextvars("window_id", "phase")
        if switch_to is None:
            parking.watch(self)
        else:
            self.writer.request()

    def switch(self, rec: WindowRecord, profile: str, outcome: str = "closed") -> None:
        """Close ``rec`` (with ``outcome``) straight into a window of ``profile``, keeping the resident down."""
        nxt = WindowRecord.new()
        nxt.profile, nxt.kind = profile, self.config.profile(profile).kind
        nxt.timers, nxt.units, nxt.stopped_mono = list(rec.timers), list(rec.units), rec.stopped_mono
        nxt.switched_from, nxt.saved = rec.id, self.times.saved()
        # The engine it took down is still being freed: the next window waits for it, never blames it.
        nxt.freeing, nxt.freeing_unknown = list(rec.freeing), rec.freeing_unknown
        nxt.after_bare = rec.kind == ProfileKind.BARE or rec.after_bare
        # The resident stays down: its saved slots are the next window's to restore (warm.py).
        nxt.cache = dict(rec.cache) if rec.cache is not None else None
        log.info("window_switching", window=rec.id, to=nxt.id, profile=profile, saved=nxt.saved)
        self.finish(rec, outcome, switch_to=nxt)

    def resident_state(self, unit: str, state: str) -> None:
        """Follow the resident's units: note one its operator stops while no window is open.

        gpuswapd stops the resident only inside a window, and only through jobs of its own; a
        stop with neither is its operator's (``systemctl stop strata``). gpuswapd never starts a
        unit it did not stop, so the hold only says so in ``status`` (any other state lifts it).
        """
        unit = self.resident_names.get(unit, unit)  # a signal names its Id; the configuration may name an alias
        if state in ("inactive", "failed"):
            self.went_down[unit] = clock.monotonic()  # a restore that cannot read systemd still hears of it
        if unit not in self.config.resident.units:
            return  # a dependent (llama-swap) follows its resident: it is never held down by itself
        if state != "inactive" and unit in self.held_down:  # started again (or tried to): no longer held
            del self.held_down[unit]
            log.info("resident_hold_lifted", unit=unit, state=state)
            self.writer.request()
        elif (state == "inactive" and self.record is None and not self.resident.jobs_running
              and unit not in self.held_down and not self.stopping.is_set()):
            self.held_down[unit] = clock.now()
            log.warning("resident_held_down", unit=unit, reason="it was stopped while no window was open, not by "
                        "gpuswapd: it is left down until it is started again (systemctl start)")
            self.writer.request()

    def _writable_again(self) -> None:
        """Remove the marks a hung state directory kept, now that it answers again (idle only)."""
        async def retry() -> None:
            if self.record is None:  # checked again as it runs: a window that opened meanwhile marks its own
                await self.resident.retry_unmark()
        if self.record is None and (self.resident.unmark_pending or self.resident.start_ended_pending) \
                and not self.stopping.is_set():
            spawn(retry(), "retry-unmark")

    async def reconcile(self) -> None:
        """Look at the resident while no window is open: report a unit that is down, never start it.

        gpuswapd starts a unit only to undo its own stop. One down for any other reason (it
        crashed, its operator stopped, masked or disabled it) is systemd's and its operator's
        (``Restart=``): it is reported in ``status``, ``plan``, the ``gpuswapd_resident_down``
        gauge and a ``resident_down`` event, and never held against the card. Only with
        ``resident.restart_crashed`` is a failed unit started again (never a masked or disabled one).
        """
        if self.stopping.is_set() or self.refusing or self.record is not None or len(self.queue) \
                or self.driver.task is not None:
            return
        await self.resident.retry_unmark()
        if self.stopped_unread and await self._still_stopped_after_all():
            return
        states = await self.resident.unit_states(self.config.resident.units)
        self.learn_names(states)
        if self.record is not None or self.driver.task is not None:
            return  # a window opened meanwhile: what it finds is its own business
        for unit, st in states.items():
            if st.active_state != "inactive" and unit in self.held_down:  # started (or failed) while nobody watched
                self.resident_state(unit, st.active_state)
        self.note_down({u: cause for u, st in states.items() if (cause := down_cause(st)) is not None})
        if not self.resident_down:
            # A resident left smaller may be back as it was; one its operator restarted is theirs.
            await identity.recheck(self, states[self.config.resident.units[0]].invocation or None)
        elif self.config.resident.restart_crashed:
            await self._restart_crashed(states)

    async def _still_stopped_after_all(self) -> bool:
        """Read again what gpuswapd stopped, unread at start (a hung disk); restore it if anything (True).

        Until it is read, the timers and units a lost window stopped would stay down while gpuswapd
        sits idle: what gpuswapd stopped always comes back.
        """
        try:
            stopped = await self.resident.stopped()
        except GpuswapError:
            return False  # asked again at the next reconcile
        if self.record is not None or self.driver.task is not None or self.stopping.is_set():
            return False  # a window opened meanwhile: read again once it is over
        self.stopped_unread = False
        if not stopped:
            return False
        self.restore_baseline(f"gpuswapd had stopped {', '.join(stopped)}, but no record of the window that "
                              "stopped them was kept (what it stopped could not be read at start)", cause="lost_record")
        return True

    def learn_names(self, states: dict[str, UnitState]) -> None:
        """Learn every name of the resident's units (``Names``): one configured by an alias is still followed."""
        for unit, st in states.items():
            for name in st.names:
                if name != unit:
                    self.resident_names[name] = unit

    def note_down(self, down: dict[str, str]) -> None:
        """Keep what the reconcile found down (unit -> cause), and say so when it changes."""
        if down == self.resident_down:
            return
        for unit, cause in down.items():
            if self.resident_down.get(unit) != cause:
                back = (f"systemctl reset-failed {unit}, then systemctl start, brings it back" if cause == "start_limit"
                        else "systemd's Restart= restarts a crashed service; systemctl start brings it back")
                log.warning("resident_down", unit=unit, cause=cause,
                            consequence=f"left as it is: gpuswapd starts only what it stopped ({back})")
        for unit in self.resident_down.keys() - down.keys():
            log.info("resident_up", unit=unit)
        self.resident_down = dict(down)
        self.notify_status()

    async def _restart_crashed(self, states: dict[str, UnitState]) -> None:
        """Start a failed resident unit again (``resident.restart_crashed``): never a masked or disabled one."""
        wanted = [u for u, cause in self.resident_down.items()
                  if cause == "failed" and states[u].unit_file_state in RESTARTABLE]
        if not wanted:
            return
        log.warning("resident_restarting_crashed", units=wanted, reason="resident.restart_crashed = true")
        try:
            await self.resident.start(wanted)
        except GpuswapError as err:
            log.error("resident_restart_failed", units=wanted, error=err.message)
        finally:
            await self.resident.start_ended(wanted)  # no restore of gpuswapd's: nothing goes on after


    # -- shutdown --------------------------------------------------------------------------

    def refuse_new(self) -> None:
        """Take no new lease or request from now on, and fail those that wait: gpuswapd is about to stop."""
        self.refusing = True
        self.queue.keep_waiters()  # for their clients to reclaim from the next start, with their tokens
        self.fail_waiters(Stopping("gpuswapd is stopping: a request with a token (gpuswapctl, the gateway) keeps "
                                   "its place for daemon.reclaim_grace once it is back; acquire again with it"))

    # -- the driver's: the record handed over --------------------------------------------------

    def recover(self, rec: WindowRecord) -> None:
        """Take over a window an earlier gpuswapd left: adopt it if it still serves, else roll back."""
        self.driver.recover(rec)

    def restore_baseline(self, reason: str, cause: str = "state_unreadable") -> None:
        """Restore what the configuration describes: no state could be read, or it was found broken."""
        self.driver.restore_baseline(reason, cause)

    async def shutdown(self, restore: bool, bound: float = math.inf) -> bool:
        """Stop serving the window; with ``restore``, close it and give the GPU back first (see Driver.shutdown)."""
        await reap(self.abandoning)
        return await self.driver.shutdown(restore, bound)


def down_cause(state: UnitState) -> str | None:
    """Say why a resident unit is down (masked, start_limit, failed, stopped), or None if it is up or on its way."""
    if state.load_state == "masked":
        return "masked"
    if state.job:
        return None  # a job is queued for it (a start at boot): it is on its way, or its operator's doing
    if state.active_state == "failed":
        # In its start limit (StartLimitBurst= starts within StartLimitIntervalSec=): systemd refuses
        # every start until `systemctl reset-failed`, so not even resident.restart_crashed tries one.
        return "start_limit" if state.result == "start-limit-hit" else "failed"
    if state.active_state == "inactive":
        return "stopped"
    return None  # active, or activating/deactivating/reloading: someone is at it right now
