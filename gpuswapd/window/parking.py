"""A parked engine: asleep on the card between windows, woken for the next one in seconds.

With ``window.park.mode = "sleep"`` a window that closes normally puts its engine to sleep
instead of removing it, but only when the card then has what the resident needs free
(``gpu.resident_needs``, or what it was seen to hold if more): a parked engine never costs the
resident an out-of-memory. The parked engine lives in the state
document's ``parked`` field, written in the same document as the window's record that hands it
over, so a restart finds it either in the window (and removes it with the window) or parked
(and keeps it only if it still sleeps and matches the configuration).

While parked it is watched: an engine that dies, stops saying it sleeps, or stays unused for
``window.park.keep`` is removed, and the resident is never touched for it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuswapd import clock, naps
from gpuswapd.adapters.pagecache import mem_available
from gpuswapd.config import ParkConfig, ProfileKind
from gpuswapd.errors import GpuswapError, VramTimeout
from gpuswapd.logs import log
from gpuswapd.record import _WINDOW_ONLY, ContainerHandle, Parked, WindowRecord
from gpuswapd.retry import backoff
from gpuswapd.sizes import format_size
from gpuswapd.tasks import reap, sleep_unless, spawn

if TYPE_CHECKING:
    from gpuswapd.parts.vram import Unless
    from gpuswapd.window.context import Context

RETRY_S = (1.0, 60.0)


def _level(w: Context) -> int:
    """Pick the sleep level: level 1 holds the weights in host RAM, so it needs room there."""
    park = w.profile.engine.park
    if park.level == 1 and park.host_ram_needs:
        available = mem_available()
        if available is None or available < park.host_ram_needs:
            shown = "unknown" if available is None else format_size(available)
            log.warning("park_level_lowered", sleep_level=2, host_ram_available=shown,
                        host_ram_needs=format_size(park.host_ram_needs))
            return 2
    return park.level


async def try_park(w: Context, rec: WindowRecord, need: int | None = None) -> bool:
    """Put the window's engine to sleep and park it, if it may be and ``need`` is then free.

    ``need`` is what comes next: the resident (``Context.resident_needs``), or the next window of a
    direct switch. False means it was not parked (the caller removes it); the log says why.
    """
    c = rec.container or ContainerHandle()
    if rec.kind != ProfileKind.ENGINE or w.profile.engine.park.mode != "sleep" or w.stopping.is_set():
        return False
    if w.parked is not None:
        log.info("engine_not_parked", reason=f"the engine of profile {w.parked.profile!r} is parked already")
        return False
    if rec.error is not None or rec.baseline is not None:
        return False  # only a window that served to the end parks its engine
    if not c.sleep or not c.canary:
        log.info("engine_not_parked", reason="the engine did not offer sleep mode at its boot")
        return False
    level = _level(w)
    try:
        await w.container_engine.sleep(level)
    except GpuswapError as err:
        log.warning("engine_not_parked", reason=err.message)
        return False
    resident_next = need is None
    need = w.resident_needs if need is None else need
    # A resident up already (a close that found it up: a record left stale by a restart) holds its
    # own memory: it runs beside the sleeping engine, and its memory is no wait.
    units = rec.units or w.config.resident.units
    beside: Unless = ("the resident's units are up: it runs beside the sleeping engine",
                      lambda: w.resident.all_active(units))
    # A sleeping engine frees its memory some time after it says it sleeps, like an exiting
    # process: wait for what comes next to fit, a while, before deciding.
    settle = w.profile.engine.park.settle
    waited = clock.monotonic()
    try:
        if resident_next and await beside[1]():
            await w.vram.read(processes=False)
        else:
            await w.vram.wait_free(need, settle, unless=beside if resident_next else None)
    except VramTimeout:
        pass
    except GpuswapError as err:
        log.warning("engine_not_parked", reason=f"the GPU's memory cannot be read: {err.message}")
        return False
    reading = w.vram.last
    runs_beside = False
    if reading is not None and reading.free_bytes < need and resident_next and await beside[1]():
        runs_beside = True  # it fits beside the sleeping engine: it runs
    elif reading is None or reading.free_bytes < need:
        free = "unknown" if reading is None else format_size(reading.free_bytes)
        log.warning("engine_not_parked", reason="what comes next would not fit beside the sleeping engine",
                    free=free, need=format_size(need), sleep_level=level, waited_s=round(clock.monotonic() - waited, 3),
                    settle_s=settle)
        return False
    before = c.free_before_boot
    pids = set(c.pid_list)
    listed = await w.vram.read(processes=True) if pids else None
    held = [p.used_bytes for p in listed.processes if p.pid in pids] if listed is not None else []
    if held:  # what the card lists under the engine's own processes
        residual = sum(held)
    elif runs_beside:
        log.warning("engine_not_parked", reason="the card lists none of the sleeping engine's processes, and what "
                    "it holds cannot be told from the resident's, which runs beside it")
        return False
    elif before is not None:  # booted cold in this window: measured against the card then
        residual = max(0, int(before) - reading.free_bytes)
    else:  # woken from park: it holds what it held before
        residual = int(c.residual_bytes or 0)
    # What the window's container record says that a parked engine's does not need goes.
    record = c.without(*_WINDOW_ONLY)
    w.parked = Parked(container=record, since=clock.now(), level=level, residual_bytes=residual,
                      canary=str(c.canary), profile=rec.profile)
    rec.container = replace(c, parked=True)
    await w.persist(required=False)  # one document: the window lets go of it, parked takes it
    log.info("engine_parked", container=record.name, sleep_level=level, residual=format_size(residual),
             free=format_size(reading.free_bytes), need=format_size(need))
    return True


async def remove(w: Context, why: str) -> bool:
    """Remove the parked engine (the resident is left alone); False if Docker would not."""
    parked = w.parked
    if parked is None:
        return True
    try:
        await w.engine_of(parked.profile).take_down(parked.container)
    except GpuswapError as err:
        log.error("parked_engine_not_removed", reason=why, error=err.message)
        return False
    if w.parked is parked:
        w.parked = None
        await w.persist(required=False)
    log.info("parked_engine_removed", container=parked.container.name, reason=why)
    return True


def watch(w: Context) -> None:
    """Watch the parked engine while no window is open (replacing any earlier watch)."""
    if w.parked is not None and (w.park_watch is None or w.park_watch.done()):
        w.park_watch = spawn(_watch(w), "park-watch")


async def stop_watching(w: Context) -> None:
    """Stop watching the parked engine (a window is about to use it or gpuswapd stops)."""
    task, w.park_watch = w.park_watch, None
    if task is not None and task is not asyncio.current_task():
        await reap(task)


def _park_config(w: Context, parked: Parked) -> tuple[ParkConfig, float] | None:
    """Return the parked engine's park settings and watch interval (None: its profile is gone)."""
    try:
        window = w.config.profile(parked.profile).window
    except KeyError:
        return None
    return (window.park, window.watch_interval) if window is not None else None


async def _watch(w: Context) -> None:
    failures = 0
    while w.parked is not None and not w.stopping.is_set():
        parked = w.parked
        settings = _park_config(w, parked)
        why: str | None
        if settings is None:
            why = f"its profile {parked.profile!r} is no longer configured"
        elif (left := parked.since + settings[0].keep - clock.now()) <= naps.EARLY_S:  # (as a pause toward it)
            why = f"unused for park.keep = {settings[0].keep:g}s"
        else:
            if await sleep_unless(w.stopping, min(settings[1], left)) or w.parked is not parked:
                continue
            why = await w.engine_of(parked.profile).why_not_parked(parked.container)
            if why is not None:
                why = f"the parked engine failed: {why}"
        if why is None:
            failures = 0
            continue
        if not await remove(w, why):
            failures += 1
            await sleep_unless(w.stopping, backoff(RETRY_S, failures))


async def check_at_start(w: Context) -> None:
    """Keep a parked engine an earlier gpuswapd left only if it still sleeps and matches; else remove it."""
    parked = w.parked
    if parked is None:
        return
    settings = _park_config(w, parked)
    why = await w.engine_of(parked.profile).why_not_parked(parked.container)
    if settings is None:
        why = f"its profile {parked.profile!r} is no longer configured"
    elif why is None and clock.now() >= parked.since + settings[0].keep:
        why = f"unused for park.keep = {settings[0].keep:g}s"
    if why is None:
        log.info("parked_engine_adopted", container=parked.container.name, since=parked.since)
        watch(w)
        return
    log.warning("parked_engine_dropped", reason=why)
    if not await remove(w, why):
        watch(w)  # keep trying
