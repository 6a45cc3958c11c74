"""What a window would do now, checked against the live system, changing nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
from gpuswapd.window import warm
from gpuswapd.window.prefetch import ResidentFiles


@dataclass(frozen=True)
class PlanContainer:
    """The container a window of the profile would run."""

    name: str
    image: str
    create: bool
    health_url: str

    def to_dict(self) -> dict[str, Any]:
        """Serialize for ``plan``."""
        return {"name": self.name, "image": self.image, "create": self.create, "health_url": self.health_url}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanContainer:
        """Rebuild from ``to_dict`` output."""
        return cls(str(data.get("name")), str(data.get("image")), bool(data.get("create")),
                   str(data.get("health_url")))


@dataclass(frozen=True)
class HeldBy:
    """A process that holds memory on the card and stays when the resident stops."""

    pid: int
    bytes: int
    unit: str | None

    def to_dict(self) -> dict[str, Any]:
        """Serialize for ``plan``."""
        return {"pid": self.pid, "bytes": self.bytes, "unit": self.unit}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeldBy:
        """Rebuild from ``to_dict`` output."""
        unit = data.get("unit")
        return cls(int(data.get("pid") or 0), int(data.get("bytes") or 0), unit if isinstance(unit, str) else None)


@dataclass(frozen=True)
class PlanVram:
    """The card now, and what would be free once the resident's units stop (sizes as people read them)."""

    total: str
    free: str
    free_after_stop: str
    window_needs: str
    resident_needs: str
    held_by_others: tuple[HeldBy, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Serialize for ``plan``."""
        return {"total": self.total, "free": self.free, "free_after_stop": self.free_after_stop,
                "window_needs": self.window_needs, "resident_needs": self.resident_needs,
                "held_by_others": [h.to_dict() for h in self.held_by_others]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanVram:
        """Rebuild from ``to_dict`` output."""
        held = data.get("held_by_others")
        return cls(str(data.get("total")), str(data.get("free")), str(data.get("free_after_stop")),
                   str(data.get("window_needs")), str(data.get("resident_needs")),
                   held_by_others=tuple(HeldBy.from_dict(h) for h in held if isinstance(h, dict))
                   if isinstance(held, list) else ())


@dataclass(frozen=True)
class Plan:
    """What a window of one profile would do now (``gpuswapctl plan``), and what would stop it.

    ``resident_files`` is the resident files' report (``ResidentFiles.describe``), ``settings``
    the boot checks' (``ProfileCheck.to_dict``): documents of their own, passed through.
    """

    profile: str
    kind: str
    units: tuple[str, ...]
    configured_units: tuple[str, ...]
    timers: tuple[str, ...]
    jobs_running: tuple[str, ...]
    resident_busy: str | None
    container: PlanContainer | None
    vram: PlanVram | None
    next_open: str
    parked: str | None
    resident_files: Mapping[str, object] | None = None
    resident_cache: Mapping[str, object] | None = None  # whether the resident's slots are kept (warm.describe)
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    settings: Mapping[str, object] | None = field(default=None)

    @property
    def ok(self) -> bool:
        """Tell whether nothing would stop the window."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """Serialize for the socket (``plan``)."""
        return {
            "profile": self.profile, "kind": self.kind, "units": list(self.units),
            "configured_units": list(self.configured_units), "timers": list(self.timers),
            "jobs_running": list(self.jobs_running), "resident_busy": self.resident_busy,
            "container": None if self.container is None else self.container.to_dict(),
            "vram": None if self.vram is None else self.vram.to_dict(),
            "next_open": self.next_open, "parked": self.parked,
            "resident_files": None if self.resident_files is None else dict(self.resident_files),
            "resident_cache": None if self.resident_cache is None else dict(self.resident_cache),
            "problems": list(self.problems), "warnings": list(self.warnings),
            "settings": None if self.settings is None else dict(self.settings), "ok": self.ok,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild from ``to_dict`` output (``ok`` follows from the problems)."""

        def texts(key: str) -> tuple[str, ...]:
            value = data.get(key)
            return tuple(str(v) for v in value) if isinstance(value, list) else ()

        def text(key: str) -> str | None:
            value = data.get(key)
            return value if isinstance(value, str) else None

        def table(key: str) -> Mapping[str, object] | None:
            value = data.get(key)
            return value if isinstance(value, dict) else None

        container, vram = table("container"), table("vram")
        return cls(profile=str(data.get("profile") or DEFAULT_PROFILE), kind=str(data.get("kind") or "engine"),
                   units=texts("units"), configured_units=texts("configured_units"), timers=texts("timers"),
                   jobs_running=texts("jobs_running"), resident_busy=text("resident_busy"),
                   container=None if container is None else PlanContainer.from_dict(container),
                   vram=None if vram is None else PlanVram.from_dict(vram),
                   next_open=str(data.get("next_open") or "cold"), parked=text("parked"),
                   resident_files=table("resident_files"), resident_cache=table("resident_cache"),
                   problems=texts("problems"), warnings=texts("warnings"),
                   settings=table("settings"))


async def make_plan(config: Config, resident: Resident, engine: Engine, vram: Vram,
                    parked: Parked | None = None, profile: Profile | None = None,
                    known_bad: Table | None = None, files: ResidentFiles | None = None) -> Plan:
    """Describe the units, timers, container and VRAM a window of ``profile`` would touch, and any blocker.

    ``warnings`` say what would not block the window but costs or risks something: a container that
    keeps no compile cache, a known-bad setting. ``resident_files`` lists the resident's model files
    with the fraction of each in the page cache now.
    """
    profile = profile or config.profile(DEFAULT_PROFILE)
    problems: list[str] = []
    start, need, parked_note = "cold", profile.needs, None
    if parked is not None and parked.profile != profile.name:
        parked_note = (f"{parked.container.name} of profile {parked.profile!r} asleep: it stays parked if "
                       "this window fits beside it, else the window removes it first")
    elif parked is not None:
        why = await engine.why_not_parked(parked.container)
        if why is None:
            start, need = "warm", needs_less_residual(need, profile.name, parked)
            parked_note = f"{parked.container.name} asleep (level {parked.level}): the next window wakes it"
        else:
            parked_note = f"{parked.container.name} cannot be woken ({why}): the next window removes it"

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
    cache = await warm.describe(config, resident)
    warnings: list[str] = []
    settings = None
    view = await engine.settings() if profile.window is not None else None
    if view is not None:
        found = bootchecks.check(profile, view, known_bad or Table())
        warnings, settings = found.warnings(), found.to_dict()
        problems.extend(found.refusals())
    plan_vram = None
    if reading is not None:
        # The same prediction that refuses an acquire: the units' memory comes free, the rest stays.
        fit = await predict_fit(vram, reading, units or [])
        plan_vram = PlanVram(
            total=format_size(reading.total_bytes), free=format_size(reading.free_bytes),
            free_after_stop=format_size(fit.free_after_stop), window_needs=format_size(need),
            resident_needs=format_size(config.gpu.resident_needs),
            held_by_others=tuple(HeldBy(h.pid, h.used_bytes, h.unit) for h in fit.others),
        )
        if not fit.fits(need):
            problems.append(f"gpu: {fit.misfit(need, units or [])}")
        elif fit.free_after_stop < need:
            problems.append(f"gpu: only {format_size(fit.free_after_stop)} would be free once the units stop, "
                            f"the window needs {format_size(need)}")
    return Plan(
        profile=profile.name,
        kind=profile.kind,
        units=tuple(units or []),
        configured_units=tuple(config.resident.units),
        timers=tuple(t.name for t in timers if t.active_state == "active"),
        jobs_running=tuple(t.service for t in timers if t.job_running),
        resident_busy=busy.detail if busy is not None and busy.busy else None,
        container=None if profile.window is None else PlanContainer(
            name=profile.window.container.name, image=profile.window.container.image,
            create=profile.window.container.create, health_url=profile.window.health_url),
        vram=plan_vram,
        next_open=start,
        parked=parked_note,
        resident_files=model,
        resident_cache=cache,
        problems=tuple(problems),
        warnings=tuple(warnings),
        settings=settings,
    )
