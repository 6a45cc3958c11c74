"""The window's driver: one supervised task that takes the window record through its phases.

It runs the steps (``opening``, ``holding``, ``closing``, ``recovery``) on the window's
``Context``, and whatever escapes a step (an outside failure, a bug, a cancellation nobody asked
for) rolls the window back or carries the close on. The ``Window`` owns one and hands it the
record: to open the next window for the queue, to take over one an earlier gpuswapd left
(``recover``), to restore the baseline, and to shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

import structlog

from gpuswapd import clock, naps
from gpuswapd.errors import GpuswapError, StateError, Stopping, WindowCancelled
from gpuswapd.logs import log
from gpuswapd.phases import Phase
from gpuswapd.record import BaselineRestore, WindowRecord
from gpuswapd.retry import backoff
from gpuswapd.tasks import spawn, uncancel
from gpuswapd.window import closing, holding, opening, parking, recovery
from gpuswapd.window.context import Context

# Once the shutdown's bound has run out, how long the window may take to stop where it is.
SHUTDOWN_ABORT_S = 10.0
# How long a restoring shutdown asks systemd, at the end, whether the resident is still up.
EXIT_CHECK_S = 5.0


class Driver:
    """Drives the window record of one Window (its ``Context``)."""

    def __init__(self, w: Context) -> None:
        self.w = w
        self.task: asyncio.Task[None] | None = None  # the supervising task, while it runs
        self.opening: asyncio.Task[None] | None = None  # the opening under way (its last client may cancel it)

    def recover(self, rec: WindowRecord) -> None:
        """Take over a window an earlier gpuswapd left: adopt it if it still serves, else roll back."""
        self.w.record = self.w.adopting = rec
        log.warning("window_recovering", window=rec.id, left_in=str(rec.phase))
        self.drive(recovery.adopt_or_roll_back(self.w, rec))

    def restore_baseline(self, reason: str, cause: str = "state_unreadable") -> None:
        """Restore what the configuration describes: no state could be read, or it was found broken."""
        self.w.baseline_restore = BaselineRestore(reason=reason, at=clock.now(), cause=cause)
        log.error("baseline_restore", reason=reason, cause=cause)
        rec = recovery.baseline_record(self.w)
        self.w.record, self.w.unknown_baseline = rec, rec
        self.w.hung_mark = closing.hung_mark(self.w)
        self.w.notify_status()
        self.drive(recovery.restore_baseline(self.w, rec))

    def drive(self, first: Any = None) -> None:
        """Start the supervising task, with ``first`` as its first step (None: the queue's next window)."""
        self.task = spawn(self._supervise(first), "window-driver", on_failure=self._died)

    def _died(self, err: BaseException) -> None:
        # The supervisor itself failed (a bug in it): start again from the record in memory.
        self.task = None
        if not self.w.stopping.is_set() and (self.w.record is not None or len(self.w.queue)):
            self.drive(self._rescue(self.w.record) if self.w.record else None)

    async def _supervise(self, first: Any) -> None:
        """Drive windows while clients want them; any failure rolls back or carries the close on."""
        step, failures = first, 0
        try:
            while True:
                if step is None:
                    if self.w.record is not None and self.w.record.pending_switch:
                        step = self._run_window()  # a direct switch: the next window takes the card over
                    elif not self.w.queue.queued() or self.w.stopping.is_set():
                        return
                    else:
                        step = self._run_window()
                try:
                    await step
                    failures = 0
                    step = None
                    continue
                except asyncio.CancelledError:
                    if self.w.stopping.is_set():
                        raise
                    uncancel()
                    log.error("window_driver_interrupted", phase=str(self.w.phase),
                              reason="cancelled without gpuswapd stopping")
                except Exception as err:  # a bug or an outside failure no step caught
                    log.exception("window_driver_failed", phase=str(self.w.phase), error=repr(err))
                rec = self.w.record
                failure = GpuswapError(f"gpuswapd failed while driving the window in {self.w.phase}; "
                                       "it is giving the GPU back to the resident (see journalctl -u gpuswapd)",
                                       phase=str(self.w.phase))
                self.w.fail_waiters(failure)
                if rec is not None:
                    rec.fail(failure)
                failures += 1
                await naps.sleep(backoff(self.w.backoffs.driver, failures))
                if rec is not None and rec is self.w.unknown_baseline:
                    # It failed before systemd said what to restore: ask again.
                    step = recovery.restore_baseline(self.w, rec)
                elif rec is not None:
                    step = self._rescue(rec)
                else:
                    step = None
        finally:
            if step is not None and asyncio.iscoroutine(step):
                step.close()
            self.task = None
            structlog.contextvars.unbind_contextvars("window_id", "phase")

    async def _rescue(self, rec: WindowRecord) -> None:
        """Close a window whose driver failed, from wherever it stands."""
        if self.w.record is not rec:
            return
        if rec.phase is Phase.DRAINING and not rec.switched_from:
            self.w.finish(rec, "refused")
            return
        if rec.phase is Phase.IDLE:  # a switch that had not begun: it changed nothing but what it took over
            rec.enter(Phase.DRAINING)
        await closing.close(self.w, rec, "rolled_back")

    async def _run_window(self) -> None:
        rec = self.w.record
        assert rec is None or rec.pending_switch, "a new window while the last one is not finished"
        if rec is None:
            rec = self.w.record = WindowRecord.new()
        self.w.hung_mark = closing.hung_mark(self.w)
        structlog.contextvars.bind_contextvars(window_id=rec.id)
        queued = self.w.queue.queued()
        if not queued:  # a switch whose clients all went away: give the card back
            rec.enter(Phase.DRAINING)
            await closing.close(self.w, rec, "abandoned")
            return
        rec.profile = queued[0].profile
        rec.kind = self.w.config.profile(rec.profile).kind
        self.w.queue.take(rec.id, rec.profile, clock.now())
        self.w.tell_queue()
        await parking.stop_watching(self.w)  # the window takes the parked engine over, or removes it
        self.opening = asyncio.create_task(opening.open_window(self.w, rec), name="window-open")
        failure: GpuswapError | None = None
        try:
            await self.opening
        except asyncio.CancelledError:
            driver = asyncio.current_task()
            if driver is not None and driver.cancelling():
                raise  # the driver itself is being stopped (on_shutdown = "keep")
            # Only the opening was cancelled: its last client went away, or gpuswapd is stopping.
            failure = WindowCancelled("gpuswapd is stopping" if self.w.stopping.is_set() else
                                      "the window was abandoned before it was ready: nobody waits for it")
        except GpuswapError as err:
            failure = err
        except Exception as err:  # a bug while opening: roll back like any failure, and say so
            log.exception("window_open_crashed", error=repr(err))
            failure = GpuswapError(f"gpuswapd failed while opening the window ({type(err).__name__}); "
                                   "the resident is being restored (see journalctl -u gpuswapd)")
        finally:
            self.opening = None
        if failure is None:
            try:
                await self.w.ready(rec)
            except StateError as err:  # READY could not be recorded: nobody gets a lease a crash would lose
                failure = err
        if failure is not None:
            await self._fail_opening(rec, failure)
            return
        await holding.hold_then_close(self.w, rec)

    async def _fail_opening(self, rec: WindowRecord, err: GpuswapError) -> None:
        rec.fail(err)
        log.error("window_failed", error=err.message, code=err.code, failed_phase=err.phase, profile=rec.profile)
        self.w.fail_waiters(err, rec.id)
        if rec.phase is Phase.IDLE:  # it never began (its last client went away at once)
            rec.enter(Phase.DRAINING)
        if rec.phase is Phase.DRAINING and not rec.switched_from:  # nothing was changed yet
            self.w.finish(rec, "refused")
        else:
            await closing.close(self.w, rec, "rolled_back")

    async def shutdown(self, restore: bool, bound: float = math.inf) -> bool:
        """Stop serving the window; with ``restore``, close it and give the GPU back first.

        The close retries as it always does, for up to ``bound`` seconds; then gpuswapd gives up
        and the record stays for the next start. Tell whether the GPU was given back.
        """
        self.w.stopping.set()
        self.w.queue.keep_waiters()  # for their clients to reclaim from the next start, with their tokens
        self.w.fail_waiters(Stopping("gpuswapd is stopping: a request with a token (gpuswapctl, the gateway) keeps "
                                     "its place for daemon.reclaim_grace once it is back; acquire again with it"))
        driver = self.task
        await parking.stop_watching(self.w)
        if not restore:
            self.w.abort.set()
            if driver is not None:
                driver.cancel()
                await asyncio.wait({driver})
            return True  # a parked engine stays parked, for the next start to adopt
        if self.opening is not None:
            self.opening.cancel()
        self.w.wake.set()
        if driver is not None:
            await asyncio.wait({driver}, timeout=None if math.isinf(bound) else bound)
            if not driver.done():
                log.error("shutdown_bound_reached", bound_s=bound, phase=str(self.w.phase),
                          consequence="the window is left for the next start of gpuswapd to finish")
                self.w.abort.set()  # its next pause ends it, with the record kept
                await asyncio.wait({driver}, timeout=SHUTDOWN_ABORT_S)
                if not driver.done():
                    driver.cancel()
                    await asyncio.wait({driver})
                return False
        if self.w.record is not None:
            return False  # the close was left part-way (it said so in the log)
        if not await parking.remove(self.w, "gpuswapd is stopping (daemon.on_shutdown = \"restore\")"):
            return False
        marks_cleared = await self._marks_cleared_at_exit()
        return await self._resident_up_at_exit() and marks_cleared

    async def _marks_cleared_at_exit(self) -> bool:
        """Remove the stop marks a hung state directory kept, before gpuswapd leaves them behind.

        Idle, gpuswapd removes them once the directory answers again; a restore that ends in a
        shutdown has no idle time after it. Left on disk, a mark tells the next start that
        gpuswapd stopped that unit, and that start would start it again even if it crashed or
        its operator stopped it in between. Tried once, for at most ``EXIT_CHECK_S``.
        """
        resident = self.w.resident
        if not (resident.unmark_pending or resident.start_ended_pending):
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(resident.retry_unmark(), EXIT_CHECK_S)
        left = sorted(resident.unmark_pending | resident.start_ended_pending)
        if not left:
            log.info("stopped_record_cleared_at_exit")
            return True
        log.error("stopped_record_left_at_exit", names=left,
                  consequence="the state directory still fails: the next start of gpuswapd reads these as its own "
                              "stops and starts them again, even one that crashed or that its operator stopped")
        return False

    async def _resident_up_at_exit(self) -> bool:
        """Tell whether the resident is up as gpuswapd leaves it: it may have failed since its restore.

        A restoring shutdown exits 0 only with the resident back; one its operator holds down
        counts as back. Asked once, for at most ``EXIT_CHECK_S``: a systemd that cannot say is no
        proof either.
        """
        units = [u for u in self.w.config.resident.units if u not in self.w.held_down]
        try:
            states = await asyncio.wait_for(self.w.resident.states(units), EXIT_CHECK_S)
        except (GpuswapError, TimeoutError) as err:
            why = err.message if isinstance(err, GpuswapError) else f"no answer within {EXIT_CHECK_S:g}s"
            log.error("resident_down_at_exit", units={}, error=why,
                      consequence="the next start of gpuswapd checks the resident and brings back what it stopped; "
                                  "a unit down for any other reason is left to systemd and its operator")
            return False
        down = {u: state for u, state in states.items() if state != "active"}
        if down:
            log.error("resident_down_at_exit", units=down,
                      consequence="the next start of gpuswapd brings back what it stopped (its stop marks); a unit "
                                  "that crashed or that its operator stopped is left to systemd's Restart= and to them")
            return False
        return True
