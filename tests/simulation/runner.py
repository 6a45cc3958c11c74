"""Play one history: the real daemon, its clients and the world, on virtual time, with the invariants checked.

``play(setup, events)`` returns what went wrong (the first violation of each invariant) and,
when asked, a trace of every event, phase change and daemon log line. Nothing here is random:
the same setup and events give the same run.

The invariants, checked after every event and every virtual second, and once all is quiet (no
lease, queue or waiter, and quiet for longer than ``daemon.reconcile``):

 1. Quiescent means restored: the resident's units are up, and verified by a completion after
    gpuswapd last started them; exactly the timers that ran at the start run (a baseline restore
    too starts only what gpuswapd stopped); no window record in memory or on disk; no container
    but a parked, sleeping, recorded engine whose residual leaves ``gpu.resident_needs`` free.
    The resident has the context its operator last configured (``-c``; a reconfiguration and
    restart may come while gpuswapd is idle or down), and gpuswapd's baseline says so: the
    baseline follows the operator, and no close repairs a resident that came back as configured.
 2. The resident is down only while a window record exists in memory or on disk (after a
    SIGKILL; while gpuswapd is down, its marks of the units it stopped count), while its operator
    holds it down, or within ``daemon.reconcile`` (and a start) of
    gpuswapd being idle after it crashed (systemd's Restart= brings it back; gpuswapd never does).
 3. No out-of-memory on the card, ever (but an engine started by a Docker call that outlived
    its deadline and landed late, which gpuswapd could not stop).
 4. A lease ends only for a reason: its release, its expiry, its unit stopping, its bound
    connection ending, a preemption (whose preemptor could open when it was noticed), a failed
    window (the engine gave up, the opening or the recovery rolled it back), a shutdown, or a
    baseline restore (no state readable). And it ends at its expiry, not much later: the one its
    client was told, or, once gpuswapd started again, a renewal's that was refused or never
    answered (its write may have landed late, and a start trusts the disk).
 5. A READY window of profile P grants a request for P at once, unless a preemption is under
    way, the window is closing or has a switch pending, fairness blocks joins, or the window is
    DEGRADED (or the state directory, which a grant waits for, is failing).
 6. Every client that stays connected gets exactly one final reply; what gpuswapd keeps unread
    for one client stays under a fixed bound (a client dropped for not reading is answered).
 7. After any SIGKILL, 1 holds again once the restarted daemon quiesces (the same final check).
Beyond the seven:
 8. A held connection hears of a preemption only for a lease it holds, of its own window.
 9. No exception escapes its owner: no "Task exception was never retrieved", and none of
    gpuswapd's own bug reports (task_failed, window_driver_failed, request_crashed, ...).
10. "Won't fit" is said only of memory that others than gpuswapd's own processes hold.
11. A shutdown with on_shutdown = "restore" exits 0 only with the resident back, the timers
    resumed and no window on disk (or when its operator holds the resident down).
12. A timer gpuswapd starts runs again only once the resident serves and, if it was started
    again, has answered a completion since that start (agents never meet a dead resident).
13. A lease on an engine is granted only after a completion from that engine since its last
    start or wake (READY is never granted on /health alone).
14. gpuswapd starts a unit (14) or a timer (14t) only to undo its own stop, whatever its
    operator did and whenever.
15. gpuswapd never spins: time moves on within ``loop.SPIN_TURNS`` turns of its event loop (a
    loop that waits for time without sleeping burns a core in service, and fills the memory here).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import inspect
import json
import logging
import math
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from gpuswapd import clock, ids, tasks, workers
from gpuswapd.config import Config, parse_config
from gpuswapd.daemon import Daemon, Systems
from gpuswapd.errors import ConfigError, GpuswapError
from gpuswapd.observe.metrics import window_now
from gpuswapd.outside import _ERRORS, Late, close_unawaited
from gpuswapd.phases import Phase
from gpuswapd.protocol import encode
from gpuswapd.server.peers import Peer
from gpuswapd.state.marks import memory_marks
from tests.simulation import world as world_module
from tests.simulation.history import Setup
from tests.simulation.loop import EPOCH, Deadlock, Spin, VirtualClock, VirtualLoop
from tests.simulation.streams import Connection
from tests.simulation.world import EngineSpec, Fit, GiB, Unit, World

# strata's llama-server: 12 GiB of weights, 1 MiB of KV cache per token of its 8192 (two slots of
# 4096), 1 GiB of compute buffers; llama.cpp's --fit leaves 1 GiB free besides (--fit-target), and
# shrinks the context to no less than 4096 (--fit-ctx) when that does not fit.
FIT = Fit(weights=12 * GiB, kv_per_token=1 << 20, margin=1 * GiB, target=1 * GiB, ctx=8192, slots=2, min_ctx=4096)
RESIDENT_BYTES = FIT.claim(FIT.ctx)  # 21 GiB
RESIDENT_NEEDS = RESIDENT_BYTES + FIT.target  # what it needs free to come back as it was
ENGINE_BYTES = int(19.5 * GiB)
TOTAL_BYTES = 24 * GiB
CHECK_EVERY_S = 1.0
QUIET_WITHIN_S = 6 * 3600.0
RECLAIM_AFTER_S = 1.0  # gpuswapctl sends its acquire again this soon after gpuswapd went away
SLURM_RECONCILE_S = 300.0  # gpuswapd-slurm-reconcile.timer: OnUnitActiveSec=5min
SERVER_CAP = 16 * 1024  # the socket server's cap on what one client leaves unread, smaller than in service
BUFFER_BOUND = SERVER_CAP + 4 * 1024  # the cap and one line more
UIDS = {"root": (0, 0), "alice": (50001, 0), "bob": (50002, 0), "eve": (50003, 50003)}
FAULT_HEALS_S = 120.0
LATE_EXPIRY_S = 60.0  # a lease still held this long after its expiry was not ended by it
HANG_LATE_S = 90.0  # a hung blocking call answers this late: past every lane's deadline
BUGS = ("task_failed", "window_driver_failed", "window_open_crashed", "request_crashed", "client_handler_crashed",
        "window_driver_interrupted")


@dataclass
class Violation:
    """An invariant that did not hold, when, and what was seen."""

    invariant: str
    at: float
    detail: str

    def __str__(self) -> str:
        return f"invariant {self.invariant} at {self.at:.2f}s: {self.detail}"


@dataclass
class Outcome:
    """What one history did."""

    violations: list[Violation]
    trace: list[str]
    events: int
    windows: int
    virtual_s: float
    buffered: int = 0


class Record:
    """What a run saw: its violations and its trace (kept apart from the run, which is thrown away)."""

    def __init__(self, clock: VirtualClock, tracing: bool) -> None:
        self.clock = clock
        self.tracing = tracing
        self.trace: list[str] = []
        self.violations: dict[str, Violation] = {}
        self.buffered = 0  # the most gpuswapd kept unread for one client

    def note(self, what: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.clock.now:9.2f}  {what}")

    def violate(self, invariant: str, detail: str) -> None:
        if invariant not in self.violations:
            self.violations[invariant] = Violation(invariant, self.clock.now, detail)
            self.note(f"VIOLATION of invariant {invariant}: {detail}")


class SimPool:
    """Runs a blocking call on the loop itself; an awaitable answer is awaited; a Late one comes late."""

    def __init__(self, name: str, count: int) -> None:
        self.name = name

    def submit(self, work: Callable[[], Any], done: workers.Done, late: float = 0.0) -> None:
        loop = asyncio.get_running_loop()

        def run() -> None:
            try:
                result = work()
            except BaseException as err:  # handed to the awaiting side, as a thread would
                done(None, err)
                return
            if inspect.isawaitable(result):
                future = asyncio.ensure_future(result)

                def finished(f: asyncio.Future[Any]) -> None:
                    if f.cancelled():
                        done(None, asyncio.CancelledError())
                    elif f.exception() is not None:
                        done(None, f.exception())
                    else:
                        done(f.result(), None)

                future.add_done_callback(finished)
            else:
                done(result, None)

        if late > 0:
            asked = loop.time()

            def late_run() -> None:
                world_module.LATE[0] = True  # what a call that outlived its deadline does now is not gpuswapd's choice
                world_module.LATE_ASKED[0] = asked
                try:
                    run()
                finally:
                    world_module.LATE[0] = False
            loop.call_later(late, late_run)
        else:
            loop.call_soon(run)

    def close(self) -> None:
        """Nothing to close."""


async def _late(awaitable: Any) -> Any:
    try:
        await asyncio.sleep(3600)  # its deadline cancels it first
    except BaseException:
        close_unawaited(awaitable)
        raise
    return await awaitable


@dataclass
class Fault:
    """A transient failure of one outside call: it fails ``times`` times, or until it heals."""

    kind: str
    times: int
    until: float


class Faults:
    """The lanes' hook: the outside calls that fail now, and how."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.calls: dict[tuple[str, str], list[Fault]] = {}
        self.env_until = 0.0
        self.fired: dict[str, float] = {}
        self.late_jobs: list[float] = []  # when a call to queue systemd jobs hung: it lands HANG_LATE_S later

    def add(self, system: str, call: str, kind: str, times: int) -> None:
        self.calls.setdefault((system, call), []).append(Fault(kind, times, self.run.clock.now + FAULT_HEALS_S))

    def active(self, systems: tuple[str, ...]) -> bool:
        """Tell whether a fault of these systems may fire now, or fired recently (a hung call is still out)."""
        now = self.run.clock.now
        if any(now - self.fired.get(system, -1e9) < HANG_LATE_S + 5 for system in systems):
            return True
        return any(f.until > now and f.times > 0 for (s, _), fs in self.calls.items() if s in systems for f in fs)

    def heal(self) -> None:
        self.calls.clear()
        self.env_until = 0.0

    async def inject(self, system: str, call: str, asynchronous: bool) -> Any:
        now = self.run.clock.now
        if system == "docker" and call == "env_file" and now < self.env_until:
            return _unreadable
        pending = self.calls.get((system, call))
        while pending and (pending[0].until <= now or pending[0].times <= 0):
            pending.pop(0)
        if not pending:
            return None
        fault = pending[0]
        fault.times -= 1
        self.fired[system] = now
        self.run.note(f"fault fires: {system}.{call} {fault.kind}")
        if fault.kind == "raise":
            if system == "state":
                raise OSError(errno.EIO, "Input/output error (simulated)")
            raise _ERRORS[system](f"simulated failure of {system}.{call}")
        if system == "systemd" and call == "queue_jobs":
            self.late_jobs.append(now)
        if system == "systemd" and call == "job":
            return self._unanswered_job
        return _late if asynchronous else Late(HANG_LATE_S)

    async def _unanswered_job(self, awaitable: Any) -> Any:
        """A call that queues systemd jobs and awaits them hangs: gpuswapd never learns whether a stop was done.

        (The world does not do it.) A unit of it that goes down meanwhile, a crash say, may as
        well have been stopped by it, as far as gpuswapd can tell: invariant 14 counts that stop
        as gpuswapd's, whose restore brings back what it may have stopped.
        """
        frame = getattr(awaitable, "cr_frame", None)
        args = frame.f_locals if frame is not None else {}
        if args.get("method") == "StopUnit":
            for unit in args.get("units") or ():
                self.run.world.systemd.stop_unanswered[unit] = self.run.clock.now
        return await _late(awaitable)


def _unreadable(work: Callable[[], Any]) -> Callable[[], Any]:
    def fail() -> Any:
        from gpuswapd.errors import DockerError
        raise DockerError("cannot read the env file ([window.container] env_file): [Errno 13] Permission denied "
                          "(simulated)")
    return fail


@dataclass(eq=False)
class Client:
    """One client process (gpuswapctl acquire, gpuswapctl run, or a unit's ExecStartPre)."""

    id: str
    spec: dict[str, Any]
    peer: Peer
    unit: str | None = None
    conn: Connection | None = None
    conns: list[Connection] = field(default_factory=list)
    finals: int = 0
    reply: dict[str, Any] | None = None
    lease: str | None = None
    window: str | None = None
    granted_at: float = 0.0
    released: bool = False
    releasing: bool = False
    release_sent: bool = False  # a release went out (whatever became of its reply)
    revoked: bool = False
    running: bool = False  # its command (run) or its service (unit) runs
    renewer: int | None = None
    ender: int | None = None
    vram_key: str | None = None
    dropped: str | None = None  # why its connection went: "kill", "shutdown"
    hung_up: bool = False
    request: dict[str, Any] | None = None  # its acquire, as sent
    token: str | None = None  # its reclaim token (the "accepted" event)
    reclaims: int = 0  # how many times it sent its acquire again after gpuswapd went away

    @property
    def kind(self) -> str:
        return "unit" if self.spec["as"] == "unit" else str(self.spec["kind"])

    @property
    def wants(self) -> bool:
        """Tell whether it still waits for something (a reply, its command's end)."""
        waiting = (self.conn is not None and self.finals == 0 and self.conn.open and self.spec.get("reads", True)
                   and self.dropped is None)
        return waiting or self.running or self.releasing


class Host:
    """The daemon's process: started, killed, shut down and started again."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.state = "down"
        self.daemon: Daemon | None = None
        self.backlog: list[tuple[Peer, Connection]] = []
        self.connections: list[Connection] = []
        self.boots = 0
        self.kill_pending: int | None = None

    def start(self) -> None:
        if self.state != "down":
            return
        self.state = "starting"
        self.boots += 1
        self.run.boot_times.append(self.run.clock.now)
        tasks.spawn(self._boot(), "sim-boot")

    async def _boot(self) -> None:
        run = self.run
        daemon = Daemon(run.config, systems=Systems(run.world.systemd, run.world.docker, run.world.http,  # type: ignore[arg-type]
                                                    run.world.card, run.world.store,  # type: ignore[arg-type]
                                                    files=run.world.files, host=run.world.peers,
                                                    slot_files=run.world.slots))
        daemon.outside.inject(run.faults.inject)
        daemon.server.max_buffered = SERVER_CAP
        daemon.window.notifier = daemon.notifier = run.notifier  # type: ignore[assignment]
        daemon.window.finished.append(lambda finished: run.window_finished(finished.to_dict()))
        try:
            await daemon.connect()
        except (ConfigError, GpuswapError) as err:
            run.note(f"gpuswapd did not start: {err.message}")
            run.world.systemd.watchers = []  # the process that registered them has exited
            self.state = "down"
            run.world.scheduler.after(10.0, self.start)  # systemd (or its operator, once fixed) starts it again
            return
        self.daemon = daemon
        await daemon.begin()
        if self.daemon is not daemon:
            return
        self.state = "up"
        run.note(f"gpuswapd up (start {self.boots})")
        backlog, self.backlog = self.backlog, []
        for peer, conn in backlog:
            self._serve(peer, conn)

    def connect(self, peer: Peer) -> Connection:
        conn = Connection()
        self.connections.append(conn)
        if self.state == "up":
            self._serve(peer, conn)
        else:
            self.backlog.append((peer, conn))  # the socket unit keeps it until gpuswapd accepts
        return conn

    def _serve(self, peer: Peer, conn: Connection) -> None:
        if conn.hung_up:
            return
        assert self.daemon is not None
        self.daemon.server.serve_streams(peer, conn.server_reader, conn.server_writer)

    def kill(self, why: str) -> None:
        """SIGKILL: the process is gone with everything it had; no finally block runs."""
        self.run.note(f"SIGKILL ({why})")
        # Every connection goes with the loop that served it (even those the socket unit still held:
        # the simulation's clients live on that loop too).
        for conn in self.connections:
            if conn.open:
                self.run.dropped(conn, "kill")
        self.connections, self.backlog = [], []
        self.state, self.daemon = "down", None
        self.run.abandon()

    async def shutdown(self, restart_after: float) -> None:
        daemon = self.daemon
        if daemon is None or self.state != "up":
            return
        self.state = "stopping"
        self.run.note("SIGTERM: gpuswapd shuts down (on_shutdown = restore)")
        self.run.shutdowns.append(self.run.clock.now)
        for conn in self.connections:
            if conn.open:
                self.run.dropped(conn, "shutdown")
        status = await daemon.shutdown()
        if self.daemon is not daemon:
            return
        self.run.note(f"gpuswapd exited with status {status}")
        self.run.check_exit(daemon, status)
        for conn in self.connections:
            if conn.open:
                self.run.dropped(conn, "shutdown")
        self.state, self.daemon = "down", None
        self.connections, self.backlog = [], []
        self.run.world.scheduler.after(restart_after, self.start)
        self.run.abandon()


class Run:
    """One history being played."""

    def __init__(self, setup: Setup, events: list[dict[str, Any]], record: Record,
                 graveyard: list[VirtualLoop]) -> None:
        self.setup = setup
        self.events = events
        self.record = record
        self.tracing = record.tracing
        self.clock = record.clock
        self.config: Config = parse_config(setup.toml(), "<simulation>")
        self.world = self._build_world()
        self.faults = Faults(self)
        self.host = Host(self)
        self.clients: dict[str, Client] = {}
        self.leases: dict[str, Client] = {}
        self.requests: list[tuple[Client, Connection, str]] = []
        self.unjudged: dict[str, Client] = {}  # leases gone while their window still closes
        self.ending = False
        self.quiet_since: float | None = None
        self.idle_since: float | None = None
        self.lease_expiry: dict[str, float] = {}
        # Renewals refused (their state write failed) or never answered, as (asked at, the expiry
        # asked for): a write that hung may still land, and the next start trusts what the disk got.
        self.unconfirmed_renewals: dict[str, list[tuple[float, float]]] = {}
        self.boot_times: list[float] = []
        self.finished: dict[str, dict[str, Any]] = {}
        self.shutdowns: list[float] = []
        self.held: list[list[float]] = []  # [stopped, started]: the operator held the resident down
        self.held_for_good = False  # its operator stopped the resident and never starts it again
        self.crashes: list[float] = []
        self.baseline_restores: list[float] = []
        self.images_gone: list[tuple[float, float, str]] = []
        self.env_unreadable: list[tuple[float, float]] = []
        self.suspends: list[tuple[float, float]] = []  # (virtual time, seconds slept)
        self.loop: VirtualLoop | None = None
        self.graveyard = graveyard
        self.done = False
        self.ended_at = 0.0
        self._pids = iter(range(5_000_000, 6_000_000))
        self._last_status = ""
        self._status_key: tuple[Any, ...] = ()
        self.windows = 0
        self.notifier = _Notifier(self)
        self.initial_timers = {name: t.active for name, t in self.world.systemd.timer_units.items()}

    # -- the world -----------------------------------------------------------------------------

    def _build_world(self) -> World:
        s = self.setup
        world = World(self.clock, TOTAL_BYTES, s.exit_lag, s.sleep_lag)
        sd = world.systemd
        sd.add(Unit("strata.service", "active", gpu_bytes=RESIDENT_BYTES, start_s=s.resident_start, stop_s=0.3,
                    fit=FIT))
        sd.add(Unit("llama-swap.service", "active", requires=("strata.service",), start_s=0.2, stop_s=0.1))
        world.resident_units = ("strata.service", "llama-swap.service")
        sd.add_timer("agent-triage.timer", True, 47.0, 4.0)
        sd.add_timer("agent-review.timer", True, 113.0, 9.0)
        sd.add_timer("agent-digest.timer", True, 301.0, 2.0)
        sd.add_timer("agent-off.timer", False, 60.0, 1.0)
        sd.add_timer("backup-models.timer", True, 900.0, 30.0)
        residual = int(s.residual_gib * GiB)
        world.docker.images = {"hyperqwen:latest", "qwen-eval:latest"}
        world.docker.specs["hyperqwen"] = EngineSpec(ENGINE_BYTES, residual, s.engine_boot)
        world.docker.specs["qwen-eval"] = EngineSpec(ENGINE_BYTES, residual, s.eval_boot, sleeps=s.eval_sleeps)
        world.http.engines = {"engine.sim:18020": "hyperqwen", "eval.sim:18021": "qwen-eval"}
        sd.in_restore = self._restoring
        sd.stop_asked = self._stop_asked
        sd.logind = all(e.get("told", True) for e in self.events if e["do"] == "suspend")
        return world

    def _restoring(self, unit: str | None = None) -> bool:
        daemon = self.host.daemon if self.host.state in ("up", "stopping") else None
        if daemon is None:  # killed in its restore: the record it left says so, and the next start goes on with it
            sd = self.world.systemd
            # A restore ends by resuming the timers its window paused, after its verify: once they all
            # run again, it is over, whatever the disk still says (its last writes may land late).
            paused = any(sd.stopped_by.get(t) == "gpuswapd" and not timer.active for t, timer in sd.timer_units.items())
            data = self.world.store.current
            if data is not None and paused and \
                    any(f'"phase":"{p}"'.encode() in data for p in (Phase.RESTORING, Phase.DEGRADED)):
                return True
            # Or the restore's start of this unit is recorded (state/marks.py, "starting": the phase's
            # own write may not have landed) and the timers it paused are paused still: it has not ended.
            return unit is not None and unit in memory_marks(self.world.store, "starting").read() and paused
        rec = daemon.window.record
        return rec is not None and rec.phase in (Phase.RESTORING, Phase.DEGRADED)

    def _stop_asked(self, unit: str) -> bool:
        """Tell whether gpuswapd's stop of ``unit`` is out: marked, and its jobs' call hung (it lands late)."""
        now = self.clock.now
        return any(asked <= now < asked + HANG_LATE_S for asked in self.faults.late_jobs) \
            and unit in memory_marks(self.world.store).read()

    def container_of(self, profile: str) -> str | None:
        return {"default": "hyperqwen", "eval": "qwen-eval"}.get(profile)

    # -- the trace ---------------------------------------------------------------------------

    def note(self, what: str) -> None:
        self.record.note(what)

    def status_line(self, line: str) -> None:
        phase = line.split(" ", 1)[0].split(",")[0]
        if phase != self._last_status:
            self._last_status = phase
            self.note(f"  phase {line}")

    def window_finished(self, record: dict[str, Any]) -> None:
        self.windows += 1
        if record.get("baseline") is not None:
            self.baseline_restores.append(self.clock.now)
        self.finished[str(record.get("id"))] = record
        self._check_no_repair(record)
        self.note(f"  window {record.get('id')} finished: {record.get('outcome')} (profile {record.get('profile')})")

    def _check_no_repair(self, record: dict[str, Any]) -> None:
        """Invariant 1: a close repairs the resident only when it came back smaller than its operator configured it.

        One that came back with the context its units' ``-c`` gives it runs as its operator wants:
        a baseline that says otherwise is stale (its operator reconfigured it), not the resident.
        """
        changed = record.get("resident_changed")
        now = changed.get("now") if isinstance(changed, dict) else None
        strata = self.world.systemd.units["strata.service"]
        if not isinstance(now, dict) or now.get("n_ctx") is None or strata.fit is None:
            return
        full = strata.fit.ctx // strata.fit.slots
        if int(now["n_ctx"]) >= full:
            was = changed.get("was") if isinstance(changed, dict) else None
            self.violate("1", f"window {record.get('id')}'s close repaired a resident that came back as its operator "
                              f"configured it (n_ctx {now['n_ctx']}, -c {strata.fit.ctx}): gpuswapd's baseline said "
                              f"n_ctx {was.get('n_ctx') if isinstance(was, dict) else '?'}")

    def violate(self, invariant: str, detail: str) -> None:
        self.record.violate(invariant, detail)

    # -- incarnations ------------------------------------------------------------------------

    def abandon(self) -> None:
        """End this incarnation's loop: its tasks never run again."""
        assert self.loop is not None
        self.world.scheduler.detach()
        self.loop.stop()

    def play(self) -> Outcome:
        for event in self.events:
            self.world.scheduler.at(float(event["at"]), lambda e=event: self.do(e))
        self.ended_at = max((float(e["at"]) for e in self.events), default=0.0) + 1.0
        self.world.scheduler.at(self.ended_at, self.end)
        self.world.scheduler.at(CHECK_EVERY_S, self.tick)
        self.world.scheduler.at(0.0, self.host.start)
        while not self.done:
            loop = VirtualLoop(self.clock)
            self.loop = loop
            loop.selector.on_turn = self._status_probe
            asyncio.set_event_loop(loop)
            self.world.new_incarnation(loop)
            try:
                loop.run_forever()
            except Deadlock as err:
                self.violate("liveness", f"the simulation deadlocked: {err}")
                self.done = True
            except Spin as err:
                self.violate("15", f"{err}{self._spinning(loop)}")
                self.done = True
            self.graveyard.append(loop)
            if self.clock.now > self.ended_at + QUIET_WITHIN_S + 60:
                self.done = True
        return Outcome(sorted(self.record.violations.values(), key=lambda v: v.at), self.record.trace,
                       len(self.events), self.windows, self.clock.now, self.record.buffered)

    # -- events --------------------------------------------------------------------------------

    def do(self, e: dict[str, Any]) -> None:
        what = e["do"]
        self.note(f"event {json.dumps({k: v for k, v in e.items() if k != 'at'}, sort_keys=True)}")
        handler = getattr(self, f"_do_{what}", None)
        if handler is None:
            raise ValueError(f"unknown event {what!r}")
        handler(e)
        self.check_now()

    def _do_acquire(self, e: dict[str, Any]) -> None:
        who = e["as"]
        unit = None
        if who == "unit":
            unit = f"job-{e['id']}.service"
            self.world.systemd.units[unit] = Unit(unit)
            self.world.systemd.start_now(unit)
            pid, (uid, gid) = self.world.systemd.units[unit].pid, UIDS["alice"]
            self.world.peers.run_as[unit] = uid  # User=alice: the unit is its client's own
        else:
            pid, (uid, gid) = next(self._pids), UIDS[who]
        if who == "unit" or e["kind"] == "run" or e["for"] == "infinity":
            e = {**e, "reads": True}  # only a plain acquire for a while may be a client that never reads
        c = Client(e["id"], e, Peer(pid, uid, gid), unit=unit, running=unit is not None)
        self.clients[c.id] = c
        request: dict[str, Any] = {"op": "acquire", "profile": e["profile"], "priority": e["priority"],
                                   "wait": e["wait"], "for": e["for"] if e["for"] == "infinity" else f"{e['for']:g}s"}
        if e.get("timeout"):
            request["timeout"] = f"{e['timeout']:g}s"
        if e["for"] == "infinity":  # as a Slurm Prolog takes it: by a holder name its Epilog releases
            request["holder"] = f"slurm-job-{c.id}"
        if c.kind == "run":
            request["bind"] = "connection"  # as gpuswapctl run asks: the lease ends with its connection
        c.request = request
        c.conn = self.host.connect(c.peer)
        c.conns.append(c.conn)
        c.conn.send(encode(request))
        self.expect_join(c)
        if e.get("reads", True):
            tasks.spawn(self._read(c, c.conn), "sim-client")

    async def _read(self, c: Client, conn: Connection) -> None:
        while True:
            line = await conn.readline()
            if not line:
                if c.conn is conn and c.finals == 0 and c.dropped is None and not conn.hung_up:
                    self.note(f"  {c.id}: connection closed with no reply")
                return
            message = json.loads(line)
            if message.get("event") == "accepted":
                c.token = message.get("token")
                continue
            if "ok" in message and not message["ok"] and message["error"].get("code") == "stopping" \
                    and self._reclaims(c):
                self.note(f"  {c.id}: told gpuswapd is stopping: it sends its request again with its token")
                c.dropped = "shutdown"
                self.world.scheduler.after(RECLAIM_AFTER_S, lambda: self._reclaim(c))
                return
            if "ok" in message:
                c.finals += 1
                if c.finals > 1:
                    self.violate("6", f"client {c.id} got a second final reply: {message}")
                self._final(c, message)
                if c.kind != "run" or not message["ok"]:
                    conn.hang_up()  # gpuswapctl acquire exits with the reply
                    return
            else:
                self._told(c, message)

    def _reclaims(self, c: Client) -> bool:
        """Tell whether a client sends its acquire again when gpuswapd goes away (as gpuswapctl does)."""
        return c.token is not None and c.unit is None and not c.hung_up and (
            c.finals == 0 or (c.kind == "run" and c.running and not c.revoked))

    def _reclaim(self, c: Client) -> None:
        """Send the acquire again with its token on a new connection (held by the socket unit until gpuswapd is up)."""
        if c.hung_up or c.request is None or c.token is None or (c.kind == "run" and not c.running and c.finals):
            return
        c.reclaims += 1
        c.dropped = None
        c.finals = 0
        c.conn = self.host.connect(c.peer)
        c.conns.append(c.conn)
        c.conn.send(encode({**c.request, "reclaim": c.token}))
        self.note(f"  {c.id}: sends its acquire again with its token ({c.reclaims})")
        tasks.spawn(self._read(c, c.conn), "sim-client")

    def _final(self, c: Client, message: dict[str, Any]) -> None:
        if c.kind == "run" and c.running and message["ok"]:  # reclaimed after a restart of gpuswapd
            lease = message["lease"]
            c.lease = lease["id"]  # the same lease, or a new one if it had ended meanwhile
            daemon = self.host.daemon
            c.window = daemon.window.record.id if daemon is not None and daemon.window.record is not None else None
            expires = lease.get("expires_at")
            self.lease_expiry[c.lease] = math.inf if expires is None else self._on_virtual(float(expires))
            self.leases[c.lease] = c
            self.note(f"  {c.id}: reclaimed lease {c.lease} on window {c.window}")
            return
        if c.kind == "run" and c.running:  # refused on its reclaim: its command runs on without a lease
            c.reply = message
            self.note(f"  {c.id}: its reclaim was refused: {message['error'].get('code')}")
            return
        c.reply = message
        if not message["ok"]:
            self.note(f"  {c.id}: refused: {message['error'].get('code')}: {message['error'].get('message')[:160]}")
            if message["error"].get("code") == "wont_fit":
                self._check_wont_fit(c, message["error"].get("message", ""))
            if c.unit is not None:  # ExecStartPre failed: the unit does not start
                c.running = False
                self.world.systemd.crash(c.unit)
            return
        lease = message["lease"]
        c.lease, c.granted_at = lease["id"], self.clock.now
        daemon = self.host.daemon
        c.window = daemon.window.record.id if daemon is not None and daemon.window.record is not None else None
        expires = lease.get("expires_at")
        self.lease_expiry[c.lease] = math.inf if expires is None else self._on_virtual(float(expires))
        self.leases[c.lease] = c
        self.note(f"  {c.id}: lease {c.lease} on window {c.window} ({message.get('profile')})")
        self._check_engine_answered(c, str(message.get("profile")))
        if self.ending and c.spec.get("for") == "infinity" and c.kind == "acquire":
            c.releasing = c.release_sent = True  # its Epilog, once the history is over
            self.request(c, {"op": "release", "holder": f"slurm-job-{c.id}"}, self._released)
        if c.kind == "run":
            c.running = True
            if message.get("kind") == "bare":
                self._allocate(c)
            duration = float(lease["expires_at"] - lease["granted_at"]) if expires is not None else None
            if duration is not None:
                c.renewer = self.world.scheduler.after(max(1.0, duration / 2), lambda: self._renew_run(c, duration))
            c.ender = self.world.scheduler.after(float(c.spec["cmd_s"]), lambda: self._command_ends(c))
        elif c.unit is not None:
            c.ender = self.world.scheduler.after(float(c.spec["cmd_s"]), lambda: self._unit_ends(c))

    def _check_engine_answered(self, c: Client, profile: str) -> None:
        """Invariant 13: a lease on an engine only after a completion from it since its last start or wake."""
        name = self.container_of(profile)
        container = self.world.docker.containers.get(name) if name is not None else None
        if container is None:
            return  # a bare window: no engine to answer
        if not any(t >= container.since and who == name for t, who in self.world.http.completions):
            self.violate("13", f"client {c.id} was granted lease {c.lease} on engine {name} (window {c.window}), "
                               f"which has answered no completion since its start or wake at {container.since:.2f}s")

    def _check_wont_fit(self, c: Client, why: str) -> None:
        """Invariant 10: "won't fit" is said only of memory that others than gpuswapd's own hold."""
        card = self.world.card
        card.free()  # settle what has come free
        theirs = sum(h.bytes for name, h in card.holdings.items() if not name.startswith(("engine:", "strata.")))
        needs = self.config.profile(c.spec["profile"]).needs
        if card.total - theirs >= needs:
            self.violate("10", f"client {c.id} was refused wont_fit for profile {c.spec['profile']!r}, but only "
                               f"gpuswapd's own processes hold the memory ({card.describe()}): {why[:200]}")

    def _allocate(self, c: Client) -> None:
        """A bare window's command takes its memory; holders that overcommit among themselves are their own fault."""
        want = int(c.spec["bare_gib"] * GiB)
        theirs = sum(h.bytes for name, h in self.world.card.holdings.items() if name.startswith("run:"))
        if theirs + want > self.config.profile("bare").needs:
            self.note(f"  {c.id}: its command does not allocate: the bare window's holders would overcommit")
            return
        c.vram_key = f"run:{c.id}"
        self.world.systemd.scopes[c.peer.pid] = "session-2.scope"
        self.world.card.claim(c.vram_key, c.peer.pid, want)

    def _told(self, c: Client, message: dict[str, Any]) -> None:
        event = message.get("event")
        if event not in ("preempting", "preempted"):
            return
        live = c.lease is not None and c.lease in self.leases and not c.released
        if not live or message.get("window") != c.window:
            self.violate("8", f"client {c.id} (lease {c.lease} of window {c.window}, "
                              f"{'live' if live else 'ended'}) was told {event} of window {message.get('window')}")
        self.note(f"  {c.id}: told {event} by {message.get('by')}")
        if event == "preempted":
            c.revoked = True
        elif c.kind == "run" and c.running and not c.spec["ignores_term"]:
            self.world.scheduler.cancel(c.ender)
            c.ender = self.world.scheduler.after(float(c.spec["term_s"]), lambda: self._command_ends(c))

    def _renew_run(self, c: Client, duration: float) -> None:
        c.renewer = None
        if not c.running or c.hung_up or c.lease is None:
            return
        self._renew(c, duration)
        c.renewer = self.world.scheduler.after(max(1.0, duration / 2), lambda: self._renew_run(c, duration))

    def _renew(self, c: Client, duration: float) -> None:
        lease, entry = c.lease, (self.clock.now, self.clock.now + duration)
        if lease is not None:
            self.unconfirmed_renewals.setdefault(lease, []).append(entry)
        self.request(c, {"op": "renew", "lease": lease, "for": f"{duration:g}s"},
                     lambda c, reply: self._renewed(c, reply, lease, entry))

    def _renewed(self, c: Client, reply: dict[str, Any], lease: str | None, entry: tuple[float, float]) -> None:
        if reply.get("ok") and c.lease is not None:
            expires = reply["lease"].get("expires_at")
            self.lease_expiry[c.lease] = math.inf if expires is None else self._on_virtual(float(expires))
            if lease is not None and entry in self.unconfirmed_renewals.get(lease, []):
                self.unconfirmed_renewals[lease].remove(entry)

    def _command_ends(self, c: Client) -> None:
        if not c.running:
            return
        c.running = False
        self.world.scheduler.cancel(c.renewer)
        self.world.scheduler.cancel(c.ender)
        if c.vram_key is not None:
            self.world.card.release(c.vram_key)
            self.world.systemd.scopes.pop(c.peer.pid, None)
        self.note(f"  {c.id}: its command ended")
        if not c.revoked and not c.hung_up and c.lease is not None:
            self.release(c)
        if c.conn is not None:
            if c.finals == 0:  # it still waited for its reclaim's answer: gpuswapctl run exits, hanging up
                c.hung_up = True
            c.conn.hang_up()

    def _unit_ends(self, c: Client) -> None:
        if c.unit is not None and c.running:
            c.running = False
            self.world.systemd.crash(c.unit)

    def release(self, c: Client) -> None:
        if c.lease is None or c.released:
            return
        c.releasing = c.release_sent = True
        self.request(c, {"op": "release", "lease": c.lease}, self._released)

    def _epilog_failed(self, c: Client) -> None:
        """A Slurm job's release got no answer (gpuswapd killed under it): its Epilog failed.

        gpuswapd-slurm-reconcile.timer (every 5 minutes) releases the leases of jobs Slurm no longer runs.
        """
        if c.kind == "acquire" and c.spec.get("for") == "infinity" and c.release_sent and not c.released:
            self.world.scheduler.after(SLURM_RECONCILE_S, lambda: self._slurm_reconcile(c))

    def _slurm_reconcile(self, c: Client) -> None:
        if not c.released and not c.releasing:
            c.releasing = True
            self.request(c, {"op": "release", "holder": f"slurm-job-{c.id}"}, self._released)

    def _released(self, c: Client, reply: dict[str, Any]) -> None:
        c.releasing = False
        if reply.get("ok"):
            c.released = True

    def request(self, c: Client, request: dict[str, Any], then: Callable[[Client, dict[str, Any]], None]) -> None:
        """Send one request on a connection of its own, as a second gpuswapctl of the same client would."""
        conn = self.host.connect(c.peer)
        conn.send(encode(request))
        self.requests.append((c, conn, request["op"]))

        async def answer() -> None:
            line = await conn.readline()
            conn.hang_up()
            with contextlib.suppress(ValueError):
                self.requests.remove((c, conn, request["op"]))
            if line:
                then(c, json.loads(line))
            elif request["op"] == "release":
                c.releasing = False
                self._epilog_failed(c)

        tasks.spawn(answer(), "sim-request")

    def _client(self, e: dict[str, Any]) -> Client | None:
        return self.clients.get(str(e.get("id")))

    def _do_release(self, e: dict[str, Any]) -> None:
        c = self._client(e)
        if c is None:
            return
        if c.kind == "run":
            self._command_ends(c)  # the user's command finished
        elif c.kind == "unit":
            self._unit_ends(c)
        else:
            self.release(c)

    def _do_renew(self, e: dict[str, Any]) -> None:
        c = self._client(e)
        if c is not None and c.lease is not None and not c.released:
            self._renew(c, float(e["for"]))

    def _do_hangup(self, e: dict[str, Any]) -> None:
        c = self._client(e)
        if c is None or c.conn is None or not c.conn.open:
            return
        c.hung_up = True
        c.conn.hang_up()
        if c.kind == "run":  # gpuswapctl run was killed: its command runs on, nobody renews
            self.world.scheduler.cancel(c.renewer)
        if c.unit is not None and c.finals == 0:  # systemd killed the ExecStartPre: the unit failed
            c.running = False
            self.world.systemd.crash(c.unit)

    def _do_unit_stop(self, e: dict[str, Any]) -> None:
        c = self._client(e)
        if c is not None and c.unit is not None:
            if c.conn is not None and c.finals == 0:
                c.hung_up = True
                c.conn.hang_up()  # its ExecStartPre was still waiting: killed with the unit
            self._unit_ends(c)

    def _do_engine_dies(self, e: dict[str, Any]) -> None:
        name = self.container_of(str(e.get("profile")))
        if name is not None:
            self.world.docker.die(name)

    def _do_garble_wake(self, e: dict[str, Any]) -> None:
        self.world.docker.garble_wakes += 1

    def _do_fault(self, e: dict[str, Any]) -> None:
        self.faults.add(e["system"], e["call"], e["kind"], int(e["times"]))

    def _do_image_gone(self, e: dict[str, Any]) -> None:
        image = {"default": "hyperqwen:latest", "eval": "qwen-eval:latest"}.get(str(e.get("profile")))
        if image is not None and image in self.world.docker.images:
            self.world.docker.images.discard(image)
            self.world.scheduler.after(float(e["for"]), lambda: self.world.docker.images.add(image))
            self.images_gone.append((self.clock.now, self.clock.now + float(e["for"]), image))

    def _do_env_unreadable(self, e: dict[str, Any]) -> None:
        self.faults.env_until = max(self.faults.env_until, self.clock.now + float(e["for"]))
        self.env_unreadable.append((self.clock.now, self.faults.env_until))

    def _do_state_broken(self, e: dict[str, Any]) -> None:
        self.world.store.broken_until = self.clock.now + float(e["for"])
        self.world.store.broken_since = self.clock.now
        self.world.store.broken_errno = errno.ENOSPC if e["errno"] == "ENOSPC" else errno.EACCES

    def _do_resident_start_fails(self, e: dict[str, Any]) -> None:
        fails = self.world.systemd.fail_starts
        fails["strata.service"] = fails.get("strata.service", 0) + int(e["times"])

    def _do_sigkill(self, e: dict[str, Any]) -> None:
        if self.host.state not in ("up", "starting"):
            return
        self.world.scheduler.after(float(e["restart_after"]), self.host.start)
        if e.get("again_after"):
            self.world.scheduler.after(float(e["restart_after"]) + float(e["again_after"]),
                                       lambda: self._do_sigkill({"restart_after": e["restart_after"]}))
        self.host.kill("history")

    def _do_shutdown(self, e: dict[str, Any]) -> None:
        if self.host.state == "up":
            tasks.spawn(self.host.shutdown(float(e["restart_after"])), "sim-shutdown")

    def _do_churn(self, e: dict[str, Any]) -> None:
        """Clients that queue and hang up, one after another, 0.2 s each."""
        for n in range(int(e["n"])):
            self.world.scheduler.after(0.2 * n, lambda n=n: self._churn_one(e, n))

    def _churn_one(self, e: dict[str, Any], n: int) -> None:
        peer = Peer(next(self._pids), *UIDS["bob"])
        conn = self.host.connect(peer)
        conn.send(encode({"op": "acquire", "profile": e["profile"], "for": "60s", "timeout": "1s"}))
        self.world.scheduler.after(0.1, conn.hang_up)

    def _do_operator_stop(self, e: dict[str, Any]) -> None:
        """The operator stops the resident (systemctl stop strata) while no window is open, and starts it later."""
        daemon = self.host.daemon
        if self.host.state != "up" or daemon is None or daemon.window.record is not None \
                or not self.world.resident_serves():
            return
        self._operator("StopUnit", ["strata.service"])
        self.held.append([self.clock.now, math.inf])
        self.world.scheduler.after(float(e["for"]), self._operator_starts)

    def _operator_starts(self) -> None:
        if not self.held or not math.isinf(self.held[-1][1]) or self.held_for_good:
            return
        daemon = self.host.daemon
        if daemon is None or daemon.window.record is not None or self._disk_window() or \
                self.world.card.free() < RESIDENT_NEEDS:
            if daemon is not None and daemon.window.record is None and daemon.window.parked is not None:
                self._do_park_remove({})  # a parked engine would keep the card from ever being free
            self.world.scheduler.after(10.0, self._operator_starts)  # the operator waits for the card to be free
            return
        self.world.systemd.operator_jobs |= {"llama-swap.service", "strata.service"}
        self._operator("StartUnit", ["llama-swap.service"])
        # Its start takes a moment, and if it fails systemd's Restart= brings it back in its own time.
        self.held[-1][1] = self.clock.now + self.config.daemon.reconcile + 60.0
        self.world.scheduler.after(10.0, self._systemd_restarts)

    def _operator(self, method: str, units: list[str]) -> None:
        """The operator's own systemctl start or stop."""
        sd = self.world.systemd
        sd.operator_hand = True
        try:
            sd.queue_jobs(method, units)
        finally:
            sd.operator_hand = False

    def _do_operator_stop_while_down(self, e: dict[str, Any]) -> None:
        """gpuswapd is down (an upgrade, the Restart= gap) and its operator stops the resident meanwhile, for good.

        Awaiting a fix (issue 34 item 1): drawn only with --draw-all.
        """
        if self.host.state != "up" or not self.world.resident_serves():
            return
        daemon = self.host.daemon
        if daemon is None or daemon.window.record is not None or self._disk_window():
            return
        self.note("  the operator stops the resident while gpuswapd is down")
        self.host.kill("SIGKILL (an upgrade)")
        self._operator("StopUnit", ["strata.service"])
        self.held.append([self.clock.now, math.inf])
        self.held_for_good = True
        self.world.scheduler.after(float(e["restart_after"]), self.host.start)

    def _do_operator_reconfigures(self, e: dict[str, Any]) -> None:
        """Its operator gives the resident another context (a drop-in: ``-c``) and restarts it (gpuswapd idle or down).

        Issue 34 item 7: what its operator runs is the baseline from then on; no close repairs it
        (invariant 1), and its stop and start are the operator's (14).
        """
        daemon = self.host.daemon
        now = self.clock.now
        if self.host.state != "up" or daemon is None or daemon.window.record is not None or self._disk_window() \
                or not self.world.resident_serves() or self.held_for_good \
                or any(start <= now <= end for start, end in self.held):
            return
        ctx = int(e["ctx"])
        self.note(f"  the operator gives the resident -c {ctx} and restarts it (gpuswapd {e['while']})")
        if e["while"] == "down":
            self.host.kill("SIGKILL (an upgrade)")
            self.world.scheduler.after(float(e["restart_after"]), self.host.start)
        strata = self.world.systemd.units["strata.service"]
        strata.fit = replace(FIT, ctx=ctx, min_ctx=min(ctx, FIT.min_ctx))
        strata.exec_start = ("/usr/bin/llama-server", "-m", f"{world_module.MODELS}/strata.gguf",
                             "--slot-save-path", world_module.SLOTS, "-c", str(ctx))
        self._operator("StopUnit", ["strata.service"])
        self.held.append([now, math.inf])
        self.world.scheduler.after(0.5, self._operator_restarts)

    def _operator_restarts(self) -> None:
        """The start half of its operator's ``systemctl restart strata`` (Requires= restarts llama-swap with it)."""
        card = self.world.card
        card.free()
        # (Its server's memory is freed a moment after it exits: a start meanwhile would not fit.)
        if self.world.systemd.units["strata.service"].active_state not in ("inactive", "failed") \
                or any(n.startswith("strata.") for n in card.holdings):
            self.world.scheduler.after(0.5, self._operator_restarts)
            return
        daemon = self.host.daemon
        fit = self.world.systemd.units["strata.service"].fit or FIT
        if (daemon is not None and daemon.window.record is not None) or self._disk_window() \
                or card.free() < fit.claim(fit.ctx) + fit.target:
            # A window opened while it was down (gpuswapd found it stopped): the operator waits for the card.
            if daemon is not None and daemon.window.record is None and daemon.window.parked is not None:
                self._do_park_remove({})
            self.world.scheduler.after(10.0, self._operator_restarts)
            return
        self.world.systemd.operator_jobs |= {"llama-swap.service", "strata.service"}
        self._operator("StartUnit", ["llama-swap.service"])
        # Its start takes a moment, and if it fails systemd's Restart= brings it back in its own time.
        self.held[-1][1] = self.clock.now + self.config.daemon.reconcile + 60.0
        self.world.scheduler.after(10.0, self._systemd_restarts)

    def _on_virtual(self, wall: float) -> float:
        """The virtual moment a wall-clock time stands for now (the wall clock may have been stepped).

        A time before a suspend is that time, one inside it its resume: a lease renewed after a
        resume may be told an expiry that fell while the machine slept (it is due at the resume).
        """
        return self._boot_to_world(wall - EPOCH - self.clock.wall_offset)

    def _daemon_to_world(self, t: float) -> float:
        """The virtual moment a time of gpuswapd's own (a record's ``at``) stands for.

        gpuswapd's time runs on CLOCK_BOOTTIME from its anchor (continued across restarts in this
        boot); the world's on CLOCK_MONOTONIC: a time inside a suspend is its resume.
        """
        return self._boot_to_world(t - (clock.now() - self.clock.monotonic()))

    def _boot_to_world(self, boot: float) -> float:
        """The virtual moment (CLOCK_MONOTONIC) a CLOCK_BOOTTIME time stands for: inside a suspend, its resume."""
        world, slept_before = boot, 0.0
        for at, slept in self.suspends:
            if boot < at + slept_before:
                break
            world = max(at, boot - slept_before - slept)
            slept_before += slept
        return world

    def _do_clock_step(self, e: dict[str, Any]) -> None:
        """The wall clock steps (date -s, NTP after a long drift); durations must not move with it."""
        self.clock.wall_offset += float(e["by"])

    def _do_suspend(self, e: dict[str, Any]) -> None:
        """The machine sleeps ``for`` seconds and resumes: CLOCK_BOOTTIME and the wall clock move on,
        the event loop's clock (CLOCK_MONOTONIC) and the world do not.

        A lease is as long on CLOCK_BOOTTIME as it was granted: one that ran out while the machine
        slept is due at the resume, and ends within a nap of it (at once when logind tells of the
        resume, ``told``; else within naps.NAP_S). Invariant 4 holds it to that.
        """
        slept = float(e["for"])
        now = self.clock.now
        self.note(f"  the machine sleeps {slept:g}s (logind {'tells' if e.get('told', True) else 'is absent'})")
        self.suspends.append((now, slept))
        self.clock.suspended += slept
        for lease_id, due in self.lease_expiry.items():
            if due > now:
                self.lease_expiry[lease_id] = max(now, due - slept)
        if e.get("told", True):
            for watcher in list(self.world.systemd.resume_watchers):
                watcher()

    def _do_resident_crash(self, e: dict[str, Any]) -> None:
        """The resident's server dies by itself (it fails); systemd's Restart=on-failure brings it back.

        gpuswapd starts only what it stopped: a crash is systemd's to undo, never gpuswapd's reconcile's.
        """
        unit = self.world.systemd.units["strata.service"]
        if unit.active_state == "active":
            self.world.systemd._exit(unit, "failed")
            self.crashes.append(self.clock.now)
            self.world.scheduler.after(5.0, self._systemd_restarts)

    def _systemd_restarts(self) -> None:
        """Restart=on-failure (RestartSec=5s), as this world has it: a failed resident is started by systemd.

        Not into a card a window holds: such a restart would fail (out of memory) and be tried again,
        which this world keeps simple by waiting until the card is the resident's again.
        """
        state = self.world.systemd.units["strata.service"].active_state
        if state == "activating":  # a start under way (a late job, say): if it fails, Restart= follows it
            self.world.scheduler.after(10.0, self._systemd_restarts)
            return
        if state != "failed":
            return  # started since (by a window's close, its operator), or stopped for good
        daemon = self.host.daemon
        if (daemon is not None and daemon.window.record is not None) or self._disk_window() or \
                self.world.card.free() < RESIDENT_NEEDS:
            if daemon is not None and daemon.window.record is None and daemon.window.parked is not None:
                # As its operator's start does: a parked engine that a gpu.resident_needs set too low
                # let stay would keep the card from ever being the resident's.
                self._do_park_remove({})
            self.world.scheduler.after(10.0, self._systemd_restarts)
            return
        self.crashes.append(self.clock.now)  # down until this start lands: systemd's, within its grace
        self.world.systemd.operator_jobs |= {"llama-swap.service", "strata.service"}
        self._operator("StartUnit", ["llama-swap.service"])  # systemd's, not gpuswapd's
        self.world.scheduler.after(10.0, self._systemd_restarts)

    def _do_park_remove(self, e: dict[str, Any]) -> None:
        root = Client("operator", {"as": "root", "kind": "acquire"}, Peer(next(self._pids), 0, 0))
        self.request(root, {"op": "park", "remove": True}, lambda c, r: None)

    def dropped(self, conn: Connection, why: str) -> None:
        for c, request_conn, op in [r for r in self.requests if r[1] is conn]:
            self.requests.remove((c, request_conn, op))
            if op == "release":
                c.releasing = False  # gpuswapctl release exits 3: the daemon went away
                self._epilog_failed(c)
        for c in self.clients.values():
            if c.conn is conn and c.dropped is None:
                c.dropped = why
                if c.unit is not None and c.finals == 0:  # its ExecStartPre exits 3: the unit fails to start
                    c.running = False
                    self.world.systemd.crash(c.unit)
                elif self._reclaims(c) and c.spec.get("reads", True):
                    self.world.scheduler.after(RECLAIM_AFTER_S, lambda c=c: self._reclaim(c))

    def check_exit(self, daemon: Daemon, status: int | None) -> None:
        """Invariant 11: on_shutdown = "restore" exits with the resident back, or with a status that says not."""
        if status:
            return
        now = self.clock.now
        if any(start <= now <= end for start, end in self.held) or any(
                now - t <= self.config.daemon.reconcile + 60.0 for t in self.crashes):
            return  # its operator holds it down, or it crashed just now: not the window's to give back
        world = self.world
        document = world.store.document()
        paused = [t for t, active in self.initial_timers.items() if active and not world.systemd.timer_units[t].active]
        if not world.resident_serves() or paused or (document is not None and document.window is not None):
            states = {u: world.systemd.units[u].active_state for u in world.resident_units}
            self.violate("11", f"gpuswapd shut down with on_shutdown = \"restore\" and exited 0, but the resident is "
                               f"{states}, timers still paused: {paused}, a window on disk: "
                               f"{document is not None and document.window is not None}")

    # -- the end --------------------------------------------------------------------------------

    def end(self) -> None:
        """Heal every fault, let every lease for infinity go, then wait until all is quiet."""
        self.note("the history is over: every fault heals")
        self.ending = True
        now = self.clock.now
        self.images_gone = [(a, min(b, now), img) for a, b, img in self.images_gone]
        self.env_unreadable = [(a, min(b, now)) for a, b in self.env_unreadable]
        self.faults.heal()
        self._operator_starts()
        self.world.docker.images |= {"hyperqwen:latest", "qwen-eval:latest"}
        self.world.store.broken_until = 0.0
        self.world.systemd.fail_starts.clear()
        self.world.docker.garble_wakes = 0
        for c in self.clients.values():
            if c.spec.get("for") == "infinity":
                if c.kind == "run":
                    self._command_ends(c)
                elif c.kind == "unit":
                    self._unit_ends(c)
                else:
                    c.releasing = c.release_sent = True
                    self.request(c, {"op": "release", "holder": f"slurm-job-{c.id}"}, self._released)
        self.world.scheduler.after(5.0, self.quiesce)

    def quiesce(self) -> None:
        why = self.busy()
        if why is not None:
            self.quiet_since = None
        elif self.quiet_since is None:
            self.quiet_since = self.clock.now
        # Quiet means it stayed so long enough for the reconcile to have looked once (and acted).
        if why is None and self.clock.now - (self.quiet_since or 0.0) >= self.config.daemon.reconcile + 60.0:
            self.final_checks()
            self.done = True
            self.abandon()
            return
        if self.clock.now > self.ended_at + QUIET_WITHIN_S:
            self.violate("1", f"gpuswapd never became quiet within {QUIET_WITHIN_S / 3600:g}h of the last event: {why}")
            self.done = True
            self.abandon()
            return
        self.world.scheduler.after(5.0, self.quiesce)

    def busy(self) -> str | None:
        """Say what is still going on (None: quiet)."""
        daemon = self.host.daemon
        if self.host.state != "up" or daemon is None:
            return f"gpuswapd is {self.host.state}"
        w = daemon.window
        if w.record is not None:
            rec = w.record
            return (f"window {rec.id} is {rec.phase} with {len(rec.leases)} lease(s)"
                    f"{f', degraded: {rec.degraded}' if rec.degraded else ''}")
        if len(w.queue) or w.driver.task is not None or w.writer.pending:
            return f"{len(w.queue)} waiting, driver {'running' if w.driver.task else 'idle'}"
        wanting = [c.id for c in self.clients.values() if c.wants]
        if wanting:
            return f"clients still waiting: {', '.join(wanting[:5])}"
        return None

    # -- the invariants --------------------------------------------------------------------------

    def tick(self) -> None:
        if self.done:
            return
        self.check_now()
        self.world.scheduler.after(CHECK_EVERY_S, self.tick)

    def check_now(self) -> None:
        world = self.world
        if world.card.ooms:
            self.violate("3", f"out of memory on the card: {world.card.ooms[0]}")
        if world.timer_violations:
            self.violate("12", world.timer_violations[0])
        if world.systemd.start_violations:
            # 14 for units, 14t for timers: each is its own finding.
            for found in world.systemd.start_violations:
                self.violate("14t" if ".timer " in found else "14", found)
        if world.short_starts and self.config.gpu.resident_needs >= RESIDENT_NEEDS:
            # With gpu.resident_needs right, gpuswapd never starts the resident into less than it needs.
            self.violate("3", f"the resident was started short of memory: {world.short_starts[0]}")
        daemon = self.host.daemon if self.host.state in ("up", "stopping") else None
        on_disk = self._disk_window()
        in_memory = daemon is not None and daemon.window.record is not None
        now = self.clock.now
        if in_memory or on_disk or self.host.state != "up":
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        held = any(start <= now <= end for start, end in self.held)
        # A resident that crashed (or whose operator's start failed) comes back within the reconcile's
        # bound of gpuswapd being idle; while systemd is hung, nothing can start it.
        grace = self.config.daemon.reconcile + 60.0
        crashed = bool(self.crashes or self.held) and (
            any(now - t <= grace for t in self.crashes) or now - (self.idle_since or now) <= grace
            or self.faults.active(("systemd",)))
        # Down by a crash or its operator's hand, it is not gpuswapd's to bring back (systemd's Restart=
        # is: this world's waits while others hold the card).
        theirs = all(world.systemd.stopped_by.get(u) in ("a crash", "its operator")
                     for u in world.resident_units if world.systemd.units[u].active_state != "active")
        # While gpuswapd is down, the second record (state/marks.py) is a record too: a start that
        # cannot read the document (its copies torn, or it overwrote one it could not read) restores
        # what the marks name.
        marked = self.host.state != "up" and all(
            u in memory_marks(world.store).read() for u in world.resident_units
            if world.systemd.units[u].active_state != "active")
        if not world.resident_up() and not in_memory and not on_disk and not held and not crashed and not theirs \
                and not marked:
            states = {u: world.systemd.units[u].active_state for u in world.resident_units}
            self.violate("2", f"the resident is down ({states}) with no window record in memory or on disk "
                              f"(gpuswapd {self.host.state})")
        if any(conn.hung_up for conn in self.host.connections):  # gone for good: buffers nothing
            self.host.connections = [conn for conn in self.host.connections if not conn.hung_up]
        for conn in self.host.connections:
            self.record.buffered = max(self.record.buffered, conn.buffered())
            if conn.buffered() > BUFFER_BOUND:
                who = next((c.id for c in self.clients.values() if conn in c.conns), "?")
                self.violate("6", f"gpuswapd keeps {conn.buffered()} bytes unread by client {who} "
                                  f"(bound {BUFFER_BOUND})")
        if daemon is not None and self.host.state == "up":
            self._check_leases(daemon)
        for loop in (self.loop,):
            if loop is not None and loop.errors:
                self.violate("9", f"an exception escaped its owner: {loop.errors[0]}")

    @staticmethod
    def _spinning(loop: VirtualLoop) -> str:
        """Name where the tasks that are ready to run stand (the busy loop is among them)."""
        where: list[str] = []
        for handle in list(getattr(loop, "_ready", ())):
            task = getattr(getattr(handle, "_callback", None), "__self__", None)
            if not isinstance(task, asyncio.Task):
                continue
            at, coro = "", task.get_coro()
            while coro is not None:
                frame = getattr(coro, "cr_frame", None)
                code = frame.f_code if frame is not None else None
                if code is not None and "/gpuswapd/" in code.co_filename:
                    at = f"{code.co_filename.rsplit('/gpuswapd/', 1)[1]}:{frame.f_lineno} in {code.co_name}"
                coro = getattr(coro, "cr_await", None)
            if at and at not in where:
                where.append(at)
        return f" (ready: {'; '.join(where[:3])})" if where else ""

    def _status_probe(self) -> None:
        """Ask for the status whenever the window changed (phase, sealed, leases, queue): it answers in every state.

        A status that raises is a `gpuswapctl status` answered "gpuswapd failed on this request".
        """
        daemon = self.host.daemon if self.host.state == "up" else None
        if daemon is None:
            return
        w = daemon.window
        rec = w.record
        key = (id(rec), w.phase, rec is not None and rec.sealed, rec is not None and len(rec.timings),
               rec is not None and len(rec.leases), len(w.queue), w.parked is not None)
        if key == self._status_key:
            return
        self._status_key = key
        try:
            w.status()
        except Exception as err:
            self.violate("9", f"status failed in phase {w.phase}: {err!r} "
                              f"{' '.join(traceback.format_exception(err)[-2:])[:300]}")

    def _disk_window(self) -> bool:
        data = self.world.store.current
        return data is not None and b'"window":null' not in data

    def _check_leases(self, daemon: Daemon, final: bool = False) -> None:
        now = self.clock.now
        rec = daemon.window.record
        current = {x.id: x for x in rec.leases.all()} if rec is not None else {}
        # A lease also ends at its expiry, not much later, whatever the wall clock did.
        for lease_id in current:
            late = now - self._expiry_allowed(lease_id)
            if late > LATE_EXPIRY_S:
                self.violate("4", f"lease {lease_id} is still held {late:.0f}s after it expired "
                                  f"(at {self.lease_expiry[lease_id]:.1f}s); the wall clock was stepped by "
                                  f"{self.clock.wall_offset:+.0f}s")
        for lease_id, c in list(self.leases.items()):
            if lease_id in current:
                continue
            del self.leases[lease_id]
            self.unjudged[lease_id] = c
        for lease_id, c in list(self.unjudged.items()):
            why = self._why_ended(c, lease_id, now)
            if why is None and (str(c.window) not in self.finished or self._window_in_memory(c.window) is not None) \
                    and not final:
                continue  # its window is still closing: its outcome says whether that was a failure
            del self.unjudged[lease_id]
            if why is None:
                self.violate("4", f"lease {lease_id} of client {c.id} ({c.spec['as']}, window {c.window}) ended "
                                  f"for no reason: not released, not expired (expires at "
                                  f"{self.lease_expiry.get(lease_id, math.inf):.1f}s), its unit still up, no "
                                  f"preemption, no failure, no shutdown; gpuswapd's window now: "
                                  f"{rec.id if rec is not None else None}")
            else:
                self.note(f"  lease {lease_id} of {c.id} ended: {why}")

    def _expiry_allowed(self, lease_id: str) -> float:
        """The lease's expiry as its client was told, or, after a start of gpuswapd, an unconfirmed renewal's.

        A renewal whose state write hung is refused, yet the write may land later (one never
        answered may have been written too): a gpuswapd started after it trusts the disk (a lease
        bound to a connection then ends within the reclaim grace all the same).
        """
        told = self.lease_expiry.get(lease_id, math.inf)
        landed = [until for asked, until in self.unconfirmed_renewals.get(lease_id, ())
                  if any(boot > asked for boot in self.boot_times)]
        return max([told, *landed])

    def _why_ended(self, c: Client, lease_id: str, now: float) -> str | None:
        if c.released or c.release_sent:
            return "released"
        if c.kind == "run" and c.conn is not None and (c.hung_up or c.dropped is not None or not c.conn.open):
            return "its bound connection ended"
        if c.kind == "run" and c.reclaims and lease_id != c.lease:
            return "its bound connection ended with gpuswapd; its client holds another lease now"
        if now + 1e-6 >= self.lease_expiry.get(lease_id, math.inf) - 0.01:
            return "expired"
        if c.unit is not None and self.world.systemd.units[c.unit].active_state not in ("active", "activating"):
            return "its unit stopped"
        if any(t >= c.granted_at for t in self.shutdowns):
            return "gpuswapd shut down"
        daemon = self.host.daemon
        if any(t >= c.granted_at for t in self.baseline_restores) or (
                daemon is not None and daemon.window.baseline_restore is not None
                and self._daemon_to_world(daemon.window.baseline_restore.at or 0.0) >= c.granted_at):
            return "no state could be read: the baseline was restored"
        # The live record first: a window whose close finished unrecorded (a failing state directory)
        # and that a restart adopted from the disk finishes twice, under one id.
        record = self._window_in_memory(c.window) or self.finished.get(str(c.window))
        if record is None:
            return None
        preempted = record.get("preempted") or {}
        if preempted.get("revoked_at") is not None and any(h.get("lease") == lease_id
                                                           for h in preempted.get("holders") or []):
            noticed = self._daemon_to_world(float(preempted.get("at") or 0))
            if not self._could_open(str(preempted.get("profile")), noticed):
                self.violate("4", f"lease {lease_id} of client {c.id} was revoked for preemptor "
                                  f"{preempted.get('by')} (profile {preempted.get('profile')}), which could not "
                                  "open a window when it was noticed (its image or env file was missing)")
            return "preempted"
        if record.get("error") is not None or record.get("outcome") in ("engine_failed", "rolled_back", "recovered",
                                                                          "baseline_restored"):
            return f"its window failed ({record.get('outcome')})"
        return None

    def _could_open(self, profile: str, at: float) -> bool:
        """Tell whether a window of ``profile`` could open at virtual time ``at``: its image and env file, or asleep."""
        name = self.container_of(profile)
        docker = self.world.docker
        slept = max((t for n, t in docker.slept if n == name and t <= at), default=None)
        if slept is not None and not any(n == name and slept < t < at - 1e-3 for n, t in docker.woke) and \
                not any(n == name and slept < t < at - 1e-3 for t, n in docker.removed):
            return True  # parked: it is woken, not created
        image = {"default": "hyperqwen:latest", "eval": "qwen-eval:latest"}.get(profile)
        # (A millisecond short of the end: the daemon's time, converted back, lands on the world's
        # instant of healing give or take a rounding.)
        gone = any(img == image and start <= at < end - 1e-3 for start, end, img in self.images_gone)
        unreadable = profile == "default" and any(start <= at < end - 1e-3 for start, end in self.env_unreadable)
        return not gone and not unreadable

    def _check_as_it_was(self, daemon: Daemon) -> None:
        """Invariant 1: quiet, the resident has its baseline's context and slots, and gpuswapd knows that baseline.

        Only a stranger's memory may leave it smaller: then the last restore said "restored,
        smaller", with what changed, and gpuswapd_resident_degraded is 1.
        """
        strata = self.world.systemd.units["strata.service"]
        configured = strata.fit or FIT  # what its operator configured (-c), which the baseline follows
        full = configured.ctx // configured.slots
        baseline = daemon.window.known.baseline
        if self.held_for_good and not self.world.resident_serves():
            return  # its operator keeps it down: gpuswapd cannot read it (and need not have, if its state was lost)
        if baseline is None or (baseline.n_ctx, baseline.slots, baseline.models) != (full, FIT.slots, ("strata",)):
            self.violate("1", f"quiet, but gpuswapd's baseline of the resident is {baseline and baseline.describe()}, "
                              f"not n_ctx {full} x {FIT.slots} slots, models strata")
        restored = [r for r in self.finished.values() if r.get("restored") is not None]
        last = max(restored, key=lambda r: float(r.get("closed_at") or 0.0)) if restored else None
        degraded = window_now(daemon.window).resident_degraded
        if strata.n_ctx == full:
            if degraded:
                self.violate("1", "quiet, with the resident as it was, but gpuswapd_resident_degraded is 1")
            return
        card = self.world.card
        card.free()
        strangers = [n for n in card.holdings if not n.startswith(("engine:", "strata."))]
        said = last is not None and last.get("restored") == "smaller" and last.get("resident_changed") is not None
        if not (said and degraded and strangers):
            self.violate("1", f"quiet, but the resident has n_ctx {strata.n_ctx}, not {full} (last restore: "
                              f"{last and last.get('restored')}, gpuswapd_resident_degraded {int(degraded)}, "
                              f"strangers on the card: {strangers or 'none'}; {card.describe()})")

    def _window_in_memory(self, window: str | None) -> dict[str, Any] | None:
        daemon = self.host.daemon
        if daemon is None or window is None:
            return None
        rec = daemon.window.record
        if rec is not None and rec.id == window:
            return rec.to_dict()
        return None

    def expect_join(self, c: Client) -> None:
        """Invariant 5: a READY window of profile P grants a request for P at once, unless it may not."""
        daemon = self.host.daemon
        if self.host.state != "up" or daemon is None:
            return
        w, e = daemon.window, c.spec
        rec = w.record
        if rec is None or rec.phase is not Phase.READY or rec.profile != e["profile"]:
            return
        if e["as"] == "eve" or (e["priority"] > 0 and e["as"] != "root"):
            return  # refused for who asks, whatever the window
        if e["for"] == "infinity" and e["as"] != "root":
            return
        preempted = rec.preempted
        if preempted is not None and preempted.revoked_at is None and preempted.abandoned_at is None:
            return
        if rec.closing or rec.pending_switch or rec.degraded or w.queue.blocked(rec.profile, clock.now()) is not None:
            return
        if w.adopting is rec:
            return  # left READY by the gpuswapd before: it grants nothing until its engine is seen to serve
        if self.faults.active(("systemd", "state")) or self.clock.now < self.world.store.broken_until \
                or not w.writer.writable or {"systemd", "state"} & set(daemon.outside.hung()):
            return  # a grant waits for its write: a failing or hung state directory delays it
        window = rec.id

        asked = self.clock.now

        def granted() -> None:
            if c.reply is not None and c.reply.get("ok"):
                return
            if self.world.store.broken_since >= asked or self.faults.active(("systemd", "state")):
                return  # the state directory broke meanwhile: the grant waits for (or fails on) its write
            if c.conn is not None and not c.spec.get("reads", True) and b'"ok":true' in c.conn.pending:
                return  # written to a client that does not read
            if c.hung_up or c.dropped is not None or self.host.daemon is not daemon:
                return
            if any(asked <= t <= self.clock.now for t, _ in self.suspends) \
                    and daemon.window.queue.blocked(rec.profile, clock.now()) is not None:
                return  # the machine slept as it was asked: the waits it counts grew, and fairness blocks joins now
            now_rec = daemon.window.record
            if now_rec is not rec or now_rec.phase is not Phase.READY or now_rec.closing:
                return  # the window failed or began closing in that instant: the request went with it
            error = (c.reply or {}).get("error") or {}
            got = "no reply yet" if c.reply is None else f"{error.get('code')}: {error.get('message')}"
            self.violate("5", f"client {c.id} asked READY window {window} of profile {e['profile']!r} for a lease "
                              f"and was not granted one at once ({got})")

        self.world.scheduler.after(3.0, granted)

    def final_checks(self) -> None:
        world, daemon = self.world, self.host.daemon
        assert daemon is not None
        self._check_leases(daemon, final=True)
        if not world.resident_serves() and not self.held_for_good:
            states = {u: world.systemd.units[u].active_state for u in world.resident_units}
            self.violate("1", f"quiet, but the resident is not up: {states}")
        restarted = world.last_resident_start()
        answered = any(t >= restarted and who == "resident" for t, who in world.http.completions)
        if restarted > 0 and not self.held_for_good and not answered:
            self.violate("1", f"quiet, but the resident was not verified after its last start at {restarted:.1f}s")
        self._check_as_it_was(daemon)
        timers = {name: t.active for name, t in world.systemd.timer_units.items()}
        expected = dict(self.initial_timers)  # a baseline restore too starts only the timers gpuswapd stopped
        if timers != expected:
            wrong = {n: ("active" if a else "inactive") for n, a in timers.items() if a != expected[n]}
            self.violate("1", f"quiet, but timers are not as they were: {wrong}")
        document = world.store.document()
        if daemon.window.record is not None or (document is not None and document.window is not None):
            self.violate("1", "quiet, but a window record is left open "
                              f"(memory: {daemon.window.record is not None}, disk: {document is not None})")
        parked = daemon.window.parked
        for name, c in world.docker.containers.items():
            held = world.card.holdings.get(c.key)
            ok = (parked is not None and parked.container.name == name and c.status == "running"
                  and c.sleeping is not None and document is not None and document.parked is not None
                  and held is not None and held.bytes + self.config.gpu.resident_needs <= TOTAL_BYTES)
            if not ok:
                self.violate("1", f"quiet, but container {name} is left ({c.status}, sleeping {c.sleeping}, "
                                  f"parked {parked is not None}, holding {held.bytes / GiB if held else 0:.1f} GiB)")
        for c in self.clients.values():
            if c.conn is None or not c.spec.get("reads", True):
                continue
            if c.finals == 0 and not c.hung_up and c.dropped is None:
                self.violate("6", f"client {c.id} stayed connected and never got a final reply")
        if self.loop is not None and self.loop.errors:
            self.violate("9", f"an exception escaped its owner: {self.loop.errors[0]}")


class _Notifier:
    """The daemon's sd_notify: its STATUS= lines go into the trace."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def send(self, **fields: str) -> None:
        status = fields.get("status")
        if status is not None and self.run.tracing:
            self.run.status_line(status)

    @property
    def enabled(self) -> bool:
        return False


def _forget_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Drop gpuswapd's references to a dead loop's tasks (they never finish)."""
    for task in [t for t in tasks._running if t.get_loop() is loop]:
        tasks._running.discard(task)


def _bury(graveyard: list[VirtualLoop]) -> None:
    while graveyard:
        loop = graveyard.pop()
        _forget_tasks(loop)
        loop.close()


@contextlib.contextmanager
def seams(record: Record) -> Iterator[list[VirtualLoop]]:
    """Point gpuswapd's clock, ids and workers at the simulation for one run, and its log at the record.

    The run's dead incarnations (and the last one) are closed afterwards, and only then collected:
    nothing of a dead daemon may run while the history is played (the cyclic collector is off), and
    whatever its coroutines do when they are closed lands in a world that is thrown away.
    """
    counter = iter(range(1, 1 << 30))
    clock.use(record.clock.wall, record.clock.monotonic, kernel_clock=record.clock.kernel)
    ids.use(lambda nbytes: f"{next(counter):0{2 * nbytes}x}")
    workers.use(SimPool)
    saved = structlog.get_config()

    def capture(_logger: Any, method: str, event: Any) -> Any:
        name = event.get("event")
        if name in BUGS:
            exc = event.get("exc_info")
            err = exc if isinstance(exc, BaseException) else sys.exc_info()[1] if exc else None
            where = ""
            if err is not None:
                where = " ".join(traceback.format_exception(err)[-3:]).replace("\n", " ")[:600]
            record.violate("9", f"gpuswapd logged {name}: {event.get('error') or event.get('reason') or ''} {where}")
        if record.tracing:
            fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "instance"))
            record.note(f"    log {method} {name} {fields}"[:400])
        raise structlog.DropEvent

    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture],
                        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if record.tracing
                                                                            else logging.ERROR),
                        cache_logger_on_first_use=False)
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None  # dead incarnations' coroutines are closed at collection
    graveyard: list[VirtualLoop] = []
    gc.disable()
    # What lived before the run (the modules, a test runner's objects) is set aside, so that the
    # collection at its end walks only what the run made: 3-5% of a history's CPU in a bare process
    # (20 histories, 3 alternating runs), more beside a test runner's objects.
    gc.freeze()
    try:
        yield graveyard
    finally:
        asyncio.set_event_loop(None)
        record.tracing = False
        with warnings.catch_warnings():  # "coroutine ... was never awaited": the dead ones' leftovers
            warnings.simplefilter("ignore")
            _bury(graveyard)  # no name here may still hold a loop (its selector holds the run)
            gc.collect()
        gc.unfreeze()
        gc.enable()
        clock.reset()
        ids.reset()
        workers.reset()
        structlog.configure(**saved)
        sys.unraisablehook = hook


def play(setup: Setup, events: list[dict[str, Any]], trace: bool = False) -> Outcome:
    """Play one history and check it."""
    record = Record(VirtualClock(), trace)
    with seams(record) as graveyard:
        run = Run(setup, events, record, graveyard)
        outcome = run.play()
        del run
    return outcome
