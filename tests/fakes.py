"""In-process fakes of the outside systems, behind the adapters' own interfaces.

Like httpx's ``MockTransport``, they replace the *systems*, not gpuswapd's code: the real
``Window``, ``Resident``, ``ContainerEngine``, ``Vram``, ``StateWriter`` and lanes run on top of
them, in milliseconds and without root. One ``FakeWorld`` ties them together the way the real
machine is tied: the resident and the engine hold VRAM in one ledger, a stop of strata stops
llama-swap (``Requires=``), a container that starts without room fails like CUDA out of memory.

Integration tests run the same code on a real systemd and a real Docker; these fakes only make
the window's logic and its fault matrix fast to test.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fnmatch
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpuswapd import clock
from gpuswapd.adapters.docker import ContainerState, RunSettings
from gpuswapd.adapters.gpu import GpuProcess, VramReading
from gpuswapd.adapters.kernel import Process
from gpuswapd.adapters.openai import Busy
from gpuswapd.adapters.pagecache import FileCache, Measured, Progress
from gpuswapd.adapters.props import ServerProps
from gpuswapd.adapters.slots import FileIdentity, Slot, SlotFile
from gpuswapd.adapters.streams import Completion
from gpuswapd.adapters.unitstates import Commands, JobResults, ServiceProcesses, TimerState, UnitState
from gpuswapd.config import Config, parse_config
from gpuswapd.errors import (
    BadResponse,
    ContainerNotFound,
    EndpointUnreachable,
    FilesError,
    ImageNotFound,
    UnitNotFound,
)
from gpuswapd.notify import Notifier
from gpuswapd.outside import Deadlines, Outside
from gpuswapd.parts.engine import ContainerEngine
from gpuswapd.parts.resident import Resident
from gpuswapd.parts.vram import Vram
from gpuswapd.server.peers import Peer, PeerChanged
from gpuswapd.state.marks import memory_marks
from gpuswapd.state.store import Document, Loaded, decode
from gpuswapd.window import Backoffs, Window

GiB = 1 << 30
RESIDENT_URL = "http://resident.test:8080/v1/chat/completions"
PROPS_URL = "http://resident.test:8081/props"  # strata itself, not through llama-swap
ENGINE_URL = "http://engine.test:18020/v1/chat/completions"
EVAL_URL = "http://eval.test:18021/v1/chat/completions"  # a second engine profile's
ENGINES = {"engine.test": "hyperqwen", "eval.test": "qwen-eval"}  # host -> container
AGENTS = ("triage", "review", "digest")
RESIDENT_BYTES = 21 * GiB
ENGINE_BYTES = int(19.5 * GiB)
RESIDUAL_BYTES = 1 * GiB  # what a sleeping engine keeps (its CUDA context and pools)
MODEL_PATH = "/models/strata.gguf"  # the resident's GGUF, named by strata.service's ExecStart=
MODEL_BYTES = 21_600_000_000
SLOT_DIR = "/var/cache/gpuswapd/slots"  # strata's --slot-save-path
SLOT_TOKENS = {0: 1566, 1: 0}  # what strata's slots hold once it has served an agent
KV_PER_TOKEN = 1024  # bytes of a slot file per token
CANARY = "2, 3, 5, 7, 11"

CONFIG = f"""
[daemon]
socket = "/nonexistent/gpuswapd.sock"
socket_group = ""
state_dir = "/nonexistent/state"
linger = "0"
[gpu]
probe = "nvidia-smi"
window_needs = "21GiB"
resident_needs = "22GiB"
release_timeout = "300ms"
[resident]
units = ["strata.service"]
stop_timeout = "300ms"
start_timeout = "300ms"
server = "llama.cpp"
props_url = "{PROPS_URL}"
[resident.idle]
kind = "none"
wait = "0"
[resident.verify]
url = "{RESIDENT_URL}"
model = "strata"
timeout = "300ms"
[timers]
pause = ["agent-*.timer"]
wait_for_jobs = "100ms"
[window]
health_url = "http://engine.test:18020/health"
boot_timeout = "300ms"
watch_interval = "50ms"
max_restarts = 1
[window.container]
name = "hyperqwen"
image = "engine:latest"
env_file = "/dev/null"
stop_timeout = "0"
[window.warmup]
requests = 1
[window.verify]
url = "{ENGINE_URL}"
model = "hyperqwen"
timeout = "300ms"
"""

FAKE_CONFIG = parse_config(CONFIG, "<fake>")
PARK_CONFIG = parse_config(CONFIG + """
[window.park]
mode = "sleep"
settle = "100ms"
""", "<fake, park = sleep>")
PROFILES = f"""
[profiles.eval]
kind = "engine"
health_url = "http://eval.test:18021/health"
boot_timeout = "300ms"
watch_interval = "50ms"
max_restarts = 1
[profiles.eval.container]
name = "qwen-eval"
image = "engine:latest"
stop_timeout = "0"
[profiles.eval.warmup]
requests = 1
[profiles.eval.verify]
url = "{EVAL_URL}"
model = "qwen-eval"
timeout = "300ms"
[profiles.bare]
kind = "bare"
needs = "20GiB"
"""
PROFILE_CONFIG = parse_config(CONFIG + PROFILES, "<fake, profiles>")
# Long enough that no fake call misses one on a loaded machine (the fast layer runs beside the
# world tests on two cores): a test that wants a deadline missed hangs that call past its own.
DEADLINES = Deadlines(systemd=2, docker=2, gpu=2, state=2, files=2, http=2, workers=4)
BACKOFFS = Backoffs(restore=(0.005, 0.02), take_down=(0.005, 0.02), take_down_for=0.05, driver=(0.005, 0.02),
                    writer=(0.005, 0.02), preempt_stop=(0.005, 0.02))


class FakeGpu:
    """The card: a ledger of who holds how much, read like NVML."""

    def __init__(self, total: int = 24 * GiB) -> None:
        self.total = total
        self.holders: dict[str, tuple[int, int]] = {}  # name -> (pid, bytes)
        self.ooms: list[str] = []
        self._lock = threading.Lock()

    def claim(self, name: str, pid: int, size: int) -> bool:
        """Take memory for a process; False (and an OOM record) if it does not fit."""
        with self._lock:
            if self.total - sum(b for _, b in self.holders.values()) < size:
                self.ooms.append(name)
                return False
            self.holders[name] = (pid, size)
            return True

    def free(self, name: str) -> None:
        """Give a holder's memory back."""
        with self._lock:
            self.holders.pop(name, None)

    def read(self, processes: bool = True) -> VramReading:
        """Read the card as the probe adapters do."""
        with self._lock:
            used = sum(b for _, b in self.holders.values())
            procs = tuple(GpuProcess(pid, size) for pid, size in self.holders.values()) if processes else ()
        return VramReading(self.total, used, self.total - used, procs)


@dataclass
class FakeFit:
    """llama.cpp's ``--fit`` for a fake resident: it claims weights + KV(ctx) + margin and leaves ``target`` free.

    Started with less free than its full claim and the target, it lowers its context (in steps of
    256 tokens per slot) until it fits, down to ``min_ctx``; only if even that does not fit at all
    does it fail, as CUDA out of memory.
    """

    weights: int = 12 * GiB
    kv_per_token: int = 1 << 20
    margin: int = 1 * GiB
    target: int = 1 * GiB
    ctx: int = 8192  # -c: the whole KV cache, split over the slots
    slots: int = 2
    min_ctx: int = 4096

    def claim(self, ctx: int) -> int:
        """Return what the server holds with a context of ``ctx`` tokens (all slots)."""
        return self.weights + self.kv_per_token * ctx + self.margin

    def fit(self, free: int) -> int | None:
        """Return the context it starts with when ``free`` bytes are free (None: it cannot start)."""
        ctx, step = self.ctx, 256 * self.slots
        while ctx > self.min_ctx and self.claim(ctx) + self.target > free:
            ctx = max(self.min_ctx, ctx - step)
        return ctx if self.claim(ctx) <= free else None


@dataclass
class FakeUnit:
    """A unit the fake manager knows."""

    name: str
    active_state: str = "active"
    requires: tuple[str, ...] = ()
    gpu_bytes: int = 0
    pid: int = 0
    fit: FakeFit | None = None  # fits itself to the free memory as llama.cpp does (opt-in)
    n_ctx: int = 4096  # its context per slot, as /props says
    masked: bool = False  # systemctl mask: nothing starts it
    names: tuple[str, ...] = ()  # its Id and aliases, as Names says (empty: its name alone)
    invocation: int = 1  # its InvocationID, new at each start
    active_enter: float | None = None  # when it last became active (CLOCK_MONOTONIC; None: before the test)
    unit_file_state: str = "enabled"
    result: str = ""  # why it failed (Service.Result: "start-limit-hit" while in its start limit)


class FakeSystemd:
    """The system manager, answering what the systemd adapter answers."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.units: dict[str, FakeUnit] = {}
        self.timer_units: dict[str, tuple[str, str]] = {}  # timer -> (active_state, service)
        self.timer_entered: dict[str, float] = {}  # timer -> when it last became active (started in the test)
        self.jobs = JobResults()
        self._count = itertools.count(1)
        self._lock = threading.RLock()
        self._watchers: list[Any] = []
        self.started: list[str] = []  # every unit started, in order
        # One sequence for this world's starts and completions, so their order can be checked.
        self.moments = itertools.count(1)
        self.started_at: list[tuple[int, str]] = []  # (moment, unit) of every start
        self.fail_starts: dict[str, int] = {}  # unit -> how many starts fail (ExecStartPre=/bin/false)
        self.fail_stops: dict[str, int] = {}  # unit -> how many stops fail (its stop job times out)
        self.start_gate: threading.Event | None = None  # set: a unit on the card starts (its model loaded)
        self.exec_start: dict[str, tuple[str, ...]] = {}  # what a unit runs, instead of the usual
        self.commands_read = 0

    def add_unit(self, unit: FakeUnit) -> None:
        """Load a unit (started if it says it is active)."""
        self.units[unit.name] = unit
        if unit.active_state == "active" and unit.gpu_bytes:
            assert self.gpu.claim(unit.name, unit.pid, unit.gpu_bytes)

    def add_timer(self, name: str, active: bool = True) -> None:
        """Load a timer and its service."""
        service = name.removesuffix(".timer") + ".service"
        self.timer_units[name] = ("active" if active else "inactive", service)
        self.units[service] = FakeUnit(service, "inactive")

    # -- what the adapter offers ---------------------------------------------------------

    def connect(self) -> None:
        """Connect (nothing to do)."""

    def close(self) -> None:
        """Close (nothing to do)."""

    def watch_active_state(self, watcher: Any) -> None:
        """Remember who wants to hear of state changes."""
        self._watchers.append(watcher)

    def system_state(self) -> str:
        """Say the system runs."""
        return "running"

    def queue_jobs(self, method: str, units: list[str]) -> list[tuple[str, str]]:
        """Do each job at once and report its end (before the caller hears the path, as can happen)."""
        queued = []
        for unit in units:
            path = f"/org/freedesktop/systemd1/job/{next(self._count)}"
            result = self._start(unit) if method == "StartUnit" else self._stop(unit)
            self.jobs.removed(path, result)
            queued.append((unit, path))
        return queued

    def when_job_done(self, path: str, callback: Any) -> None:
        """Hand a job's result to a waiter."""
        self.jobs.when_done(path, callback)

    def forget_job(self, path: str) -> None:
        """Stop waiting for a job."""
        self.jobs.forget(path)

    def _start(self, name: str) -> str:
        with self._lock:
            if name in self.timer_units:
                if self.timer_units[name][0] != "active":
                    self.timer_entered[name] = clock.kernel_monotonic()
                self.timer_units[name] = ("active", self.timer_units[name][1])
                return "done"
            unit = self.units.get(name)
            if unit is None:
                return "failed"
            for dep in unit.requires:
                if self._start(dep) != "done":
                    return "dependency"
            if unit.active_state == "active":
                return "done"
            if unit.masked:
                return "failed"  # systemd refuses the job: the unit is masked
            if self.fail_starts.get(name):
                self.fail_starts[name] -= 1
                unit.active_state = "failed"
                return "failed"
            if unit.gpu_bytes and self.start_gate is not None:
                self.start_gate.wait(2.0)
            if unit.fit is not None:
                free = self.gpu.read(processes=False).free_bytes
                ctx = unit.fit.fit(free)
                if ctx is None or not self.gpu.claim(unit.name, unit.pid, unit.fit.claim(ctx)):
                    if ctx is None:
                        self.gpu.ooms.append(unit.name)
                    unit.active_state = "failed"
                    return "failed"
                unit.n_ctx = ctx // unit.fit.slots
            elif unit.gpu_bytes and not self.gpu.claim(unit.name, unit.pid, unit.gpu_bytes):
                unit.active_state = "failed"
                return "failed"
            unit.active_state = "active"
            unit.invocation += 1
            unit.active_enter = clock.kernel_monotonic()
            self.started.append(name)
            self.started_at.append((next(self.moments), name))
            return "done"

    def _stop(self, name: str) -> str:
        with self._lock:
            if name in self.timer_units:
                self.timer_units[name] = ("inactive", self.timer_units[name][1])
                return "done"
            unit = self.units.get(name)
            if unit is None:
                return "done"
            if self.fail_stops.get(name):
                self.fail_stops[name] -= 1
                return "timeout"
            for other in self.units.values():  # a stop propagates to what Requires= the unit
                if name in other.requires and other.active_state == "active":
                    self._stop(other.name)
            unit.active_state = "inactive"
            self.gpu.free(unit.name)
        for watcher in self._watchers:
            watcher(name, "inactive")
        return "done"

    def state(self, unit: str) -> UnitState:
        """Read a unit's state."""
        with self._lock:
            if unit in self.timer_units:
                return UnitState(unit, "loaded", self.timer_units[unit][0], "waiting",
                                 active_enter=self.timer_entered.get(unit))
            u = self.units.get(unit)
            if u is None:
                return UnitState(unit, "not-found", "inactive", "dead")
            return UnitState(unit, "masked" if u.masked else "loaded", u.active_state,
                             "running" if u.active_state == "active" else "dead",
                             "masked" if u.masked else u.unit_file_state, u.names or (unit,),
                             f"{u.invocation:032x}" if u.active_state == "active" else "",
                             active_enter=u.active_enter, result=u.result if u.active_state == "failed" else "")

    def _dependents(self, name: str) -> list[str]:
        return sorted(u.name for u in self.units.values() if name in u.requires)

    def stop_closure(self, units: list[str]) -> list[str]:
        """List the active units and their active dependents."""
        with self._lock:
            for name in units:
                if name not in self.units:
                    raise UnitNotFound(f"unit {name} is not-found")
            queue, seen, out = list(units), set(), []
            while queue:
                name = queue.pop(0)
                if name in seen:
                    continue
                seen.add(name)
                if self.units[name].active_state != "active":
                    continue
                out.append(name)
                queue.extend(self._dependents(name))
            return out

    def timers(self, patterns: list[str]) -> list[TimerState]:
        """List the matching timers with their service's state."""
        with self._lock:
            return [TimerState(name, state, svc, self.units[svc].active_state)
                    for name, (state, svc) in sorted(self.timer_units.items())
                    if any(fnmatch.fnmatchcase(name, p) for p in patterns)]

    def unit_of_pid(self, pid: int) -> str | None:
        """Name the unit of a live process (None: it is gone); one on the card outside these units is a session's."""
        unit = next((u.name for u in self.units.values() if u.pid == pid and pid), None)
        if unit is None and any(p == pid for p, _ in self.gpu.holders.values()):
            return "session-1.scope"
        return unit

    def control_group(self, unit: str) -> str | None:
        """Return a unit's cgroup."""
        if unit not in self.units:
            raise UnitNotFound(f"no unit {unit}")
        return f"/system.slice/{unit}"

    def commands(self, unit: str) -> Commands:
        """Say what a unit runs: strata is llama-server on its GGUF, behind a wrapper; the rest run a binary."""
        if unit not in self.units:
            raise UnitNotFound(f"no unit {unit}")
        self.commands_read += 1
        if unit in self.exec_start:
            return Commands(unit, (self.exec_start[unit],))
        if unit == "strata.service":
            return Commands(unit, (("/usr/bin/gpu-hold", "--", "/usr/bin/llama-server", "-m", MODEL_PATH,
                                    "--port", "8081", "--slot-save-path", SLOT_DIR),))
        return Commands(unit, ((f"/usr/bin/{unit.removesuffix('.service')}",),))


class FakeSlotFiles:
    """strata's slot save directory and its model file (``resident.cache``)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, int, int]] = {}  # name: (slot, tokens, bytes), in SLOT_DIR
        self.model_mtime = 1  # a test changes it: another model file
        self.free_bytes = 100 * GiB
        self.removals = 0

    def identity(self, path: str) -> FileIdentity:
        """Stat the model file."""
        if path != MODEL_PATH:
            raise FilesError(f"{path}: No such file or directory")
        return FileIdentity(path, MODEL_BYTES, self.model_mtime, 42)

    def listing(self, directory: str, prefix: str) -> dict[str, int]:
        """List the files of the save directory."""
        if directory != SLOT_DIR:
            raise FilesError(f"{directory}: No such file or directory")
        return {n: b for n, (_, _, b) in self.files.items() if n.startswith(prefix)}

    def free(self, directory: str) -> int:
        """Say how much room the disk has."""
        return self.free_bytes - sum(b for _, _, b in self.files.values())

    def remove(self, directory: str, names: list[str]) -> list[str]:
        """Remove files."""
        self.removals += 1
        return [n for n in names if self.files.pop(n, None) is not None]


class FakeFiles:
    """The page cache of the resident's model files: the GGUF, pushed out of RAM while an engine ran."""

    def __init__(self) -> None:
        self.sizes = {MODEL_PATH: MODEL_BYTES}
        self.cached = {MODEL_PATH: 0}
        self.mem_available = 64 * GiB
        self.read_s = 30.0  # how long a prefetch reads (wall seconds) before it is done, unless stopped
        self.prefetches = 0
        self.read_in = threading.Event()  # set once a prefetch has read to the end
        self.stopped = threading.Event()  # set once a prefetch has seen its stop

    def measure(self, paths: list[str]) -> Measured:
        """Measure each file (a path it does not know: no such file)."""
        return Measured(tuple(FileCache(p, p, self.sizes[p], self.cached[p]) if p in self.sizes
                              else FileCache(p, p, error="no such file") for p in paths), self.mem_available)

    def prefetch(self, paths: list[str], stop: threading.Event, progress: Progress) -> Progress:
        """Read the files in, unless stopped first."""
        self.prefetches += 1
        if stop.wait(self.read_s):
            self.stopped.set()
            return progress
        for p in paths:
            progress.read += self.sizes[p] - self.cached[p]
            progress.cached += self.sizes[p] - self.cached[p]
            self.cached[p] = self.sizes[p]
        self.read_in.set()
        return progress


@dataclass
class FakeProcess:
    """A process the fake host knows: who it runs as, its groups, its cgroup, when it started."""

    pid: int
    uid: int
    gid: int = 0
    groups: tuple[int, ...] = ()
    cgroup: str | None = None  # "/system.slice/NAME.service"; None: the root cgroup
    started: int = 1
    nspid: tuple[int, ...] = ()  # its pids from the host's namespace inwards (default: just pid)


class FakeHost:
    """The host's word on callers, in memory: processes by pid, services' owners, users and groups.

    The server on a real Unix socket takes each connection to come from the next pid of
    ``connect_as`` (else the first process known): the kernel's record at connect() is that
    process as it is then. A test that replaces ``processes[pid]`` afterwards reuses the pid.
    """

    def __init__(self, systemd: FakeSystemd | None = None) -> None:
        self.systemd = systemd
        self.processes: dict[int, FakeProcess] = {}
        self.services: dict[str, ServiceProcesses] = {}
        self.users: dict[str, int] = {"root": 0}
        self.groups: dict[str, int] = {}
        self._next: collections.deque[int] = collections.deque()

    def add(self, process: FakeProcess) -> FakeProcess:
        """Start a process (or reuse its pid)."""
        self.processes[process.pid] = process
        return process

    def connect_as(self, *pids: int) -> None:
        """Make the next connections come from these processes, in order."""
        self._next.extend(pids)

    @property
    def waiting(self) -> int:
        """Count the connections of ``connect_as`` not yet made."""
        return len(self._next)

    def user_name(self, uid: int) -> str:
        """Name a user this host knows (or give the uid)."""
        return next((name for name, known in self.users.items() if known == uid), str(uid))

    def peer(self, sock: socket.socket) -> Peer:
        """Record the connecting process as it is now."""
        pid = self._next.popleft() if self._next else next(iter(self.processes))
        p = self.processes[pid]
        return Peer(p.pid, p.uid, p.gid, frozenset(p.groups), started=p.started, origin=sock, names=self.user_name)

    def process(self, peer: Peer) -> Process | None:
        """Read the process under the peer's pid; PeerChanged if it is another one now."""
        p = self.processes.get(peer.pid)
        if p is None or p.started != peer.started:
            raise PeerChanged("has exited, and its pid may be another process's now")
        if p.uid != peer.uid:
            raise PeerChanged(f"runs as uid {p.uid} now, not as the uid {peer.uid} it connected with")
        return Process(p.pid, p.uid, p.nspid or (p.pid,), p.started, p.cgroup)

    def still(self, peer: Peer) -> bool:
        """Tell whether the peer's process still runs under its pid."""
        p = self.processes.get(peer.pid)
        return p is not None and p.started == peer.started

    def unit_cgroup(self, unit: str) -> str | None:
        """Return a unit's cgroup: the fake systemd's, else that of a service this host knows."""
        if self.systemd is not None and unit in self.systemd.units:
            return self.systemd.control_group(unit)
        if unit in self.services:
            return f"/system.slice/{unit}"
        raise UnitNotFound(f"no unit {unit}")

    def unit_of_pid(self, pid: int) -> str | None:
        """Name the unit of a process from its cgroup."""
        p = self.processes.get(pid)
        return p.cgroup.rsplit("/", 1)[-1] if p is not None and p.cgroup else None

    def service(self, unit: str) -> ServiceProcesses:
        """Return whose a service's processes are (root's, with no main process, unless told)."""
        return self.services.get(unit) or ServiceProcesses(unit, "", False, 0, 0)

    def process_in(self, cgroup: str, pid: int) -> Process | None:
        """Find the process the manager calls ``pid`` in ``cgroup``."""
        for p in self.processes.values():
            if p.cgroup == cgroup and (p.nspid or (p.pid,))[-1] == pid:
                return Process(p.pid, p.uid, p.nspid or (p.pid,), p.started, p.cgroup)
        return None

    def user_id(self, name: str) -> int | None:
        """Resolve a user name (or a number)."""
        return int(name) if name.isdigit() else self.users.get(name)

    def group_id(self, name: str) -> int | None:
        """Resolve a group name."""
        return self.groups.get(name)


@dataclass
class FakeContainer:
    """A container the fake engine knows."""

    name: str
    labels: dict[str, str]
    status: str = "created"
    exit_code: int | None = None
    starts: int = 0
    sleeping: int | None = None  # the sleep level, while asleep
    garbled: bool = False  # answers differently since its last wake
    wakes: int = 0
    started_at: str = ""  # Docker's StartedAt: a new one at each start


class FakeDocker:
    """The Docker engine, answering what the docker adapter answers."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.images = {"engine:latest"}
        self.containers: dict[str, FakeContainer] = {}
        self.where = "fake"
        self.engine_pid = 4242
        self.residual = RESIDUAL_BYTES  # what a sleeping engine keeps
        self._changed = threading.Condition()
        self._started = itertools.count(1)

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
        if c is None:
            return None
        return ContainerState(name, name, c.status, c.exit_code, False, c.started_at, "", dict(c.labels))

    def create(self, spec: Any, labels: dict[str, str]) -> str:
        """Create a container."""
        if spec.image not in self.images:
            raise ImageNotFound(f"image {spec.image!r} not found")
        self.containers[spec.name] = FakeContainer(spec.name, dict(labels))
        return spec.name

    def start(self, name: str) -> str:
        """Start a container: the engine claims its VRAM, or dies of out of memory; return its StartedAt."""
        c = self.containers.get(name)
        if c is None:
            raise ContainerNotFound(f"no container {name}")
        with self._changed:
            c.starts += 1
            if c.status != "running":  # Docker's start of a running container changes nothing
                c.started_at = f"2026-12-01T00:00:{next(self._started):09.6f}Z"
            c.sleeping, c.garbled = None, False
            if self.gpu.claim(f"engine:{name}", self.engine_pid, ENGINE_BYTES):
                c.status, c.exit_code = "running", None
            else:
                c.status, c.exit_code = "exited", 1
            self._changed.notify_all()
            return c.started_at

    def stop(self, name: str, timeout: float) -> None:
        """Stop a container (no error if absent)."""
        c = self.containers.get(name)
        if c is None:
            return
        with self._changed:
            if c.status == "running":
                c.status, c.exit_code = "exited", 0
            self.gpu.free(f"engine:{name}")
            self._changed.notify_all()

    def remove(self, name: str) -> None:
        """Remove a container (no error if absent)."""
        self.stop(name, 0)
        with self._changed:
            self.containers.pop(name, None)
            self._changed.notify_all()

    def sleep(self, name: str, level: int) -> None:
        """Put the engine to sleep: it keeps only its residual."""
        with self._changed:
            c = self.containers[name]
            if c.status == "running" and c.sleeping is None:
                self.gpu.free(f"engine:{name}")
                self.gpu.claim(f"engine:{name}", self.engine_pid, self.residual)
                c.sleeping = level

    def wake(self, name: str, garble: bool = False) -> bool:
        """Wake the engine: it takes its memory back, or stays asleep (False) if there is no room."""
        with self._changed:
            c = self.containers[name]
            if c.sleeping is None:
                return True
            self.gpu.free(f"engine:{name}")
            if not self.gpu.claim(f"engine:{name}", self.engine_pid, ENGINE_BYTES):
                self.gpu.ooms.pop()
                self.gpu.claim(f"engine:{name}", self.engine_pid, self.residual)
                return False
            c.sleeping, c.garbled, c.wakes = None, garble, c.wakes + 1
            return True

    def die(self, name: str) -> None:
        """Make the engine exit as on EngineDeadError."""
        with self._changed:
            c = self.containers[name]
            c.status, c.exit_code = "exited", 1
            self.gpu.free(f"engine:{name}")
            self._changed.notify_all()

    def wait_exit(self, name: str, timeout: float) -> ContainerState | None:
        """Block until the container is not running."""
        deadline = time.monotonic() + min(timeout, 2.0)
        with self._changed:
            while True:
                c = self.containers.get(name)
                if c is None:
                    raise ContainerNotFound(f"container {name!r} was removed while gpuswapd waited for it to exit")
                if c.status != "running":
                    return self.state(name)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)

    def logs_tail(self, name: str, lines: int = 20) -> str:
        """Return the log's end."""
        return "EngineDeadError\n"

    def top(self, name: str) -> list[int]:
        """List the host pids of a running container's processes."""
        c = self.containers.get(name)
        return [self.engine_pid] if c is not None and c.status == "running" else []

    def find(self, labels: dict[str, str]) -> list[ContainerState]:
        """List containers carrying all these labels."""
        out = []
        for name, c in list(self.containers.items()):
            if all(c.labels.get(k) == v for k, v in labels.items()):
                state = self.state(name)
                if state is not None:
                    out.append(state)
        return out


class FakeHttp:
    """The model servers: the resident through its proxy, and the engine."""

    def __init__(self, systemd: FakeSystemd, docker: FakeDocker) -> None:
        self.systemd = systemd
        self.docker = docker
        self.completions: list[str] = []
        self.completed_at: list[tuple[int, str]] = []  # (moment, url) of every completion
        self.garble_wakes = 0  # the next wakes answer differently
        self.sleep_mode = True  # the engine serves /sleep, /wake_up and /is_sleeping
        self.models = ["strata"]  # what the resident lists at /v1/models
        self.props_answer: Any = None  # a raw /props answer instead of strata's own (a server that is not llama.cpp)
        self.slot_files = FakeSlotFiles()
        self.slot_tokens = dict(SLOT_TOKENS)  # what strata's slots hold now
        self.slot_epoch = 0  # strata's starts when slot_tokens was last true: a start empties the slots
        self.verify_slots: list[int | None] = []  # the id_slot each verify asked for
        self.save_s = 0.0  # how long a save takes (seconds)
        self.fail_restore = False  # restores answer HTTP 500
        self.resident_500 = False  # the resident is up but answers every completion HTTP 500 (a broken model)

    def _engine(self, url: str | None = None) -> FakeContainer | None:
        host = urlsplit(url.split()[-1]).hostname if url else "engine.test"
        c = self.docker.containers.get(ENGINES.get(host or "", "hyperqwen"))
        return c if c is not None and c.status == "running" else None

    def _engine_up(self, url: str | None = None) -> bool:
        c = self._engine(url)
        return c is not None and c.sleeping is None

    def _sleep_endpoint(self, url: str) -> FakeContainer:
        c = self._engine(url)
        if c is None:
            raise EndpointUnreachable(f"{url}: connection refused")
        return c

    async def is_sleeping(self, base: str, timeout: float) -> bool | None:
        """Answer vLLM's /is_sleeping (None: sleep mode is off)."""
        await asyncio.sleep(0)
        c = self._sleep_endpoint(f"GET {base}/is_sleeping")
        return None if not self.sleep_mode else c.sleeping is not None

    async def sleep(self, base: str, level: int, timeout: float) -> None:
        """Put the engine to sleep."""
        await asyncio.sleep(0)
        c = self._sleep_endpoint(f"POST {base}/sleep")
        if not self.sleep_mode:
            raise BadResponse(f"POST {base}/sleep: HTTP 404")
        self.docker.sleep(c.name, level)

    async def wake_up(self, base: str, timeout: float) -> None:
        """Wake the engine (CUDA out of memory when there is no room)."""
        await asyncio.sleep(0)
        c = self._sleep_endpoint(f"POST {base}/wake_up")
        garble = self.garble_wakes > 0
        self.garble_wakes -= garble
        if not self.docker.wake(c.name, garble):
            raise BadResponse(f"POST {base}/wake_up: HTTP 500: CUDA out of memory")

    def _resident_up(self) -> bool:
        return all(self.systemd.units[u].active_state == "active" for u in ("strata.service", "llama-swap.service"))

    async def health(self, url: str, timeout: float = 2.0) -> int:
        """Answer the engine's health."""
        await asyncio.sleep(0)
        return 200 if self._engine_up(url) else 0

    async def wait_healthy(self, url: str, timeout: float, interval: float = 0.2, abort: Any = None) -> float:
        """Poll health until 200."""
        started = time.monotonic()
        while not self._engine_up(url):
            if abort is not None and (why := abort()) is not None:
                raise EndpointUnreachable(why)
            if time.monotonic() - started > timeout:
                raise EndpointUnreachable(f"{url} did not answer 200 within {timeout:g}s")
            await asyncio.sleep(0.005)
        return time.monotonic() - started

    async def chat(self, url: str, model: str, prompt: Any, max_tokens: int, timeout: float,
                   sampling: dict[str, Any] | None = None) -> Completion:
        """Answer a completion if the server behind ``url`` is up (a sleeping engine crashes)."""
        await asyncio.sleep(0)
        engine = url in (ENGINE_URL, EVAL_URL)
        c = self._engine(url) if engine else None
        if c is not None and c.sleeping is not None:
            self.docker.die(c.name)  # a request to a sleeping vLLM can crash it
            raise BadResponse(f"POST {url}: HTTP 500: the engine is sleeping")
        up = self._engine_up(url) if engine else self._resident_up()
        if not up:
            raise EndpointUnreachable(f"POST {url}: connection refused")
        if not engine and self.resident_500:
            raise BadResponse(f"POST {url}: HTTP 500: failed to load the model")
        self.completions.append(url)
        self.completed_at.append((next(self.systemd.moments), url))
        text = CANARY if sampling is not None else "ready"
        if c is not None and c.garbled:
            text = text[::-1]
        return Completion(text, "", "stop", 5, 1, 1, 0.001, 0.001)

    async def verify(self, check: Any, retry_until: float | None = None, fields: Any = None) -> Completion:
        """Get a real answer, retrying until ``retry_until``."""
        while True:
            try:
                reply = await self.chat(check.url, check.model, check.prompt, check.max_tokens, check.timeout)
                if check.url == RESIDENT_URL:  # llama-server answers in the slot asked for, else the first
                    slot = (fields or {}).get("id_slot")
                    self.verify_slots.append(slot)
                    self._slots()[slot if slot is not None else 0] = 20
                return reply
            except EndpointUnreachable:
                if retry_until is None or time.monotonic() >= retry_until:
                    raise
                await asyncio.sleep(0.005)

    async def props(self, url: str, timeout: float) -> ServerProps:
        """Answer strata's /props: its context per slot and slots, as it started."""
        await asyncio.sleep(0)
        strata = self.systemd.units["strata.service"]
        if strata.active_state != "active":
            raise EndpointUnreachable(f"GET {url}: connection refused")
        if self.props_answer is not None:
            raise BadResponse(f"GET {url}: no default_generation_settings.n_ctx: {self.props_answer}")
        return ServerProps(strata.n_ctx, strata.fit.slots if strata.fit else 2, "/models/strata.gguf", "strata")

    def _slots(self) -> dict[int, int]:
        """Return strata's slots: a start since they were last looked at empties them."""
        starts = sum(1 for _, u in self.systemd.started_at if u == "strata.service")
        if starts != self.slot_epoch:
            self.slot_epoch, self.slot_tokens = starts, dict.fromkeys(SLOT_TOKENS, 0)
        return self.slot_tokens

    def _strata(self, url: str) -> None:
        if self.systemd.units["strata.service"].active_state != "active":
            raise EndpointUnreachable(f"{url}: connection refused")

    async def slots(self, url: str, timeout: float) -> list[Slot]:
        """Answer strata's /slots."""
        await asyncio.sleep(0)
        self._strata(f"GET {url}")
        return [Slot(i, 4096, n, False) for i, n in sorted(self._slots().items())]

    async def slot_file(self, url: str, slot: int, action: str, filename: str, timeout: float) -> SlotFile:
        """Save a slot to a file of strata's save path, or restore one."""
        await asyncio.sleep(self.save_s if action == "save" else 0)
        self._strata(f"POST {url}/{slot}")
        slots = self._slots()
        if action == "save":
            tokens = slots[slot]
            self.slot_files.files[filename] = (slot, tokens, tokens * KV_PER_TOKEN + 100)
            return SlotFile(slot, filename, tokens, tokens * KV_PER_TOKEN + 100, 1.0)
        if self.fail_restore or filename not in self.slot_files.files:
            raise BadResponse(f"POST {url}/{slot}?action=restore: HTTP 400: Unable to restore slot")
        _, tokens, nbytes = self.slot_files.files[filename]
        slots[slot] = tokens
        return SlotFile(slot, filename, tokens, nbytes, 1.0)

    async def model_ids(self, url: str, timeout: float) -> list[str]:
        """Answer the resident's /v1/models through its proxy."""
        await asyncio.sleep(0)
        if not self._resident_up():
            raise EndpointUnreachable(f"GET {url}: connection refused")
        return sorted(self.models)

    async def idle(self, idle: Any, timeout: float = 10.0, draining: bool = False) -> Busy:
        """Say the resident is idle."""
        return Busy(False, "idle")

    async def aclose(self) -> None:
        """Close nothing."""


class FakeStore:
    """The state directory in memory: it keeps the newest document written, read as the real store reads it."""

    def __init__(self) -> None:
        self.dir = Path("/fake/state")
        self._data: bytes | None = None
        self._document: Document | None = None
        self.history_records: list[dict[str, Any]] = []
        self.on_write: Any = None

    @property
    def document(self) -> Document | None:
        """Return the newest document written."""
        if self._document is None and self._data is not None:
            self._document = decode(self._data)
        return self._document

    @document.setter
    def document(self, document: Document | None) -> None:
        self._data, self._document = None, document

    def holds_window(self) -> bool:
        """Tell whether the newest document holds a window (without decoding it)."""
        return (self._data is not None and b'"window":null' not in self._data) or (self._document is not None \
            and self._document.window is not None)

    def write(self, data: bytes) -> None:
        """Take a serialized document."""
        if self.on_write is not None:
            self.on_write(b'"window":null' in data, data)
        self._data, self._document = data, None

    def append_history(self, records: list[dict[str, Any]]) -> None:
        """Keep finished windows."""
        self.history_records.extend(json.loads(json.dumps(r)) for r in records)

    def history(self, limit: int = 20) -> list[dict[str, Any]]:
        """Return the last windows."""
        return self.history_records[-limit:]

    def load(self) -> Loaded:
        """Read back the newest document."""
        return Loaded(self.document, [])

    def set_aside(self) -> list[str]:
        """Nothing to set aside."""
        return []


@dataclass
class FakeWorld:
    """A whole machine in memory: the card, systemd, Docker, the servers, the state directory."""

    config: Config = field(default_factory=lambda: FAKE_CONFIG)
    gpu: FakeGpu = field(default_factory=FakeGpu)
    store: FakeStore = field(default_factory=FakeStore)
    fit: FakeFit | None = None  # the resident fits itself to the free memory (llama.cpp's --fit)

    def __post_init__(self) -> None:
        self.systemd = FakeSystemd(self.gpu)
        self.docker = FakeDocker(self.gpu)
        self.http = FakeHttp(self.systemd, self.docker)
        self.files = FakeFiles()
        full = self.fit.claim(self.fit.ctx) if self.fit is not None else RESIDENT_BYTES
        self.systemd.add_unit(FakeUnit("strata.service", gpu_bytes=full, pid=1001, fit=self.fit,
                                       n_ctx=self.fit.ctx // self.fit.slots if self.fit else 4096))
        self.systemd.add_unit(FakeUnit("llama-swap.service", requires=("strata.service",), pid=1002))
        for agent in AGENTS:
            self.systemd.add_timer(f"agent-{agent}.timer")
        self.systemd.add_timer("agent-off.timer", active=False)  # disabled by its owner: stays so
        self.systemd.add_timer("backup-models.timer")

    def window(self, outside: Outside | None = None) -> Window:
        """Build the real window on these fakes."""
        outside = outside or Outside(DEADLINES)
        vram = Vram(self.gpu, self.systemd, outside)  # type: ignore[arg-type]
        resident = Resident(self.config, self.systemd, self.http, outside,  # type: ignore[arg-type]
                            self.http.slot_files, memory_marks(self.store), memory_marks(self.store, "starting"))
        engine = ContainerEngine(self.config.window, self.docker, self.http, outside)  # type: ignore[arg-type]
        engines = {p.name: ContainerEngine(p.engine, self.docker, self.http, outside)  # type: ignore[arg-type]
                   for p in self.config.engine_profiles() if p.name != "default"}
        return Window(self.config, resident, engine, vram, self.store, Notifier(""), outside,  # type: ignore[arg-type]
                      BACKOFFS, engines=engines, files=self.files)  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, Any]:
        """Read the world's state: units, timers, containers, VRAM."""
        return {
            "units": {u: self.systemd.units[u].active_state for u in ("strata.service", "llama-swap.service")},
            "timers": {name: state for name, (state, _) in self.systemd.timer_units.items()},
            "containers": sorted(self.docker.containers),
            "vram": sorted(self.gpu.holders),
            "slot_files": sorted(self.http.slot_files.files),
        }


BASELINE = FakeWorld().snapshot()


async def settle(window: Window, timeout: float = 10.0) -> None:
    """Wait until the window's driver has nothing left to do (IDLE, no driver, state written)."""
    deadline = time.monotonic() + timeout
    while window.record is not None or window.driver.task is not None or window.writer.pending:
        if time.monotonic() > deadline:
            rec = window.record
            raise AssertionError(f"the window did not settle: phase {window.phase}, leases "
                                 f"{rec and [x.to_dict(time.time()) for x in rec.leases.all()]}, driver "
                                 f"{window.driver.task and _awaiting(window.driver.task.get_coro())}")
        await asyncio.sleep(0.005)


def _awaiting(coro: Any) -> list[str]:
    """Follow what a coroutine awaits, down to the innermost (for a report of where it hangs)."""
    chain = []
    while coro is not None and len(chain) < 30:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            chain.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    chain.append(repr(coro))
    return chain


@contextlib.asynccontextmanager
async def running(window: Window, seq: int = 0) -> Any:
    """Run a window's writer for the test, and stop it afterwards."""
    window.writer.start(seq)
    try:
        yield window
    finally:
        window.stopping.set()
        await window.writer.stop(1.0)
