"""Every call to an outside system, with a deadline, on a lane of its own.

    systemd  D-Bus calls (pydbus) and the jobs they queue
    docker   the Docker SDK
    gpu      NVML or nvidia-smi
    state    reads and writes of the state directory
    files    the resident's model files: what of them is in the page cache, and reading them in;
             the slot save directory (its files listed and removed, its free space)
    http     the model servers (httpx, asynchronous: a deadline, no thread)

A call that outlives its deadline fails at once with the system's own error. Its thread may go
on (a stuck NVML call cannot be cancelled): it counts as hung until it returns, and status shows
it. When every worker of a lane is hung, the next call fails at once instead of queueing behind
them, and since each system has workers of its own, one stuck system never starves the others.

``CALLS`` names every call the window makes, by lane: the fault tests cover each entry, and a
call whose name is not registered is a bug that fails loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from gpuswapd import clock
from gpuswapd import workers as workers_
from gpuswapd.errors import (
    BusUnavailable,
    DockerUnavailable,
    EndpointTimeout,
    FilesError,
    GpuProbeError,
    GpuswapError,
    StateError,
)
from gpuswapd.logs import log
from gpuswapd.protocol import JsonObject

P = ParamSpec("P")
R = TypeVar("R")

CALLS: dict[str, frozenset[str]] = {
    "systemd": frozenset({"connect", "closure", "timers", "queue_jobs", "job", "unit_state", "system_state",
                          "unit_of_pid", "unit_cgroup", "unit_service",
                          "commands", "user_name"}),
    "docker": frozenset({"ping", "image_present", "state", "create", "start", "stop", "remove",
                         "logs_tail", "find", "env_file", "top",
                         "settings"}),  # wait_exit: a long wait on a thread of its own
    "gpu": frozenset({"read"}),
    "state": frozenset({"read", "write", "append_history", "read_history", "mark", "unmark", "read_marks"}),
    "files": frozenset({"measure", "prefetch", "slot_identity", "slot_listing", "slot_free", "slot_remove"}),
    "http": frozenset({"idle", "health", "wait_healthy", "chat", "verify", "is_sleeping", "sleep", "wake_up",
                       "canary", "props", "models", "slots", "slot_save", "slot_restore"}),
}

# Calls that only look and change nothing: one that outlives its deadline is still shown as hung,
# but the close does not wait for it to land (closing.hung_mark counts the others): the prefetch's
# read of the resident's units never holds up a close.
LOOKS_ONLY: dict[str, frozenset[str]] = {"systemd": frozenset({"commands"})}

# Calls that change the outside system. One whose caller went away (a cancelled opening) while it
# still runs is followed like one that outlived its deadline: it may still create a container or
# stop a unit after the close, so the close waits for it to land and then makes sure again.
CHANGES: dict[str, frozenset[str]] = {"systemd": frozenset({"queue_jobs", "job"}),
                                      "docker": frozenset({"create", "start", "stop", "remove"})}

CANCELLED_GRACE_S = 2.0  # a call whose caller went away and that has not returned after this holds a worker

# Raised when a call of that lane misses its deadline or the lane is hung.
_ERRORS: dict[str, type[GpuswapError]] = {
    "systemd": BusUnavailable, "docker": DockerUnavailable, "gpu": GpuProbeError, "state": StateError,
    "files": FilesError, "http": EndpointTimeout,
}
_WHAT = {"systemd": "systemd (D-Bus)", "docker": "Docker", "gpu": "the GPU probe", "state": "the state directory",
         "files": "the resident's model files", "http": "the model server"}
_NEXT = {"systemd": "check `systemctl status` and the system bus",
         "docker": "check `systemctl status docker`",
         "gpu": "the driver may be hung: check `dmesg` and `nvidia-smi`",
         "state": "check the disk under daemon.state_dir",
         "files": "check the disk or filesystem that holds them",
         "http": "check the server's log"}



@dataclass(frozen=True)
class Late:
    """A fault's verdict on a blocking call: it does its work, but its answer comes this much later.

    ``deadline``: this call's own, instead of the lane's (a hang that outlives a short deadline
    while the other calls keep long ones, which a loaded machine does not miss).
    """

    seconds: float
    deadline: float | None = None


# (system, call, asynchronous) -> None, a wrapper of the call (a function for a blocking call,
# an awaitable for an asynchronous one), or Late for a blocking call; it may also raise, or be cancelled.
Injector = Callable[[str, str, bool], Awaitable[Callable[[Any], Any] | Late | None]]


@dataclass(frozen=True)
class Deadlines:
    """How long each lane's calls may take by default (seconds), and its number of workers."""

    systemd: float = 30.0
    docker: float = 60.0
    gpu: float = 12.0
    state: float = 30.0
    files: float = 30.0  # a measure; a prefetch has a deadline of its own (resident.start_timeout)
    http: float = 5.0  # for calls with a timeout of their own, the margin beyond it
    workers: int = 4


@dataclass
class _Stuck:
    call: str
    since: float


class _Call:
    """One blocking call in flight: whether it returned, and who wants to know when it does."""

    __slots__ = ("_then", "landed")

    def __init__(self) -> None:
        self.landed = False
        self._then: list[Callable[[], None]] = []

    def land(self, loop: asyncio.AbstractEventLoop) -> None:
        self.landed = True
        for then in self._then:
            loop.call_soon(then)
        self._then.clear()

    def when_landed(self, then: Callable[[], None]) -> None:
        if self.landed:
            asyncio.get_running_loop().call_soon(then)
        else:
            self._then.append(then)


class Lane:
    """One outside system's calls: bounded workers, a deadline on each call, hung calls counted."""

    def __init__(self, system: str, deadline: float, workers: int) -> None:
        self.system = system
        self.deadline = deadline
        self.workers = workers
        self.calls = CALLS[system]
        self.injector: Injector | None = None  # the fault tests' hook; None in service
        self._pool = workers_.pool(system, workers)
        self._stuck: dict[int, _Stuck] = {}
        self._drained = asyncio.Event()
        self._drained.set()
        self.hung_total = 0  # calls that ever outlived their deadline, but those that only look
        self.changes_hung = 0  # of those, the calls that change the system (CHANGES): a stop job, a create
        self._error = _ERRORS[system]

    async def call(self, name: str, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a blocking call on this lane's workers within the lane's deadline."""
        return await self.call_within(self.deadline, name, func, *args, **kwargs)

    async def call_within(self, deadline: float, name: str, func: Callable[P, R], /,
                          *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a blocking call on this lane's workers within ``deadline`` seconds."""
        self._check(name)
        work: Callable[[], Any] = lambda: func(*args, **kwargs)  # noqa: E731
        late = 0.0
        if self.injector is not None:
            wrap = await self.injector(self.system, name, False)
            if isinstance(wrap, Late):
                late = wrap.seconds
                deadline = deadline if wrap.deadline is None else wrap.deadline
            elif wrap is not None:
                work = wrap(work)
        if len(self._stuck) >= self.workers:
            oldest = min(self._stuck.values(), key=lambda s: s.since)
            raise self._error(f"{_WHAT[self.system]} is hung: {len(self._stuck)} call(s) have not returned "
                              f"({oldest.call} for {clock.monotonic() - oldest.since:.0f}s); {_NEXT[self.system]}")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[R] = loop.create_future()  # cancelled when its caller stops waiting
        call = _Call()
        context = contextvars.copy_context()

        def settle(result: Any, error: BaseException | None) -> None:
            call.land(loop)
            if waiter.done():
                return  # nobody waits any more (deadline or cancellation): drop what it brings
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(result)

        def done(result: Any, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: gpuswapd is exiting
                loop.call_soon_threadsafe(settle, result, error)

        self._pool.submit(lambda: context.run(work), done, late)
        started = clock.monotonic()
        try:
            # asyncio.timeout, not wait_for: in Python 3.11 wait_for can swallow a cancellation.
            # The call itself is not the awaited future (its thread cannot be cancelled): what it
            # brings after its caller stopped waiting lands in ``call`` and is dropped.
            async with asyncio.timeout(deadline):
                return await waiter
        except TimeoutError:
            self._hung(name, call, started)
            raise self._error(f"{_WHAT[self.system]} did not answer ({name}) within {deadline:g}s; "
                              f"{_NEXT[self.system]}") from None
        except asyncio.CancelledError:
            if not call.landed and name in CHANGES.get(self.system, frozenset()):
                self._hung(name, call, started, abandoned=True)
            elif not call.landed:
                # A call told to stop (the prefetch's stop event) returns within a moment; one that
                # does not still holds a worker, and is counted and shown as hung until it returns.
                loop.call_later(CANCELLED_GRACE_S, self._still_running, name, call, started)
            raise

    async def run(self, name: str, awaitable: Awaitable[R], deadline: float | None = None) -> R:
        """Await an asynchronous call (or a signal) of this system within a deadline."""
        self._check(name)
        if self.injector is not None:
            try:
                wrap = await self.injector(self.system, name, True)
            except BaseException:
                close_unawaited(awaitable)
                raise
            if isinstance(wrap, Late):
                raise AssertionError(f"{self.system}.{name} is asynchronous: a hang wraps it, it is not Late")
            if wrap is not None:
                awaitable = wrap(awaitable)
        limit = self.deadline if deadline is None else deadline
        try:
            async with asyncio.timeout(limit):
                return await awaitable
        except TimeoutError:
            raise self._error(f"{_WHAT[self.system]} did not answer ({name}) within {limit:g}s; "
                              f"{_NEXT[self.system]}") from None

    def beyond(self, timeout: float) -> float:
        """Give a call with a timeout of its own a deadline that backs it up: the lane's margin more."""
        return timeout + self.deadline

    def _check(self, name: str) -> None:
        if name not in self.calls:
            raise AssertionError(f"{self.system}.{name} is not in outside.CALLS: register it "
                                 "(the fault tests cover every entry)")

    async def drained(self) -> None:
        """Wait until every call that outlived its deadline has returned (and done what it did)."""
        await self._drained.wait()

    def _still_running(self, name: str, call: _Call, started: float) -> None:
        if not call.landed and id(call) not in self._stuck:
            self._hung(name, call, started)

    def _hung(self, name: str, call: _Call, started: float, abandoned: bool = False) -> None:
        key = id(call)
        self._stuck[key] = _Stuck(name, started)
        if name not in LOOKS_ONLY.get(self.system, frozenset()):
            self.hung_total += 1
        if name in CHANGES.get(self.system, frozenset()):
            self.changes_hung += 1
        self._drained.clear()
        if abandoned:
            log.warning("outside_call_hung", system=self.system, call=name, hung=len(self._stuck),
                        reason="its caller went away while it still runs; the close makes sure again once it lands")
        else:
            log.warning("outside_call_hung", system=self.system, call=name, hung=len(self._stuck))

        def returned() -> None:
            stuck = self._stuck.pop(key, None)
            if stuck is not None:
                log.info("outside_call_returned", system=self.system, call=name,
                         took_s=round(clock.monotonic() - stuck.since, 3))
            if not self._stuck:
                self._drained.set()

        call.when_landed(returned)

    def close(self) -> None:
        """Let the idle workers end."""
        self._pool.close()

    def status(self) -> JsonObject:
        """Describe the calls that outlived their deadline and have not returned."""
        now = clock.monotonic()
        return {"hung": [{"call": s.call, "for_s": round(now - s.since, 1)} for s in self._stuck.values()]}


class Outside:
    """The lanes of every outside system gpuswapd talks to."""

    def __init__(self, deadlines: Deadlines | None = None) -> None:
        d = deadlines or Deadlines()
        self.deadlines = d
        self.systemd = Lane("systemd", d.systemd, d.workers)
        self.docker = Lane("docker", d.docker, d.workers)
        self.gpu = Lane("gpu", d.gpu, 2)
        # One worker: a write that outlives its deadline must land before the next, never after it.
        self.state = Lane("state", d.state, 1)
        # Two: one prefetch reading, and a measure (plan, the next close) beside it.
        self.files = Lane("files", d.files, 2)
        self.http = Lane("http", d.http, 1)

    def lanes(self) -> list[Lane]:
        """List every lane."""
        return [self.systemd, self.docker, self.gpu, self.state, self.files, self.http]

    def close(self) -> None:
        """Let every lane's idle workers end (a hung one ends when its call returns)."""
        for lane in self.lanes():
            lane.close()

    def inject(self, injector: Injector | None) -> None:
        """Route every call through ``injector`` first (the fault tests)."""
        for lane in self.lanes():
            lane.injector = injector

    def status(self) -> JsonObject:
        """Describe each lane's hung calls, for status."""
        return {lane.system: lane.status() for lane in self.lanes() if lane.system != "http"}

    def hung(self) -> list[str]:
        """Name the systems with a hung call."""
        return [lane.system for lane in self.lanes() if lane.status()["hung"]]


def close_unawaited(awaitable: Awaitable[Any]) -> None:
    """Dispose of an awaitable that will never run (no "never awaited" warning for a coroutine)."""
    close = getattr(awaitable, "close", None)
    if close is not None:
        close()
    elif isinstance(awaitable, asyncio.Future):
        awaitable.cancel()

