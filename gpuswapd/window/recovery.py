"""What a starting gpuswapd finds: the window an earlier one left, the baseline, orphaned engines."""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import TYPE_CHECKING

import structlog

from gpuswapd import clock, naps
from gpuswapd.config import DEFAULT_PROFILE, ProfileKind
from gpuswapd.errors import GpuswapError
from gpuswapd.logs import log
from gpuswapd.phases import Phase
from gpuswapd.record import BaselineRestore, ContainerHandle, Finished, Parked, PhaseTiming, WindowRecord
from gpuswapd.retry import backoff, until_done
from gpuswapd.state.store import Document, Loaded
from gpuswapd.tasks import reap, spawn, uncancel
from gpuswapd.window import closing, holding, opening, parking, preempting, undone
from gpuswapd.window.baseline import Known

if TYPE_CHECKING:
    from gpuswapd.window.context import Context

READ_ATTEMPTS = 3  # a read that fails may be a moment's trouble; three that fail are the disk's


async def recover_at_start(window: Context) -> None:
    """Pick up the state an earlier gpuswapd left, or restore the baseline if none can be read."""
    loaded, problem = await _read_state(window)
    document = loaded.document if loaded is not None else None
    # Its times are the daemon's time of the gpuswapd that wrote it: in this boot, that time goes on
    # (a wall step since moves no lease); after a reboot, the wall clock is the only bridge.
    if document is not None and clock.continue_from(document.clock):
        log.info("daemon_time_continued", wall_step_s=round(clock.offset(), 3))
    window.writer.start(document.seq if document else 0)
    if loaded is None or loaded.unreadable:
        window.restore_baseline(f"no copy of the state could be read ({problem})")
        return  # the baseline takes the configured engine down itself
    record = _take_in(window, document)
    await _learn_history(window)
    await _carry_on(window, record)


async def _read_state(window: Context) -> tuple[Loaded | None, str]:
    """Read the state document, a few times if reading fails; say what was wrong with it, if anything."""
    loaded: Loaded | None = None
    problem = ""
    for attempt in range(READ_ATTEMPTS):
        try:
            loaded = await window.outside.state.call("read", window.store.load)
            problem = "; ".join(loaded.problems)
            break
        except (GpuswapError, OSError, asyncio.CancelledError) as err:  # EIO, a hung disk, an interruption
            problem = _why(err, window)
            log.error("state_read_failed", error=problem, attempt=attempt + 1, of=READ_ATTEMPTS)
            lane = window.outside.state
            # A read that outlived its deadline holds the lane: give it a while to come back.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(lane.deadline):
                    await lane.drained()
            await naps.sleep(backoff((window.backoffs.driver[0], math.inf), attempt + 1))
    if loaded is not None and loaded.problems:
        log.error("state_unreadable", problems=loaded.problems, fell_back=loaded.document is not None)
    if loaded is not None and loaded.migrated:
        log.info("state_migrated", to="state.json", version=2)
    return loaded, problem


def _take_in(window: Context, document: Document | None) -> WindowRecord | None:
    """Put what the document holds in memory (the window, what is held down, the resident, the parked engine).

    This comes before anything is written again: every write from here on (the one that drops
    the queue, say) keeps the window and the parked engine. Return the window record it held.
    """
    record = document.window if document is not None else None
    window.record = record
    if document is None:
        return None
    grace = window.config.daemon.reclaim_grace
    for lease in record.leases.matching(lambda x: x.bound and x.token is not None) if record and grace > 0 else []:
        # Bound to a connection of the gpuswapd that stopped, which is gone: its client (gpuswapctl
        # run, the gateway) reclaims it with its token on a new connection within the grace, or it ends.
        lease.reclaim_by = clock.now() + grace
        log.info("lease_kept_for_reclaim", lease=lease.id, holder=lease.holder, grace_s=grace)
    window.held_down = dict(document.held_down)
    try:
        window.known = Known.from_dict(document.resident)
    except ValueError as err:  # what the resident was is learned again
        log.error("resident_state_unreadable", error=str(err))
    if document.parked is not None:
        try:
            window.parked = Parked.from_dict(document.parked)
        except ValueError as err:  # its container is nobody's now: the orphan sweep removes it
            log.error("parked_state_unreadable", error=str(err))
    if document.queue:
        # Their clients saw the connection drop: each sends its acquire again with its token and
        # keeps its place (the time it had waited) within the grace.
        kept = window.queue.keep(document.queue, clock.now(), window.config.daemon.reclaim_grace)
        log.warning("queue_kept_for_reclaim", waiting=len(document.queue), reclaimable=kept,
                    grace_s=window.config.daemon.reclaim_grace,
                    holders=[str(q.get("holder")) for q in document.queue if isinstance(q, dict)][:20])
        window.writer.request()
    return record


async def _carry_on(window: Context, record: WindowRecord | None) -> None:
    """Resume the window the document held, or restore the baseline over a lost one; then reconcile the engines."""
    if record is not None:
        try:
            unsaid = await undone.judge(window, record, record.phase)
        except asyncio.CancelledError as err:
            unsaid = _why(err, window)
        if unsaid is not None:
            # systemd cannot say now: the restore judges the record again before it starts anything.
            log.info("resident_stop_unchecked", error=unsaid, consequence="judged again before the restore")
            record.unchecked_in = record.phase
        await _never_stopped(window, record)
        window.recover(record)
    elif (lost := await _lost_window(window)) is not None:
        # Its engine still runs, but no record of it was kept and history never saw it close:
        # what it stopped comes back from the second record (state/marks.py).
        window.restore_baseline(f"the engine of window {lost} was still running, but no record of that window "
                                "was kept", cause="lost_record")
        return  # the baseline takes every engine down itself
    elif stopped := await _still_stopped(window):
        # No window is recorded, yet gpuswapd stopped these and never started them again (a bare
        # window whose record was lost: no engine to prove it): they come back.
        window.restore_baseline(f"gpuswapd had stopped {', '.join(stopped)}, but no record of the window "
                                "that stopped them was kept", cause="lost_record")
        return
    # Reconcile before serving: nobody sees an engine no record knows about.
    try:
        await window.engine_of(DEFAULT_PROFILE).remove_orphans(window.engines_kept())
    except (GpuswapError, asyncio.CancelledError) as err:
        log.warning("orphan_check_failed", error=_why(err, window), retry="in the background")
        closing.sweep_orphans(window)
    await parking.check_at_start(window)


async def _never_stopped(w: Context, rec: WindowRecord) -> None:
    """Leave out of a record left in STOPPING_RESIDENT the units whose stop gpuswapd never issued.

    The record names the units before any is stopped; each is marked (state/marks.py) just before
    its stop job. One with no mark was never stopped by gpuswapd (it was killed during the slot
    save, say): it is not gpuswapd's to start, and if it crashed meanwhile that is systemd's to undo.
    When the marks cannot be read, the record stands.
    """
    if rec.phase is not Phase.STOPPING_RESIDENT or not rec.units:
        return
    try:
        marked = await w.resident.marked_at()
    except (GpuswapError, asyncio.CancelledError) as err:
        log.info("resident_stop_unchecked", error=_why(err, w), consequence="the record stands")
        return
    # A mark older than this window's stop time is an earlier window's that its close could not
    # remove (a failing state directory): it says nothing of this window's stop.
    never = [u for u in rec.units if u not in marked
             or (rec.stopped_mono is not None and (marked[u] or math.inf) < rec.stopped_mono)]
    if never:
        log.info("resident_stop_never_issued", units=never, window=rec.id,
                 consequence="left as they are: gpuswapd stopped before it stopped them")
        rec.units = [u for u in rec.units if u not in never]
        if left := [u for u in never if u in marked]:
            await w.resident.unmark(left)  # an earlier window's, restored since


async def adopt_or_roll_back(w: Context, rec: WindowRecord) -> None:
    """Adopt a window left READY whose engine still serves and whose leases last; else close it.

    Until it is decided, the window grants no lease (``Context.adopting``): its requests queue.
    """
    try:
        await _adopt_or_roll_back(w, rec)
    finally:
        if w.adopting is rec:
            w.adopting = None


async def _adopt_or_roll_back(w: Context, rec: WindowRecord) -> None:
    structlog.contextvars.bind_contextvars(window_id=rec.id, phase=str(rec.phase))
    preempting.resume_stops(w, rec)  # a preemption's stops that were not confirmed before the restart
    if rec.phase is Phase.IDLE and not rec.pending_switch:  # it had finished; the cleared document was not written
        w.record = None
        await w.persist(required=False)
        return
    if rec.phase in (Phase.IDLE, Phase.DRAINING) and rec.switched_from:
        # A direct switch that had not got further: the timers and units it took over come back.
        if rec.phase is Phase.IDLE:
            rec.enter(Phase.DRAINING)
        await closing.close(w, rec, "recovered")
        return
    if rec.phase is Phase.DRAINING:  # nothing was changed yet
        w.finish(rec, "recovered")
        return
    rec.leases.expire(clock.now())
    grace = w.config.daemon.reclaim_grace
    for lease in rec.leases.matching(lambda x: x.bound and (x.token is None or grace <= 0)):
        # Bound to a connection of the gpuswapd that stopped: that connection is gone (one with a
        # token is kept for its client to reclaim: see _take_in).
        rec.leases.release(lease.id)
        log.info("lease_released", lease=lease.id, holder=lease.holder, reason="its connection ended with gpuswapd")
    # Deciding may take a while (a systemd or health call that hangs): leases still end on time.
    expiring = spawn(holding.expire_on_time(w, rec), "lease-expiry")
    try:
        # Left anywhere past the resident's stop on the way to READY (or in it), a record whose resident
        # is up again is stale: the close of the gpuswapd that stopped finished, its writes did not land.
        opened = rec.phase in (Phase.BOOTING, Phase.WARMING, Phase.WAKING, Phase.READY, Phase.RECOVERING) or (
            rec.phase is Phase.WAITING_VRAM and not rec.closing)
        closed_early = rec.phase is Phase.CLOSING or (rec.phase is Phase.WAITING_VRAM and rec.closing)
        up = await _resident_now(w, rec.units) if (opened or closed_early) and rec.units else None
        stale = opened and up == "up"
        if closed_early and up == "up":
            # Left closing before its restore, yet its resident is up again (another window's restore,
            # its operator, or this close's own restore whose phase never reached the disk): the close
            # goes on, and its restore only verifies it; one that goes down meanwhile is not started.
            rec.found_up = True
        # A bare window's holders still hold the card; an engine window is adopted if its engine serves.
        # Not one whose resident is coming up (the restore of the gpuswapd that stopped, its start under
        # way): the card is the resident's again, and the close goes on with that restore.
        adopted = up in (None, "unknown") and rec.phase is Phase.READY and len(rec.leases) > 0 and (
            rec.kind == ProfileKind.BARE or (rec.container is not None and await w.engine.adopt(rec.container)))
    finally:
        await reap(expiring)
    if stale:
        # The resident it stopped is up again: the close finished but its end was never written
        # (a full disk at the last exit). The window holds nothing: close it, which changes nothing.
        log.warning("window_stale", window=rec.id, units=rec.units,
                    reason="its resident is up again: its close finished but was not recorded")
        rec.found_up = True
        await closing.close(w, rec, "recovered", switch=False)
        return
    if adopted and len(rec.leases):
        log.info("window_adopted", leases=len(rec.leases))
        if rec.kind == ProfileKind.ENGINE:
            await opening.learn_pids(w, rec)  # a restart may have replaced them after the last write
        w.adopting = None
        await w.grant_adopted(rec)
        w.notify_status()
        await holding.hold_then_close(w, rec)
        return
    w.adopting = None  # closing: what queued meanwhile waits for the next window
    # A resident coming up (the restore's start of the gpuswapd that stopped, its job still under
    # way) takes the card: the close goes back to it, never straight to another window beside it.
    # Nor does one found up again (that close's restore ran, its end unwritten), or one systemd
    # cannot tell of: a direct switch would carry its units as stopped by gpuswapd, and start them
    # at its own close after a crash took them down. The next window stops what runs itself, marked first.
    await closing.close(w, rec, "recovered", switch=up is None)


async def _resident_now(w: Context, units: list[str]) -> str | None:
    """Say whether a record's units are all "up" (active), "coming" (any active or activating), or neither (None).

    "unknown" when systemd cannot say. One still activating may be the start of a restore the
    gpuswapd that stopped had begun: if that start fails, the restore is gpuswapd's to go on with,
    not a crash of a resident found up.
    """
    try:
        states = await w.resident.unit_states(units)
    except GpuswapError:
        return "unknown"
    if all(st.active_state == "active" for st in states.values()):
        return "up"
    return "coming" if any(st.active for st in states.values()) else None


async def _lost_window(w: Context) -> str | None:
    """Name a window whose engine runs orphaned though history never saw it close (a lost record)."""
    try:
        orphans = await w.engine_of(DEFAULT_PROFILE).orphaned(w.engines_kept())
    except (GpuswapError, asyncio.CancelledError) as err:
        log.warning("orphan_check_failed", error=_why(err, w), retry="in the background")
        return None
    return next((win for win in orphans if win not in w.closed_windows), None)


async def _learn_history(w: Context) -> None:
    """Learn open and restore times from the history (queue ETAs, what a switch saves), and which windows closed."""
    try:
        for line in await w.outside.state.call("read_history", w.store.history, 200):
            record = Finished.from_dict(line)
            w.times.learn(record)
            if record.id is not None:
                w.closed_windows.add(record.id)
    except (GpuswapError, OSError, asyncio.CancelledError) as err:  # an interruption at start: noted only
        log.warning("history_unreadable", error=_why(err, w),
                    consequence="queue ETAs are unknown until windows have opened")


def baseline_record(w: Context) -> WindowRecord:
    """Make the record of a baseline restore; its units and timers come from systemd next.

    The record exists at once (status shows the close), but it is written only once systemd has
    said what the baseline is: a record without its units would restore nothing.
    """
    rec = WindowRecord.new()
    c = w.config.window.container
    rec.phase = Phase.CLOSING
    rec.timings.append(PhaseTiming(Phase.CLOSING, clock.now(), stage="close"))
    # Whatever was running is unknown: the configured engine goes down like any window's.
    rec.container = ContainerHandle(name=c.name, created=c.create, image=c.image)
    rec.baseline = w.baseline_restore or BaselineRestore()
    return rec


async def restore_baseline(w: Context, rec: WindowRecord) -> None:
    """Ask systemd what the baseline is, write it down, and close to it like any window."""
    structlog.contextvars.bind_contextvars(window_id=rec.id, phase=str(rec.phase))
    try:
        kept = await w.outside.state.call("write", w.store.set_aside)
    except (GpuswapError, OSError) as err:
        log.warning("state_not_set_aside", error=getattr(err, "message", None) or repr(err))
    else:
        if kept:
            log.warning("state_set_aside", copies=kept, state_dir=str(w.store.dir))
    rec.units, rec.timers = await _baseline_targets(w)
    rec.stopped_mono = await _marked_since(w, rec.units)
    w.unknown_baseline = None
    await w.persist(required=False)
    await _other_engines_down(w, rec)
    await closing.close(w, rec, "baseline_restored")


async def _marked_since(w: Context, units: list[str]) -> float | None:
    """Return the earliest of gpuswapd's marks of these units' stops (CLOCK_MONOTONIC), or None if none can be read.

    A baseline restore knows no window's stop; the marks, each written just before its stop job,
    stand for it in the record. If this record outlives its close (a state directory that refused
    the last writes), the next start leaves to their operator the units that ran again after it
    and are down now (``undone.judge``), as it does for any window's record.
    """
    try:
        marked = await w.resident.marked_at()
    except GpuswapError:
        return None
    times = [at for u in units if (at := marked.get(u)) is not None]
    return min(times) if times else None


async def _other_engines_down(w: Context, rec: WindowRecord) -> None:
    """Take down every other engine profile's container too: which one held the card is unknown.

    Tried once each: one that cannot be taken down now (Docker is down) does not keep the
    resident down. It is noted on the record, and the orphan sweep goes on trying.
    """
    failed = []
    for profile in w.config.engine_profiles():
        if profile.name == DEFAULT_PROFILE:  # the record's own: the close takes it down
            continue
        c = profile.engine.container
        try:
            await w.engine_of(profile.name).take_down(ContainerHandle(name=c.name, created=c.create))
        except GpuswapError as err:
            failed.append(c.name)
            log.error("engine_take_down_failed", container=c.name, error=err.message,
                      consequence="the resident is restored all the same; the orphan sweep keeps trying")
            rec.fail(err)
    if failed:
        said = rec.error.message if rec.error is not None else "see the log"
        rec.degraded = (f"the engines {', '.join(failed)} could not be taken down yet: {said}; "
                        "gpuswapd keeps trying (the resident is restored meanwhile)")
        w.notify_status()
        closing.sweep_orphans(w)


async def _baseline_targets(w: Context) -> tuple[list[str], list[str]]:
    """Read what gpuswapd stopped and never started again, retrying until it can: only those come back.

    The state document could not say (every copy torn, a window's record lost); the second
    record (state/marks.py) can. A unit its operator holds down stays down.
    """
    names = await until_done(w.resident.stopped, w.backoffs.restore,
                             lambda err, delay: log.error("baseline_unknown", error=err.message, retry_in_s=delay))
    units = [n for n in names if not n.endswith(".timer") and n not in w.held_down]
    return units, [n for n in names if n.endswith(".timer")]


async def _still_stopped(w: Context) -> list[str]:
    """List what gpuswapd stopped and never started again (nothing, if that cannot be read now)."""
    try:
        return await w.resident.stopped()
    except (GpuswapError, asyncio.CancelledError) as err:
        log.warning("stopped_record_unreadable", error=_why(err, w),
                    consequence="read again by the idle reconcile: what it names comes back then")
        w.stopped_unread = True
        return []


def _why(err: BaseException, window: Context) -> str:
    """Say what went wrong; an interruption at start is nobody's request, so it is only noted."""
    if isinstance(err, asyncio.CancelledError):
        uncancel()  # nothing stops gpuswapd while it starts: carry on
        return "interrupted"
    if isinstance(err, GpuswapError):
        return err.message
    return f"{window.store.dir}: {getattr(err, 'strerror', None) or err}"
