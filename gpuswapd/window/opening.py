"""Opening the window, one step per phase: check, drain, pause, stop, wait for VRAM, boot, warm.

With a parked engine the last two are one: WAKING wakes it and checks the canary; an engine that
does not wake, or answers the canary differently, is removed and booted cold instead. A bare
window has no engine: it is READY once its memory is free. A window switched to directly from
the last one finds the timers paused and the resident stopped already, and skips those steps.

Each step runs after its phase is on disk, and records what it is about to change before it
changes it; a failure anywhere rolls the window back through closing. Everything that can be
checked without changing anything is checked in DRAINING, so a window that cannot open never
touches a unit or a timer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gpuswapd import clock
from gpuswapd.adapters.gpu import VramReading
from gpuswapd.adapters.streams import snip
from gpuswapd.adapters.unitstates import TimerState
from gpuswapd.config import ProfileKind
from gpuswapd.errors import DockerError, EngineFailed, GpuswapError, WontFit
from gpuswapd.logs import log
from gpuswapd.parts.vram import predict_fit
from gpuswapd.phases import Phase
from gpuswapd.record import ContainerHandle, Parked, WindowRecord, needs_less_residual
from gpuswapd.sizes import format_size
from gpuswapd.tasks import together
from gpuswapd.window import identity, parking, warm

if TYPE_CHECKING:
    from gpuswapd.window.context import Context


@dataclass
class Opening:
    """One window on its way to READY, and what its steps learn for the next ones."""

    window: Context
    rec: WindowRecord
    timers: list[TimerState] = field(default_factory=list)
    parked: Parked | None = None
    running: list[str] = field(default_factory=list)  # the resident's active units, as the timers were paused

    @property
    def needs(self) -> int:
        """The VRAM to wait for: a parked engine already holds its residual."""
        return needs_less_residual(self.window.profile.needs, self.rec.profile, self.parked)


async def _check_and_drain(op: Opening) -> None:
    """Check everything that could fail before anything changes, at once; then let work finish.

    Nothing here changes the system but the removal of a parked engine that cannot be used: the
    parked engine, the card, the resident's units, the timers and the resident's idle probe are
    all asked at the same time, and the fit is judged once the parked engine is known.
    """
    w, cfg, rec = op.window, op.window.config, op.rec
    parked = w.parked
    going = frozenset(rec.freeing)  # the engine the last window took down: its memory is coming free

    async def checks() -> None:
        seen = together(w.vram.read(processes=True), w.resident.closure())
        timers = w.resident.timers() if not rec.switched_from else _nothing()
        op.parked, (reading, running), op.timers = await together(_usable_parked(w, rec), seen, timers)
        if parked is not None and op.parked is None and w.parked is None:
            reading, running = None, None  # the parked engine was removed: read the card again
        preflight = w.engine.preflight() if op.parked is None else _nothing()
        # What the parked engine's removal just freed is coming free too.
        await together(preflight, check_fit(w, op.needs, going | frozenset(rec.freeing), rec.freeing_unknown,
                                            reading, running))

    # The drain's first look goes with the checks; a check that fails ends it at once.
    await together(checks(), w.resident.drain() if not rec.switched_from else _nothing())
    if rec.switched_from:  # the timers are paused and the resident is down already
        return
    op.timers = op.timers or []
    await w.resident.wait_jobs(op.timers, clock.monotonic() + cfg.timers.wait_for_jobs)
    # Recorded by the write that enters PAUSING_TIMERS, before any timer is stopped.
    rec.timers = [t.name for t in op.timers if t.active_state == "active"]


async def _nothing() -> None:
    return None


async def preflight(w: Context, profile: str) -> None:
    """Check, changing nothing, that a window of ``profile`` could bring its engine up (a parked one is woken)."""
    parked = w.parked
    # A parked engine that cannot be woken (a removal gpuswapd gave up on landed late, say) is created
    # anew by its window: its image and env file must be there, as for any engine that is not parked.
    if parked is not None and parked.profile == profile \
            and await w.engine_of(profile).why_not_parked(parked.container) is None:
        return
    # Its port may be the open window's engine's until that one is gone: DRAINING checks it then.
    await w.engine_of(profile).preflight(check_port=False)


async def _usable_parked(w: Context, rec: WindowRecord) -> Parked | None:
    """Return the parked engine if this window can wake it; remove it (resident untouched) if not.

    An engine of another profile stays parked only if this window fits beside it.
    """
    parked = w.parked
    if parked is None:
        return None
    why: str | None
    if parked.profile != rec.profile:
        try:
            # Its memory stays: counted as held even when systemd cannot say whose its processes are.
            stays = dict.fromkeys(parked.pids, f"the parked engine {parked.container.name}")
            await check_fit(w, w.profile.needs, frozenset(rec.freeing), rec.freeing_unknown, stays=stays)
            return None
        except WontFit as err:
            why = f"the window of profile {rec.profile!r} does not fit beside it ({err.message})"
    else:
        why = await w.engine.why_not_parked(parked.container)
    if why is None:
        return parked
    if not await parking.remove(w, f"it cannot be woken: {why}"):
        raise DockerError(f"the parked engine {parked.container.name} cannot be woken ({why}) and could not "
                          "be removed: see the log (journalctl -u gpuswapd)")
    rec.freeing = sorted({*rec.freeing, *parked.pids})  # its memory is coming free now, like any engine's
    rec.freeing_unknown = rec.freeing_unknown or not parked.pids  # Docker could not list them when it parked
    return None


async def check_fit(w: Context, need: int | None = None, going: frozenset[int] = frozenset(),
                    unsure: bool = False, reading: VramReading | None = None, running: list[str] | None = None,
                    stays: dict[int, str] | None = None) -> None:
    """Refuse a window the card cannot hold: other processes keep more than it leaves free.

    The resident's units and ``going`` (the pids of gpuswapd's engines being taken down) come
    free; the window waits for them in WAITING_VRAM. Only everyone else's memory stays. With
    ``unsure`` (an engine went whose processes Docker could not list), nothing is refused here:
    WAITING_VRAM tells, naming what still holds the memory.
    """
    need = w.profile.needs if need is None else need
    if reading is None or running is None:  # not read already by the caller
        # With the resident up the card is mostly taken, so the process list is nearly always needed:
        # read it in the same go (this read is also the check that the probe answers at all).
        reading, running = await together(w.vram.read(processes=True), w.resident.closure())
    if reading is None or reading.free_bytes >= need:
        return  # it fits already (or there is no probe to ask)
    # The resident's own processes are no stranger's, whatever state their unit is in (stopping, say).
    units = [*running, *(u for u in w.config.resident.units if u not in running)]
    fit = await predict_fit(w.vram, reading, units, going, stays)
    if fit.fits(need):
        return
    if unsure:
        log.warning("fit_unsure", need=format_size(need), free=format_size(reading.free_bytes),
                    reason="an engine gpuswapd took down could not be told apart from other processes; "
                           "the window waits for its memory instead")
        return
    raise WontFit(fit.misfit(need, units))


async def _pause_timers(op: Opening) -> None:
    """Stop the timers (recorded as the phase was entered); then learn which units the next phase stops."""
    w, rec = op.window, op.rec
    # Every restore before this window has ended: a start record one left behind says nothing now.
    await w.resident.forget_ended_starts()
    await w.resident.pause(rec.timers)
    # A job its timer started just before the pause must not lose the resident under it.
    await w.resident.wait_jobs(await w.resident.timers(), clock.monotonic() + w.config.timers.wait_for_jobs)
    op.running = await w.resident.closure()
    # Only what gpuswapd stops comes back when the window closes: a resident unit found down (it
    # crashed, its operator stopped or masked it) is its operator's and systemd's, and stays so.
    down = [u for u in w.config.resident.units if u not in op.running]
    if down:
        log.warning("resident_found_down", units=down,
                    consequence="left as it is: gpuswapd starts only what it stopped")
    # Recorded by the write that enters STOPPING_RESIDENT, before any unit is stopped.
    rec.units, rec.stopped_mono = list(op.running), clock.kernel_monotonic()
    # What the resident really holds, while it still holds it: the checks from here on count that
    # (the same write records it).
    try:
        await identity.learn_footprint(w, op.running)
    except BaseException:
        # Nothing of the resident was stopped yet (the window failed or was abandoned here): the
        # close has none of its units to start again; one that crashes meanwhile is systemd's.
        rec.units = []
        raise


async def _stop_resident(op: Opening) -> None:
    # The timers are paused and their jobs done: the slots' caches are kept for the restore (warm.py).
    try:
        await warm.save(op.window, op.rec)
        # Also when nothing was saved: a save that timed out (a hung read of how the resident runs)
        # took its deadline, and the resident may have crashed meanwhile.
        await _drop_gone_meanwhile(op)
    except BaseException:
        # Nothing of the resident was stopped yet: the close has none of its units to start again
        # (one that crashes meanwhile is systemd's), nor their memory to wait for.
        op.rec.units = []
        raise
    try:
        await op.window.resident.mark(op.running)
    except BaseException:
        # Its stop was never issued (it could not be recorded first): the close has none of its
        # units to start again; one that crashed meanwhile is systemd's.
        op.rec.units = []
        raise
    await op.window.resident.stop(op.running, marked=True)
    await warm.after_stop(op.window, op.rec)


async def _drop_gone_meanwhile(op: Opening) -> None:
    """Leave out a unit that went down while its slots were saved (it crashed): not gpuswapd's stop to undo."""
    w, rec = op.window, op.rec
    running = await w.resident.closure()
    gone = [u for u in op.running if u not in running]
    if not gone:
        return
    log.warning("resident_found_down", units=gone,
                consequence="left as it is: it went down while its slots were saved, and gpuswapd starts only "
                            "what it stopped")
    op.running = [u for u in op.running if u in running]
    rec.units = [u for u in rec.units if u not in gone]
    await w.persist(required=True)


async def _wait_vram(op: Opening) -> None:
    gpu = op.window.config.gpu
    await op.window.vram.wait_free(op.needs, gpu.release_timeout)
    op.rec.freeing, op.rec.freeing_unknown = [], False  # whatever was being freed is free


async def _boot(op: Opening) -> None:
    w, rec = op.window, op.rec
    c = w.profile.engine.container
    rec.container = ContainerHandle(name=c.name, created=c.create)
    await w.persist(required=True)
    free = w.vram.last.free_bytes if w.vram.last is not None else None
    rec.container = await w.container_engine.bring_up(rec.id)
    if free is not None:
        # What the sleeping engine keeps is measured against it.
        rec.container = replace(rec.container, free_before_boot=free)
    await learn_pids(w, rec)
    await w.persist(required=True)
    await w.container_engine.wait_serving(w.profile.engine.boot_timeout)


async def _warm(op: Opening) -> None:
    await op.window.container_engine.warm()
    await learn_canary(op.window, op.rec)
    await learn_pids(op.window, op.rec)


async def learn_pids(w: Context, rec: WindowRecord) -> None:
    """Record the engine's processes (all it ever had): the card lists their memory under these pids."""
    if rec.container is not None:
        known = rec.container.pid_list
        rec.container = replace(rec.container, pids=tuple(sorted({*known, *await w.engine.pids()})))


async def learn_canary(w: Context, rec: WindowRecord) -> None:
    """With park mode "sleep", learn whether the cold engine can sleep, and its canary's answer."""
    if rec.kind != ProfileKind.ENGINE or w.profile.engine.park.mode != "sleep" or rec.container is None:
        return
    sleeps = await w.container_engine.offers_sleep()
    canary = None
    if sleeps:
        try:
            canary = await w.container_engine.canary()
        except GpuswapError as err:
            log.warning("engine_canary_failed", error=err.message, consequence="this engine will not be parked")
            sleeps = False
    rec.container = replace(rec.container, sleep=sleeps, canary=canary)


async def _wake(op: Opening) -> bool:
    """Wake the parked engine and check its canary; False if it must boot cold instead."""
    w, rec, parked = op.window, op.rec, op.parked
    assert parked is not None
    # The window takes the engine over in the same write that enters WAKING.
    rec.container = replace(parked.container, sleep=True, canary=parked.canary,
                            residual_bytes=parked.residual_bytes)
    rec.start = "warm"
    w.parked = None
    await w.enter(rec, Phase.WAKING, required=True)
    try:
        await w.container_engine.wake()
        said = await w.container_engine.canary()
        if said != parked.canary:
            raise EngineFailed(f"the woken engine answers the canary differently: {snip(said)!r}, before it slept: "
                               f"{snip(parked.canary)!r}")
    except GpuswapError as err:
        rec.restarts += 1
        max_restarts = w.profile.engine.max_restarts
        log.error("engine_wake_failed", error=err.message, restarts=rec.restarts, max_restarts=max_restarts)
        if rec.restarts > max_restarts:
            raise EngineFailed(f"{err.message}; no restart left for a cold boot (window.max_restarts = "
                               f"{max_restarts})", phase=str(Phase.WAKING)) from err
        await w.engine.take_down(rec.container)
        rec.container = replace(rec.container, removed=True)
        rec.start = "cold"
        return False
    log.info("engine_woken", container=rec.container.name, sleep_level=parked.level,
             parked_s=round(clock.now() - parked.since, 3))
    return True


BEFORE_ENGINE: tuple[tuple[Phase, Callable[[Opening], Awaitable[None]]], ...] = (
    (Phase.DRAINING, _check_and_drain),
    (Phase.PAUSING_TIMERS, _pause_timers),
    (Phase.STOPPING_RESIDENT, _stop_resident),
    (Phase.WAITING_VRAM, _wait_vram),
)
_LOOKING = frozenset({Phase.DRAINING, Phase.WAITING_VRAM})
COLD: tuple[tuple[Phase, Callable[[Opening], Awaitable[None]]], ...] = (
    (Phase.BOOTING, _boot),
    (Phase.WARMING, _warm),
)


async def open_window(window: Context, rec: WindowRecord) -> None:
    """Take a new window from DRAINING to the edge of READY; raise on any failure."""
    op = Opening(window, rec)
    for phase, step in BEFORE_ENGINE:
        if rec.switched_from and phase in (Phase.PAUSING_TIMERS, Phase.STOPPING_RESIDENT):
            continue
        # DRAINING and WAITING_VRAM only look: their write goes on meanwhile, and the next one covers it.
        try:
            await window.enter(rec, phase, required=True, overlap=phase in _LOOKING)
        except BaseException:
            if phase is Phase.STOPPING_RESIDENT:
                # Its units are recorded by this write, before any is stopped: none was, and the close has
                # none to start again (one that crashed meanwhile is systemd's).
                rec.units = []
            raise
        await step(op)
    if rec.kind == ProfileKind.BARE:
        return  # the card is clear: the holders bring their own processes
    if op.parked is not None:
        if await _wake(op):
            return
        op.parked = None  # boot cold: wait for the whole window's memory first
        await window.enter(rec, Phase.WAITING_VRAM, required=True, overlap=True)
        await _wait_vram(op)
    for phase, step in COLD:
        await window.enter(rec, phase, required=True)
        await step(op)
