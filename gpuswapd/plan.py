"""What a window would do now, checked against the live system, changing nothing."""

from __future__ import annotations

from typing import Any

from gpuswapd.blocking import blocking
from gpuswapd.config import Config
from gpuswapd.engine import Engine
from gpuswapd.errors import GpuswapError
from gpuswapd.resident import Resident
from gpuswapd.sizes import format_size
from gpuswapd.vram import Vram


async def make_plan(config: Config, resident: Resident, engine: Engine, vram: Vram) -> dict[str, Any]:
    """Describe the units, timers, container and VRAM a window would touch, and any blocker."""
    problems: list[str] = []

    async def attempt(what: str, coro: Any) -> Any:
        try:
            return await coro
        except GpuswapError as err:
            problems.append(f"{what}: {err.message}")
            return None

    units = await attempt("units", resident.closure())
    timers = await attempt("timers", resident.timers()) or []
    busy = await attempt("resident idle probe", resident.http.idle(config.resident.idle))
    await attempt("engine", engine.preflight())
    reading = await attempt("gpu", vram.read())
    c = config.window.container
    plan: dict[str, Any] = {
        "units": units or [],
        "configured_units": config.resident.units,
        "timers": [t.name for t in timers if t.active_state == "active"],
        "jobs_running": [t.service for t in timers if t.job_running],
        "resident_busy": busy.detail if busy is not None and busy.busy else None,
        "container": {"name": c.name, "image": c.image, "create": c.create,
                      "health_url": config.window.health_url},
        "vram": None,
        "problems": problems,
    }
    if reading is not None:
        # The memory of the units the window stops comes free: count it as available.
        freed = 0
        for proc in reading.processes:
            if await blocking(resident.systemd.unit_of_pid, proc.pid) in (units or []):
                freed += proc.used_bytes
        after = reading.free_bytes + freed
        plan["vram"] = {
            "total": format_size(reading.total_bytes), "free": format_size(reading.free_bytes),
            "free_after_stop": format_size(after), "window_needs": format_size(config.gpu.window_needs),
            "resident_needs": format_size(config.gpu.resident_needs),
        }
        if after < config.gpu.window_needs:
            problems.append(f"gpu: only {format_size(after)} would be free once the units stop, "
                            f"the window needs {format_size(config.gpu.window_needs)}")
    plan["ok"] = not problems
    return plan
