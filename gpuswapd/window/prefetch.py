"""The resident's model files in the page cache when it starts again: found, measured, read during the close.

Restoring the resident means llama.cpp reading its GGUF again: about 9 GB/s from the page cache,
about 1 GB/s from a Gen3 NVMe. A window's engine (its weights, a level-1 sleep's copy in host
RAM) pushes that file out of the page cache, so a close would pay the disk after the engine is
gone, with the card idle. Instead, a close that will restore the resident reads the files in the
background from its start, while the engine stops or sleeps and the VRAM comes free:

- **Found**: ``[resident] files``, else what the resident's units run (``modelfiles.py``, over
  D-Bus). What cannot be found (``-hf``, a missing or unreadable file) is logged once and skipped.
- **Measured**: the fraction of each file in the page cache (mincore, ``adapters/pagecache.py``),
  for ``plan``, the history and the ``gpuswapd_resident_cached_ratio`` metric.
- **Read**: only on a close that restores the resident (a switch or a preemption does not, and
  would only slow the next engine's load); nothing waits for it and it ends with the close; it is
  skipped when the host's MemAvailable, less what a level-1 park keeps in host RAM, cannot hold
  the files. The window's record keeps what it did (``prefetch``): the cached fraction before and
  after, the bytes read, how long it took and how it ended.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from gpuswapd import clock
from gpuswapd.adapters.pagecache import FileCache, Files, Measured, Progress
from gpuswapd.config import Config, ProfileKind
from gpuswapd.errors import GpuswapError
from gpuswapd.failpoints import failpoint
from gpuswapd.logs import log
from gpuswapd.outside import Outside
from gpuswapd.parts.modelfiles import model_files
from gpuswapd.protocol import JsonObject
from gpuswapd.record import ContainerHandle, WindowRecord
from gpuswapd.sizes import format_size
from gpuswapd.tasks import spawn

if TYPE_CHECKING:
    from gpuswapd.parts.resident import Resident
    from gpuswapd.window.context import Context


class ResidentFiles:
    """The resident's model files: where they are, how much of them is in RAM, and reading them in."""

    def __init__(self, config: Config, resident: Resident, files: Files | None, outside: Outside) -> None:
        self.config = config
        self.resident = resident
        self.files = files  # None: this gpuswapd does not look at the page cache
        self.outside = outside
        self.ratio: float | None = None  # the fraction in the page cache as last measured (the metric)
        self._told: set[str] = set()

    async def find(self, units: Sequence[str]) -> list[str]:
        """Name the resident's model files: ``[resident] files``, else what its units run."""
        if self.config.resident.files:
            return list(dict.fromkeys(self.config.resident.files))
        paths: list[str] = []
        for unit in units:
            commands = await self.outside.systemd.call("commands", self.resident.systemd.commands, unit)
            found = model_files(commands)
            for line in found.unresolved:
                self._once(line, line, next_step="name the files in [resident] files")
            paths += [p for p in found.paths if p not in paths]
        if not paths:
            self._once("no files", f"no model file found in what {', '.join(units)} run",
                       next_step="name them in [resident] files for plan and the prefetch to see them")
        return paths

    async def measure(self, paths: Sequence[str]) -> Measured:
        """Measure what of each file is in the page cache (and the host's available memory)."""
        assert self.files is not None
        measured = await self.outside.files.call("measure", self.files.measure, list(paths))
        kept = []
        for f in measured.files:
            if f.error == "no such file" and not self.config.resident.files:
                # Found in a command line but no file: a model's name (llama-swap's --model NAME, say).
                self._once(f"resident_file:{f.path}", f"{f.path}: no such file, so not a model file of the "
                           "resident (a name, or a path only the unit sees)",
                           next_step="name the files in [resident] files")
                continue
            if f.error is not None:
                self._once(f"resident_file:{f.path}", unreadable(f))
            kept.append(f)
        measured = Measured(tuple(kept), measured.mem_available)
        readable = [f for f in measured.files if f.error is None]
        if readable:
            self.ratio = _ratio(sum(f.cached for f in readable), sum(f.size for f in readable))
        return measured

    async def describe(self, units: Sequence[str]) -> JsonObject:
        """Say for ``plan`` which files the resident loads, each with its size and cached fraction."""
        if self.files is None:
            return {"files": [], "cached": None, "prefetch": False}
        measured = await self.measure(await self.find(units))
        rows = [{"path": f.path, "bytes": f.size, "size": format_size(f.size),
                 "cached": None if f.error else round(f.ratio, 4), "error": None if f.error is None else unreadable(f)}
                for f in measured.files]
        return {"files": rows, "cached": None if self.ratio is None else round(self.ratio, 4),
                "prefetch": self.config.resident.prefetch}

    def start(self, w: Context, rec: WindowRecord) -> asyncio.Task[None] | None:
        """Begin reading the files in the background, for a close that restores the resident (None: no need)."""
        if self.files is None or not self.config.resident.prefetch or not rec.units:
            return None
        return spawn(self._prefetch(w, rec), "resident-prefetch")

    async def _prefetch(self, w: Context, rec: WindowRecord) -> None:
        """Read what of the files is not in the page cache; record before and after in the window's record."""
        assert self.files is not None
        # The task took the driver's logging context when it was made: its phase moves on without it.
        structlog.contextvars.unbind_contextvars("phase")
        started = clock.monotonic()
        report: JsonObject = {"outcome": "finding"}
        rec.prefetch = report
        stop, progress, total = threading.Event(), Progress(), 0
        try:
            measured = await self.measure(await self.find(rec.units))
            files = [f for f in measured.files if f.error is None]
            total, cached = sum(f.size for f in files), sum(f.cached for f in files)
            rows: list[JsonObject] = [{"path": f.path, "bytes": f.size, "cached_before": round(f.ratio, 4)}
                                      for f in files]
            report.update(files=rows, bytes=total, cached_before=_ratio(cached, total), read_bytes=0)
            if not files or cached >= total:
                report.update(outcome="no_files" if not files else "cached", cached_after=report["cached_before"])
                return
            await failpoint("prefetch:measured")
            kept = parked_in_host_ram(w, rec, measured.mem_available)
            if measured.mem_available is not None and measured.mem_available - kept < total:
                report.update(outcome="skipped", reason=(
                    f"{format_size(total)} of model files do not fit in the host's available memory: "
                    f"{format_size(measured.mem_available)} available, {format_size(kept)} of it for the engine's "
                    "level-1 sleep"))
                log.warning("resident_prefetch_skipped", reason=report["reason"], files=[f.path for f in files],
                            phase=str(rec.phase))
                return
            report["outcome"] = "reading"
            progress.cached = cached
            # Only the files as measured are read (the memory check above counted them): a path that
            # names another file by now (a FIFO, a larger one) is skipped.
            progress.measured = {f.path: f.identity for f in files if f.identity is not None}
            try:
                await self.outside.files.call_within(self.config.resident.start_timeout, "prefetch",
                                                     self.files.prefetch, [f.path for f in files], stop, progress)
            finally:
                for why in progress.skipped:
                    self._once(f"prefetch:{why}", why, consequence="not read: it is not the file measured",
                               phase=str(rec.phase))
                if progress.skipped:
                    report["skipped"] = list(progress.skipped)
            after = await self.measure([f.path for f in files])
            done = {f.path: f for f in after.files if f.error is None}
            for row in rows:
                path = str(row["path"])
                row["cached_after"] = round(done[path].ratio, 4) if path in done else None
            report.update(outcome="done", cached_after=_ratio(sum(f.cached for f in done.values()), total),
                          read_bytes=progress.read)
            log.info("resident_prefetched", read=format_size(progress.read), cached_before=report["cached_before"],
                     cached_after=report["cached_after"], took_s=round(clock.monotonic() - started, 3),
                     phase=str(rec.phase))
        except asyncio.CancelledError:
            # The close ended first (or gpuswapd stops): what it read is counted, not measured again.
            report.update(outcome="cancelled", read_bytes=progress.read,
                          cached_after=_ratio(progress.cached, total) if total else None)
            raise
        except GpuswapError as err:
            report.update(outcome="failed", error=err.message, read_bytes=progress.read)
            log.warning("resident_prefetch_failed", error=err.message, phase=str(rec.phase))
        finally:
            stop.set()  # the worker sees it within one chunk
            report["took_s"] = round(clock.monotonic() - started, 3)

    def _once(self, key: str, message: str, **more: Any) -> None:
        """Log a file that cannot be had once for this gpuswapd, not at every close."""
        if key in self._told:
            return
        self._told.add(key)
        log.warning("resident_file_skipped", reason=message, **more)


def unreadable(f: FileCache) -> str:
    """Say why a file cannot be measured or read, and what to do about it."""
    if f.denied and not f.mode:
        return (f"{f.path}: gpuswapd may not reach it: a directory on its path is not searchable for root without "
                "CAP_DAC_OVERRIDE (as gpuswapd runs); let others search it (chmod o+x), or name a readable path")
    if f.denied:
        return (f"{f.path}: gpuswapd may not read it (mode {f.mode}, owner {f.owner}, group {f.group}; it runs as "
                "root without CAP_DAC_OVERRIDE): give it the file's group with a drop-in for gpuswapd.service "
                f"([Service] SupplementaryGroups={f.group}), or make the file readable to others (chmod o+r)")
    if f.error == "no such file":
        return (f"{f.path}: no such file (for gpuswapd: a path under /tmp or /home may be hidden by its unit's "
                "sandbox, PrivateTmp=yes; name the files in [resident] files, or give the unit ReadOnlyPaths=)")
    return f"{f.path}: {f.error}"


def parked_in_host_ram(w: Context, rec: WindowRecord, available: int | None) -> int:
    """Say what a level-1 park of this window's engine will keep in host RAM (0: it will not park at level 1).

    ``window.park.host_ram_needs`` when set (with less available, parking goes to level 2, which
    keeps nothing there); else the window's VRAM, of which the weights are most.
    """
    c = rec.container or ContainerHandle()
    if (rec.kind != ProfileKind.ENGINE or rec.error is not None or rec.baseline is not None or w.parked is not None
            or not c.sleep or c.removed or c.parked):
        return 0
    try:
        profile = w.config.profile(rec.profile)
    except KeyError:
        return 0
    park = profile.engine.park
    if park.mode != "sleep" or park.level != 1:
        return 0
    if park.host_ram_needs:
        return park.host_ram_needs if available is not None and available >= park.host_ram_needs else 0
    return profile.needs


def _ratio(part: int, whole: int) -> float:
    return 1.0 if whole <= 0 else round(min(1.0, part / whole), 4)
