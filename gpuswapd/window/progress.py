"""How far the current phase has come, for systemd's STATUS= line: free VRAM, boot time, leases."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuswapd import clock
from gpuswapd.phases import Phase
from gpuswapd.record import WindowRecord, needs_less_residual

if TYPE_CHECKING:
    from gpuswapd.window.context import Context

GiB = 1024**3
TICK_S = 1.0  # how often the line is refreshed while a window is open


def progress(window: Context, rec: WindowRecord) -> str:
    """Say how far ``rec``'s phase has come, as a suffix of its name ("" when there is nothing to say)."""
    if rec.phase is Phase.WAITING_VRAM:
        reading = window.vram.last
        if reading is None:
            return ""
        return f" {reading.free_bytes / GiB:.1f}/{_vram_needed(window, rec) / GiB:.1f} GiB free"
    if rec.phase is Phase.BOOTING and rec.timings:
        took = clock.now() - rec.timings[-1].started_at
        engine = window.profile.window or window.config.window
        return f" {took:.0f}s of {engine.boot_timeout:.0f}s"
    if rec.phase is Phase.READY:
        held = len(rec.leases)
        return f", {held} lease{'' if held == 1 else 's'}"
    return ""


def _vram_needed(window: Context, rec: WindowRecord) -> int:
    """Return what this WAITING_VRAM waits for: the profile's needs less its parked residual, or the resident's."""
    if rec.closing:
        return window.resident_needs
    return needs_less_residual(window.profile.needs, rec.profile, window.parked)
