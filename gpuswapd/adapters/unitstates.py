"""What systemd says about units, timers and jobs: plain values, no D-Bus (tests use them too)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from gpuswapd import clock

ACTIVE = frozenset({"active", "activating", "reloading"})


@dataclass(frozen=True)
class UnitState:
    """What systemd says about a unit right now."""

    name: str
    load_state: str
    active_state: str
    sub_state: str
    unit_file_state: str = ""  # enabled, disabled, masked, static... ("": unknown)
    names: tuple[str, ...] = ()  # every name of the unit (its Id and its aliases); signals carry the Id
    invocation: str = ""  # InvocationID: new at each start of the unit, by whoever started it ("": none, unknown)
    job: bool = False  # a job for it is queued (a start at boot, its operator's): it is on its way
    # When it last became active, on CLOCK_MONOTONIC (ActiveEnterTimestampMonotonic; None: never, or unknown).
    active_enter: float | None = None
    # Why a failed service failed (Service.Result: "start-limit-hit", "exit-code", ...; "": not read).
    result: str = ""

    @property
    def active(self) -> bool:
        """Tell whether the unit is up or coming up."""
        return self.active_state in ACTIVE


@dataclass(frozen=True)
class TimerState:
    """A timer and the service it triggers."""

    name: str
    active_state: str
    service: str
    service_state: str

    @property
    def job_running(self) -> bool:
        """Tell whether the timer's service is running now."""
        return self.service_state in ("activating", "active", "deactivating", "reloading")


@dataclass(frozen=True)
class ServiceProcesses:
    """Whose a service's processes are, as its manager says: ``User=``, its main and control process."""

    unit: str
    user: str           # User= as written (a name or a uid); "" when unset (root, unless dynamic)
    dynamic_user: bool  # DynamicUser=yes: a uid allocated while it runs
    main_pid: int       # in the manager's PID namespace; 0 when it has none now
    control_pid: int    # the ExecStartPre=/ExecStopPost= (...) command running now; 0 when none


@dataclass(frozen=True)
class Commands:
    """What a unit runs: each ExecStart= command line (program first), its Environment= and WorkingDirectory=."""

    unit: str
    argvs: tuple[tuple[str, ...], ...] = ()
    environment: tuple[str, ...] = ()
    working_directory: str = ""


class JobResults:
    """Results of removed jobs, handed to whoever waits for that job path.

    JobRemoved can arrive before StartUnit/StopUnit has even returned the job's path: a result
    nobody waits for yet is kept for a while, for the waiter that comes next.
    """

    _KEEP_S = 300.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, tuple[str, float]] = {}
        self._waiting: dict[str, Callable[[str], None]] = {}

    def removed(self, path: str, result: str) -> None:
        """Record that a job ended (called from the GLib thread)."""
        now = clock.monotonic()
        with self._lock:
            callback = self._waiting.pop(path, None)
            if callback is None:
                self._done[path] = (result, now)
                if len(self._done) > 512:
                    self._done = {p: v for p, v in self._done.items() if now - v[1] < self._KEEP_S}
        if callback is not None:
            callback(result)

    def when_done(self, path: str, callback: Callable[[str], None]) -> None:
        """Call ``callback(result)`` once the job at ``path`` has ended (at once if it has)."""
        with self._lock:
            done = self._done.pop(path, None)
            if done is None:
                self._waiting[path] = callback
        if done is not None:
            callback(done[0])

    def forget(self, path: str) -> None:
        """Stop waiting for a job (its waiter gave up)."""
        with self._lock:
            self._waiting.pop(path, None)
