"""The resident side of the GPU: its units, their dependents, the agent timers, and proof it serves."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from typing import TYPE_CHECKING

from gpuswapd import clock
from gpuswapd.adapters.jobs import run_jobs
from gpuswapd.adapters.openai import ModelHttp
from gpuswapd.adapters.props import ServerProps
from gpuswapd.adapters.slots import FileIdentity, Slot, SlotDir, SlotFile, SlotFiles
from gpuswapd.adapters.unitstates import TimerState, UnitState
from gpuswapd.config import Config
from gpuswapd.errors import (
    EndpointError,
    EndpointUnreachable,
    GpuswapError,
    ResidentBusy,
    RestoreFailed,
    StateError,
    VerifyFailed,
)
from gpuswapd.logs import log
from gpuswapd.outside import Outside
from gpuswapd.state.marks import Marks

POLL_S = 0.25
PROPS_TIMEOUT_S = 10.0

if TYPE_CHECKING:  # the D-Bus adapter needs PyGObject, which tests of the logic do without
    from gpuswapd.adapters.systemd import Systemd


class Resident:
    """Stops and restores the resident units and pauses and resumes the agent timers."""

    def __init__(self, config: Config, systemd: Systemd, http: ModelHttp, outside: Outside,
                 slot_files: SlotFiles | None = None, marks: Marks | None = None,
                 starting: Marks | None = None) -> None:
        self.config = config
        self.systemd = systemd
        self.http = http
        self.outside = outside
        # What gpuswapd stopped, kept apart from the state document (state/marks.py); None: in memory.
        self.marks = marks if marks is not None else Marks(None)
        # The starts of its restores under way, until each ends (state/marks.py): a unit that failed
        # after it came up under one of them is a restore's start that did not last, not its operator's.
        self.starting = starting if starting is not None else Marks(None)
        self.slot_files: SlotFiles = slot_files if slot_files is not None else SlotDir()
        self.kv_per_token: int | None = None  # bytes a slot's file takes per token, as last saved
        self.jobs_running = 0  # start and stop jobs gpuswapd has queued and not yet seen end
        self.stops_hung = 0  # its own stops of units (own=True) whose job call outlived its deadline
        # Started again, but their marks could not be removed (the state directory hung): removed
        # once it answers, before a later start could read them as a stop of gpuswapd's.
        self.unmark_pending: set[str] = set()
        self.start_ended_pending: set[str] = set()  # restores ended whose start records could not be removed

    async def drain(self) -> None:
        """Wait up to ``resident.idle.wait`` for in-flight requests to end; fail or proceed."""
        idle = self.config.idle_probe()
        deadline = clock.monotonic() + idle.wait
        while True:
            try:
                busy = await self.outside.http.run("idle", self.http.idle(idle, draining=True))
            except EndpointUnreachable as err:
                # Nothing listens: nothing is in flight (the resident may be down already). A probe
                # that answers wrongly is another matter: that fails the window below.
                log.info("resident_idle_probe_unanswered", error=err.message)
                return
            except EndpointError as err:
                raise ResidentBusy(f"cannot tell whether the resident is idle: {err.message}; fix "
                                   "[resident.idle] or set kind = \"none\"") from err
            if not busy.busy:
                return
            if clock.monotonic() >= deadline:
                units = ", ".join(self.config.resident.units)
                message = f"resident {units} is busy: {busy.detail} (waited {idle.wait:g}s)"
                if idle.on_busy == "fail":
                    raise ResidentBusy(message + "; try again later or set resident.idle.on_busy = \"proceed\"")
                log.warning("resident_busy_proceeding", detail=busy.detail)
                return
            await asyncio.sleep(POLL_S)

    async def timers(self) -> list[TimerState]:
        """List the timers matching ``timers.pause``."""
        return await self.outside.systemd.call("timers", self.systemd.timers, self.config.timers.pause)

    async def wait_jobs(self, timers: list[TimerState], deadline: float) -> None:
        """Wait until no service of these timers runs, up to a monotonic deadline."""
        names = {t.name for t in timers}
        while running := [t.service for t in timers if t.job_running]:
            if clock.monotonic() >= deadline:
                raise ResidentBusy(
                    f"agent jobs still running after {self.config.timers.wait_for_jobs:g}s: "
                    f"{', '.join(running)}; they use the resident, so the window waits for them "
                    "(raise timers.wait_for_jobs or stop them)"
                )
            await asyncio.sleep(POLL_S)
            timers = [t for t in await self.timers() if t.name in names]

    async def pause(self, timers: list[str]) -> None:
        """Stop the timers, recorded first as gpuswapd's own stop (their running services are left alone)."""
        if timers:
            await self.mark(timers)
            await self._jobs("StopUnit", timers, self.config.resident.stop_timeout, "stop")
            log.info("timers_paused", timers=timers)

    async def resume(self, timers: list[str]) -> None:
        """Start the timers again (all of them, even if one fails); then forget gpuswapd stopped them."""
        if not timers:
            return
        try:
            await self._jobs("StartUnit", timers, self.config.resident.start_timeout, "start")
        except GpuswapError as err:
            log.error("timers_resume_failed", error=err.message)
            raise RestoreFailed(f"could not start timers again: {err.message}") from err
        log.info("timers_resumed", timers=timers)
        if self.start_ended_pending:
            await self.start_ended(sorted(self.start_ended_pending))
        if self.start_ended_pending:
            # The restore's start records stay (the state directory fails): so do the timers'
            # marks, which tell a later start that this restore ended. Both go once it answers.
            self.unmark_pending |= set(timers)
            return
        await self.unmark(timers)

    # -- what gpuswapd stopped (state/marks.py): the only units and timers it ever starts ------------

    async def mark(self, names: list[str]) -> None:
        """Record, before the stop, that gpuswapd stops these units or timers (a failure stops nothing)."""
        try:
            await self.outside.state.call("mark", self.marks.add, list(names))
        except (GpuswapError, OSError) as err:
            # Nothing is stopped; a mark that still lands (a hung call) would claim a stop never made:
            # it is removed once the state directory answers, like any mark left behind.
            self.unmark_pending |= set(names)
            if isinstance(err, GpuswapError):
                raise
            raise StateError(f"cannot record what gpuswapd stops: {err.strerror or err}; nothing was stopped") from err
        self.unmark_pending -= set(names)  # stopped again: these marks are current

    async def unmark(self, names: list[str]) -> None:
        """Forget that gpuswapd stopped these: they run again. A failure is noted, not raised."""
        try:
            await self.outside.state.call("unmark", self.marks.remove, list(names))
        except (GpuswapError, OSError) as err:
            first = not set(names) <= self.unmark_pending
            self.unmark_pending |= set(names)
            if first:
                log.warning("stopped_record_not_cleared", names=names,
                            error=getattr(err, "message", None) or str(err),
                            consequence="removed once the state directory answers; a start of gpuswapd before "
                                        "then may start them again")
            return
        self.unmark_pending -= set(names)

    async def start_ended(self, units: list[str]) -> None:
        """Forget the starts of a restore that ended (verified, or left to the resident's operator).

        A record that stays (the state directory failed) is tried again before the paused
        timers' marks are removed, and while idle: a later start reads a record left with no
        paused timer running since as a restore that never ended.
        """
        try:
            await self.outside.state.call("unmark", self.starting.remove, list(units))
        except (GpuswapError, OSError):
            self.start_ended_pending |= set(units)  # tried again before the timers' marks go, and when idle
            return
        self.start_ended_pending -= set(units)

    async def forget_ended_starts(self) -> None:
        """Remove every restore's start record left behind: a window opens only once the last close ended.

        A record whose removal failed (a hung state directory, then a restart that forgot it was
        owed) would otherwise outlive the timers' marks that tell of its restore's end, and a later
        start would read a crash or its operator's stop as that restore's own start that did not
        last. Raises StateError when they cannot be read or removed: the window stops nothing then,
        as when its own marks cannot be written.
        """
        left = await self.started_at()
        if not left:
            self.start_ended_pending.clear()
            return
        try:
            await self.outside.state.call("unmark", self.starting.remove, sorted(left))
        except OSError as err:
            raise StateError(f"cannot clear the starts gpuswapd recorded: {err.strerror or err}; "
                             "nothing was stopped") from err
        self.start_ended_pending.clear()

    async def started_at(self) -> dict[str, float | None]:
        """Map each unit whose restore's start is under way to the CLOCK_MONOTONIC second it was issued."""
        try:
            return await self.outside.state.call("read_marks", self.starting.read_times)
        except OSError as err:
            raise StateError(f"cannot read the starts gpuswapd issued: {err.strerror or err}") from err

    async def retry_unmark(self) -> None:
        """Remove the marks a hung state directory kept (no window open: none of them is current)."""
        # The start records first: a paused timer's mark, gone, would no longer tell of a restore that ended.
        if self.start_ended_pending:
            await self.start_ended(sorted(self.start_ended_pending))
        if self.unmark_pending and not self.start_ended_pending:
            await self.unmark(sorted(self.unmark_pending))

    async def marked_at(self) -> dict[str, float | None]:
        """Map each name gpuswapd marked stopped to the CLOCK_MONOTONIC second of its mark (None: not said)."""
        try:
            return await self.outside.state.call("read_marks", self.marks.read_times)
        except OSError as err:
            raise StateError(f"cannot read what gpuswapd stopped: {err.strerror or err}") from err

    async def stopped(self) -> list[str]:
        """List the units and timers gpuswapd stopped and has not brought back yet.

        A mark whose unit became active after it was written is stale (its removal failed, and
        gpuswapd was killed before it could retry): it ran again since, whoever started it, and
        what it is now is its operator's. Such a mark is removed, never acted on.

        Except under a restore of gpuswapd's own that never ended: a unit whose restore's start is
        recorded (``starting``; issued after its stop mark, if one is left), that came up under
        that start, while no timer it paused runs again since (timers resume only after the
        resident's verify) was started by that restore, and gpuswapd was killed before its verify. It is still
        gpuswapd's to bring back and verify, with or without its stop mark (the start removes it).
        A start record of a restore that ended is removed. When systemd cannot say, every mark counts.
        """
        marked = await self.marked_at()
        try:
            issued = {n: at for n, at in (await self.started_at()).items() if at is not None}
        except GpuswapError:
            issued = {}
        dated = sorted(n for n, at in marked.items() if at is not None)
        said = True  # systemd said what the units are (else no record is judged ended)
        try:
            states = await self.unit_states(sorted(set(dated) | issued.keys())) if dated or issued else {}
        except GpuswapError:
            states, said = {}, False

        def resumed_since(moment: float) -> bool:  # a timer it paused runs again: that restore had ended
            return any(t.endswith(".timer") and t in states and states[t].active
                       and (states[t].active_enter or 0.0) > moment for t in dated)

        # Came up under that start (a start of a unit already up changes nothing, and says nothing).
        owed = {n for n, at in issued.items()
                if (marked.get(n) is None or at > (marked[n] or 0.0)) and n in states
                and (states[n].active_enter or -math.inf) >= at and not resumed_since(at)}
        stale = [n for n in dated if n not in owed and n in states
                 and (states[n].active_enter or -math.inf) > (marked[n] or math.inf)]
        if stale:
            log.warning("stopped_record_stale", names=stale,
                        reason="each became active again after gpuswapd stopped it: left as it is now")
            await self.unmark(stale)
        if said and (ended := sorted(issued.keys() - owed)):
            await self.start_ended(ended)
        return sorted((marked.keys() - set(stale)) | owed)

    async def closure(self) -> list[str]:
        """List the active resident units and everything that Requires/BindsTo/PartOf them."""
        return await self.outside.systemd.call("closure", self.systemd.stop_closure, self.config.resident.units)

    async def states(self, units: list[str]) -> dict[str, str]:
        """Read each unit's ActiveState."""
        return {u: s.active_state for u, s in (await self.unit_states(units)).items()}

    async def how_it_runs(self) -> tuple[str | None, str | None]:
        """Say how its operator runs the resident: a digest of its units' ExecStart= and Environment=, its InvocationID.

        Either is None when systemd cannot say now (nothing is compared then); each is read apart,
        so that a failed read of the unit's state does not lose what it runs.
        """
        config = invocation = None
        with contextlib.suppress(GpuswapError):
            config = await self.runs_as()
        try:
            first = self.config.resident.units[0]
            invocation = (await self.unit_states([first]))[first].invocation or None
        except GpuswapError:
            pass
        return config, invocation

    async def runs_as(self) -> str:
        """Return a digest of how its operator runs the resident: its units' ExecStart= and Environment=."""
        lane, digest = self.outside.systemd, hashlib.sha256()
        for unit in self.config.resident.units:
            c = await lane.call("commands", self.systemd.commands, unit)
            digest.update(repr((unit, c.argvs, c.environment)).encode())
        return digest.hexdigest()[:16]

    async def unit_states(self, units: list[str]) -> dict[str, UnitState]:
        """Read each unit's load, active and sub state."""
        lane = self.outside.systemd
        return {u: await lane.call("unit_state", self.systemd.state, u) for u in units}

    async def all_active(self, units: list[str]) -> bool:
        """Tell whether every one of these units is up now (False when systemd cannot say)."""
        try:
            return set(units) <= set(await self.closure())
        except GpuswapError:
            return False

    async def stop(self, units: list[str], own: bool = True, marked: bool = False) -> None:
        """Stop the units together; systemd stops dependents first (the reverse of After=).

        ``own``: gpuswapd will start them again (the resident), so the stop is recorded first
        (``marked``: the caller recorded it); a preempted lease's unit is not.
        """
        started = clock.monotonic()
        if own and not marked:
            await self.mark(units)
        hung = self.outside.systemd.changes_hung
        try:
            await self._jobs("StopUnit", units, self.config.resident.stop_timeout, "stop")
        finally:
            if own and self.outside.systemd.changes_hung != hung:
                self.stops_hung += 1  # systemd may still do it, late
        log.info("units_stopped", units=units, took_s=round(clock.monotonic() - started, 3))

    async def start(self, units: list[str], since: float | None = None) -> None:
        """Start exactly these units together (systemd orders them by After=); then forget gpuswapd stopped them.

        The start is recorded first, apart from the stop marks it removes (``starting``, kept until
        the restore ends: ``start_ended``). A failure to record it starts them all the same: the
        resident must come back. ``since``: the CLOCK_MONOTONIC second of this restore's first
        start, recorded instead of now: a unit that came up under an earlier attempt and is started
        again (a no-op) still came up under this restore.
        """
        started = clock.monotonic()
        # Not recorded: a restart before the verify then reads a crash of this start as its operator's.
        with contextlib.suppress(GpuswapError, OSError):
            await self.outside.state.call("mark", self.starting.add, list(units), since)
        await self._jobs("StartUnit", units, self.config.resident.start_timeout, "start")
        log.info("units_started", units=units, took_s=round(clock.monotonic() - started, 3))
        await self.unmark(units)

    async def verify(self, slot: int | None = None) -> float:
        """Get a real completion from the resident, retrying while it loads; return seconds taken.

        ``slot``: llama.cpp's slot to answer it in (one that no restore will fill).
        """
        check = self.config.resident.verify
        started = clock.monotonic()
        retry_until = started + check.timeout
        asked = (self.http.verify(check, retry_until) if slot is None
                 else self.http.verify(check, retry_until, {"id_slot": slot}))
        try:
            reply = await self.outside.http.run("verify", asked, self.outside.http.beyond(check.timeout))
        except EndpointError as err:
            raise VerifyFailed(f"the resident did not answer a completion within {check.timeout:g}s: "
                               f"{err.message}") from err
        took = clock.monotonic() - started
        log.info("resident_verified", took_s=round(took, 3), completion_tokens=reply.completion_tokens)
        return took

    async def _jobs(self, method: str, units: list[str], timeout: float, verb: str) -> None:
        self.jobs_running += 1
        try:
            await run_jobs(self.systemd, self.outside.systemd, method, units, timeout, verb)
        finally:
            self.jobs_running -= 1

    # -- what the resident is (gpuswapd.window.identity compares it with its baseline) -------------------

    async def what_it_is(self) -> tuple[ServerProps | None, list[str]]:
        """Read llama-server's ``/props`` (``resident.server = "llama.cpp"``) and the ids of ``/v1/models``."""
        cfg, lane = self.config.resident, self.outside.http
        limit = min(PROPS_TIMEOUT_S, cfg.verify.timeout)
        props = None
        if cfg.server == "llama.cpp":
            props = await lane.run("props", self.http.props(cfg.props_url, limit), lane.beyond(limit))
        models = await lane.run("models", self.http.model_ids(cfg.models_url, limit), lane.beyond(limit))
        return props, models

    # -- its slots' caches (gpuswapd.window.warm saves them before a window and restores them after) -----

    async def slots(self, timeout: float) -> list[Slot]:
        """List llama-server's slots and what each holds (its own ``/slots``)."""
        lane = self.outside.http
        return await lane.run("slots", self.http.slots(self.config.resident.slots_url, timeout), lane.beyond(timeout))

    async def save_slot(self, slot: int, filename: str, timeout: float) -> SlotFile:
        """Have llama-server save a slot's cache to ``filename`` in its save path."""
        lane = self.outside.http
        return await lane.run("slot_save", self.http.slot_file(self.config.resident.slots_url, slot, "save", filename,
                                                               timeout), lane.beyond(timeout))

    async def restore_slot(self, slot: int, filename: str, timeout: float) -> SlotFile:
        """Have llama-server restore a slot's cache from ``filename`` in its save path."""
        lane = self.outside.http
        return await lane.run("slot_restore", self.http.slot_file(self.config.resident.slots_url, slot, "restore",
                                                                  filename, timeout), lane.beyond(timeout))

    async def model_identity(self, path: str) -> FileIdentity:
        """Stat the resident's model file."""
        return await self.outside.files.call("slot_identity", self.slot_files.identity, path)

    async def slot_listing(self, directory: str, prefix: str) -> dict[str, int]:
        """List gpuswapd's files in the slot save directory, with their sizes."""
        return await self.outside.files.call("slot_listing", self.slot_files.listing, directory, prefix)

    async def slot_free(self, directory: str) -> int:
        """Say how much room the slot save directory's file system has."""
        return await self.outside.files.call("slot_free", self.slot_files.free, directory)

    async def remove_slot_files(self, directory: str, names: list[str]) -> list[str]:
        """Remove gpuswapd's files from the slot save directory."""
        return await self.outside.files.call("slot_remove", self.slot_files.remove, directory, names)
