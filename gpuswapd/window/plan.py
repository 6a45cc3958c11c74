"""What a window would do now, checked against the live system, changing nothing."""

from __future__ import annotations

from typing import Any

from gpuswapd.checks import bootchecks
from gpuswapd.checks.knownbad import Table
from gpuswapd.config import DEFAULT_PROFILE, Config, Profile
from gpuswapd.errors import GpuswapError
from gpuswapd.parts.engine import Engine
from gpuswapd.parts.resident import Resident
from gpuswapd.parts.vram import Vram, predict_fit
from gpuswapd.record import Parked, needs_less_residual
from gpuswapd.sizes import format_size
from gpuswapd.window.prefetch import ResidentFiles


async def make_plan(config: Config, resident: Resident, engine: Engine, vram: Vram,
                    parked: Parked | None = None, profile: Profile | None = None,
                    known_bad: Table | None = None, files: ResidentFiles | None = None) -> dict[str, Any]:
    """Describe the units, timers, container and VRAM a window of ``profile`` would touch, and any blocker.

    ``warnings`` say what would not block the window but costs or risks something: a container that
    keeps no compile cache, a known-bad setting. ``resident_files`` lists the resident's model files
    with the fraction of each in the page cache now.
    """
    profile = profile or config.profile(DEFAULT_PROFILE)
    problems: list[str] = []
    start, need, parked_note = "cold", profile.needs, None
    if parked is not None and parked.profile != profile.name:
        parked_note = (f"{parked.container.get('name')} of profile {parked.profile!r} asleep: it stays parked if "
                       "this window fits beside it, else the window removes it first")
    elif parked is not None:
        why = await engine.why_not_parked(parked.container)
        if why is None:
            start, need = "warm", needs_less_residual(need, profile.name, parked)
            parked_note = f"{parked.container.get('name')} asleep (level {parked.level}): the next window wakes it"
        else:
            parked_note = f"{parked.container.get('name')} cannot be woken ({why}): the next window removes it"

    async def attempt(what: str, coro: Any) -> Any:
        try:
            return await coro
        except GpuswapError as err:
            problems.append(f"{what}: {err.message}")
            return None

    units = await attempt("units", resident.closure())
    timers = await attempt("timers", resident.timers()) or []
    idle = resident.outside.http.run("idle", resident.http.idle(config.idle_probe()))
    busy = await attempt("resident idle probe", idle)
    if start == "cold":
        await attempt("engine", engine.preflight())
    reading = await attempt("gpu", vram.read())
    # What the resident loads when it comes back, and how much of it is in RAM now.
    model = await attempt("resident files", files.describe(units or config.resident.units)) if files else None
    warnings: list[str] = []
    settings = None
    view = await engine.settings() if profile.window is not None else None
    if view is not None:
        found = bootchecks.check(profile, view, known_bad or Table())
        warnings, settings = found.warnings(), found.to_dict()
        problems.extend(found.refusals())
    plan: dict[str, Any] = {
        "profile": profile.name,
        "kind": profile.kind,
        "units": units or [],
        "configured_units": config.resident.units,
        "timers": [t.name for t in timers if t.active_state == "active"],
        "jobs_running": [t.service for t in timers if t.job_running],
        "resident_busy": busy.detail if busy is not None and busy.busy else None,
        "container": None if profile.window is None else {
            "name": profile.window.container.name, "image": profile.window.container.image,
            "create": profile.window.container.create, "health_url": profile.window.health_url},
        "vram": None,
        "next_open": start,
        "parked": parked_note,
        "resident_files": model,
        "problems": problems,
        "warnings": warnings,
        "settings": settings,
    }
    if reading is not None:
        # The same prediction that refuses an acquire: the units' memory comes free, the rest stays.
        fit = await predict_fit(vram, reading, units or [])
        plan["vram"] = {
            "total": format_size(reading.total_bytes), "free": format_size(reading.free_bytes),
            "free_after_stop": format_size(fit.free_after_stop), "window_needs": format_size(need),
            "resident_needs": format_size(config.gpu.resident_needs),
            "held_by_others": [{"pid": h.pid, "bytes": h.used_bytes, "unit": h.unit} for h in fit.others],
        }
        if not fit.fits(need):
            problems.append(f"gpu: {fit.misfit(need, units or [])}")
        elif fit.free_after_stop < need:
            problems.append(f"gpu: only {format_size(fit.free_after_stop)} would be free once the units stop, "
                            f"the window needs {format_size(need)}")
    plan["ok"] = not problems
    return plan
