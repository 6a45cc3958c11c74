"""The resident comes back warm: llama.cpp's slots saved before the window, restored after it.

An agent's long context lives in a slot's KV cache; a window that stops llama-server throws it
away, and the agent's next turn prefills it all again. Where the resident is llama.cpp and its
server has a slot save path (``--slot-save-path DIR`` in its ExecStart=, a wrapper's arguments
too, or ``resident.cache.save_path``), gpuswapd keeps it:

- **Saved** in STOPPING_RESIDENT, before the stop: the timers are paused and their jobs done, the
  resident drained. Every slot whose cache holds tokens (its own ``/slots``, never through a
  proxy) is saved by the server to ``gpuswapd-ID-WINDOW-FINGERPRINT-slotN.bin`` in its save path,
  largest first, within ``resident.cache.save_timeout`` in all (what the cache may add to the
  opening), and within ``resident.cache.max_size`` and the disk's free room. A save that fails, is
  slow or finds no room is skipped with a warning and the window opens as it would have.
- **Restored** in RESTORING, after the verify and before anything else reaches the resident (the
  timers resume in the next phase; the front door holds resident requests until the window is
  IDLE): each file into its slot, once the resident is the one that saved it. The fingerprint is
  the model file's path, size, mtime and inode, and the baseline's context per slot and slot
  count: another model or context skips the restore. The verify's completion is asked in a slot
  that no file fills. A restore that fails leaves the resident serving cold: never DEGRADED.
- **Removed**: gpuswapd's files are removed once restored or skipped, when the window ends
  however it ends (after the timers are resumed), and before each save (stale ones of a gpuswapd
  that stopped mid-window). The save directory is written by llama-server as the resident's
  user; gpuswapd removes its files through the directory's group (``ReadWritePaths=`` in
  gpuswapd.service names ``/var/cache/gpuswapd/slots``, which tmpfiles.d makes
  ``2770 root:gpuswap``).

The window's record keeps what happened (``cache``): slots, tokens, bytes and seconds of the save
and of the restore, or why it was skipped. ``gpuswapd_resident_prefill_tokens_saved_total``
counts the tokens restored, which the agents need not prefill again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import TYPE_CHECKING, Any

from gpuswapd import clock
from gpuswapd.config import Config
from gpuswapd.errors import GpuswapError
from gpuswapd.logs import log
from gpuswapd.parts.modelfiles import slot_save_path
from gpuswapd.protocol import JsonObject
from gpuswapd.record import WindowRecord
from gpuswapd.sizes import format_size

if TYPE_CHECKING:
    from gpuswapd.parts.resident import Resident
    from gpuswapd.window.context import Context, Services

LOOK_S = 5.0  # the deadline of a look (/props, /slots, a stat) when no other bounds it
ROOM_MARGIN = 64 * 1024**2  # left free on the save directory's disk


def prefix(w: Services) -> str:
    """Name the start of this gpuswapd's file names (an instance of its own per state directory)."""
    tag = hashlib.sha256(w.config.daemon.state_dir.encode()).hexdigest()[:6]
    return f"gpuswapd-{tag}-"


async def save_dir(config: Config, resident: Resident) -> str | None:
    """Find the resident's slot save path: ``resident.cache.save_path``, else its units' ExecStart=."""
    cfg = config.resident
    if cfg.cache.save_path:
        return cfg.cache.save_path
    for unit in cfg.units:
        commands = await resident.outside.systemd.call("commands", resident.systemd.commands, unit)
        found = slot_save_path(commands)
        if found is not None:
            return found
    return None


def wanted(config: Config) -> str | None:
    """Say why the cache is not kept by configuration (None: it is, where a save path is found)."""
    cfg = config.resident
    if cfg.cache.keep == "off":
        return "resident.cache.keep = \"off\""
    if cfg.server != "llama.cpp":
        return "the resident is not llama.cpp (resident.server)"
    if not cfg.slots_url:
        return "no slots URL (resident.cache.slots_url, or resident.props_url ending in /props)"
    return None


async def describe(config: Config, resident: Resident) -> JsonObject:
    """Say for ``plan`` whether the resident's cache will be kept, and what it costs."""
    why = wanted(config)
    cfg = config.resident.cache
    where = None
    if why is None:
        try:
            where = await save_dir(config, resident)
        except GpuswapError as err:
            where, why = None, f"the resident's ExecStart= could not be read: {err.message}"
        if where is None and why is None:
            why = "llama-server has no --slot-save-path (nor resident.cache.save_path)"
    if why is not None:
        return {"kept": False, "why": why}
    out: JsonObject = {"kept": True, "dir": where, "save_timeout_s": cfg.save_timeout, "max_bytes": cfg.max_size}
    try:
        slots = [s for s in await resident.slots(LOOK_S) if s.tokens > 0]
        out.update(slots=len(slots), tokens=sum(s.tokens for s in slots))
        per = resident.kv_per_token
        if per is not None:
            out["bytes"] = per * sum(s.tokens for s in slots)
    except GpuswapError as err:
        out["slots_error"] = err.message
    out["cost"] = (f"up to {cfg.save_timeout:g}s more before the resident stops (the save), and the restore's "
                   "read after its verify")
    return out


def _fingerprint(model: str, size: int, mtime_ns: int, inode: int, n_ctx: int, slots: int) -> tuple[str, str]:
    """Return the resident's fingerprint (short, for file names) and what it is made of."""
    what = f"{model}:{size}:{mtime_ns}:{inode}:ctx={n_ctx}:slots={slots}"
    return hashlib.sha256(what.encode()).hexdigest()[:12], what


async def _identity(w: Context) -> tuple[str, str, int]:
    """Read what the resident is now: its fingerprint, what it is made of, and its slot count."""
    props, _ = await w.resident.what_it_is()
    if props is None or props.model_path is None:
        raise _Skip("llama-server's /props names no model file, so no fingerprint can be taken")
    f = await w.resident.model_identity(props.model_path)
    short, what = _fingerprint(f.path, f.size, f.mtime_ns, f.inode, props.n_ctx, props.slots)
    return short, what, props.slots


class _Skip(Exception):
    """The cache is not saved or restored, for a reason a person can read."""

    def __init__(self, reason: str, outcome: str = "skipped") -> None:
        super().__init__(reason)
        self.reason = reason
        self.outcome = outcome


# -- before the stop ----------------------------------------------------------------------------------


async def save(w: Context, rec: WindowRecord) -> None:
    """Save the resident's slots before it stops, within the save's deadline; never fail the window."""
    if wanted(w.config) is not None or not rec.units:
        return
    cfg = w.config.resident.cache
    started = clock.monotonic()
    report: JsonObject = {"outcome": "saving", "files": []}
    try:
        async with asyncio.timeout(cfg.save_timeout):
            await _save(w, rec, report)
    except TimeoutError:
        report.update(outcome="timeout", reason=f"the save took longer than resident.cache.save_timeout = "
                      f"{cfg.save_timeout:g}s")
    except _Skip as skip:
        report.update(outcome=skip.outcome, reason=skip.reason)
    except GpuswapError as err:
        report.update(outcome="failed", reason=err.message)
    finally:
        report["save_s"] = round(clock.monotonic() - started, 3)
        if report.get("dir") is not None or report["outcome"] == "saved":
            rec.cache = report
    if report["outcome"] not in ("saved", "empty", "off"):
        log.warning("resident_cache_not_saved", outcome=report["outcome"], reason=report.get("reason"),
                    consequence="the resident comes back cold after this window")
        report["files"] = []  # nothing to restore; the files are removed once the resident is down
    elif report["outcome"] == "saved":
        log.info("resident_cache_saved", slots=len(_files(report)), tokens=report["tokens"],
                 bytes=format_size(_n(report.get("bytes"))), took_s=report["save_s"])


async def _save(w: Context, rec: WindowRecord, report: JsonObject) -> None:
    where = await save_dir(w.config, w.resident)
    if where is None:
        if w.config.resident.cache.keep == "on":
            raise _Skip("llama-server has no --slot-save-path and resident.cache.save_path is not set")
        report["outcome"] = "off"
        return
    report["dir"] = where
    mine = prefix(w)
    stale = await w.resident.slot_listing(where, mine)
    if stale:
        try:
            await w.resident.remove_slot_files(where, sorted(stale))
        except GpuswapError as err:  # the room they take is counted below, as the disk's
            log.warning("resident_cache_files_left", dir=where, error=err.message, consequence="tried again next time")
    short, what, total = await _identity(w)
    report.update(fingerprint=short, resident=what, slots_total=total)
    slots = sorted((s for s in await w.resident.slots(LOOK_S) if s.tokens > 0), key=lambda s: -s.tokens)
    if not slots:
        report.update(outcome="empty", tokens=0, bytes=0)
        return
    limit = w.config.resident.cache.max_size
    free = await w.resident.slot_free(where) - ROOM_MARGIN
    files: list[JsonObject] = report["files"]  # type: ignore[assignment]
    used, skipped = 0, []
    for s in slots:
        per = w.resident.kv_per_token
        guess = per * s.tokens if per is not None else 0
        room = min(limit - used, free - used)
        if guess > room:
            skipped.append(f"slot {s.id} ({s.tokens} tokens, about {format_size(guess)}): "
                           + ("no room on the disk" if free - used < limit - used else
                              f"over resident.cache.max_size = {format_size(limit)}"))
            continue
        name = f"{mine}{rec.id}-{short}-slot{s.id}.bin"
        files.append({"slot": s.id, "file": name, "tokens": s.tokens, "bytes": None})  # named before it is written
        try:
            got = await w.resident.save_slot(s.id, name, w.config.resident.cache.save_timeout)
        except GpuswapError as err:
            files.pop()
            skipped.append(f"slot {s.id}: {err.message} ({format_size(max(0, free - used))} free on the disk)")
            continue
        if got.tokens > 0:
            w.resident.kv_per_token = max(1, got.bytes // got.tokens)
        if got.bytes > room:
            files.pop()
            await w.resident.remove_slot_files(where, [name])
            skipped.append(f"slot {s.id} ({format_size(got.bytes)}): "
                           + ("no room on the disk" if free - used < limit - used else
                              f"over resident.cache.max_size = {format_size(limit)}"))
            continue
        files[-1].update(tokens=got.tokens, bytes=got.bytes, ms=round(got.ms, 1))
        used += got.bytes
    report.update(outcome="saved" if files else "skipped", tokens=sum(_n(f.get("tokens")) for f in files),
                  bytes=used)
    if skipped:
        report["skipped"] = skipped
        log.warning("resident_cache_slots_skipped", slots=skipped)
    if not files:
        raise _Skip("; ".join(skipped))


def _n(value: object) -> int:
    """Read a count of the record (0 if it is none)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _files(report: JsonObject | None) -> list[JsonObject]:
    files = (report or {}).get("files")
    return [f for f in files if isinstance(f, dict)] if isinstance(files, list) else []


async def after_stop(w: Context, rec: WindowRecord) -> None:
    """Once the resident is down, remove whatever of its files a failed or slow save left."""
    report = rec.cache
    if report is None or report.get("outcome") == "saved" or not isinstance(report.get("dir"), str):
        return
    await _remove_all(w, rec, report)


# -- after the verify ----------------------------------------------------------------------------------


def verify_slot(rec: WindowRecord) -> int | None:
    """Name a slot the verify may answer in that no restore fills (None: any; every slot has a file)."""
    report = rec.cache
    files = _files(report)
    if not files or report is None or "restore" in report:
        return None
    total = report.get("slots_total")
    taken = {f.get("slot") for f in files}
    if not isinstance(total, int):
        return None
    return next((i for i in range(total) if i not in taken), None)


async def restore(w: Context, rec: WindowRecord) -> None:
    """Restore the saved slots into the resident just verified; never fail the close (discard removes the files)."""
    report = rec.cache
    if report is None or "restore" in report or not _files(report):
        return
    started = clock.monotonic()
    result: dict[str, Any] = {"outcome": "restoring", "slots": [], "tokens": 0, "bytes": 0}
    report["restore"] = result
    try:
        async with asyncio.timeout(w.config.resident.cache.save_timeout):
            await _restore(w, report, result)
        result["outcome"] = "restored"
    except TimeoutError:
        result.update(outcome="timeout", reason=f"the restore took longer than resident.cache.save_timeout = "
                      f"{w.config.resident.cache.save_timeout:g}s")
    except _Skip as skip:
        result.update(outcome=skip.outcome, reason=skip.reason)
    except GpuswapError as err:
        result.update(outcome="failed", reason=err.message)
    finally:
        result["restore_s"] = round(clock.monotonic() - started, 3)
    if result["outcome"] == "restored":
        log.info("resident_cache_restored", slots=len(result["slots"]), tokens=result["tokens"],
                 bytes=format_size(result["bytes"]), took_s=result["restore_s"])
    else:
        log.warning("resident_cache_not_restored", outcome=result["outcome"], reason=result.get("reason"),
                    consequence="the resident serves, cold: its slots prefill again")
    # The files are removed at the window's end (discard), after the timers: a removal that hangs on
    # the disk must not keep them paused while the resident it verified may have gone again.


async def _restore(w: Context, report: JsonObject, result: dict[str, Any]) -> None:
    short, what, _ = await _identity(w)
    if short != report.get("fingerprint"):
        raise _Skip(f"the resident is not the one that saved its slots: it was {report.get('resident')}, it is "
                    f"{what}", outcome="mismatch")
    for f in _files(report):
        slot, name = _n(f.get("slot")), str(f.get("file"))
        got = await w.resident.restore_slot(slot, name, w.config.resident.cache.save_timeout)
        result["slots"].append({"slot": slot, "tokens": got.tokens, "bytes": got.bytes, "ms": round(got.ms, 1)})
        result["tokens"] += got.tokens
        result["bytes"] += got.bytes


async def _remove_all(w: Context, rec: WindowRecord, report: JsonObject) -> None:
    """Remove this window's files from the save directory (what it named, and any other of its own)."""
    where = report.get("dir")
    if not isinstance(where, str):
        return
    try:
        names = set(await w.resident.slot_listing(where, f"{prefix(w)}{rec.id}-"))
        names |= {str(f["file"]) for f in _files(report)}
        if names:
            await w.resident.remove_slot_files(where, sorted(names))
        report["removed"] = True
    except GpuswapError as err:
        report["removed"] = False
        log.warning("resident_cache_files_left", dir=where, error=err.message,
                    consequence="removed before the next save")


async def discard(w: Context, rec: WindowRecord) -> None:
    """At the window's end, remove any of its files still there (a close that never restored them)."""
    report = rec.cache
    if report is None and rec.baseline is not None and rec.units and wanted(w.config) is None:
        # No state was read: whatever a window left in the save directory is nobody's now.
        await _sweep(w)
    if report is None or report.get("removed") is True:
        return
    await _remove_all(w, rec, report)
    if report.get("removed") is False:
        await _settled(w)
        await _remove_all(w, rec, report)


async def _settled(w: Context) -> None:
    """Wait, up to the lane's deadline, until the disk's calls that outlived theirs have returned."""
    lane = w.outside.files
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(lane.deadline):
            await lane.drained()


async def _sweep(w: Context) -> None:
    """Remove every file of this gpuswapd from the save directory (tried twice: a call may fail once)."""
    for attempt in (1, 2):
        try:
            where = await save_dir(w.config, w.resident)
            if where is None:
                return
            names = await w.resident.slot_listing(where, prefix(w))
            if names:
                await w.resident.remove_slot_files(where, sorted(names))
                log.info("resident_cache_files_removed", dir=where, files=len(names), why="no window owns them")
            return
        except GpuswapError as err:
            if attempt == 2:
                log.warning("resident_cache_files_left", error=err.message,
                            consequence="removed before the next save")
            else:
                await _settled(w)
