"""Holding the window READY: leases expire, the linger passes, a watchdog restarts a failed engine."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuswapd import clock, naps
from gpuswapd.errors import EngineFailed, GpuswapError
from gpuswapd.logs import log
from gpuswapd.phases import Phase
from gpuswapd.record import WindowRecord
from gpuswapd.tasks import reap, retrieve, spawn
from gpuswapd.window import closing, opening, preempting

WATCH_BARE_S = 10.0  # a bare window has no engine to watch; leases and the queue still wake it

if TYPE_CHECKING:
    from gpuswapd.window.context import Context


async def hold_then_close(w: Context, rec: WindowRecord) -> None:
    """Hold the window while it is wanted and the engine serves, then close it."""
    if await hold(w, rec):
        await closing.close(w, rec, "closed")
        return
    assert rec.error is not None
    w.fail_waiters(rec.error.error(), rec.id)
    await closing.close(w, rec, "engine_failed")


async def hold(w: Context, rec: WindowRecord) -> bool:
    """Keep the window READY while leases last, plus ``linger``; False if the engine was lost.

    A watchdog runs meanwhile: when the engine fails, it is restarted and verified again, up
    to ``max_restarts`` times per window.
    """
    interval = w.profile.window.watch_interval if w.profile.window is not None else WATCH_BARE_S
    linger = w.config.daemon.linger
    linger_from: float | None = None
    watch = asyncio.create_task(w.engine.watch(interval), name="engine-watch")
    try:
        while not w.stopping.is_set():
            # Cleared before the loop looks, not before it sleeps: a wake while it looks (a request
            # withdrawn as a preemption is revoked, in the same instant) is not lost.
            w.wake.clear()
            if watch.done():
                if not await _serves_after(w, rec, watch):
                    rec.sealed = True
                    return False
                watch = asyncio.create_task(w.engine.watch(interval), name="engine-watch")
            if rec.phase is Phase.READY:
                # Its check that the preemptor could open may wait on Docker, the probe or systemd
                # (a lookup of a process's unit that hangs): leases still end at their expiry meanwhile.
                expiring = spawn(expire_on_time(w, rec), "lease-expiry")
                try:
                    await preempting.check(w, rec)
                finally:
                    await reap(expiring)
            now = clock.now()
            await _expire_leases(w, rec, now)
            if len(rec.leases):
                linger_from = None
            else:
                linger_from = now if linger_from is None else linger_from
                if now - linger_from >= linger or w.queue.wants_other(rec.profile):
                    rec.sealed = True  # from here on it takes no lease: the close has begun
                    return True  # a request for another profile waits: no lingering for nobody
            await _sleep_until_due(w, rec, watch, linger_from and linger_from + linger)
        rec.sealed = True
        return True
    finally:
        await reap(watch)


async def _serves_after(w: Context, rec: WindowRecord, watch: asyncio.Task[str]) -> bool:
    """Deal with a watchdog that ended: watch again if it was lost, else restart the engine; False if that failed."""
    if watch.cancelled() or watch.exception() is not None:
        # The watchdog itself was lost (not the engine): watch again.
        log.warning("engine_watch_restarted", error=None if watch.cancelled() else repr(watch.exception()))
        return True
    return await _restart_engine(w, rec, watch.result())


async def _expire_leases(w: Context, rec: WindowRecord, now: float) -> None:
    """End the leases whose time is up, tell their holders, and write the state down."""
    expired = rec.leases.expire(now)
    for lease in expired:
        log.info("lease_expired", lease=lease.id, holder=lease.holder)
    if expired:
        w.end_watchers("expired")
        await w.persist(required=False)


async def _sleep_until_due(w: Context, rec: WindowRecord, watch: asyncio.Task[str],
                           linger_ends: float | None) -> None:
    """Sleep until a lease expires, the linger ends, a preemption is due, the window is woken or the engine fails."""
    wake_at = min(t for t in (rec.leases.next_expiry(), linger_ends, preempting.deadline(rec)) if t is not None)
    waker = asyncio.create_task(w.wake.wait())
    retrieve(waker)
    try:
        # A nap at most (only leases for infinity: a nap): asyncio's timers stop in a suspend, the
        # deadlines on clock.now() do not; the loop above looks again. From the time now, not the
        # loop's: its write of an expiry may have waited on a hung state directory for its deadline.
        now = clock.now()
        await naps.nap(max(0.0, wake_at - now) if math.isfinite(wake_at) else math.inf, waker, watch)
    finally:
        waker.cancel()


async def _restart_engine(w: Context, rec: WindowRecord, reason: str) -> bool:
    """Restart a failed engine until it serves again, within ``max_restarts`` for the window.

    Leases still end at their expiry meanwhile (a restart may take a boot timeout and more).
    """
    expiring = spawn(expire_on_time(w, rec), "lease-expiry")
    try:
        return await _restarted(w, rec, reason)
    finally:
        await reap(expiring)


async def expire_on_time(w: Context, rec: WindowRecord) -> None:
    """End each lease at its expiry, telling its holder, while no holding loop runs (a restart, an adoption)."""
    while True:
        await _expire_leases(w, rec, clock.now())
        due = rec.leases.next_expiry()
        now = clock.now()  # the write of an expiry may have waited on the state directory
        await naps.nap(max(0.0, due - now) if due is not None and math.isfinite(due) else naps.longest())


async def _restarted(w: Context, rec: WindowRecord, reason: str) -> bool:
    cfg = w.profile.engine
    log.error("engine_failed", reason=reason, restarts=rec.restarts, max_restarts=cfg.max_restarts)
    await w.enter(rec, Phase.RECOVERING, required=False)
    while rec.restarts < cfg.max_restarts:
        rec.restarts += 1
        await w.persist(required=False)
        try:
            await w.engine.take_down(rec.container)
            # A GPU frees memory some time after the process died: restarting at once would
            # fail with out of memory.
            await w.vram.wait_free(w.profile.needs, w.config.gpu.release_timeout)
            free = w.vram.last.free_bytes if w.vram.last is not None else None
            rec.container = await w.container_engine.bring_up(rec.id)
            if free is not None:
                # What a sleeping engine keeps is measured against it.
                rec.container = replace(rec.container, free_before_boot=free)
            await opening.learn_pids(w, rec)
            log.warning("engine_restarted", restart=rec.restarts, max_restarts=cfg.max_restarts)
            await w.persist(required=False)
            await w.container_engine.wait_serving(cfg.boot_timeout)
            await w.enter(rec, Phase.WARMING, required=False)
            await w.container_engine.warm()
            await opening.learn_canary(w, rec)
            await opening.learn_pids(w, rec)
        except GpuswapError as err:
            reason = err.message
            log.error("engine_restart_failed", restart=rec.restarts, error=reason)
            if rec.phase is Phase.WARMING:
                await w.enter(rec, Phase.RECOVERING, required=False)
            continue
        log.info("engine_recovered", restart=rec.restarts)
        await w.ready(rec)
        return True
    rec.fail(EngineFailed(f"the engine failed and {rec.restarts} restart(s) did not bring it back "
                          f"(window.max_restarts = {cfg.max_restarts}): {reason}; "
                          "the GPU went back to the resident", phase=str(Phase.RECOVERING)))
    await w.persist(required=False)
    return False
