"""Preemption: urgent work gets the card, and the running work gets a notice and a grace period first.

A queued request for another profile preempts the open window when its base priority is above
that of every lease (aging orders the queue but never preempts). Every holder is told at once:
the ``preempting`` event goes to each client that kept its connection (``gpuswapctl run``
forwards SIGTERM to its command then); a plain ``acquire`` has exited, and its holder learns from
``status``, ``history`` and the log. After ``daemon.preempt_grace`` the leases are revoked: a lease
bound to a unit has that unit stopped through systemd, so its ``ExecStopPost=`` runs as usual
(never a unit of ``daemon.never_stop``); any other lease is only revoked. A stop that fails is
retried; one not confirmed when gpuswapd restarts is redone at recovery (``stops_pending``). The window then closes,
and switches directly to the preempting request's profile.

The preemption is in the window's record (``preempted``), written before anyone is told. If
gpuswapd restarts during the grace, the waiting request is gone with the queue (waiting requests
are not kept across a restart): the adopted window abandons the preemption, says so in the log
(``preemption_abandoned``), and its leases run on. Once revoked, the leases stay revoked.
"""

from __future__ import annotations

import fnmatch
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuswapd import clock, naps
from gpuswapd.config import ProfileKind
from gpuswapd.errors import GpuswapError
from gpuswapd.leases import Lease
from gpuswapd.logs import log
from gpuswapd.protocol import JsonObject
from gpuswapd.record import PreemptedHolder, Preemption, WindowRecord, needs_less_residual
from gpuswapd.retry import backoff
from gpuswapd.tasks import spawn
from gpuswapd.window import opening
from gpuswapd.window.queueing import Waiter

if TYPE_CHECKING:
    from gpuswapd.window.context import Context

STOP_ATTEMPTS = 5  # a unit whose stop fails this often is left to the next window's wait for VRAM


def deadline(rec: WindowRecord) -> float | None:
    """Return when a pending preemption revokes the leases (None: none is pending)."""
    p = rec.preempted
    if p is None or p.ended:
        return None
    return p.deadline


def under_way(rec: WindowRecord) -> bool:
    """Tell whether the window is being preempted: noticed and not abandoned (it then takes no joins)."""
    return rec.preempted is not None and rec.preempted.abandoned_at is None


async def check(w: Context, rec: WindowRecord) -> None:
    """Start, abandon or complete a preemption of the READY window ``rec``."""
    now = clock.now()
    by = w.queue.preemptor(rec.profile, [lease.priority for lease in rec.leases.all()])
    pending = deadline(rec)
    p = rec.preempted
    if pending is None and p is not None and p.revoked_at is not None and p.abandoned_at is None and by is None \
            and not w.queue.wants_other(rec.profile):
        # The leases were revoked, and the request that preempted them went away (its own timeout, in
        # the same instant, say): the window is its profile's again and takes joins, not lingering
        # closed to them for nobody.
        await _abandon(w, rec, "the request that preempted it is no longer waiting", now)
        return
    if pending is None:
        if by is not None and (rec.preempted is None or rec.preempted.abandoned_at is not None) \
                and await _can_open(w, rec, by):
            # Now, not when the check began: the preflight may have taken a while (a hung `docker top`),
            # and the holders' grace counts from the notice they get.
            await _notice(w, rec, by.holder, by.profile, by.priority, clock.now())
        return
    if not len(rec.leases):
        # The holders let the card go before the grace ended: nothing to revoke, and the window
        # closes now and switches to the request that preempted it.
        await _yielded(w, rec, now)
    elif by is None:
        await _abandon(w, rec, "the request that preempted it is no longer waiting", now)
    elif now >= pending:
        await _revoke(w, rec, now)


async def _can_open(w: Context, rec: WindowRecord, by: Waiter) -> bool:
    """Check, before anyone is told, that the preemptor's window could open; refuse it at once if not.

    Its image and env file must be there, and it must fit on the card beside what stays once this
    window's engine is gone: revoking work for a window that then fails helps nobody.
    """
    live = await w.engine.pids() if rec.kind == ProfileKind.ENGINE else []
    going = {*rec.freeing, *(rec.container.pid_list if rec.container is not None else []), *live}
    # Docker could not list the engine's processes now: its memory cannot be told from a stranger's.
    unsure = rec.freeing_unknown or (rec.kind == ProfileKind.ENGINE and not live)
    parked = w.parked
    need = needs_less_residual(w.config.profile(by.profile).needs, by.profile, parked)
    if parked is not None and parked.profile != by.profile:
        going |= set(parked.pids)  # removed if the window does not fit beside it
        # Docker could not list its processes when it was parked: its memory is not a stranger's either.
        unsure = unsure or not parked.pids
    try:
        await opening.check_fit(w, need, frozenset(going), unsure)
        # The image and env file last, just before the notice: the fit may have taken a while (a hung
        # lookup of a process's unit), and an image pruned meanwhile would fail the window it noticed.
        await opening.preflight(w, by.profile)
    except GpuswapError as err:
        log.warning("preemptor_refused", by=by.holder, profile=by.profile, error=err.message, window=rec.id)
        w.refuse(by, GpuswapError.from_dict({**err.to_dict(), "message": (
            f"the window of profile {by.profile!r} could not open, so window {rec.id} was not preempted for it: "
            f"{err.message}")}))
        return False
    return True


async def _notice(w: Context, rec: WindowRecord, holder: str, profile: str, priority: int, now: float) -> None:
    grace = w.config.daemon.preempt_grace
    leases = rec.leases.all()
    rec.preempted = Preemption(by=holder, profile=profile, priority=priority, at=now, grace_s=grace,
                               deadline=now + grace,
                               holders=tuple(PreemptedHolder(x.id, x.holder, x.priority, x.unit) for x in leases))
    await w.persist(required=False)  # in the record before anyone is told
    log.warning("preempting", by=holder, profile=profile, priority=priority, grace_s=grace,
                holders=[x.holder for x in leases], window=rec.id)
    w.tell_holders({"event": "preempting", "window": rec.id, "by": holder, "profile": profile,
                    "priority": priority, "grace_s": grace, "deadline": now + grace})
    w.notify_status()


async def _yielded(w: Context, rec: WindowRecord, now: float) -> None:
    assert rec.preempted is not None
    rec.preempted = replace(rec.preempted, yielded_at=now)
    await w.persist(required=False)
    log.info("preemption_yielded", by=rec.preempted.by, window=rec.id,
             reason="the preempted holders released their leases before the grace ended")
    w.notify_status()


async def _abandon(w: Context, rec: WindowRecord, why: str, now: float) -> None:
    assert rec.preempted is not None
    rec.preempted = replace(rec.preempted, abandoned_at=now, abandoned=why)
    await w.persist(required=False)
    log.warning("preemption_abandoned", by=rec.preempted.by, reason=why, window=rec.id)
    w.tell_holders({"event": "preemption_abandoned", "window": rec.id, "reason": why})
    w.notify_status()


async def _revoke(w: Context, rec: WindowRecord, now: float) -> None:
    assert rec.preempted is not None
    leases = rec.leases.clear()
    units = sorted({x.unit for x in leases if x.unit is not None and not never_stop(w, x.unit)})
    # stops_pending: the stops not yet confirmed; a gpuswapd that restarts before they are redoes them.
    rec.preempted = p = replace(rec.preempted, revoked_at=now, stopped_units=tuple(units), stops_pending=tuple(units))
    for lease in leases:
        log.info("lease_ended", lease=lease.id, holder=lease.holder, reason="preempted")
    # The holders are told as their leases end, not once the state directory answers: a hung write
    # would leave them running on a card they no longer hold, told only "not found" by a renewal.
    # A gpuswapd that dies before the write revokes again from the record (its deadline passed).
    w.tell_holders({"event": "preempted", "window": rec.id, "by": p.by,
                    "profile": p.profile, "priority": p.priority,
                    "leases": [_described(x) for x in leases]}, leases)
    w.end_watchers("preempted")
    await w.persist(required=False)
    log.warning("preempted", window=rec.id, by=p.by, profile=p.profile,
                priority=p.priority, holders=[x.holder for x in leases], stopped_units=units)
    for unit in units:  # the window goes on at once: the next one waits for the VRAM anyway
        spawn(_stop_unit(w, rec, unit), "preempt-stop")
    w.wake.set()


def resume_stops(w: Context, rec: WindowRecord) -> None:
    """Stop again the units of a revoked preemption whose stop was not confirmed (gpuswapd restarted)."""
    p = rec.preempted
    if p is None or p.revoked_at is None:
        return
    for unit in [u for u in p.stops_pending or () if not never_stop(w, u)]:
        log.warning("preempted_unit_stopping_again", unit=unit, window=rec.id,
                    reason="gpuswapd restarted before its stop was confirmed")
        spawn(_stop_unit(w, rec, unit), "preempt-stop")


def never_stop(w: Context, unit: str) -> bool:
    """Tell whether ``unit`` is one gpuswapd never stops for a preemption."""
    return any(fnmatch.fnmatchcase(unit, pattern) for pattern in w.config.daemon.never_stop)


async def _stop_unit(w: Context, rec: WindowRecord, unit: str) -> None:
    """Stop a preempted lease's unit, retrying with a backoff; note in the record once it is stopped."""
    for attempt in range(1, STOP_ATTEMPTS + 1):
        try:
            await w.resident.stop([unit], own=False)
            break
        except GpuswapError as err:
            if attempt == STOP_ATTEMPTS:
                log.error("preempted_unit_not_stopped", unit=unit, error=err.message, attempts=attempt,
                          consequence="its lease is revoked; the next window waits for the VRAM it holds")
                return  # still pending in the record: a restart of gpuswapd tries again
            delay = backoff(w.backoffs.preempt_stop, attempt)
            log.warning("preempted_unit_not_stopped", unit=unit, error=err.message, attempts=attempt,
                        retry_in_s=delay)
            await naps.sleep(delay)
    p = rec.preempted
    if p is not None:
        rec.preempted = replace(p, stops_pending=tuple(u for u in p.stops_pending or () if u != unit))
        if rec is w.record:
            w.writer.request()


def _described(lease: Lease) -> JsonObject:
    return {"id": lease.id, "holder": lease.holder, "unit": lease.unit, "priority": lease.priority}
