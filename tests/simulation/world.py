"""The simulated machine: a card with a release lag, systemd, Docker, the model servers, the state directory.

Everything here runs on the simulation's one event loop and answers at once, or schedules its
effect on the world's own ``Scheduler``, whose actions outlive every incarnation of the daemon
(systemd finishes a job, an engine finishes booting, whether gpuswapd is alive or not). A call
that would block (Docker's wait for a container's exit) returns an awaitable, which the
simulation's worker pool awaits. What one incarnation of the daemon registered (signal
watchers, job waiters, exit waiters) is forgotten when it is killed: a dead process hears nothing.

The card keeps memory that is being freed listed under the process that held it until the
release lag has passed, after a process exits and after an engine sleeps, as real drivers do.
"""

from __future__ import annotations

import asyncio
import errno
import fnmatch
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpuswapd.adapters.docker import ContainerState, RunSettings
from gpuswapd.adapters.gpu import GpuProcess, VramReading
from gpuswapd.adapters.kernel import Process
from gpuswapd.adapters.openai import Busy
from gpuswapd.adapters.pagecache import FileCache, Measured, Progress
from gpuswapd.adapters.props import ServerProps
from gpuswapd.adapters.slots import FileIdentity, Slot, SlotFile
from gpuswapd.adapters.streams import Completion
from gpuswapd.adapters.unitstates import Commands, JobResults, ServiceProcesses, TimerState, UnitState
from gpuswapd.errors import (
    BadResponse,
    ContainerNotFound,
    DockerError,
    EndpointUnreachable,
    FilesError,
    ImageNotFound,
    UnitNotFound,
)
from gpuswapd.server.peers import Peer
from gpuswapd.state.store import Document, Loaded, decode
from tests.simulation.loop import VirtualClock

GiB = 1 << 30
CANARY = "2, 3, 5, 7, 11"
MODELS = "/models"
MODEL_BYTES = 21_600_000_000  # the resident's GGUF
SLOTS = "/var/cache/gpuswapd/slots"  # the resident's --slot-save-path
AGENT_TOKENS = 1566  # what an agent's context holds in strata's first slot once it has served
# True while a blocking call that outlived its deadline does its work late: an engine it starts
# then may find the card taken (an out-of-memory gpuswapd could not prevent: the call was gone).
LATE = [False]
LATE_ASKED = [0.0]  # when gpuswapd made the late call that does its work now


def _as_late(asked: float, work: Callable[[], None]) -> None:
    """Do ``work`` as the late call made at ``asked`` would: what it does is not gpuswapd's choice."""
    was = LATE[0], LATE_ASKED[0]
    LATE[0], LATE_ASKED[0] = True, asked
    try:
        work()
    finally:
        LATE[0], LATE_ASKED[0] = was


class Scheduler:
    """The world's timed actions, on whichever loop runs now (they outlive a killed daemon)."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._pending: dict[int, tuple[float, Callable[[], None]]] = {}
        self._ids = itertools.count(1)
        self.loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the pending actions on ``loop`` from now on (the last loop is abandoned)."""
        self.loop = loop
        for action, (when, _) in sorted(self._pending.items(), key=lambda kv: (kv[1][0], kv[0])):
            loop.call_at(when, self._fire, action)

    def at(self, when: float, fn: Callable[[], None]) -> int:
        """Run ``fn`` at virtual time ``when``."""
        action = next(self._ids)
        when = max(when, self.clock.now)
        self._pending[action] = (when, fn)
        if self.loop is not None:
            self.loop.call_at(when, self._fire, action)
        return action

    def after(self, delay: float, fn: Callable[[], None]) -> int:
        """Run ``fn`` ``delay`` seconds from now."""
        return self.at(self.clock.now + max(0.0, delay), fn)

    def cancel(self, action: int | None) -> None:
        """Forget an action that has not run."""
        if action is not None:
            self._pending.pop(action, None)

    def detach(self) -> None:
        """The loop is abandoned: what it would still run this turn waits for the next loop."""
        self.loop = None

    def _fire(self, action: int) -> None:
        if self.loop is None or self.loop is not asyncio.get_running_loop():
            return  # a dead loop's turn: the action stays pending for the next one
        entry = self._pending.pop(action, None)
        if entry is not None:
            entry[1]()


# -- the card ----------------------------------------------------------------------------------


@dataclass
class Holding:
    """What one process holds on the card; ``until``: being freed, listed until then, then ``then``."""

    pid: int
    bytes: int
    until: float | None = None
    then: int = 0


class Card:
    """The GPU's memory, read like NVML: used, free, and the processes that hold it."""

    def __init__(self, clock: VirtualClock, total: int, exit_lag: float, sleep_lag: float) -> None:
        self.clock = clock
        self.total = total
        self.exit_lag = exit_lag
        self.sleep_lag = sleep_lag
        self.holdings: dict[str, Holding] = {}
        self.ooms: list[str] = []
        self.late_ooms: list[str] = []

    def _settle(self) -> None:
        now = self.clock.now
        for name, h in list(self.holdings.items()):
            if h.until is not None and h.until <= now:
                if h.then:
                    h.bytes, h.until, h.then = h.then, None, 0
                else:
                    del self.holdings[name]

    def used(self) -> int:
        """Return the memory in use now (what is being freed still counts)."""
        self._settle()
        return sum(h.bytes for h in self.holdings.values())

    def free(self) -> int:
        """Return the memory free now."""
        return self.total - self.used()

    def claim(self, name: str, pid: int, size: int) -> bool:
        """Take memory for a process starting now; False (an out-of-memory, recorded) if it does not fit."""
        free = self.free()
        if free < size:
            (self.late_ooms if LATE[0] else self.ooms).append(
                f"at {self.clock.now:.1f}s {name} needed {size / GiB:.1f} GiB with {free / GiB:.1f} GiB free "
                f"(held: {self.describe()})")
            return False
        self.holdings[name] = Holding(pid, size)
        return True

    def release(self, name: str, lag: float | None = None) -> None:
        """A process exited: its memory comes free after the lag (listed under it until then)."""
        h = self.holdings.get(name)
        if h is None:
            return
        lag = self.exit_lag if lag is None else lag
        if lag <= 0:
            del self.holdings[name]
        else:
            h.until, h.then = self.clock.now + lag, 0

    def shrink(self, name: str, to: int) -> None:
        """An engine slept: it keeps ``to``, the rest comes free after the sleep lag."""
        h = self.holdings.get(name)
        if h is not None:
            h.until, h.then = self.clock.now + max(self.sleep_lag, 1e-6), to

    def grow(self, name: str, to: int) -> bool:
        """A sleeping engine wakes: it takes its memory back now, or fails (an out-of-memory)."""
        self._settle()
        h = self.holdings.get(name)
        if h is None:
            return False
        # Memory still being freed from its sleep is held yet: waking then costs nothing more.
        extra = to - h.bytes
        free = self.total - sum(x.bytes for x in self.holdings.values())
        if free < extra:
            self.ooms.append(f"at {self.clock.now:.1f}s {name} woke needing {extra / GiB:.1f} GiB more with "
                             f"{free / GiB:.1f} GiB free (held: {self.describe()})")
            return False
        h.bytes, h.until, h.then = to, None, 0
        return True

    def describe(self) -> str:
        """Name every holder and its size."""
        self._settle()
        return ", ".join(f"{n} {h.bytes / GiB:.1f}" + (" (freeing)" if h.until is not None else "")
                         for n, h in sorted(self.holdings.items())) or "nothing"

    def read(self, processes: bool = True) -> VramReading:
        """Read the card as the probe adapters do."""
        used = self.used()
        procs = tuple(GpuProcess(h.pid, h.bytes) for _, h in sorted(self.holdings.items())) if processes else ()
        return VramReading(self.total, used, self.total - used, procs)


# -- systemd -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """llama.cpp's ``--fit``: the server claims weights + KV(ctx) + margin, and leaves ``target`` free besides.

    Started with less free than its full claim and the target, it lowers its context (256 tokens
    per slot at a time) until that fits, down to ``min_ctx``; it fails (out of memory) only when
    even ``min_ctx`` does not fit at all. ``ctx`` is ``-c``, the KV cache of all the slots.
    """

    weights: int
    kv_per_token: int
    margin: int
    target: int
    ctx: int
    slots: int
    min_ctx: int

    def claim(self, ctx: int) -> int:
        """Return what the server holds with ``ctx`` tokens of context (all slots)."""
        return self.weights + self.kv_per_token * ctx + self.margin

    def fit(self, free: int) -> int:
        """Return the context it starts with when ``free`` bytes are free (the minimum, when nothing fits)."""
        ctx = self.ctx
        while ctx > self.min_ctx and self.claim(ctx) + self.target > free:
            ctx = max(self.min_ctx, ctx - 256 * self.slots)
        return ctx


@dataclass
class Unit:
    """A unit the simulated manager knows."""

    name: str
    active_state: str = "inactive"
    requires: tuple[str, ...] = ()
    gpu_bytes: int = 0
    start_s: float = 0.1
    stop_s: float = 0.1
    pid: int = 0
    starts: int = 0
    started_at: list[float] = field(default_factory=list)
    job: tuple[str, int] | None = None  # the pending job: (method, world action)
    job_paths: list[str] = field(default_factory=list)
    fit: Fit | None = None  # a llama-server that fits itself to the free memory
    n_ctx: int = 0  # its context per slot, as its /props says
    exec_start: tuple[str, ...] = ()  # what it runs (none given: llama-server on /models/NAME.gguf if it holds VRAM)
    started_by: str = ""  # who asked for its last start: "gpuswapd" or "its operator"
    start_who: str = ""  # who queued its pending start job


@dataclass
class Timer:
    """A timer and its service (an agent job that uses the resident while it runs)."""

    name: str
    active: bool
    service: str
    every_s: float
    runs_s: float
    next_run: int | None = None
    job: tuple[str, int, list[str]] | None = None  # the pending job: (method, world action, job paths)
    stopped_at: float | None = None  # when it was last stopped (paused)
    entered: float | None = None  # when it last became active (ActiveEnterTimestampMonotonic)
    resident_was_up: bool = False  # whether the resident served when it was stopped


class Systemd:
    """The system manager, answering what gpuswapd's systemd adapter answers."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.units: dict[str, Unit] = {}
        self.timer_units: dict[str, Timer] = {}
        self.jobs = JobResults()
        self.watchers: list[Callable[[str, str], None]] = []
        self.logind = True  # logind is on the bus: it tells of every resume (PrepareForSleep(false))
        self.resume_watchers: list[Callable[[], None]] = []
        self._paths = itertools.count(1)
        self._pids = itertools.count(7_000_000)
        self.fail_starts: dict[str, int] = {}
        self.scopes: dict[int, str] = {}  # live processes outside gpuswapd's units: a user's session
        self.operator_jobs: set[str] = set()  # units whose pending start their operator asked for
        self.operator_started: list[float] = []
        self.history: list[tuple[float, str, str]] = []  # (time, unit, state): what went on
        # Invariant 14: who last stopped each unit and timer that is down ("gpuswapd", "its operator",
        # "a crash", "nobody": it never ran); gpuswapd may start only what it stopped itself.
        self.operator_hand = False  # set while the history's operator calls systemd
        self.stopped_by: dict[str, str] = {}
        self.crashed: set[str] = set()  # units whose last exit was a crash (even one a restore of gpuswapd's undoes)
        # unit -> when a stop of gpuswapd's for it was asked whose call or job hung unanswered
        self.stop_unanswered: dict[str, float] = {}
        self._crashing = False
        self._stopping: dict[str, str] = {}  # stops under way: who asked
        self._cause: str | None = None  # who stops what a stop takes down with it
        self.start_violations: list[str] = []
        # Whether gpuswapd is restoring the resident now (its start and verify, retried): a unit of its
        # start that dies meanwhile is its restore failing, still gpuswapd's stop to undo.
        self.in_restore: Callable[[str], bool] = lambda unit: False  # gpuswapd's restore of this unit is under way
        # gpuswapd asked to stop this unit (its mark is written) and the call is still out (hung; it lands late).
        self.stop_asked: Callable[[str], bool] = lambda unit: False

    def add(self, unit: Unit) -> None:
        """Load a unit (running if it says it is active)."""
        self.units[unit.name] = unit
        if unit.active_state == "active":
            unit.pid = next(self._pids)
            unit.starts += 1
            unit.started_at.append(self.world.clock.now)
            if unit.gpu_bytes:
                assert self.world.card.claim(self._key(unit), unit.pid, unit.gpu_bytes)
            if unit.fit is not None:
                unit.n_ctx = unit.fit.ctx // unit.fit.slots

    def add_timer(self, name: str, active: bool, every_s: float, runs_s: float) -> None:
        """Load a timer and its service; an active timer runs its service every ``every_s``."""
        service = name.removesuffix(".timer") + ".service"
        self.timer_units[name] = Timer(name, active, service, every_s, runs_s,
                                       entered=self.world.clock.now if active else None)
        self.units[service] = Unit(service)
        if active:
            self._schedule_timer(self.timer_units[name])
        else:
            self.stopped_by[name] = "nobody (it never ran)"

    def _key(self, unit: Unit) -> str:
        return f"{unit.name}#{unit.starts}"

    # -- the adapter's interface ---------------------------------------------------------------

    def connect(self) -> None:
        """Connect (nothing to do)."""

    def close(self) -> None:
        """Close (nothing to do)."""

    def watch_active_state(self, watcher: Callable[[str, str], None]) -> None:
        """Call ``watcher(unit, state)`` when a unit's ActiveState changes."""
        self.watchers.append(watcher)

    def watch_resume(self, watcher: Callable[[], None]) -> bool:
        """Call ``watcher()`` at every resume from a suspend; tell whether logind is there to say it."""
        if self.logind:
            self.resume_watchers.append(watcher)
        return self.logind

    def system_state(self) -> str:
        """Say the system runs."""
        return "running"

    def queue_jobs(self, method: str, units: list[str]) -> list[tuple[str, str]]:
        """Queue a start or stop job for each unit; each ends later, announced like JobRemoved."""
        return [(unit, self._queue(method, unit)) for unit in units]

    def when_job_done(self, path: str, callback: Callable[[str], None]) -> None:
        """Hand a job's result to a waiter."""
        self.jobs.when_done(path, callback)

    def forget_job(self, path: str) -> None:
        """Stop waiting for a job."""
        self.jobs.forget(path)

    def state(self, unit: str) -> UnitState:
        """Read a unit's state."""
        if unit in self.timer_units:
            timer = self.timer_units[unit]
            return UnitState(unit, "loaded", "active" if timer.active else "inactive", "waiting",
                             active_enter=timer.entered)
        u = self.units.get(unit)
        if u is None:
            return UnitState(unit, "not-found", "inactive", "dead")
        sub = {"active": "running", "activating": "start", "deactivating": "stop", "failed": "failed"}
        # InvocationID: systemd draws a new one at each start of the unit, whoever asks for it.
        return UnitState(unit, "loaded", u.active_state, sub.get(u.active_state, "dead"),
                         invocation=f"{u.pid:032x}" if u.pid else "",
                         active_enter=u.started_at[-1] if u.started_at else None)

    def stop_closure(self, units: list[str]) -> list[str]:
        """List the active units and their active dependents."""
        for name in units:
            if name not in self.units:
                raise UnitNotFound(f"unit {name} is not-found")
        queue, seen, out = list(units), set(), []
        while queue:
            name = queue.pop(0)
            if name in seen:
                continue
            seen.add(name)
            if self.units[name].active_state not in ("active", "activating"):
                continue
            out.append(name)
            queue.extend(self._dependents(name))
        return out

    def dependents_closure(self, units: list[str]) -> list[str]:
        """List the units and every loaded dependent, whatever its state."""
        queue, seen, out = list(units), set(), []
        while queue:
            name = queue.pop(0)
            if name in seen or name not in self.units:
                continue
            seen.add(name)
            out.append(name)
            queue.extend(self._dependents(name))
        return out

    def timers(self, patterns: list[str]) -> list[TimerState]:
        """List the matching timers with their service's state."""
        return [TimerState(name, "active" if t.active else "inactive", t.service,
                           self.units[t.service].active_state)
                for name, t in sorted(self.timer_units.items())
                if any(fnmatch.fnmatchcase(name, p) for p in patterns)]

    def installed_timers(self, patterns: list[str]) -> list[str]:
        """List every loaded timer that matches."""
        return [t.name for t in self.timers(patterns)]

    def unit_of_pid(self, pid: int) -> str | None:
        """Name the unit of a live process (None: it is gone), as GetUnitByPID does."""
        unit = next((u.name for u in self.units.values() if u.pid == pid and pid
                     and u.active_state in ("active", "activating", "deactivating")), None)
        if unit is not None:
            return unit
        for c in self.world.docker.containers.values():
            if c.pid == pid and c.status == "running":
                return f"docker-{c.name}.scope"
        return self.scopes.get(pid)

    def control_group(self, unit: str) -> str | None:
        """Return a unit's cgroup."""
        if unit not in self.units:
            raise UnitNotFound(f"no unit {unit}")
        return f"/system.slice/{unit}"

    def commands(self, unit: str) -> Commands:
        """Say what a unit runs (its ExecStart=): a unit on the card runs llama-server on its model file."""
        u = self.units.get(unit)
        if u is None:
            raise UnitNotFound(f"unit {unit} is not-found")
        stem = unit.removesuffix(".service")
        argv = u.exec_start or (("/usr/bin/llama-server", "-m", f"{MODELS}/{stem}.gguf", "--slot-save-path", SLOTS)
                                if u.gpu_bytes else (f"/usr/bin/{stem}",))
        return Commands(unit, (argv,))

    # -- how units change ----------------------------------------------------------------------

    def _dependents(self, name: str) -> list[str]:
        return sorted(u.name for u in self.units.values() if name in u.requires)

    def _went_down_at(self, name: str) -> float:
        """Return when the unit last went down (inactive or failed), or 0."""
        return max((t for t, unit, state in self.history if unit == name and state in ("inactive", "failed")),
                   default=0.0)

    def _whose_start(self, name: str) -> None:
        """Invariant 14: a start gpuswapd asks for is of a unit or timer that is up, or that it stopped itself."""
        if self.operator_hand:
            return
        timer = self.timer_units.get(name)
        unit = self.units.get(name)
        down = (not timer.active) if timer is not None else (
            unit is not None and unit.active_state in ("inactive", "failed", "deactivating"))
        who = self.stopped_by.get(name, "nobody (it never ran)")
        if unit is not None and unit.active_state == "deactivating" and name in self._stopping:
            who = self._stopping[name]  # its stop is under way: whose that stop is, not the one before
        if down and LATE[0] and self._went_down_at(name) > LATE_ASKED[0]:
            return  # a start asked before the unit went down (a crash), done late by systemd: not gpuswapd's choice
        if down and who != "gpuswapd" and self._went_down_at(name) >= self.stop_unanswered.get(name, float("inf")):
            return  # it went down while gpuswapd's stop of it hung unanswered: for all it can tell, its own stop
        if down and who != "gpuswapd":
            self.start_violations.append(f"gpuswapd started {name} at {self.world.clock.now:.2f}s, "
                                         f"which {who} stopped, not gpuswapd")

    def _queue(self, method: str, name: str) -> str:
        path = f"/org/freedesktop/systemd1/job/{next(self._paths)}"
        who = "its operator" if self.operator_hand else "gpuswapd"
        if method == "StopUnit" and LATE[0] and not self.operator_hand:
            # gpuswapd's call queueing this stop outlived its deadline and lands only now: a unit
            # that went down since the call was made may as well have been taken down by it, as
            # far as gpuswapd can tell (it never learns when systemd queued it, nor the job's path).
            self.stop_unanswered[name] = min(self.stop_unanswered.get(name, float("inf")), LATE_ASKED[0])
        if method == "StartUnit":
            self._whose_start(name)
        elif (name in self.timer_units and self.timer_units[name].active) or (
                name in self.units and self.units[name].active_state in ("active", "activating")):
            self._stopping[name] = who
        if name in self.timer_units:
            timer = self.timer_units[name]
            if timer.job is not None and timer.job[0] == method:
                timer.job[2].append(path)  # merged into the pending job of the same kind
                return path
            if timer.job is not None:  # the opposite job replaces the pending one
                self.world.scheduler.cancel(timer.job[1])
                for old in timer.job[2]:
                    self.jobs.removed(old, "canceled")
            action = self.world.scheduler.after(0.01, lambda: self._timer_job(method, name))
            timer.job = (method, action, [path])
            return path
        unit = self.units.get(name)
        if unit is None:
            self.world.scheduler.after(0.0, lambda: self.jobs.removed(path, "failed"))
            return path
        verb = "start" if method == "StartUnit" else "stop"
        if unit.job is not None and unit.job[0] == verb:
            unit.job_paths.append(path)  # merged into the pending job of the same kind
            return path
        if unit.job is not None:  # the opposite job replaces the pending one
            self.world.scheduler.cancel(unit.job[1])
            for old in unit.job_paths:
                self.jobs.removed(old, "canceled")
            unit.job, unit.job_paths = None, []
        if verb == "start":
            if unit.active_state == "active":
                self.world.scheduler.after(0.0, lambda: self.jobs.removed(path, "done"))
                return path
            deps = [d for d in unit.requires if self.units[d].active_state != "active"]
            for dep in deps:  # Requires= pulls the dependency in, in the same transaction
                self._queue("StartUnit", dep)
            self._set(unit, "activating")
            unit.start_who = who
            delay = unit.start_s + max((self.units[d].start_s for d in deps), default=0.0)
            if LATE[0]:
                # A late call's job, asked before the unit went down (a crash since): its start, when it
                # lands, is no more gpuswapd's choice than the call's. One asked while the unit was down
                # already is gpuswapd's own, late or not.
                asked = LATE_ASKED[0]
                action = self.world.scheduler.after(
                    delay, lambda: _as_late(asked, lambda: self._started(unit))
                    if self._went_down_at(unit.name) > asked else self._started(unit))
            else:
                action = self.world.scheduler.after(delay, lambda: self._started(unit))
        else:
            if unit.active_state in ("inactive", "failed"):
                self.world.scheduler.after(0.0, lambda: self.jobs.removed(path, "done"))
                return path
            outer, self._cause = self._cause, who  # a stop propagates to what Requires= it, for the same reason
            try:
                for dep in self._dependents(name):
                    if self.units[dep].active_state in ("active", "activating"):
                        self._stop_now(self.units[dep])
            finally:
                self._cause = outer
            self._set(unit, "deactivating")
            action = self.world.scheduler.after(unit.stop_s, lambda: self._stopped(unit))
        unit.job, unit.job_paths = (verb, action), [path]
        return path

    def _finish(self, unit: Unit, result: str) -> None:
        paths, unit.job, unit.job_paths = unit.job_paths, None, []
        for path in paths:
            self.jobs.removed(path, result)

    def _started(self, unit: Unit) -> None:
        for dep in unit.requires:
            if self.units[dep].active_state != "active":
                self._set(unit, "failed")
                self._finish(unit, "dependency")
                return
        if self.fail_starts.get(unit.name):
            self.fail_starts[unit.name] -= 1
            self._set(unit, "failed")
            self._finish(unit, "failed")
            return
        unit.starts += 1
        unit.pid = next(self._pids)
        size = unit.gpu_bytes
        if unit.fit is not None:
            free = self.world.card.free()
            ctx = unit.fit.fit(free)
            size, unit.n_ctx = unit.fit.claim(ctx), ctx // unit.fit.slots
            if ctx < unit.fit.ctx and size <= free:
                self.world.short_starts.append(
                    f"at {self.world.clock.now:.1f}s {unit.name} started with {free / GiB:.1f} GiB free and fit "
                    f"itself to n_ctx {unit.n_ctx} (held: {self.world.card.describe()})")
        if size and not self.world.card.claim(self._key(unit), unit.pid, size):
            self._set(unit, "failed")  # CUDA out of memory while loading
            self._finish(unit, "failed")
            return
        unit.started_at.append(self.world.clock.now)
        self.stopped_by.pop(unit.name, None)
        self.stop_unanswered.pop(unit.name, None)  # up again: whatever took it down is settled
        # Whose job this start is (its operator's, systemd's Restart=, or gpuswapd's): a name in
        # operator_jobs whose job never ran (the unit was up already) says nothing of a later start.
        unit.started_by = unit.start_who or "gpuswapd"
        self.operator_jobs.discard(unit.name)
        if unit.started_by == "its operator":
            self.operator_started.append(self.world.clock.now)
        self._set(unit, "active")
        self._finish(unit, "done")

    def _stop_now(self, unit: Unit) -> None:
        if unit.job is not None:
            self.world.scheduler.cancel(unit.job[1])
            self._finish(unit, "canceled")
        self._exit(unit)

    def _stopped(self, unit: Unit) -> None:
        self._exit(unit)
        self._finish(unit, "done")

    def _exit(self, unit: Unit, state: str = "inactive") -> None:
        if unit.gpu_bytes and unit.active_state in ("active", "deactivating"):
            self.world.card.release(self._key(unit))
        outer = self._cause
        own = self._stopping.pop(unit.name, None)
        cause = own or outer or "a crash"
        crashing = cause == "a crash" or (own is None and outer is not None and self._crashing)
        if crashing:
            self.crashed.add(unit.name)  # what a crash takes down (Requires=) went down with it
        else:
            self.crashed.discard(unit.name)
        if cause == "a crash" and unit.started_by == "gpuswapd" and self.in_restore(unit.name):
            cause = "gpuswapd"  # its restore's start did not last: the restore goes on undoing its own stop
        elif cause == "a crash" and self.stop_asked(unit.name):
            # It died while gpuswapd's stop of it was out (the call hung: systemd does it late, all the
            # same). gpuswapd cannot tell this crash from its own stop ending failed: the window's
            # restore brings it back, as it would after its stop.
            cause = "gpuswapd"
        self.stopped_by[unit.name] = cause
        self._cause = cause  # what it takes down goes for the same reason
        was_crashing, self._crashing = self._crashing, crashing
        try:
            for dep in self._dependents(unit.name):
                if self.units[dep].active_state in ("active", "activating", "deactivating"):
                    self._stop_now(self.units[dep])
        finally:
            self._cause = outer
            self._crashing = was_crashing
        self._set(unit, state)

    def _set(self, unit: Unit, state: str) -> None:
        if unit.active_state == state:
            return
        unit.active_state = state
        self.history.append((self.world.clock.now, unit.name, state))
        for watcher in list(self.watchers):
            watcher(unit.name, state)

    def crash(self, name: str) -> None:
        """A unit stops by itself (its process ended, or someone stopped it)."""
        unit = self.units.get(name)
        if unit is not None and unit.active_state in ("active", "activating"):
            self._stop_now(unit)

    def start_now(self, name: str) -> None:
        """Start a unit that is not gpuswapd's (a consumer service started by its owner)."""
        unit = self.units[name]
        if unit.active_state != "active":
            unit.starts += 1
            unit.pid = next(self._pids)
            unit.started_at.append(self.world.clock.now)
            self.stopped_by.pop(unit.name, None)
            self._set(unit, "active")

    # -- timers and their agent jobs ----------------------------------------------------------

    def _timer_job(self, method: str, name: str) -> None:
        timer = self.timer_units[name]
        assert timer.job is not None
        paths, timer.job = timer.job[2], None
        if method == "StartUnit" and not timer.active:
            self._timer_resumed(timer)
        if method != "StartUnit" and timer.active:
            timer.stopped_at = self.world.clock.now
            timer.resident_was_up = self.world.resident_serves()
        if method == "StartUnit":
            self.stopped_by.pop(name, None)
        elif timer.active:
            self.stopped_by[name] = self._stopping.pop(name, "gpuswapd")
        if method == "StartUnit" and not timer.active:
            timer.entered = self.world.clock.now
        timer.active = method == "StartUnit"
        self.world.scheduler.cancel(timer.next_run)
        timer.next_run = None
        if timer.active:
            self._schedule_timer(timer)
        self.history.append((self.world.clock.now, name, "active" if timer.active else "inactive"))
        for path in paths:
            self.jobs.removed(path, "done")

    def _timer_resumed(self, timer: Timer) -> None:
        """Invariant 12: a timer runs again only once the resident started while it was stopped has answered.

        A resident that served when the timer stopped must serve again, and one started again since
        the timer stopped (gpuswapd's restore) must have answered a completion since that start: the
        agents the timer runs use the resident. One already down when the timer stopped (its
        operator's stop, a crash) is not this rule's: the timer ran with it down before; nor is one
        that served since (and, if gpuswapd started it again, answered a completion since) and then
        crashed or was stopped by its operator: the timers run with it down as they would without
        gpuswapd, and systemd's Restart= is its way back; nor one its operator stopped, answered or
        not (a restore that never verifies leaves a resident they stop to them); nor one down when
        the timer stopped that its operator started since (the timer would have run against that
        start without gpuswapd).
        """
        world = self.world
        if timer.stopped_at is None:
            return
        since = max((t for u in world.resident_units for t in self.units[u].started_at), default=0.0)
        answered = any(t >= since and who == "resident" for t, who in world.http.completions)
        if timer.resident_was_up and not world.resident_serves():
            down = [u for u in world.resident_units if self.units[u].active_state != "active"]
            if (since < timer.stopped_at or answered) and \
                    all(self.stopped_by.get(u) in ("a crash", "its operator") or u in self.crashed for u in down):
                return  # served (verified, if started since), then crashed or its operator stopped it: not gpuswapd's
            if all(self.stopped_by.get(u) == "its operator" for u in down):
                return  # its operator stopped it (one gpuswapd's restore started, unverified, say): theirs now
            states = {u: self.units[u].active_state for u in world.resident_units}
            world.timer_violations.append(
                f"{timer.name} was started at {world.clock.now:.2f}s, but the resident, up when it was stopped "
                f"at {timer.stopped_at:.2f}s, is not serving ({states})")
            return
        if since < timer.stopped_at:
            return
        started_since = [self.units[u] for u in world.resident_units
                         if self.units[u].started_at and self.units[u].started_at[-1] >= timer.stopped_at]
        if not timer.resident_was_up and all(u.started_by == "its operator" for u in started_since):
            return  # down when the timer stopped, then started by its operator: theirs, as it would be without gpuswapd
        if not answered:
            world.timer_violations.append(
                f"{timer.name} was started at {world.clock.now:.2f}s, but the resident started at {since:.2f}s "
                "has answered no completion since")

    def _schedule_timer(self, timer: Timer) -> None:
        timer.next_run = self.world.scheduler.after(timer.every_s, lambda: self._run_agent(timer))

    def _run_agent(self, timer: Timer) -> None:
        timer.next_run = None
        service = self.units[timer.service]
        if timer.active:
            self._schedule_timer(timer)
        if service.active_state != "inactive":
            return
        self.start_now(service.name)
        self.world.agent_runs += 1
        if not self.world.resident_serves():
            self.world.agent_failures.append(f"{timer.service} at {self.world.clock.now:.1f}s: the resident is down")
        self.world.scheduler.after(timer.runs_s, lambda: self._exit(service))


# -- Docker -------------------------------------------------------------------------------------


@dataclass
class Container:
    """A container the simulated engine knows."""

    name: str
    image: str
    labels: dict[str, str]
    vram: int
    boot_s: float
    status: str = "created"
    exit_code: int | None = None
    pid: int = 0
    key: str = ""
    healthy_at: float = 0.0
    dead: bool = False
    sleeping: int | None = None
    garbled: bool = False
    starts: int = 0
    since: float = 0.0  # its last start or wake: a lease needs a completion from it after this
    started_at: str = ""  # Docker's StartedAt: a new one at each start

    def state(self) -> ContainerState:
        """Inspect it."""
        return ContainerState(self.name, self.name, self.status, self.exit_code, False, self.started_at, "",
                              dict(self.labels))


@dataclass
class EngineSpec:
    """How an engine profile's container behaves in the simulated Docker."""

    vram: int
    residual: int
    boot_s: float
    sleeps: bool = True


class Docker:
    """The Docker engine, answering what gpuswapd's docker adapter answers."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.images: set[str] = set()
        self.specs: dict[str, EngineSpec] = {}  # container name -> how it behaves
        self.containers: dict[str, Container] = {}
        self.exit_waiters: list[tuple[str, asyncio.Future[Any], int]] = []
        self._pids = itertools.count(8_000_000)
        self.garble_wakes = 0
        self.removed: list[tuple[float, str]] = []
        self.slept: list[tuple[str, float]] = []  # (container, when it went to sleep)
        self.woke: list[tuple[str, float]] = []

    def ping(self) -> None:
        """Answer."""

    def image_present(self, image: str) -> bool:
        """Tell whether the image is here."""
        return image in self.images

    def image_settings(self, image: str) -> RunSettings | None:
        """Say what an image runs with: nothing of its own."""
        return RunSettings(image, {}, [], [], "") if image in self.images else None

    def container_settings(self, name: str) -> RunSettings | None:
        """Say what a container runs with: nothing of its own."""
        return RunSettings("", {}, [], [], "") if name in self.containers else None

    def state(self, name: str) -> ContainerState | None:
        """Inspect a container."""
        c = self.containers.get(name)
        return None if c is None else c.state()

    def create(self, spec: Any, labels: dict[str, str]) -> str:
        """Create a container."""
        if spec.image not in self.images:
            raise ImageNotFound(f"image {spec.image!r} not found: `docker pull {spec.image}`")
        if spec.name in self.containers:
            raise DockerError(f"Conflict. The container name \"/{spec.name}\" is already in use")
        how = self.specs[spec.name]
        self.containers[spec.name] = Container(spec.name, spec.image, dict(labels), how.vram, how.boot_s)
        return spec.name

    def start(self, name: str) -> str:
        """Start a container: the engine claims its VRAM, or dies of out of memory; return its StartedAt."""
        c = self._get(name)
        if c.status == "running":
            return c.started_at
        c.starts += 1
        c.pid = next(self._pids)
        c.started_at = f"{self.world.clock.now:.6f}s#{c.pid}"
        c.key = f"engine:{name}#{c.starts}"
        c.since = self.world.clock.now
        c.sleeping, c.garbled, c.dead = None, False, False
        self.world.files.evict()  # the engine's weights push the resident's model out of the page cache
        if self.world.card.claim(c.key, c.pid, c.vram):
            c.status, c.exit_code = "running", None
            c.healthy_at = self.world.clock.now + c.boot_s
        else:
            c.status, c.exit_code = "exited", 1
            self._exited(c)
        return c.started_at

    def stop(self, name: str, timeout: float) -> None:
        """Stop a container (no error if absent)."""
        c = self.containers.get(name)
        if c is not None and c.status == "running":
            c.status, c.exit_code = "exited", 0
            self.world.card.release(c.key)
            self._exited(c)

    def remove(self, name: str) -> None:
        """Remove a container (no error if absent)."""
        self.stop(name, 0)
        if self.containers.pop(name, None) is not None:
            self.removed.append((self.world.clock.now, name))
            for waiter in [w for w in self.exit_waiters if w[0] == name]:
                self.exit_waiters.remove(waiter)
                if not waiter[1].done():
                    waiter[1].set_exception(ContainerNotFound(f"container {name!r} was removed"))

    def top(self, name: str) -> list[int]:
        """List the host pids of a running container's processes."""
        c = self.containers.get(name)
        return [c.pid] if c is not None and c.status == "running" else []

    def logs_tail(self, name: str, lines: int = 20) -> str:
        """Return the log's end."""
        c = self.containers.get(name)
        return "EngineDeadError\n" if c is not None and c.dead else "INFO serving\n"

    def find(self, labels: dict[str, str]) -> list[ContainerState]:
        """List containers carrying all these labels."""
        return [c.state() for c in self.containers.values() if all(c.labels.get(k) == v for k, v in labels.items())]

    def wait_exit(self, name: str, timeout: float) -> Any:
        """Wait until the container is not running (an awaitable: the simulation's pool awaits it)."""
        c = self._get(name)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if c.status != "running":
            future.set_result(c.state())
            return future
        action = self.world.scheduler.after(timeout, lambda: future.done() or future.set_result(None))
        self.exit_waiters.append((name, future, action))
        return future

    def _get(self, name: str) -> Container:
        c = self.containers.get(name)
        if c is None:
            raise ContainerNotFound(f"no container {name!r}")
        return c

    def _exited(self, c: Container) -> None:
        for waiter in [w for w in self.exit_waiters if w[0] == c.name]:
            self.exit_waiters.remove(waiter)
            self.world.scheduler.cancel(waiter[2])
            if not waiter[1].done():
                waiter[1].set_result(c.state())

    # -- what happens to engines ----------------------------------------------------------------

    def die(self, name: str) -> None:
        """EngineDeadError: health 503 and every request 500 at once; the API process exits 5 s later."""
        c = self.containers.get(name)
        if c is None or c.status != "running" or c.dead:
            return
        c.dead = True

        def exit_now() -> None:
            if self.containers.get(name) is c and c.status == "running" and c.dead:
                c.status, c.exit_code = "exited", 1
                self.world.card.release(c.key)
                self._exited(c)

        self.world.scheduler.after(5.0, exit_now)

    def sleep(self, name: str, level: int) -> None:
        """Put the engine to sleep: it keeps only its residual, after the sleep lag."""
        c = self._get(name)
        if c.status == "running" and c.sleeping is None:
            self.world.card.shrink(c.key, self.specs[name].residual)
            c.sleeping = level
            self.slept.append((name, self.world.clock.now))

    def wake(self, name: str) -> bool:
        """Wake the engine: it takes its memory back, or stays asleep (False) if there is no room."""
        c = self._get(name)
        if c.sleeping is None:
            return True
        if not self.world.card.grow(c.key, c.vram):
            return False
        c.sleeping = None
        c.since = self.world.clock.now
        self.woke.append((name, self.world.clock.now))
        c.garbled = self.garble_wakes > 0
        self.garble_wakes -= c.garbled
        return True


# -- the model servers ---------------------------------------------------------------------------


class Http:
    """The resident (through its proxy) and the engines, answering what ModelHttp answers."""

    RETRY_S = 0.25

    def __init__(self, world: World) -> None:
        self.world = world
        self.engines: dict[str, str] = {}  # netloc -> container name
        self.resident_host = "resident.sim:8080"  # llama-swap, in front of strata
        self.props_host = "resident.sim:8081"  # strata's llama-server itself
        self.completions: list[tuple[float, str]] = []

    def _container(self, url: str) -> Container | None:
        name = self.engines.get(urlsplit(url).netloc)
        if name is None:
            return None
        c = self.world.docker.containers.get(name)
        return c if c is not None and c.status == "running" else None

    def _serving(self, c: Container | None) -> bool:
        return c is not None and not c.dead and c.sleeping is None and self.world.clock.now >= c.healthy_at

    async def aclose(self) -> None:
        """Close nothing."""

    async def health(self, url: str, timeout: float = 2.0) -> int:
        """Answer an engine's /health: 200 serving, 503 dead, nothing while it loads."""
        await asyncio.sleep(0)
        c = self._container(url)
        if c is None:
            return 0
        if c.dead:
            return 503
        return 200 if c.sleeping is not None or self.world.clock.now >= c.healthy_at else 0

    async def wait_healthy(self, url: str, timeout: float, interval: float = 0.2,
                           abort: Callable[[], str | None] | None = None) -> float:
        """Poll health until 200 (in steps of at least half a second: the simulation's cost)."""
        started = self.world.clock.now
        while True:
            if abort is not None and (why := abort()) is not None:
                raise EndpointUnreachable(why)
            if await self.health(url) == 200:
                return self.world.clock.now - started
            left = started + timeout - self.world.clock.now
            if left <= 0:
                raise EndpointUnreachable(f"{url} did not answer 200 within {timeout:g}s")
            c = self._container(url)
            until_up = c.healthy_at - self.world.clock.now if c is not None and not c.dead else 1.0
            await asyncio.sleep(min(left, max(interval, 0.5, min(until_up, 2.0))))

    async def chat(self, url: str, model: str, prompt: Any, max_tokens: int, timeout: float,
                   sampling: dict[str, Any] | None = None) -> Completion:
        """Answer a completion if the server behind ``url`` serves (a sleeping engine crashes)."""
        await asyncio.sleep(0)
        if urlsplit(url).netloc == self.resident_host:
            if not self.world.resident_serves():
                raise EndpointUnreachable(f"POST {url}: connection refused")
            self.completions.append((self.world.clock.now, "resident"))
            return Completion("ready", "", "stop", 5, 1, 1, 0.001, 0.001)
        c = self._container(url)
        if c is not None and c.sleeping is not None:
            self.world.docker.die(c.name)  # a request to a sleeping vLLM can crash it
            raise BadResponse(f"POST {url}: HTTP 500: the engine is sleeping")
        if c is not None and c.dead:
            raise BadResponse(f"POST {url}: HTTP 500: EngineDeadError")
        if not self._serving(c):
            raise EndpointUnreachable(f"POST {url}: connection refused")
        assert c is not None
        text = CANARY if sampling is not None else "ready"
        self.completions.append((self.world.clock.now, c.name))
        return Completion(text[::-1] if c.garbled else text, "", "stop", 5, 1, 1, 0.001, 0.001)

    async def verify(self, check: Any, retry_until: float | None = None, fields: Any = None) -> Completion:
        """Get a real answer, retrying while the server loads."""
        while True:
            try:
                return await self.chat(check.url, check.model, check.prompt, check.max_tokens, check.timeout)
            except EndpointUnreachable:
                if retry_until is None or self.world.clock.now >= retry_until:
                    raise
                await asyncio.sleep(min(self.RETRY_S, max(0.0, retry_until - self.world.clock.now)))

    async def props(self, url: str, timeout: float) -> ServerProps:
        """Answer strata's /props: its context per slot and its slots, as it fit itself at its start."""
        await asyncio.sleep(0)
        strata = self.world.systemd.units["strata.service"]
        if urlsplit(url).netloc != self.props_host or strata.active_state != "active" or strata.fit is None:
            raise EndpointUnreachable(f"GET {url}: connection refused")
        return ServerProps(strata.n_ctx, strata.fit.slots, "/models/strata.gguf", "strata")

    async def slots(self, url: str, timeout: float) -> list[Slot]:
        """Answer strata's /slots: an agent's context in the first slot once it has served."""
        await asyncio.sleep(0)
        if urlsplit(url).netloc != self.props_host or not self.world.resident_serves():
            raise EndpointUnreachable(f"GET {url}: connection refused")
        return [Slot(i, 4096, n, False) for i, n in sorted(self.world.slots.held().items())]

    async def slot_file(self, url: str, slot: int, action: str, filename: str, timeout: float) -> SlotFile:
        """Save a slot to strata's save path (a second per GiB), or restore one."""
        slots = self.world.slots
        if urlsplit(url).netloc != self.props_host or not self.world.resident_serves():
            raise EndpointUnreachable(f"POST {url}/{slot}: connection refused")
        held = slots.held()
        if action == "save":
            nbytes = held[slot] * slots.PER_TOKEN
            await asyncio.sleep(nbytes / GiB)
            slots.files[filename] = (held[slot], nbytes)
            return SlotFile(slot, filename, held[slot], nbytes, nbytes / GiB * 1000)
        await asyncio.sleep(0)
        if filename not in slots.files:
            raise BadResponse(f"POST {url}/{slot}?action=restore: HTTP 400: Unable to restore slot")
        tokens, nbytes = slots.files[filename]
        held[slot] = tokens
        slots.restored += tokens
        return SlotFile(slot, filename, tokens, nbytes, 1.0)

    async def model_ids(self, url: str, timeout: float) -> list[str]:
        """Answer llama-swap's /v1/models."""
        await asyncio.sleep(0)
        if urlsplit(url).netloc != self.resident_host or not self.world.resident_serves():
            raise EndpointUnreachable(f"GET {url}: connection refused")
        return ["strata"]

    async def idle(self, idle: Any, timeout: float = 10.0, draining: bool = False) -> Busy:
        """Say whether an agent job is using the resident now."""
        await asyncio.sleep(0)
        if not self.world.resident_serves():
            raise EndpointUnreachable("GET /slots: connection refused")
        running = [t.service for t in self.world.systemd.timer_units.values()
                   if self.world.systemd.units[t.service].active_state == "active"]
        return Busy(bool(running), f"slots processing for {', '.join(running)}" if running else "idle")

    def _sleepy(self, base: str) -> Container:
        c = self._container(base)
        if c is None:
            raise EndpointUnreachable(f"{base}: connection refused")
        return c

    async def is_sleeping(self, base: str, timeout: float) -> bool | None:
        """Answer vLLM's /is_sleeping (None: sleep mode is off)."""
        await asyncio.sleep(0)
        c = self._sleepy(base)
        if not self.world.docker.specs[c.name].sleeps:
            return None
        return c.sleeping is not None

    async def sleep(self, base: str, level: int, timeout: float) -> None:
        """Put the engine to sleep."""
        await asyncio.sleep(0)
        c = self._sleepy(base)
        if not self.world.docker.specs[c.name].sleeps:
            raise BadResponse(f"POST {base}/sleep: HTTP 404")
        self.world.docker.sleep(c.name, level)

    async def wake_up(self, base: str, timeout: float) -> None:
        """Wake the engine (CUDA out of memory when there is no room)."""
        await asyncio.sleep(0)
        c = self._sleepy(base)
        if not self.world.docker.wake(c.name):
            raise BadResponse(f"POST {base}/wake_up: HTTP 500: CUDA out of memory")


# -- the state directory ----------------------------------------------------------------------------


class Store:
    """The state directory: the newest document and the one before it, and the history, in memory."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.dir = Path("/sim/state")
        self.current: bytes | None = None
        self.previous: bytes | None = None
        self.history_records: list[dict[str, Any]] = []
        self.broken_until = 0.0
        self.broken_since = -1.0
        self.broken_errno = errno.ENOSPC
        self.writes = 0

    def _check(self) -> None:
        if self.clock.now < self.broken_until:
            raise OSError(self.broken_errno, "No space left on device" if self.broken_errno == errno.ENOSPC
                          else "Permission denied")

    def prepare(self) -> None:
        """Nothing to create."""

    def write(self, data: bytes) -> None:
        """Keep a serialized document (the last one stays as the previous copy)."""
        self._check()
        self.previous, self.current = self.current, data
        self.writes += 1

    def append_history(self, records: list[dict[str, Any]]) -> None:
        """Keep finished windows."""
        self._check()
        self.history_records.extend(records)

    def history(self, limit: int = 20) -> list[dict[str, Any]]:
        """Return the last windows."""
        return self.history_records[-limit:]

    def load(self) -> Loaded:
        """Read back the newest usable document."""
        for data in (self.current, self.previous):
            if data is not None:
                return Loaded(decode(data), [])
        return Loaded(None, [])

    def document(self) -> Document | None:
        """Return the newest document written."""
        return decode(self.current) if self.current is not None else None

    def set_aside(self) -> list[str]:
        """Nothing to set aside."""
        return []


class Slots:
    """strata's slots and its slot save directory (llama-server's --slot-save-path), and its model file."""

    PER_TOKEN = 160 * 1024  # bytes of KV cache per token (a 27B-class model's, at f16)

    def __init__(self, world: World) -> None:
        self.world = world
        self.files: dict[str, tuple[int, int]] = {}  # name: (tokens, bytes)
        self.tokens: dict[int, int] = {}
        self.starts = -1  # strata's starts when ``tokens`` was last true: a start empties its slots
        self.restored = 0  # tokens restored, ever

    def held(self) -> dict[int, int]:
        """Return what each slot holds now: an agent's context once strata has served since its start."""
        strata = self.world.systemd.units.get("strata.service")
        starts = strata.starts if strata is not None else 0
        if starts != self.starts:
            self.starts, self.tokens = starts, {0: AGENT_TOKENS, 1: 0}
        return self.tokens

    def identity(self, path: str) -> FileIdentity:
        """Stat the model file."""
        if path not in self.world.files.sizes:
            raise FilesError(f"{path}: No such file or directory")
        return FileIdentity(path, self.world.files.sizes[path], 1, 7)

    def listing(self, directory: str, prefix: str) -> dict[str, int]:
        """List the save directory's files."""
        if directory != SLOTS:
            raise FilesError(f"{directory}: No such file or directory")
        return {n: b for n, (_, b) in self.files.items() if n.startswith(prefix)}

    def free(self, directory: str) -> int:
        """Say how much room the disk has."""
        return 500 * GiB - sum(b for _, b in self.files.values())

    def remove(self, directory: str, names: list[str]) -> list[str]:
        """Remove files of the save directory."""
        return [n for n in names if self.files.pop(n, None) is not None]


class Files:
    """The page cache of the model files: a file is read in at READ_RATE, and evicted when an engine boots."""

    READ_RATE = 2e9  # bytes per second from disk

    def __init__(self, world: World) -> None:
        self.world = world
        self.sizes: dict[str, int] = {f"{MODELS}/strata.gguf": MODEL_BYTES}
        self.cached: dict[str, int] = dict(self.sizes)
        self.mem_available = 64 * GiB
        self.reads: list[tuple[float, float]] = []  # (started, ended) of every prefetch that read to the end

    def evict(self) -> None:
        """Push every file out of the page cache."""
        self.cached = dict.fromkeys(self.sizes, 0)

    def measure(self, paths: list[str]) -> Measured:
        """Measure each file at once (a path it does not know: no such file)."""
        return Measured(tuple(FileCache(p, p, self.sizes[p], self.cached[p]) if p in self.sizes
                              else FileCache(p, p, error="no such file") for p in paths), self.mem_available)

    def prefetch(self, paths: list[str], stop: threading.Event, progress: Progress) -> Any:
        """Read what is missing, in virtual time (an awaitable: the simulation's pool awaits it)."""
        future: asyncio.Future[Progress] = asyncio.get_running_loop().create_future()
        known = [p for p in paths if p in self.sizes]
        missing = sum(self.sizes[p] - self.cached[p] for p in known)
        started = self.world.clock.now

        def done() -> None:
            if not stop.is_set():  # a prefetch stopped meanwhile reads no further
                for p in known:
                    progress.read += self.sizes[p] - self.cached[p]
                    progress.cached += self.sizes[p] - self.cached[p]
                    self.cached[p] = self.sizes[p]
                self.reads.append((started, self.world.clock.now))
            if not future.done():
                future.set_result(progress)

        self.world.scheduler.after(missing / self.READ_RATE, done)
        return future


# -- the whole machine ---------------------------------------------------------------------------------


class Peers:
    """What the OS says of the simulation's clients (gpuswapd.server.peers.Host): their processes and units.

    A client is the process the simulation hands in with its Peer; one that is a unit's main process
    runs in that unit's cgroup, and the unit runs as the uid ``run_as`` gives it (``User=``).
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self.run_as: dict[str, int] = {}  # unit -> the uid of its User=

    def peer(self, sock: Any) -> Peer:
        """Nothing connects through a socket here: the simulation hands each peer in."""
        raise AssertionError("the simulation serves streams with their peer, not sockets")

    def process(self, peer: Peer) -> Process | None:
        """Read a client's process: in its unit's cgroup if it is that unit's main process."""
        unit = self.world.systemd.unit_of_pid(peer.pid)
        cgroup = f"/system.slice/{unit}" if unit is not None and unit.endswith(".service") else None
        return Process(peer.pid, peer.uid, (peer.pid,), 0, cgroup)

    def still(self, peer: Peer) -> bool:
        """A client's pid is never reused while it runs."""
        return True

    def unit_cgroup(self, unit: str) -> str | None:
        """Ask the simulated manager for a unit's cgroup."""
        return self.world.systemd.control_group(unit)

    def unit_of_pid(self, pid: int) -> str | None:
        """Ask the simulated manager which unit a process is in."""
        return self.world.systemd.unit_of_pid(pid)

    def service(self, unit: str) -> ServiceProcesses:
        """Say whose a unit's processes are: its User= (``run_as``) and its main process."""
        u = self.world.systemd.units.get(unit)
        uid = self.run_as.get(unit)
        return ServiceProcesses(unit, "" if uid is None else str(uid), False, u.pid if u is not None else 0, 0)

    def process_in(self, cgroup: str, pid: int) -> Process | None:
        """Find a unit's main process."""
        unit = cgroup.rsplit("/", 1)[-1]
        u = self.world.systemd.units.get(unit)
        if u is None or u.pid != pid or not pid:
            return None
        return Process(pid, self.run_as.get(unit, 0), (pid,), 0, cgroup)

    def user_id(self, name: str) -> int | None:
        """Resolve a uid written as a number (User= here is always one)."""
        return int(name) if name.isdigit() else None

    def user_name(self, uid: int) -> str:
        """Name a user by its uid."""
        return str(uid)

    def group_id(self, name: str) -> int | None:
        """Resolve the socket group: root's (0), as the simulation's configuration names it."""
        return 0 if name == "root" else None


class World:
    """One machine: its card, systemd, Docker, the servers, the state directory, and the clock."""

    def __init__(self, clock: VirtualClock, total: int, exit_lag: float, sleep_lag: float) -> None:
        self.clock = clock
        self.scheduler = Scheduler(clock)
        self.card = Card(clock, total, exit_lag, sleep_lag)
        self.systemd = Systemd(self)
        self.docker = Docker(self)
        self.http = Http(self)
        self.files = Files(self)
        self.slots = Slots(self)
        self.store = Store(clock)
        self.peers = Peers(self)
        self.resident_units: tuple[str, ...] = ()
        self.agent_runs = 0
        self.agent_failures: list[str] = []
        self.short_starts: list[str] = []  # the resident fit itself smaller: it was started short of memory
        self.timer_violations: list[str] = []  # invariant 12: a timer started before the resident answered

    def resident_serves(self) -> bool:
        """Tell whether the resident answers completions now (its units active)."""
        return all(self.systemd.units[u].active_state == "active" for u in self.resident_units)

    def resident_up(self) -> bool:
        """Tell whether the resident's units are up or coming up."""
        return all(self.systemd.units[u].active_state in ("active", "activating") for u in self.resident_units)

    def last_resident_start(self) -> float:
        """Return when gpuswapd last made the resident's units active (0 if never); its operator's starts aside."""
        mine = [t for u in self.resident_units for t in self.systemd.units[u].started_at
                if t not in self.systemd.operator_started]
        return max(mine, default=0.0)

    def new_incarnation(self, loop: asyncio.AbstractEventLoop) -> None:
        """A daemon starts (its predecessor is dead): forget what the dead one registered."""
        self.systemd.watchers = []
        self.systemd.resume_watchers = []
        self.systemd.jobs = JobResults()
        for _, future, action in self.docker.exit_waiters:
            self.scheduler.cancel(action)
            del future
        self.docker.exit_waiters = []
        self.scheduler.attach(loop)
