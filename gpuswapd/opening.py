"""Opening the window, one step per phase: check, drain, pause, stop, wait for VRAM, boot, warm.

Each step runs after its phase is on disk, and records what it is about to change before it
changes it; a failure anywhere rolls the window back through closing. Everything that can be
checked without changing anything is checked in DRAINING, so a window that cannot open never
touches a unit or a timer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuswapd.adapters.unitstates import TimerState
from gpuswapd.errors import WontFit
from gpuswapd.phases import Phase
from gpuswapd.record import WindowRecord
from gpuswapd.tasks import together
from gpuswapd.vram import predict_fit

if TYPE_CHECKING:
    from gpuswapd.window import Window


@dataclass
class Opening:
    """One window on its way to READY, and what its steps learn for the next ones."""

    window: Window
    rec: WindowRecord
    timers: list[TimerState] = field(default_factory=list)


async def _check_and_drain(op: Opening) -> None:
    """Check everything that could fail before anything changes, at once; then let work finish."""
    w, cfg = op.window, op.window.config
    _, _, op.timers = await together(w.engine.preflight(), check_fit(w), w.resident.timers())
    await together(w.resident.wait_jobs(op.timers, time.monotonic() + cfg.timers.wait_for_jobs),
                   w.resident.drain())


async def check_fit(w: Window) -> None:
    """Refuse a window the card cannot hold: other processes keep more than it leaves free."""
    need = w.config.gpu.window_needs
    # With the resident up the card is mostly taken, so the process list is nearly always needed:
    # read it in the same go (this read is also the check that the probe answers at all).
    reading, units = await together(w.vram.read(processes=True), w.resident.closure())
    if reading is None or reading.free_bytes >= need:
        return  # it fits already (or there is no probe to ask)
    fit = await predict_fit(w.vram, reading, units)
    if not fit.fits(need):
        raise WontFit(fit.misfit(need, units))


async def _pause_timers(op: Opening) -> None:
    w, rec = op.window, op.rec
    rec.timers = [t.name for t in op.timers if t.active_state == "active"]
    await w.persist(required=True)
    await w.resident.pause(rec.timers)
    # A job its timer started just before the pause must not lose the resident under it.
    await w.resident.wait_jobs(await w.resident.timers(), time.monotonic() + w.config.timers.wait_for_jobs)


async def _stop_resident(op: Opening) -> None:
    w, rec = op.window, op.rec
    rec.units = await w.resident.closure()
    await w.persist(required=True)
    await w.resident.stop(rec.units)


async def _wait_vram(op: Opening) -> None:
    gpu = op.window.config.gpu
    await op.window.vram.wait_free(gpu.window_needs, gpu.release_timeout)


async def _boot(op: Opening) -> None:
    w, rec = op.window, op.rec
    c = w.config.window.container
    rec.container = {"name": c.name, "created": c.create}
    await w.persist(required=True)
    rec.container = await w.engine.bring_up(rec.id)
    await w.persist(required=True)
    await w.engine.wait_serving(w.config.window.boot_timeout)


async def _warm(op: Opening) -> None:
    await op.window.engine.warm()


STEPS: tuple[tuple[Phase, Callable[[Opening], Awaitable[None]]], ...] = (
    (Phase.DRAINING, _check_and_drain),
    (Phase.PAUSING_TIMERS, _pause_timers),
    (Phase.STOPPING_RESIDENT, _stop_resident),
    (Phase.WAITING_VRAM, _wait_vram),
    (Phase.BOOTING, _boot),
    (Phase.WARMING, _warm),
)


async def open_window(window: Window, rec: WindowRecord) -> None:
    """Take a new window from DRAINING to the edge of READY; raise on any failure."""
    op = Opening(window, rec)
    for phase, step in STEPS:
        await window.enter(rec, phase, required=True)
        await step(op)
