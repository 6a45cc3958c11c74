"""Closing the window, one step per phase: take the engine down, wait for VRAM, restore, resume.

Closing never gives up on the resident: a step that fails is retried with backoff (the restore
waits in DEGRADED meanwhile), and a state document that cannot be written does not stop it,
since the record in memory says what to undo. A record left in a closing phase by an earlier
gpuswapd continues from that phase.

A direct switch: when the engine is down and the first queued request wants another profile,
the window ends there and the next one takes the card over, with the timers still paused and
the resident still down; the resident comes back when the queue is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuswapd import clock, naps
from gpuswapd.config import DEFAULT_PROFILE, ProfileKind
from gpuswapd.errors import Degraded, GpuswapError, VramTimeout
from gpuswapd.logs import log
from gpuswapd.parts.vram import Unless, predict_fit
from gpuswapd.phases import Phase
from gpuswapd.record import WindowRecord
from gpuswapd.retry import backoff, until_done
from gpuswapd.sizes import format_size
from gpuswapd.tasks import reap, sleep_unless, spawn
from gpuswapd.window import identity, parking, undone, warm

if TYPE_CHECKING:
    from gpuswapd.adapters.unitstates import UnitState
    from gpuswapd.window.context import Context

# A step of the restore that took longer than this (a hung state directory) is followed by another
# look at the resident before the timers resume: it may have died meanwhile.
SLOW_STEP_S = 1.0
JOB_POLL_S = 0.25  # how often a job still queued on a resident unit is looked at again


class Interrupted(Exception):
    """Closing stopped part-way because gpuswapd gives up (its shutdown bound ran out); the record stays."""


def engine_left(rec: WindowRecord) -> bool:
    """Tell whether the window's engine has not been taken down (or parked) yet."""
    return rec.container is not None and not rec.container.removed and not rec.container.parked


def switch_target(w: Context, rec: WindowRecord) -> str | None:
    """Name the profile a closing window should switch to directly, if any.

    Only a window that served to the end switches, and only to the profile the first queued
    request wants, when that is another profile; gpuswapd stopping gives the card back instead,
    and so does a window with calls to systemd or Docker still out (``_reconcile_late_calls``).
    """
    if w.stopping.is_set() or rec.error is not None or rec.baseline is not None or rec.degraded:
        return None
    if hung_mark(w) != w.hung_mark:
        # A call of this window's outlived its deadline and may still land (a create: its engine
        # back). The next window would forget it: this one closes to the resident and waits for it.
        return None
    queued = w.queue.queued()
    if not queued or queued[0].profile == rec.profile:
        return None
    return queued[0].profile


async def _take_down(w: Context, rec: WindowRecord) -> None:
    for lease in rec.leases.clear():
        log.info("lease_ended", lease=lease.id, holder=lease.holder, reason="closed")
    w.end_watchers("the window closed")
    await w.persist(required=False)
    nxt = switch_target(w, rec)
    # Parked only if what comes next fits beside it: the resident, or the next window.
    need = None if nxt is None else w.config.profile(nxt).needs
    if not engine_left(rec):
        return
    # The card goes on listing the engine's processes until their memory is free: they are this
    # window's, and whatever opens next waits for them instead of taking them for a stranger's.
    going = [*(rec.container.pid_list if rec.container is not None else []), *await w.engine.pids()]
    if not await parking.try_park(w, rec, need):
        rec.freeing = sorted({*rec.freeing, *going})
        rec.freeing_unknown = rec.freeing_unknown or (not going and rec.kind == ProfileKind.ENGINE)
        await w.persist(required=False)
        await _retry_take_down(w, rec, clock.monotonic() + w.backoffs.take_down_for)


async def _retry_take_down(w: Context, rec: WindowRecord, until: float | None) -> bool:
    """Take the engine down, retrying with backoff until ``until`` (None: for as long as it takes).

    With a deadline, it also stops early once the resident would fit beside the engine: the
    restore can go on while the take-down is retried alongside it.
    """
    attempt = 0
    while True:
        try:
            await w.engine.take_down(rec.container)
        except GpuswapError as err:
            attempt += 1
            delay = backoff(w.backoffs.take_down, attempt)
            rec.fail(err)
            log.error("engine_take_down_failed", error=err.message, retry_in_s=delay)
            if until is not None and (clock.monotonic() + delay > until or await _resident_fits(w)):
                return False
            await _pause(w, delay)
            continue
        assert rec.container is not None
        rec.container = replace(rec.container, removed=True)
        await w.persist(required=False)
        return True


async def _keep_taking_down(w: Context, rec: WindowRecord) -> bool:
    """Retry the take-down until it succeeds; False if gpuswapd stops first."""
    try:
        return await _retry_take_down(w, rec, None)
    except Interrupted:
        return False


async def _resident_fits(w: Context) -> bool:
    """Tell whether the resident would fit now, engine or not (no probe: cannot tell)."""
    try:
        reading = await w.vram.read(processes=False)
    except GpuswapError:
        return False
    return reading is not None and reading.free_bytes >= w.resident_needs


async def _wait_resident_vram(w: Context, rec: WindowRecord) -> None:
    """Wait until the resident would fit: the engine's memory released, up to ``gpu.release_timeout``.

    Also with no resident to restore (its operator's, or down before the window): IDLE says the
    card is free, and its operator's start of the resident right after must not find the engine's
    memory still being released.
    """
    gpu = w.config.gpu
    units = rec.units or w.config.resident.units
    if await w.resident.all_active(units):
        # It is back already (a close carried on after a restart), or up without gpuswapd (its
        # operator's): its own memory is no wait.
        return
    # Asked again while it waits: systemd may not have said the first time (the wait would last
    # the whole release timeout for memory the resident itself holds), or its operator starts it.
    up: Unless = ("the resident's units are up: the memory held is their own", lambda: w.resident.all_active(units))
    with contextlib.suppress(Degraded):  # the restore retries it, in DEGRADED
        await _parked_leaves_room(w)
    deadline = clock.monotonic() + gpu.release_timeout
    attempt = 0
    while True:
        try:
            await w.vram.wait_free(w.resident_needs, max(0.1, deadline - clock.monotonic()), unless=up)
            return
        except VramTimeout as err:
            if rec.kind == ProfileKind.BARE or rec.after_bare or rec.baseline is not None:  # _restore waits in DEGRADED
                log.error("vram_held_after_bare_window", error=err.message)
                return
            if not rec.units:
                log.warning("vram_not_free_at_close", error=err.message,
                            consequence="the window closes all the same; a resident started now may not fit yet")
                return
            # Starting the resident is still the best move: llama.cpp fits itself to what is
            # free, and if the memory is really gone it fails, and the restore retries with backoff.
            log.warning("vram_not_free_restoring_anyway", error=err.message)
            return
        except GpuswapError as err:
            # The probe does not answer: starting the resident blind could put it into the
            # engine's memory still being freed. Ask again, up to the release timeout.
            attempt += 1
            if naps.due(deadline):  # (a pause toward it is over at once: asking again would spin)
                if rec.units:
                    log.warning("vram_unknown_restoring_anyway", error=err.message)
                else:
                    log.warning("vram_not_free_at_close", error=err.message,
                                consequence="the window closes all the same; a resident started now may not fit yet")
                return
            log.warning("vram_unknown_before_restore", error=err.message, attempt=attempt)
            await _pause(w, min(backoff(w.backoffs.restore, attempt), max(0.0, deadline - clock.monotonic())))


async def _parked_leaves_room(w: Context) -> None:
    """Remove a parked engine that leaves the resident less than it needs (``Context.resident_needs``).

    Degraded if it could not be removed: the restore waits for it, and says whose memory it is.
    """
    parked = w.parked
    if parked is None:
        return
    need = w.resident_needs
    try:
        await w.vram.wait_free(need, w.config.profile(parked.profile).engine.park.settle
                               if parked.profile in {p.name for p in w.config.engine_profiles()} else 0.0)
        return
    except VramTimeout:
        reading = w.vram.last
        free = format_size(reading.free_bytes) if reading is not None else "unknown"
    except GpuswapError as err:
        log.warning("parked_engine_room_unknown", error=err.message)
        return
    why = (f"the resident needs {format_size(need)} and only {free} is free beside it "
           f"(residual {format_size(parked.residual_bytes)})")
    if not await parking.remove(w, why):
        raise Degraded(f"the parked engine {parked.container.name} leaves the resident too little memory "
                       f"({why}) and could not be removed yet: see the log (journalctl -u gpuswapd); gpuswapd "
                       "keeps trying")
    # Its memory comes free a while after it exits (the card's release lag): a resident started
    # before that would fit itself into what is left (llama.cpp's --fit) and come back smaller.
    try:
        await w.vram.wait_free(need, w.config.gpu.release_timeout)
    except GpuswapError as err:
        log.warning("vram_not_free_restoring_anyway", error=err.message)


async def _let_exited_go(w: Context, unsure: bool = False) -> None:
    """Wait, up to the release timeout, until processes that have exited no longer hold memory.

    A resident that failed or crashed leaves its memory listed for a while: starting it again at
    once would run it into its own dying process's memory. ``unsure`` (a baseline restore: the
    footprint gpuswapd learned went with its state, and a ``gpu.resident_needs`` set low passes
    early) waits for them even when the need is free: engines it just took down are still freeing
    theirs, and a resident started beside them comes up smaller and is taken for the baseline.
    """
    need = w.resident_needs
    deadline = clock.monotonic() + w.config.gpu.release_timeout
    while clock.monotonic() < deadline:
        reading = await w.vram.read(processes=True)
        if reading is None or (reading.free_bytes >= need and not unsure):
            return
        exited = [p for p in reading.processes if await w.vram.unit_of(p.pid) is None]
        if not exited:
            return
        await _pause(w, 0.25)


async def _room_for_resident(w: Context, rec: WindowRecord) -> None:
    """Refuse to start the resident into memory that a bare window's holders still hold.

    What the resident's own units hold (a start that was not verified yet) and what gpuswapd's
    engines are still freeing are no stranger's: only the holders' live processes count.
    """
    need = w.resident_needs
    reading = await w.vram.read(processes=True)
    if reading is None or reading.free_bytes >= need:
        return
    parked = set(w.parked.pids) if w.parked is not None else set()
    fit = await predict_fit(w.vram, reading, rec.units, frozenset({*rec.freeing, *parked}))
    if reading.free_bytes + fit.freed_bytes >= need:
        return
    held = "; ".join(h.describe() for h in sorted(fit.others, key=lambda h: -h.used_bytes)) or "no process listed"
    raise Degraded(f"the bare window's memory has not come free, so the resident is not started into an "
                   f"out-of-memory: {format_size(reading.free_bytes)} free, {format_size(need)} needed; held: "
                   f"{held}; stop those processes (gpuswapd retries)")


async def _restore(w: Context, rec: WindowRecord) -> None:
    """Start exactly the recorded units and verify the resident; retry with backoff."""
    if not rec.units:
        await _verify_found_up(w, rec)
        return
    attempt = 0
    # The resident came back smaller than its baseline: "due" until it is stopped and its room is
    # waited for (retried like any failed step), then "done" (a second smaller one is accepted).
    repair: str | None = None
    first_start: float | None = None  # CLOCK_MONOTONIC of this restore's first start
    while True:
        attempt += 1
        try:
            if attempt > 1 and (await _masked_meanwhile(w, rec) or await _stopped_meanwhile(w, rec, first_start)):
                return  # its operator masked or stopped the resident: it is theirs now, and the card is not held for it
            if attempt == 1 and rec.found_up and await _down_since_found_up(w, rec):
                return  # a stale record's resident went down since it was found up: not gpuswapd's to start
            if rec.unchecked_in is not None:
                # Found at a start while systemd could not say whether this stop was undone since (a
                # restore that started the units, then a crash): nothing starts until it can.
                if (unsaid := await undone.judge(w, rec, rec.unchecked_in)) is not None:
                    raise Degraded(f"systemd cannot say yet whether {', '.join(rec.units)} ran again since "
                                   f"gpuswapd stopped them ({unsaid}); nothing is started until it can")
                rec.unchecked_in = None
                if not rec.units:
                    return  # each ran again since, and is down now: its operator's (or systemd's)
            if repair == "due":
                first_start = None  # the repair stops the units: gpuswapd's own stop again, not its operator's
                await identity.make_room(w, rec, lambda s: _pause(w, s))
                repair = "done"
            if not await w.resident.all_active(rec.units):  # (one up already holds its own memory: no room to wait for)
                # An engine still holding its memory would only make the resident fail (out of memory):
                # wait until it is gone, or until the resident fits beside it.
                if engine_left(rec) and not await _resident_fits(w):
                    raise Degraded(f"the engine {_name(rec)} still holds the GPU and could "
                                   f"not be taken down yet: {_said(rec)}")
                # A process that just exited (a holder's, a start that failed) is still freeing its memory.
                await _let_exited_go(w, unsure=rec.baseline is not None)
                await _parked_leaves_room(w)
                if rec.kind == ProfileKind.BARE or rec.after_bare or rec.baseline is not None:
                    # Holders of a bare window may still hold memory (after a baseline restore, nobody knows).
                    await _room_for_resident(w, rec)
            started = clock.monotonic()
            if first_start is None:
                first_start = clock.kernel_monotonic()
            await w.resident.start(rec.units, first_start)
            await w.resident.verify(warm.verify_slot(rec))
            verified = clock.monotonic()
            rec.resident_s = round(verified - started, 3)
            rec.verified_at = verified
            if not await identity.after_verify(w, rec, repair == "done", lambda s: _pause(w, s)):
                repair = "due"
                attempt -= 1  # not a failure: the next pass repairs it
                continue
            if attempt > 1:  # it was DEGRADED
                log.info("recovered", attempts=attempt)
            rec.degraded = None
            # Verified and as it was: its slots' caches go back before the timers reach it (warm.py).
            await warm.restore(w, rec)
            if await _gone_since_verify(w, rec, verified):
                # Reading it and its caches took a while (a hung /props): it died meanwhile, and the
                # timers would resume against it. Its start did not last: the restore goes on.
                raise Degraded("the resident stopped after it was verified, before the timers resumed")
            ending = clock.monotonic()
            await w.resident.start_ended(rec.units)
            if clock.monotonic() - ending > SLOW_STEP_S and await _gone_since_verify(w, rec, verified):
                # Ending its start record took a while too (a hung state directory): it died
                # meanwhile. The next pass starts it again, and records that start first.
                raise Degraded("the resident stopped after it was verified, before the timers resumed")
            return
        except GpuswapError as err:
            await _degraded(w, rec, err, attempt)


async def _verify_found_up(w: Context, rec: WindowRecord) -> None:
    """Before the timers resume, hear a completion from a resident that is up but was not this close's to start.

    Its operator started it meanwhile, or a start of gpuswapd's that no record kept (its start
    record could not be written, then gpuswapd was killed before the verify) left it up: either way
    the agents the timers run must not meet a server still loading. Nothing is started: a resident
    down stays down, and one that never answers within ``resident.verify.timeout`` is its operator's
    to mend (the timers resume all the same, as they would without gpuswapd).
    """
    units = w.config.resident.units
    if not rec.timers or not await w.resident.all_active(units):
        return
    deadline = clock.monotonic() + w.config.resident.verify.timeout
    attempt = 0
    while True:
        try:
            await w.resident.verify(warm.verify_slot(rec))
            return
        except GpuswapError as err:
            attempt += 1
            if clock.monotonic() >= deadline or not await w.resident.all_active(units):
                log.warning("resident_unverified", units=units, error=err.message,
                            consequence="the timers resume all the same: gpuswapd has no record of starting this "
                                        "resident, and leaves it to systemd and its operator")
                return
            await _pause(w, backoff(w.backoffs.restore, attempt))


async def _gone_since_verify(w: Context, rec: WindowRecord, verified: float) -> bool:
    """Tell whether a unit the restore started is no longer up, or is up again under a start the verify never saw.

    The units' signals since the verify (``verified``, CLOCK_MONOTONIC) tell of a crash after it,
    even when something started the unit again since (an earlier attempt's start job that systemd
    ran late): what runs now has answered no completion. Else systemd says what is up; when it
    cannot (a read that hung), the signals alone tell.
    """
    if any(w.went_down.get(unit, -math.inf) >= verified for unit in rec.units):
        return True
    try:
        return not set(rec.units) <= set(await w.resident.closure())
    except GpuswapError:
        return False


async def _leave_resident(w: Context, rec: WindowRecord) -> None:
    """Leave the resident to its operator and to systemd (the caller has logged why): forget the stop, persist that.

    gpuswapd unmarks the units it stopped and no longer restores them; the close goes on to the
    timers.
    """
    await w.resident.unmark(rec.units)
    await w.resident.start_ended(rec.units)
    rec.units, rec.degraded = [], None
    await w.persist(required=False)


async def _masked_meanwhile(w: Context, rec: WindowRecord) -> bool:
    """Tell whether its operator masked a resident unit while the restore retried; if so, leave the resident to them.

    A masked unit never starts: retrying would hold the card in DEGRADED for ever. The operator's
    mask stands; gpuswapd forgets it stopped the resident's units and goes on to the timers.
    """
    configured = [u for u in w.config.resident.units if u in rec.units]
    if not configured:
        return False
    states = await w.resident.unit_states(configured)
    masked = [u for u, st in states.items() if st.load_state == "masked"]
    if not masked:
        return False
    log.warning("resident_left_masked", units=masked, left=rec.units,
                consequence="not started: its operator masked it (systemctl unmask, then start it)")
    await _leave_resident(w, rec)
    return True


async def _down_since_found_up(w: Context, rec: WindowRecord) -> bool:
    """Tell whether a stale record's units, all up when it was found, are not all up now; if so, leave them.

    The record's close finished before a restart but was not recorded, or it was left closing before
    its restore while the resident ran again (another window's restore, its operator); its close
    now only verifies the resident. A unit that went down since it was found up (a crash while this close waited on a
    hung disk, its operator's stop) was brought down by someone else: gpuswapd does not start it.
    """
    try:
        states = await w.resident.unit_states(list(rec.units))
    except GpuswapError:
        return False  # systemd cannot say: the close goes on
    down = {u: st.active_state for u, st in states.items() if not st.active}
    if not down:
        return False
    log.warning("resident_down_since_found_up", units=down, left=rec.units,
                consequence="not started: it was up when this record was found stale, and went down since "
                            "(a crash, its operator): systemd's Restart= or systemctl start brings it back")
    await _leave_resident(w, rec)
    return True


async def _crashed_since_restore(w: Context, rec: WindowRecord, stops_late: bool = True) -> None:
    """Leave to systemd a resident that crashed after this close restored it, before the late calls' check.

    A late stop job of the window's own leaves its unit ``inactive``, and the check starts it
    again. A configured unit that came up since the window's stop and is ``failed`` now crashed
    after the restore (a late start job, of the timers say, stops nothing): its operator's and
    ``Restart=``'s, so the check does not start the resident. Without a late stop of gpuswapd's
    own (``stops_late``), nothing of its can have taken the resident down since its restore
    verified it: a unit that went down since then was someone else's stop or a crash.

    A unit still changing (a job queued, activating: a late start of the restore's own, which
    systemd runs only now, or its ``Restart=``) is waited for first, up to
    ``resident.start_timeout``: a unit that comes up is verified by the check's restore, never left
    unverified under the timers; one that fails is left to systemd.
    """
    configured = [u for u in w.config.resident.units if u in rec.units]
    if not configured or rec.stopped_mono is None:
        return
    deadline = clock.monotonic() + w.config.resident.start_timeout
    try:
        states = await w.resident.unit_states(list(rec.units))
        while any(_changing(st) for st in states.values()) and clock.monotonic() < deadline:
            await _pause(w, JOB_POLL_S)
            states = await w.resident.unit_states(list(rec.units))
    except GpuswapError:
        return  # systemd cannot say: the check goes on
    states = {u: st for u, st in states.items() if u in configured}
    crashed = [u for u, st in states.items() if st.active_state == "failed"
               and st.active_enter is not None and st.active_enter > rec.stopped_mono]
    if not stops_late and rec.verified_at is not None:
        crashed += [u for u, st in states.items() if u not in crashed and st.active_state != "active"
                    and w.went_down.get(u, -math.inf) >= rec.verified_at]
    if not crashed:
        return
    log.warning("resident_crashed_since_restore", units=crashed, left=rec.units,
                consequence="not started again: it failed after this close restored it (systemd's Restart= or "
                            "systemctl start brings it back)")
    await _leave_resident(w, rec)


def _changing(st: UnitState) -> bool:
    """Tell whether a unit is on its way somewhere (a job queued, activating, deactivating)."""
    return bool(st.job) or st.active_state in ("activating", "deactivating", "reloading")


async def _stopped_meanwhile(w: Context, rec: WindowRecord, first_start: float | None) -> bool:
    """Tell whether its operator stopped the resident this restore had started; if so, leave it to them.

    The restore's start undid gpuswapd's own stop. A configured unit that came up under this
    restore's start (``ActiveEnterTimestampMonotonic`` after its first start, ``first_start``,
    on CLOCK_MONOTONIC) and is now
    ``inactive`` with no job queued (a clean stop: a start that failed, or a crash, ends
    ``failed``) was stopped by someone else: its operator, to mend it. gpuswapd does not start it
    again and does not hold the card for it. A unit stopped while ``failed`` stays ``failed``, so
    only a mask (``_masked_meanwhile``) takes that one from the restore.
    """
    configured = [u for u in w.config.resident.units if u in rec.units]
    if not configured or first_start is None or hung_mark(w)[2] != w.hung_mark[2]:
        return False  # (a stop job of this window's own that hung may have landed late: the restore goes on)
    try:
        states = await w.resident.unit_states(configured)
    except GpuswapError:
        return False  # systemd cannot say: the restore goes on
    down = [st for st in states.values() if not st.active]
    stopped = [st.name for st in down if st.active_state == "inactive" and not st.job
               and st.active_enter is not None and st.active_enter > first_start]
    if not down or len(stopped) < len(down):
        return False
    log.warning("resident_left_stopped", units=stopped, left=rec.units,
                consequence="not started again: its operator stopped it after this restore started it "
                            "(systemctl start brings it back)")
    await _leave_resident(w, rec)
    return True


async def _degraded(w: Context, rec: WindowRecord, err: GpuswapError, attempt: int) -> None:
    """Wait in DEGRADED before the next try; nobody gets a window meanwhile."""
    delay = backoff(w.backoffs.restore, attempt)
    rec.degraded = err.message
    log.error("restore_failed", error=err.message, retry_in_s=delay)
    if attempt == 1:
        log.error("degraded", reason=err.message)
    await w.enter(rec, Phase.DEGRADED, required=False)
    w.fail_waiters(Degraded(f"the resident could not be restored yet: {err.message}", phase=str(Phase.DEGRADED)))
    await _pause(w, delay)
    await w.enter(rec, Phase.RESTORING, required=False)


async def _resume(w: Context, rec: WindowRecord) -> None:
    """Start exactly the paused timers again; retry until they run (the record stays till then)."""
    def failed(err: GpuswapError, delay: float) -> None:
        rec.fail(err)
        log.error("timers_resume_retry", error=err.message, retry_in_s=delay)

    await until_done(lambda: w.resident.resume(rec.timers), w.backoffs.restore, failed, lambda s: _pause(w, s))


async def _pause(w: Context, seconds: float) -> None:
    """Wait before a retry; when gpuswapd gives up (its shutdown bound ran out), leave the record for the next start.

    A shutdown that restores (on_shutdown = "restore") retries like any close: only ``abort`` ends it.
    """
    if await sleep_unless(w.abort, seconds):
        raise Interrupted


STEPS: tuple[tuple[Phase, Callable[[Context, WindowRecord], Awaitable[None]]], ...] = (
    (Phase.CLOSING, _take_down),
    (Phase.WAITING_VRAM, _wait_resident_vram),
    (Phase.RESTORING, _restore),
    (Phase.RESUMING_TIMERS, _resume),
)


def _first_step(rec: WindowRecord) -> int:
    """Find where closing starts: at CLOSING, or where an interrupted close stood."""
    if rec.phase is Phase.WAITING_VRAM and rec.closing:
        return 1
    if rec.phase in (Phase.RESTORING, Phase.DEGRADED):
        return 2
    if rec.phase is Phase.RESUMING_TIMERS:
        return 3
    return 0


async def close(w: Context, rec: WindowRecord, outcome: str, switch: bool = True) -> None:
    """Take the engine down, wait for VRAM, restore and verify the resident, resume the timers.

    An engine that could not be taken down in CLOSING is retried alongside the restore, and the
    record is cleared only once it is gone too: nothing of the window is left behind.
    ``switch=False``: never straight into the next window (a stale record, whose resident is up
    again: the next window stops what runs itself, it takes nothing over).
    """
    first = _first_step(rec)
    remover: asyncio.Task[bool] | None = None
    # The resident's files are read into the page cache meanwhile; nothing waits for it (prefetch.py).
    fetch = w.files.start(w, rec) if not switch or switch_target(w, rec) is None else None
    try:
        for index, (phase, step) in enumerate(STEPS):
            if index < first:
                continue
            if index > 0 and engine_left(rec) and remover is None:
                # An engine CLOSING could not take down, or one a restart found left (the close
                # resumes past CLOSING), is retried alongside the rest: RESTORING may wait for it.
                remover = spawn(_keep_taking_down(w, rec), "engine-take-down")
            if rec.phase is not phase:
                await w.enter(rec, phase, required=False)
            await step(w, rec)
            nxt = switch_target(w, rec) if phase is Phase.CLOSING and switch and not engine_left(rec) else None
            if nxt is not None:
                await reap(fetch)
                w.switch(rec, nxt, outcome)
                return
        if remover is not None and not remover.done():
            rec.degraded = (f"the resident is back, but the engine {_name(rec)} could not be "
                            f"removed yet: {_said(rec)}; gpuswapd keeps trying")
            log.warning("engine_take_down_pending", container=_name(rec))
            w.notify_status()
            if not await asyncio.shield(remover):
                raise Interrupted
            rec.degraded = None
        await _reconcile_late_calls(w, rec)
        if not rec.units:
            # Nothing to restore now, but the resident may start any time (its operator, the
            # reconcile): a parked engine must leave it room all the same (the park watch retries).
            with contextlib.suppress(Degraded):
                await _parked_leaves_room(w)
    except Interrupted:
        log.warning("window_left_for_next_start", window=rec.id, phase=str(rec.phase))
        return
    finally:
        await reap(remover)
        await reap(fetch)
    await warm.discard(w, rec)
    w.finish(rec, outcome)


def hung_mark(w: Context) -> tuple[int, int, int, int]:
    """Count calls to systemd and Docker that outlived their deadline, systemd's that change it, its own stops."""
    return (w.outside.systemd.hung_total, w.outside.docker.hung_total, w.outside.systemd.changes_hung,
            w.resident.stops_hung)


async def _reconcile_late_calls(w: Context, rec: WindowRecord) -> None:
    """Make sure again once calls that outlived their deadline have landed.

    A stop job or a container create that timed out here may still be done by systemd or Docker
    later, after the restore: wait until every such call has returned, then take the engine
    down, start the resident and the timers once more (each is a no-op if already so).

    Only a late job of systemd's (a stop) can have stopped the resident after its restore: when
    only Docker's calls or systemd's reads were late, the resident restored and verified stays as
    it is now. A unit of it that is down by then (it crashed meanwhile, its operator stopped it)
    is not gpuswapd's to start.
    """
    while hung_mark(w) != w.hung_mark:
        rec.degraded = "waiting for calls to systemd or Docker that outlived their deadline to return"
        log.warning("late_calls_pending", systemd=w.outside.systemd.status()["hung"],
                    docker=w.outside.docker.status()["hung"])
        w.notify_status()
        if hung_mark(w)[1] != w.hung_mark[1] and rec.container is not None and not rec.container.parked \
                and rec.container.removed:
            # A create still out may bring the engine back: recorded before the wait, so that a
            # start after a kill meanwhile takes it down too.
            rec.container = replace(rec.container, removed=False)
            await w.persist(required=False)
        await _until(w, w.outside.systemd.drained())
        await _until(w, w.outside.docker.drained())
        systemd_late = hung_mark(w)[2] != w.hung_mark[2]
        stops_late = hung_mark(w)[3] != w.hung_mark[3]
        docker_late = hung_mark(w)[1] != w.hung_mark[1]
        w.hung_mark = hung_mark(w)
        if rec.container is not None and not rec.container.parked:
            if docker_late and rec.container.removed:
                # A create that landed late may have brought the engine back: recorded before the
                # take-down, so that a start after a crash meanwhile takes it down too.
                rec.container = replace(rec.container, removed=False)
                await w.persist(required=False)
            await _retry_take_down(w, rec, None)
        await _until(w, _sweep(w))
        if systemd_late:
            await _crashed_since_restore(w, rec, stops_late)
            await w.enter(rec, Phase.RESTORING, required=False)
            # A late stop job may have stopped the resident after its restore: what its old process
            # held is freed first, or the new one starts into it (as after the engine's stop).
            await _wait_resident_vram(w, rec)
            await _restore(w, rec)
            await w.enter(rec, Phase.RESUMING_TIMERS, required=False)
            await _resume(w, rec)
        rec.degraded = None
        log.info("late_calls_reconciled")


async def _until(w: Context, aw: Awaitable[None]) -> None:
    """Await something long, unless gpuswapd gives up first (then the record stays)."""
    task = asyncio.ensure_future(aw)
    stop = asyncio.ensure_future(w.abort.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled: the long wait is not left running without an owner
        await reap(task)
        raise
    finally:
        stop.cancel()
    if not task.done():
        await reap(task)
        raise Interrupted
    task.result()


def sweep_orphans(w: Context) -> None:
    """Remove this instance's engines that no open window owns, retrying until Docker lets it."""
    if w.sweeper is None or w.sweeper.done():
        w.sweeper = spawn(_sweep(w), "orphan-sweep")


class _SweepStopped(Exception):
    """gpuswapd stops: the orphan sweep is left to its next start."""


async def _sweep(w: Context) -> None:
    async def pause(seconds: float) -> None:
        if await sleep_unless(w.stopping, seconds):
            raise _SweepStopped

    if w.stopping.is_set():
        return
    with contextlib.suppress(_SweepStopped):
        await until_done(lambda: w.engine_of(DEFAULT_PROFILE).remove_orphans(w.engines_kept()), w.backoffs.restore,
                         lambda err, delay: log.warning("orphan_sweep_failed", error=err.message, retry_in_s=delay),
                         pause)


def _name(rec: WindowRecord) -> str | None:
    """Name the window's engine container (None: it has none)."""
    return rec.container.name if rec.container is not None else None


def _said(rec: WindowRecord) -> str:
    """Say what went wrong in the window, as its error has it."""
    return rec.error.message if rec.error is not None else "see the log"
