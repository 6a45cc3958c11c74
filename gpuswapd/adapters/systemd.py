"""systemd over D-Bus (pydbus): unit state, start/stop jobs, dependency closures, timers.

pydbus is synchronous and thread-safe: the asyncio core calls these methods from a worker
thread. Signals (JobRemoved) are delivered by a GLib main loop that runs in a thread of its own.
"""

from __future__ import annotations

import fnmatch
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

from gi.repository import Gio, GLib
from pydbus import SystemBus

from gpuswapd import clock
from gpuswapd.adapters.unitnames import Owner, cgroup_of, owner_of, unit_from_path
from gpuswapd.adapters.unitstates import ACTIVE, Commands, JobResults, ServiceProcesses, TimerState, UnitState
from gpuswapd.errors import BusUnavailable, JobFailed, SystemdError, UnitNotFound

P = ParamSpec("P")
R = TypeVar("R")

_SYSTEMD = "org.freedesktop.systemd1"
_MANAGER_PATH = "/org/freedesktop/systemd1"
_UNIT_IFACE = "org.freedesktop.systemd1.Unit"
_LOGIND = "org.freedesktop.login1"
_TIMER_IFACE = "org.freedesktop.systemd1.Timer"
_SERVICE_IFACE = "org.freedesktop.systemd1.Service"
# Reverse dependency properties: who Requires=, BindsTo= or is PartOf= this unit.
_DEPENDENTS = ("RequiredBy", "BoundBy", "ConsistsOf")
_UNAVAILABLE = frozenset({
    "org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NoReply",
    "org.freedesktop.DBus.Error.Disconnected", "org.freedesktop.DBus.Error.NoServer",
    "org.freedesktop.DBus.Error.Timeout", "org.freedesktop.DBus.Error.TimedOut",
})


def _systemd_errors(func: Callable[P, R]) -> Callable[P, R]:
    """Turn GLib/D-Bus errors into gpuswapd's own."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except GLib.Error as err:
            name = Gio.DBusError.get_remote_error(err) or ""
            text = Gio.DBusError.strip_remote_error(err) or err.message
            if name in ("org.freedesktop.systemd1.NoSuchUnit", "org.freedesktop.systemd1.LoadFailed"):
                raise UnitNotFound(text) from err
            if name in _UNAVAILABLE or err.matches(Gio.io_error_quark(), Gio.IOErrorEnum.TIMED_OUT):
                raise BusUnavailable(f"systemd did not answer over D-Bus: {text}") from err
            if not name:
                raise BusUnavailable(f"cannot talk to systemd over D-Bus: {text}") from err
            raise SystemdError(f"systemd refused: {text} ({name})") from err

    return wrapper


class Systemd:
    """A connection to the system manager over the system bus."""

    def __init__(self, call_timeout: float = 25.0) -> None:
        self._timeout = call_timeout
        self._jobs_done = JobResults()
        self._lock = threading.Lock()
        self._bus: Any = None
        self._manager: Any = None
        self._props: dict[str, Any] = {}
        self._subscription: Any = None
        self._state_subscription: Any = None
        self._timer_units: dict[str, str] = {}
        self._state_watchers: list[Callable[[str, str], None]] = []
        self._resume_subscription: Any = None
        self._resume_watchers: list[Callable[[], None]] = []
        self._owners: dict[str, str] = {}  # cgroups this manager confirmed are a unit's (unitnames.owner_of)

    @_systemd_errors
    def connect(self) -> None:
        """Connect to the bus (again, if it was lost) and subscribe to job signals."""
        with self._lock:
            if self._manager is not None and not self._bus.con.is_closed():
                return
            self._manager, self._props, self._timer_units = None, {}, {}
            bus = SystemBus()
            # GLib's shared bus connection raises SIGTERM in the process when the bus goes away;
            # a daemon reconnects instead.
            bus.con.set_exit_on_close(False)
            manager = bus.get(_SYSTEMD, _MANAGER_PATH, timeout=self._timeout)[
                "org.freedesktop.systemd1.Manager"
            ]
            # Subscribe to JobRemoved before any job is started: the signal can arrive before
            # the StartUnit/StopUnit call returns.
            self._subscription = bus.subscribe(
                sender=_SYSTEMD, iface="org.freedesktop.systemd1.Manager", signal="JobRemoved",
                object=_MANAGER_PATH, signal_fired=self._on_job_removed,
            )
            try:
                manager.Subscribe(timeout=self._timeout)  # without it systemd sends few signals
            except GLib.Error as err:
                # One subscription per connection; another Systemd on this connection made it.
                if Gio.DBusError.get_remote_error(err) != "org.freedesktop.systemd1.AlreadySubscribed":
                    raise
            self._state_subscription = self._resume_subscription = None
            self._bus, self._manager = bus, manager
            self._subscribe_states()
            self._subscribe_resume()
            _start_glib_loop()

    def _subscribe_states(self) -> None:
        if self._state_watchers and self._state_subscription is None and self._bus is not None:
            self._state_subscription = self._bus.subscribe(
                sender=_SYSTEMD, iface="org.freedesktop.DBus.Properties", signal="PropertiesChanged",
                arg0=_UNIT_IFACE, signal_fired=self._on_properties_changed,
            )

    def _subscribe_resume(self) -> None:
        if self._resume_watchers and self._resume_subscription is None and self._bus is not None:
            self._resume_subscription = self._bus.subscribe(
                sender=_LOGIND, iface="org.freedesktop.login1.Manager", signal="PrepareForSleep",
                object="/org/freedesktop/login1", signal_fired=self._on_prepare_for_sleep,
            )

    def close(self) -> None:
        """Stop receiving signals."""
        for sub in (self._subscription, self._state_subscription, self._resume_subscription):
            if sub is not None:
                sub.unsubscribe()
        self._subscription = self._state_subscription = self._resume_subscription = None

    def _on_job_removed(self, _sender: str, _obj: str, _iface: str, _sig: str, params: Any) -> None:
        _job_id, path, _unit, result = params
        self._jobs_done.removed(path, result)

    def _mgr(self) -> Any:
        if self._manager is None or self._bus.con.is_closed():
            self.connect()
        return self._manager

    def _properties(self, path: str) -> Any:
        proxy = self._props.get(path)
        if proxy is None:
            proxy = self._bus.get(_SYSTEMD, path, timeout=self._timeout)["org.freedesktop.DBus.Properties"]
            self._props[path] = proxy
        return proxy

    @_systemd_errors
    def properties(self, unit: str, iface: str = _UNIT_IFACE) -> dict[str, Any]:
        """Read all properties of one interface of a unit (loading it if needed)."""
        path = self._mgr().LoadUnit(unit, timeout=self._timeout)
        props: dict[str, Any] = self._properties(path).GetAll(iface, timeout=self._timeout)
        return props

    @_systemd_errors
    def system_state(self) -> str:
        """Read the manager's SystemState (running, degraded, stopping, ...)."""
        self._mgr()
        state: str = self._properties(_MANAGER_PATH).Get("org.freedesktop.systemd1.Manager", "SystemState",
                                                         timeout=self._timeout)
        return state

    def state(self, unit: str) -> UnitState:
        """Read a unit's load, active and sub state."""
        p = self.properties(unit)
        entered = int(p.get("ActiveEnterTimestampMonotonic") or 0)  # microseconds; 0: never
        result = ""
        if p["ActiveState"] == "failed" and unit.endswith(".service"):  # why: its start limit, or a crash
            result = str(self.properties(unit, _SERVICE_IFACE).get("Result", ""))
        return UnitState(unit, p["LoadState"], p["ActiveState"], p["SubState"], str(p.get("UnitFileState", "")),
                         tuple(str(n) for n in p.get("Names", ())), bytes(p.get("InvocationID") or b"").hex(),
                         bool((p.get("Job") or (0, "/"))[0]), entered / 1e6 if entered > 0 else None, result)

    def _require_loaded(self, unit: str) -> dict[str, Any]:
        props = self.properties(unit)
        if props["LoadState"] != "loaded":
            raise UnitNotFound(f"unit {unit} is {props['LoadState']}: check its name and `systemctl status {unit}`")
        return props

    @_systemd_errors
    def queue_jobs(self, method: str, units: list[str]) -> list[tuple[str, str]]:
        """Queue one StartUnit or StopUnit job per unit (systemd orders them); return (unit, job path)."""
        if method not in ("StartUnit", "StopUnit"):
            raise ValueError(f"not a job method: {method}")
        mgr = self._mgr()
        return [(unit, str(getattr(mgr, method)(unit, "replace", timeout=self._timeout))) for unit in units]

    def when_job_done(self, path: str, callback: Callable[[str], None]) -> None:
        """Call ``callback(result)`` from the signal thread once the job ends (done, failed, ...)."""
        self._jobs_done.when_done(path, callback)

    def forget_job(self, path: str) -> None:
        """Stop waiting for a job's result."""
        self._jobs_done.forget(path)

    def start(self, *units: str, timeout: float) -> None:
        """Start units and block until their jobs are done (for tools; gpuswapd awaits JobRemoved)."""
        self._block_on_jobs("StartUnit", list(units), timeout)

    def stop(self, *units: str, timeout: float) -> None:
        """Stop units and block until their jobs are done (for tools; gpuswapd awaits JobRemoved)."""
        self._block_on_jobs("StopUnit", list(units), timeout)

    def _block_on_jobs(self, method: str, units: list[str], timeout: float) -> None:
        deadline = clock.monotonic() + timeout
        results: dict[str, str] = {}
        done = threading.Condition()

        def settle(path: str, result: str) -> None:
            with done:
                results[path] = result
                done.notify_all()

        queued = self.queue_jobs(method, units)
        for _, path in queued:
            self.when_job_done(path, functools.partial(settle, path))
        with done:
            done.wait_for(lambda: len(results) == len(queued), max(0.0, deadline - clock.monotonic()))
        failed = [f"{unit}: {results.get(path, 'timeout')}" for unit, path in queued if results.get(path) != "done"]
        if failed:
            raise JobFailed(f"{method} failed: {', '.join(failed)}")

    def stop_closure(self, units: Iterable[str]) -> list[str]:
        """List the active units among ``units`` and all that Requires=/BindsTo=/PartOf= them."""
        queue, seen, active = list(units), set[str](), list[str]()
        for name in queue:
            self._require_loaded(name)
        while queue:
            name = queue.pop(0)
            if name in seen:
                continue
            seen.add(name)
            props = self.properties(name)
            if props["ActiveState"] not in ACTIVE:
                continue
            active.append(name)
            for key in _DEPENDENTS:
                queue.extend(sorted(props.get(key, [])))
        return active

    @_systemd_errors
    def commands(self, unit: str) -> Commands:
        """Read what a service runs: its ExecStart= command lines, Environment= and WorkingDirectory=."""
        path = self._mgr().LoadUnit(unit, timeout=self._timeout)
        if not unit.endswith(".service"):
            return Commands(unit)  # a target or socket runs nothing of its own
        # Three small Gets, not GetAll: a service has some 200 properties to unpack (milliseconds each time).
        props = self._properties(path)
        exec_start, env, cwd = (props.Get(_SERVICE_IFACE, name, timeout=self._timeout)
                                for name in ("ExecStart", "Environment", "WorkingDirectory"))
        # ExecStart is a(sasbttttuii): path, argv, ignore failure, then timestamps and the last exit.
        argvs = tuple(tuple(str(a) for a in row[1]) for row in exec_start or [])
        return Commands(unit, argvs, tuple(str(e) for e in env or []), str(cwd or ""))

    @_systemd_errors
    def timers(self, patterns: Iterable[str]) -> list[TimerState]:
        """List the loaded timers whose names match any of the glob patterns."""
        pats = list(patterns)
        if not pats:
            return []
        rows = self._mgr().ListUnitsByPatterns([], pats, timeout=self._timeout)
        timers = []
        for row in sorted(rows):
            name, active_state, path = row[0], row[3], row[6]
            if name.endswith(".timer") and any(fnmatch.fnmatchcase(name, p) for p in pats):
                if name not in self._timer_units:  # a timer's Unit= does not change while it is loaded
                    self._timer_units[name] = self._properties(path).Get(_TIMER_IFACE, "Unit", timeout=self._timeout)
                timers.append((name, active_state, self._timer_units[name]))
        services = {row[0]: row[3] for row in self._mgr().ListUnitsByNames([t[2] for t in timers],
                                                                             timeout=self._timeout)}
        return [TimerState(name, state, service, services.get(service, "inactive")) for name, state, service in timers]

    @_systemd_errors
    def control_group(self, unit: str) -> str | None:
        """Return the cgroup of a loaded service or scope of this manager (None if it has none now)."""
        iface = "org.freedesktop.systemd1." + ("Scope" if unit.endswith(".scope") else "Service")
        path = self._mgr().GetUnit(unit, timeout=self._timeout)
        group = self._properties(path).Get(iface, "ControlGroup", timeout=self._timeout)
        return str(group) or None

    @_systemd_errors
    def service_processes(self, unit: str) -> ServiceProcesses:
        """Read whose a loaded service's processes are: User=, DynamicUser=, MainPID and ControlPID."""
        path = self._mgr().GetUnit(unit, timeout=self._timeout)
        props = self._properties(path).GetAll("org.freedesktop.systemd1.Service", timeout=self._timeout)
        return ServiceProcesses(unit, str(props.get("User") or ""), bool(props.get("DynamicUser")),
                                int(props.get("MainPID") or 0), int(props.get("ControlPID") or 0))

    def unit_of_pid(self, pid: int) -> str | None:
        """Name whose a process is: its system unit, else a stranger's (never a unit name); None: it is gone."""
        owner = self.owner_of_pid(pid)
        return None if owner is None else owner.name

    def owner_of_pid(self, pid: int) -> Owner | None:
        """Find the system unit that owns a process, as this manager confirms it (None: the process is gone).

        The process's cgroup is read from /proc and its outermost unit confirmed by the manager's
        ``ControlGroup`` (cached by cgroup path): a user manager's ``strata.service`` is a stranger's,
        and so is a process in a cgroup no system unit owns (the root cgroup, Docker's cgroupfs
        driver). Where /proc hides the process (hidepid=), the manager's ``GetUnitByPID`` says.
        """
        try:
            cgroup = cgroup_of(pid)
        except OSError:
            pass  # /proc hides it (hidepid=), or it has exited: ask systemd
        else:
            return owner_of(cgroup or "/", self.control_group, self._owners)
        try:
            path = self._mgr().GetUnitByPID(pid, timeout=self._timeout)
            props = self._properties(path).GetAll(_UNIT_IFACE, timeout=self._timeout)
        except GLib.Error:
            return None
        unit = str(props["Id"])
        # A slice holds no process of its own: one in a slice's cgroup is in no service or scope.
        return Owner(None if unit.endswith(".slice") else unit, f"the cgroup of {unit}")

    def watch_active_state(self, watcher: Callable[[str, str], None]) -> None:
        """Call ``watcher(unit, active_state)`` from the signal thread when a unit's state changes."""
        self.connect()
        with self._lock:
            self._state_watchers.append(watcher)
            self._subscribe_states()

    @_systemd_errors
    def watch_resume(self, watcher: Callable[[], None]) -> bool:
        """Call ``watcher()`` from the signal thread whenever the machine resumes from a suspend.

        logind says so (``PrepareForSleep(false)``); tell whether logind is on this bus to say it
        (without it, nobody calls: gpuswapd's naps stay short).
        """
        self.connect()
        with self._lock:
            self._resume_watchers.append(watcher)
            self._subscribe_resume()
            dbus = self._bus.get("org.freedesktop.DBus", "/org/freedesktop/DBus", timeout=self._timeout)
        if dbus.NameHasOwner(_LOGIND, timeout=self._timeout):
            return True
        return _LOGIND in dbus.ListActivatableNames(timeout=self._timeout)

    def _on_prepare_for_sleep(self, _sender: str, _path: str, _iface: str, _sig: str, params: Any) -> None:
        (sleeping,) = params
        if not sleeping:  # false: it has resumed
            for watcher in list(self._resume_watchers):
                watcher()

    def _on_properties_changed(self, _sender: str, path: str, _iface: str, _sig: str, params: Any) -> None:
        iface, changed, _invalidated = params
        if iface != _UNIT_IFACE or "ActiveState" not in changed:
            return
        unit = unit_from_path(path)
        for watcher in list(self._state_watchers):
            watcher(unit, str(changed["ActiveState"]))


_glib_lock = threading.Lock()
_glib_thread: threading.Thread | None = None


def _start_glib_loop() -> None:
    """Run one GLib main loop for the process: it delivers D-Bus signals to callbacks."""
    global _glib_thread
    with _glib_lock:
        if _glib_thread is None or not _glib_thread.is_alive():
            _glib_thread = threading.Thread(target=GLib.MainLoop().run, name="glib-loop", daemon=True)
            _glib_thread.start()
