"""The GPU window: one driver task takes it through its phases; leases keep it open.

Every phase change is written to the state file before the phase acts, and every change the
window makes to the system (timers paused, units stopped, a container created) is recorded
before it is made, so whatever happens next can be undone from the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from gpuswapd.blocking import together
from gpuswapd.config import Config
from gpuswapd.engine import Engine, warm_and_verify
from gpuswapd.errors import EngineFailed, GpuswapError, LeaseNotFound, NotReady, WindowCancelled
from gpuswapd.failpoints import failpoint
from gpuswapd.leases import Lease
from gpuswapd.logs import log
from gpuswapd.notify import Notifier
from gpuswapd.phases import Phase
from gpuswapd.record import WindowRecord
from gpuswapd.resident import Resident
from gpuswapd.saver import Saver
from gpuswapd.state import StateStore
from gpuswapd.vram import Vram

Listener = Callable[[dict[str, Any]], None]
RESTORE_BACKOFF_S = (1.0, 60.0)


@dataclass(eq=False)
class Waiter:
    """An acquire waiting for the window to be READY."""

    holder: str
    duration: float
    unit: str | None
    uid: int | None
    future: asyncio.Future[Lease] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Interrupted(Exception):
    """Closing stopped part-way because gpuswapd is stopping; the record stays for the next start."""


class Window:
    """Opens, holds and closes the GPU window for the lease holders."""

    def __init__(self, config: Config, resident: Resident, engine: Engine, vram: Vram,
                 store: StateStore, notifier: Notifier) -> None:
        self.config = config
        self.resident = resident
        self.engine = engine
        self.vram = vram
        self.store = store
        self.saver = Saver(store)
        self.notifier = notifier
        self.record: WindowRecord | None = None
        self.last: WindowRecord | None = None
        self._waiters: list[Waiter] = []
        self._listeners: set[Listener] = set()
        self._driver: asyncio.Task[None] | None = None
        self._opening: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()

    # -- what clients ask ------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Return the current phase (IDLE when no window is open)."""
        return self.record.phase if self.record else Phase.IDLE

    async def acquire(self, holder: str, duration: float, *, unit: str | None = None, uid: int | None = None,
                      wait: bool = True, listener: Listener | None = None) -> Lease:
        """Get a lease: at once if READY, else after opening the window (or joining its opening)."""
        if self._stopping.is_set():
            raise WindowCancelled("gpuswapd is stopping")
        if self.record is not None and self.record.phase is Phase.READY:
            return await self._grant(self.record, Waiter(holder, duration, unit, uid))
        if not wait:
            raise NotReady(f"the window is not open (phase {self.phase}); acquire without --no-wait opens it")
        waiter = Waiter(holder, duration, unit, uid)
        self._waiters.append(waiter)
        if listener is not None:
            self._listeners.add(listener)
        if self._driver is None:
            self._driver = asyncio.create_task(self._drive(), name="window-driver")
        try:
            return await asyncio.shield(waiter.future)
        except asyncio.CancelledError:
            # The client went away (or its timeout passed): a lease granted meanwhile is nobody's.
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                await self.release(fut.result().id)
            raise
        finally:
            if listener is not None:
                self._listeners.discard(listener)
            self._withdraw(waiter)

    def _withdraw(self, waiter: Waiter) -> None:
        """Forget a waiter that went away; abandon an opening window nobody waits for."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if waiter.future.done():
            return
        waiter.future.cancel()
        rec = self.record
        if not self._waiters and self._opening is not None and rec is not None and not len(rec.leases):
            log.info("window_abandoned", reason="the last waiting client went away")
            self._opening.cancel()

    async def release(self, lease_id: str | None = None, match: Callable[[Lease], bool] | None = None) -> list[Lease]:
        """End a lease by id, or every lease ``match`` accepts."""
        rec = self._open_record()
        if lease_id is not None:
            gone = [rec.leases.release(lease_id)]
        else:
            gone = [rec.leases.release(lease.id) for lease in rec.leases.matching(match or (lambda _: False))]
        for lease in gone:
            log.info("lease_released", lease=lease.id, holder=lease.holder)
        await self._leases_changed(rec)
        return gone

    async def unit_gone(self, unit: str) -> list[Lease]:
        """End the leases held by a unit that became inactive or failed (it may have crashed)."""
        rec = self.record
        if rec is None:
            return []
        gone = [rec.leases.release(lease.id) for lease in rec.leases.matching(lambda x: x.unit == unit)]
        for lease in gone:
            log.info("lease_ended", lease=lease.id, holder=lease.holder, reason=f"{unit} is no longer active")
        if gone:
            await self._leases_changed(rec)
        return gone

    async def renew(self, lease_id: str, duration: float) -> Lease:
        """Extend a lease to end ``duration`` seconds from now."""
        rec = self._open_record()
        lease = rec.leases.renew(lease_id, duration, time.time())
        log.info("lease_renewed", lease=lease.id, holder=lease.holder, expires_at=lease.expires_at)
        await self._leases_changed(rec)
        return lease

    def leases(self) -> list[Lease]:
        """List the leases of the open window."""
        return self.record.leases.all() if self.record else []

    def status(self) -> dict[str, Any]:
        """Describe the window now: phase, leases, waiters, the last window."""
        now = time.time()
        return {
            "phase": str(self.phase),
            "window": self.record.to_dict(now) if self.record else None,
            "waiting": len(self._waiters),
            "last": self.last.to_dict() if self.last else None,
        }

    def closed_because(self) -> str:
        """Say why no window is open, when the last one ended badly (for lease errors)."""
        if self.record is None and self.last is not None and self.last.error is not None:
            return f": the window closed: {self.last.error['message']}"
        return ""

    def _open_record(self) -> WindowRecord:
        if self.record is None or not len(self.record.leases):
            raise LeaseNotFound(f"no lease is held{self.closed_because()}")
        return self.record

    async def _grant(self, rec: WindowRecord, w: Waiter) -> Lease:
        lease = rec.leases.grant(w.holder, w.duration, time.time(), w.unit, w.uid)
        log.info("lease_granted", lease=lease.id, holder=w.holder, duration_s=w.duration)
        await self._leases_changed(rec)
        return lease

    async def _leases_changed(self, rec: WindowRecord) -> None:
        self._wake.set()
        await self.saver.save(rec)

    # -- phases ------------------------------------------------------------------------------

    async def _phase(self, rec: WindowRecord, phase: Phase) -> None:
        """Enter a phase: check and persist it, tell systemd, the log and the waiters, then act."""
        rec.enter(phase)
        await self.saver.save(rec)
        structlog.contextvars.bind_contextvars(phase=str(phase))
        elapsed = round(time.time() - rec.opened_at, 3)
        log.info("phase_entered", elapsed_s=elapsed)
        self.notifier.send(status=f"{phase} (window {rec.id})" + (f": {rec.degraded}" if rec.degraded else ""))
        event = {"event": "phase", "phase": str(phase), "window": rec.id, "elapsed_s": elapsed}
        for listener in list(self._listeners):
            listener(event)
        closing = any(t.phase is Phase.CLOSING for t in rec.timings)
        await failpoint(f"{phase}:closing" if closing and phase is not Phase.CLOSING else str(phase))

    def _finish(self, rec: WindowRecord, outcome: str) -> None:
        rec.outcome = outcome
        rec.enter(Phase.IDLE)
        self.store.append_history(rec)
        self.store.clear()
        self.last, self.record = rec, None
        self.notifier.send(status="IDLE")
        log.info("window_finished", window=rec.id, outcome=outcome,
                 took_s=round((rec.closed_at or time.time()) - rec.opened_at, 3))
        structlog.contextvars.unbind_contextvars("window_id", "phase")

    # -- the driver ------------------------------------------------------------------------

    def recover(self, rec: WindowRecord) -> None:
        """Take over a window an earlier gpuswapd left: adopt it if it still serves, else roll back."""
        self.record = rec
        log.warning("window_recovering", window=rec.id, left_in=str(rec.phase))
        self._driver = asyncio.create_task(self._drive(recovering=rec), name="window-driver")

    async def _drive(self, recovering: WindowRecord | None = None) -> None:
        try:
            if recovering is not None:
                await self._recover(recovering)
            while self._waiters and not self._stopping.is_set():
                await self._run_window()
        finally:
            self._driver = None
            structlog.contextvars.unbind_contextvars("window_id", "phase")

    async def _recover(self, rec: WindowRecord) -> None:
        structlog.contextvars.bind_contextvars(window_id=rec.id, phase=str(rec.phase))
        if rec.phase is Phase.DRAINING:  # nothing was changed yet
            self._finish(rec, "recovered")
            return
        rec.leases.expire(time.time())
        if rec.phase is Phase.READY and len(rec.leases) and rec.container and await self.engine.adopt(rec.container):
            log.info("window_adopted", leases=len(rec.leases))
            await self._hold_then_close(rec)
            return
        await self._close(rec, "recovered")

    async def _run_window(self) -> None:
        rec = self.record = WindowRecord.new()
        structlog.contextvars.bind_contextvars(window_id=rec.id)
        self._opening = asyncio.create_task(self._open(rec), name="window-open")
        failure: GpuswapError | None = None
        try:
            await self._opening
        except asyncio.CancelledError:
            if not self._opening.cancelled():
                raise
            failure = WindowCancelled("the window was abandoned before it was ready: nobody waits for it")
        except GpuswapError as err:
            failure = err
        finally:
            self._opening = None
        if failure is not None:
            await self._fail_opening(rec, failure)
            return
        await self._ready(rec)
        await self._hold_then_close(rec)

    def _fail_waiters(self, err: GpuswapError) -> None:
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_exception(GpuswapError.from_dict(err.to_dict()))
        self._waiters.clear()

    async def _fail_opening(self, rec: WindowRecord, err: GpuswapError) -> None:
        rec.fail(err)
        log.error("window_failed", error=err.message, code=err.code, failed_phase=err.phase)
        self._fail_waiters(err)
        if rec.phase is Phase.DRAINING:  # nothing was changed yet
            self._finish(rec, "refused")
        else:
            await self._close(rec, "rolled_back")

    async def _open(self, rec: WindowRecord) -> None:
        cfg = self.config
        await self._phase(rec, Phase.DRAINING)
        # Check everything that could fail before anything is changed, all at once.
        _, _, timers = await together(self.engine.preflight(), self.vram.read(processes=False),
                                      self.resident.timers())
        await together(self.resident.wait_jobs(timers, time.monotonic() + cfg.timers.wait_for_jobs),
                       self.resident.drain())

        await self._phase(rec, Phase.PAUSING_TIMERS)
        rec.timers = [t.name for t in timers if t.active_state == "active"]
        await self.saver.save(rec)
        await self.resident.pause(rec.timers)
        # A job its timer started just before the pause must not lose the resident under it.
        await self.resident.wait_jobs(await self.resident.timers(), time.monotonic() + cfg.timers.wait_for_jobs)

        await self._phase(rec, Phase.STOPPING_RESIDENT)
        rec.units = await self.resident.closure()
        await self.saver.save(rec)
        await self.resident.stop(rec.units)

        await self._phase(rec, Phase.WAITING_VRAM)
        await self.vram.wait_free(cfg.gpu.window_needs, cfg.gpu.release_timeout)

        await self._phase(rec, Phase.BOOTING)
        rec.container = {"name": cfg.window.container.name, "created": cfg.window.container.create}
        await self.saver.save(rec)
        rec.container = await self.engine.bring_up(rec.id)
        await self.saver.save(rec)
        await self.engine.wait_serving(cfg.window.boot_timeout)

        await self._phase(rec, Phase.WARMING)
        await warm_and_verify(self.resident.http, cfg.window)

    async def _ready(self, rec: WindowRecord) -> None:
        """Enter READY and give every waiting acquire its lease."""
        await self._phase(rec, Phase.READY)
        waiters, self._waiters = self._waiters, []
        leases = [rec.leases.grant(w.holder, w.duration, time.time(), w.unit, w.uid) for w in waiters]
        await self._leases_changed(rec)
        for waiter, lease in zip(waiters, leases, strict=True):
            log.info("lease_granted", lease=lease.id, holder=lease.holder, duration_s=waiter.duration)
            if waiter.future.done():  # it went away meanwhile
                await self.release(lease.id)
            else:
                waiter.future.set_result(lease)

    async def _hold_then_close(self, rec: WindowRecord) -> None:
        """Hold the window while it is wanted and the engine serves, then close it."""
        if await self._hold(rec):
            await self._close(rec, "closed")
            return
        assert rec.error is not None
        self._fail_waiters(GpuswapError.from_dict(rec.error))
        await self._close(rec, "engine_failed")

    async def _hold(self, rec: WindowRecord) -> bool:
        """Keep the window READY while leases last, plus ``linger``; False if the engine was lost.

        A watchdog runs meanwhile: when the engine fails, it is restarted and verified again, up
        to ``max_restarts`` times per window.
        """
        interval = self.config.window.watch_interval
        linger = self.config.daemon.linger
        linger_from: float | None = None
        watch = asyncio.create_task(self.engine.watch(interval), name="engine-watch")
        try:
            while not self._stopping.is_set():
                if watch.done():
                    if not await self._recover_engine(rec, watch.result()):
                        return False
                    watch = asyncio.create_task(self.engine.watch(interval), name="engine-watch")
                now = time.time()
                for lease in rec.leases.expire(now):
                    log.info("lease_expired", lease=lease.id, holder=lease.holder)
                    await self.saver.save(rec)
                if len(rec.leases):
                    linger_from = None
                else:
                    linger_from = now if linger_from is None else linger_from
                    if now - linger_from >= linger:
                        return True
                wake_at = min(t for t in (rec.leases.next_expiry(), linger_from and linger_from + linger)
                              if t is not None)
                self._wake.clear()
                waker = asyncio.create_task(self._wake.wait())
                await asyncio.wait({waker, watch}, timeout=max(0.0, wake_at - now),
                                   return_when=asyncio.FIRST_COMPLETED)
                waker.cancel()
            return True
        finally:
            watch.cancel()

    async def _recover_engine(self, rec: WindowRecord, reason: str) -> bool:
        """Restart a failed engine until it serves again, within ``max_restarts`` for the window."""
        cfg = self.config
        log.error("engine_failed", reason=reason, restarts=rec.restarts, max_restarts=cfg.window.max_restarts)
        await self._phase(rec, Phase.RECOVERING)
        while rec.restarts < cfg.window.max_restarts:
            rec.restarts += 1
            await self.saver.save(rec)
            try:
                await self.engine.take_down(rec.container)
                # A GPU frees memory some time after the process died: restarting at once would
                # fail with out of memory.
                await self.vram.wait_free(cfg.gpu.window_needs, cfg.gpu.release_timeout)
                rec.container = await self.engine.bring_up(rec.id)
                await self.saver.save(rec)
                await self.engine.wait_serving(cfg.window.boot_timeout)
                await self._phase(rec, Phase.WARMING)
                await warm_and_verify(self.resident.http, cfg.window)
            except GpuswapError as err:
                reason = err.message
                log.error("engine_restart_failed", restart=rec.restarts, error=reason)
                if rec.phase is Phase.WARMING:
                    await self._phase(rec, Phase.RECOVERING)
                continue
            log.info("engine_recovered", restart=rec.restarts)
            await self._ready(rec)
            return True
        rec.fail(EngineFailed(f"the engine failed and {rec.restarts} restart(s) did not bring it back "
                              f"(window.max_restarts = {cfg.window.max_restarts}): {reason}; "
                              "the GPU went back to the resident", phase=str(Phase.RECOVERING)))
        await self.saver.save(rec)
        return False

    async def _close(self, rec: WindowRecord, outcome: str) -> None:
        """Take the engine down, wait for VRAM, restore and verify the resident, resume the timers.

        A record left in a closing phase by an earlier gpuswapd continues from that phase.
        """
        steps = ((Phase.CLOSING, self._take_down), (Phase.WAITING_VRAM, self._wait_resident_vram),
                 (Phase.RESTORING, self._restore), (Phase.RESUMING_TIMERS, self._resume))
        first = _closing_step(rec)
        for index, (phase, step) in enumerate(steps):
            if index < first or (phase is Phase.WAITING_VRAM and not rec.units):
                continue
            if rec.phase is not phase:
                await self._phase(rec, phase)
            try:
                await step(rec)
            except _Interrupted:
                log.warning("window_left_for_next_start", window=rec.id, phase=str(rec.phase))
                return
        self._finish(rec, outcome)

    async def _take_down(self, rec: WindowRecord) -> None:
        for lease in rec.leases.clear():
            log.info("lease_ended", lease=lease.id, holder=lease.holder, reason="window closing")
        await self.saver.save(rec)
        if rec.container is None:
            return
        try:
            await self.engine.take_down(rec.container)
        except GpuswapError as err:
            rec.fail(err)
            log.error("engine_take_down_failed", error=err.message)

    async def _wait_resident_vram(self, rec: WindowRecord) -> None:
        try:
            await self.vram.wait_free(self.config.gpu.resident_needs, self.config.gpu.release_timeout)
        except GpuswapError as err:
            # Starting the resident is still the best move: if the memory is really gone it
            # fails, and the restore retries with backoff.
            log.warning("vram_not_free_restoring_anyway", error=err.message)

    async def _restore(self, rec: WindowRecord) -> None:
        """Start exactly the recorded units and verify the resident; retry with backoff."""
        if not rec.units:
            return
        delay, cap = RESTORE_BACKOFF_S
        while True:
            try:
                await self.resident.start(rec.units)
                await self.resident.verify()
                rec.degraded = None
                return
            except GpuswapError as err:
                rec.degraded = err.message
                log.error("restore_failed", error=err.message, retry_in_s=delay)
                await self._phase(rec, Phase.DEGRADED)
                if self._stopping.is_set():
                    # Leave the record as it is: the next gpuswapd goes on restoring from it.
                    raise _Interrupted from err
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                delay = min(delay * 2, cap)
                await self._phase(rec, Phase.RESTORING)

    async def _resume(self, rec: WindowRecord) -> None:
        try:
            await self.resident.resume(rec.timers)
        except GpuswapError as err:
            rec.fail(err)

    # -- shutdown --------------------------------------------------------------------------

    async def shutdown(self, restore: bool) -> None:
        """Stop serving the window; with ``restore``, close it and give the GPU back first."""
        self._stopping.set()
        self._fail_waiters(WindowCancelled("gpuswapd is stopping"))
        if not restore:
            if self._driver is not None:
                self._driver.cancel()
            return
        if self._opening is not None:
            self._opening.cancel()
        self._wake.set()
        if self._driver is not None:
            await asyncio.shield(self._driver)


def _closing_step(rec: WindowRecord) -> int:
    """Find where closing starts: at CLOSING, or where an interrupted close stood."""
    if rec.phase is Phase.WAITING_VRAM and any(t.phase is Phase.CLOSING for t in rec.timings):
        return 1
    if rec.phase in (Phase.RESTORING, Phase.DEGRADED):
        return 2
    if rec.phase is Phase.RESUMING_TIMERS:
        return 3
    return 0
