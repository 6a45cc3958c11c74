"""The fault matrix: every outside call, in every phase it is made in, fails once, and nothing is stranded.

For each scenario (a full window, an engine that dies and is restarted, a window adopted after a
restart, the baseline restored when no state is readable) a clean run first traces which calls
the driver makes in which phase. Then, for every (call, phase) of that trace and each way a call
can fail (it raises, it hangs past its deadline, or its caller is cancelled), the scenario runs
again with that one fault, which fires once and then heals. Every run must end the same way:
the resident up and verified (a completion through it after its last start), exactly the paused
timers resumed, no container, VRAM held only by the resident, and the record cleared only after
all of that.

Each scenario's fault-free run must also have done what its name says (``MILESTONES``: READY
reached, the engine restarted, parked then woken, adopted after a restart...): a scenario that
quietly stopped doing its part would otherwise pass every cell without testing anything.

The cells of one scenario and fault kind run concurrently on one event loop: each has its own
fake machine, lanes and window.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpuswapd.errors import GpuswapError
from gpuswapd.logs import setup_logging
from gpuswapd.outside import _ERRORS, CALLS, Deadlines, Late, Outside, close_unawaited
from gpuswapd.phases import Phase
from gpuswapd.state.store import Document, Loaded, decode
from gpuswapd.window.recovery import recover_at_start
from gpuswapd.window.window import Window
from tests.fakes import BASELINE, ENGINE_URL, PARK_CONFIG, RESIDENT_URL, FakeWorld, settle

KINDS = ("raise", "hang", "cancel")
# Long deadlines, which no call misses on a loaded machine (a missed one would take the cell down
# another path, where its fault may never fire); only the hung call has a short one of its own.
DEADLINES = Deadlines(systemd=2, docker=2, gpu=2, state=2, files=2, http=2, workers=4)
HANG_DEADLINE = 0.1  # the hung call's
HANG_S = 0.25  # a hung call's thread returns this much later, long after its deadline
PREFETCH = "prefetch"  # where the close's prefetch makes its calls, whatever phase the close is in by then
# Calls only the daemon's startup and the socket server make, tested at their own seams.
NOT_THE_DRIVER = {("systemd", "connect"), ("systemd", "system_state"), ("systemd", "unit_cgroup"),
                  ("systemd", "unit_service"), ("systemd", "user_name"), ("state", "read_history"),
                  ("docker", "settings")}
CONCURRENCY = 16
RESIDENT_UNITS = ("strata.service", "llama-swap.service")


def label(window: Window | None) -> str:
    """Name where the window stands: its phase, with ':close' for WAITING_VRAM on the way back."""
    rec = window.record if window is not None else None
    if rec is None:
        return "IDLE"
    if rec.phase is Phase.WAITING_VRAM and rec.closing:
        return "WAITING_VRAM:close"
    return str(rec.phase)


@dataclass
class Fault:
    """One fault to inject: a call, the phase it fires in, and how it fails."""

    system: str
    call: str
    phase: str
    kind: str
    fired: bool = False

    def __str__(self) -> str:
        return f"{self.system}.{self.call}@{self.phase}:{self.kind}"


@dataclass
class Cell:
    """One run of a scenario: its world, its window, what it traced and what went wrong."""

    world: FakeWorld
    expected: dict[str, Any]
    fault: Fault | None = None
    window: Window | None = None
    trace: set[tuple[str, str, str]] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    left_open: str | None = None  # the id of the window a scenario left READY before a restart
    prefetches: set[asyncio.Task[None]] = field(default_factory=set)  # the closes' prefetch tasks

    async def inject(self, system: str, call: str, asynchronous: bool) -> Callable[[Any], Any] | Late | None:
        """The lanes' hook: trace the call, and fail it once if it is this cell's fault."""
        if asyncio.current_task() in self.prefetches:
            where = PREFETCH  # a task of its own, beside the close: its phase is a matter of timing
        else:
            where = label(self.window)
            if where == "RESTORING":
                await self._prefetch_decided()
        self.trace.add((system, call, where))
        f = self.fault
        if f is None or f.fired or (f.system, f.call, f.phase) != (system, call, where):
            return None
        f.fired = True
        if f.kind == "cancel":
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)
        if f.kind == "raise":
            if system == "state":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise _ERRORS[system](f"injected: {f}")
        # A hung call still does its work, late: a thread stuck past its deadline, an answer that never comes.
        return _late if asynchronous else Late(HANG_S, HANG_DEADLINE)

    async def _prefetch_decided(self) -> None:
        """Hold the resident's restore until the close's prefetch has decided what to do (or ended).

        On the fakes a close is over in milliseconds: without this, how far the prefetch got
        before the close ended it, and so which of its calls a cell could fail, would be timing.
        """
        rec = self.window.record if self.window is not None else None
        deadline = time.monotonic() + 5
        while (rec is not None and any(not t.done() for t in self.prefetches) and time.monotonic() < deadline
               and (rec.prefetch or {}).get("outcome") in (None, "finding")):
            await asyncio.sleep(0.002)

    def check_clear(self, clears: bool, data: bytes) -> None:
        """The store's hook: a cleared record must find the world restored."""
        if clears and self.world.store.holds_window():
            snap = without_parked(self, self.world.snapshot(), decode(data))
            if snap != self.expected:
                self.problems.append(f"record cleared before the world was restored: {snap}")


async def _late(awaitable: Awaitable[Any]) -> Any:
    """An asynchronous call that outlives a deadline of HANG_DEADLINE: the lane's own error, as a real one's."""
    close_unawaited(awaitable)
    await asyncio.sleep(HANG_DEADLINE)
    raise TimeoutError  # the lane's deadline, come early: it turns it into the system's error


Scenario = Callable[[Cell], Awaitable[None]]


def _window(cell: Cell) -> Window:
    outside = Outside(DEADLINES)
    outside.inject(cell.inject)
    cell.window = w = cell.world.window(outside)
    cell.world.store.on_write = cell.check_clear
    start = w.files.start

    def started(window: Window, rec: Any) -> asyncio.Task[None] | None:
        task = start(window, rec)
        if task is not None:
            cell.prefetches.add(task)
        return task

    w.files.start = started  # type: ignore[method-assign]
    return w


async def _acquire(w: Window) -> Any:
    try:
        return await w.acquire("job", 60)
    except GpuswapError:
        return None


async def _release(w: Window, lease: Any) -> None:
    if lease is not None:
        with contextlib.suppress(GpuswapError):
            await w.release(lease.id)


async def _left_open(world: FakeWorld) -> Document:
    """Run a window to READY without faults and leave it, as a SIGKILL would."""
    w = world.window(Outside())  # no deadline missed on a loaded machine: nothing of it lands late
    w.writer.start()
    assert await w.acquire("survivor", 60) is not None
    await w.shutdown(restore=False)
    await w.writer.stop(1.0)
    w.outside.close()
    document = world.store.document
    assert document is not None and document.window is not None and document.window.phase is Phase.READY
    return document


async def cycle(cell: Cell) -> None:
    """A window opens, serves a while (the watchdog probes), and closes."""
    w = _window(cell)
    w.writer.start()
    lease = await _acquire(w)
    await asyncio.sleep(0.08)
    await _release(w, lease)


async def engine_dies(cell: Cell) -> None:
    """The engine dies while READY; the watchdog restarts it; then the window closes."""
    w = _window(cell)
    w.writer.start()
    lease = await _acquire(w)
    if lease is not None:
        cell.world.docker.die("hyperqwen")
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not (w.record is not None and w.record.restarts
                                                   and w.phase is Phase.READY) and w.record is not None:
            await asyncio.sleep(0.005)
    await _release(w, lease)


async def restore_fails_once(cell: Cell) -> None:
    """The resident fails to start once at close: DEGRADED, then the retry brings it back."""
    w = _window(cell)
    w.writer.start()
    lease = await _acquire(w)
    cell.world.systemd.fail_starts["strata.service"] = 1
    await _release(w, lease)


async def adopt(cell: Cell) -> None:
    """gpuswapd restarts while a window is READY: the new one adopts it, and closes it after."""
    document = await _left_open(cell.world)
    assert document.window is not None
    cell.left_open = document.window.id
    cell.world.store.document = document
    w = _window(cell)
    await recover_at_start(w)
    await _watched(cell, w)
    for lease in list(w.leases()):
        await _release(w, lease)


async def _watched(cell: Cell, w: Window, within: float = 2.0) -> None:
    """Serve a watch interval, then until the engine's watch has probed READY (a loaded machine is slow to).

    A fixed sleep of one ``watch_interval`` let a busy machine's first probe land after the
    release, and a fault on that probe never fired.
    """
    await asyncio.sleep(0.05)
    probe = {("docker", "top", "READY"), ("http", "health", "READY")}
    deadline = time.monotonic() + within
    while label(w) == "READY" and not probe <= cell.trace and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


async def baseline(cell: Cell) -> None:
    """No copy of the state is readable: what gpuswapd stopped (its second record) comes back."""
    await _left_open(cell.world)
    cell.world.store.document = None
    cell.world.store.load = lambda: Loaded(None, ["state.json: checksum mismatch: torn or corrupted"])  # type: ignore
    w = _window(cell)
    await recover_at_start(w)


async def park(cell: Cell) -> None:
    """A window parks its engine asleep; the parked engine is watched; the next window wakes it."""
    w = _window(cell)
    w.writer.start()
    await _release(w, await _acquire(w))
    await settle(w)
    await asyncio.sleep(0.07)  # the parked engine's watch looks at it (every watch_interval)
    await _release(w, await _acquire(w))


SCENARIOS: dict[str, Scenario] = {"cycle": cycle, "engine_dies": engine_dies, "restore_fails_once": restore_fails_once,
                                  "adopt": adopt, "baseline": baseline, "park": park}


def without_parked(cell: Cell, snap: dict[str, Any], doc: Document | None) -> dict[str, Any]:
    """Leave out an engine that is parked, asleep and recorded as parked (in ``doc``): it may stay."""
    w = cell.window
    c = cell.world.docker.containers.get("hyperqwen")
    if w is None or w.parked is None or doc is None or doc.parked is None or c is None or c.sleeping is None \
            or c.status != "running":
        return snap
    return {**snap, "containers": [n for n in snap["containers"] if n != "hyperqwen"],
            "vram": [h for h in snap["vram"] if h != "engine:hyperqwen"]}


async def run_cell(scenario: Scenario, fault: Fault | None) -> Cell:
    """Run one scenario (with one fault) and check where it ends."""
    world = FakeWorld(config=PARK_CONFIG) if scenario is park else FakeWorld()
    # A baseline restore starts exactly what gpuswapd stopped (its second record): the timer its
    # operator left off stays off, as in every other scenario.
    cell = Cell(world, BASELINE, fault)
    try:
        await asyncio.wait_for(scenario(cell), 20)
        assert cell.window is not None
        await settle(cell.window, 20)
    except Exception as err:  # a cell reports; the matrix goes on
        cell.problems.append(f"did not finish: {err!r}")
    finally:
        if cell.window is not None:
            cell.window.stopping.set()
            await cell.window.writer.stop(0.5)
            cell.window.outside.close()
    snap = without_parked(cell, cell.world.snapshot(), cell.world.store.document)
    if snap != cell.expected:
        cell.problems.append(f"ended with {snap}")
    if cell.world.gpu.ooms:
        cell.problems.append(f"out of memory: {cell.world.gpu.ooms}")
    doc = cell.world.store.document
    if doc is None or doc.window is not None:
        last = cell.window.last if cell.window is not None else None
        cell.problems.append("the record was not cleared: the last document written holds "
                             f"{doc and doc.window and (doc.window.phase, doc.window.outcome)}; "
                             f"the window last finished {last and last.outcome}")
    if not resident_verified(cell.world):
        cell.problems.append("the resident came back without a verifying completion after its last start "
                             f"(starts {cell.world.systemd.started_at}, completions {cell.world.http.completed_at})")
    if fault is not None and not fault.fired:
        cell.problems.append("the fault never fired")
    return cell


def resident_verified(world: FakeWorld) -> bool:
    """Tell whether a completion through the resident came after the last start of its units (if any)."""
    starts = [moment for moment, unit in world.systemd.started_at if unit in RESIDENT_UNITS]
    return not starts or any(moment > max(starts) and url == RESIDENT_URL
                             for moment, url in world.http.completed_at)


def _phases(record: dict[str, Any]) -> list[str]:
    return [t["phase"] for t in record["timings"]]


def _after(phases: list[str], first: str, then: str) -> bool:
    """Tell whether ``then`` was entered after ``first`` was."""
    return first in phases and then in phases[phases.index(first) + 1:]


def _served(record: dict[str, Any]) -> list[str]:
    """What every window that opened must have done: reached READY, and closed cleanly."""
    missed = []
    if "READY" not in _phases(record):
        missed.append(f"window {record['id']} never reached READY: {_phases(record)}")
    if record["outcome"] != "closed" or record["error"]:
        missed.append(f"window {record['id']} ended {record['outcome']} ({record['error']})")
    return missed


def _engine_completions(world: FakeWorld) -> list[str]:
    return [url for _, url in world.http.completed_at if url == ENGINE_URL]


def _one_window(cell: Cell) -> tuple[dict[str, Any] | None, list[str]]:
    history = cell.world.store.history_records
    if len(history) != 1:
        return None, [f"expected one finished window, found {len(history)}"]
    return history[0], []


def served_once(cell: Cell) -> list[str]:
    """cycle: one window reached READY (warmed and verified by real completions) and closed."""
    record, missed = _one_window(cell)
    if record is None:
        return missed
    if not _engine_completions(cell.world):
        missed.append("the engine never answered a completion")
    return missed + _served(record)


def restarted(cell: Cell) -> list[str]:
    """engine_dies: READY, the engine died and was restarted, READY again, closed."""
    record, missed = _one_window(cell)
    if record is None:
        return missed
    if record["restarts"] < 1:
        missed.append("the engine was never restarted")
    if not _after(_phases(record), "RECOVERING", "READY"):
        missed.append(f"no READY after RECOVERING: {_phases(record)}")
    return missed + _served(record)


def degraded_then_restored(cell: Cell) -> list[str]:
    """restore_fails_once: the resident's start failed once (DEGRADED), the retry restored it."""
    record, missed = _one_window(cell)
    if record is None:
        return missed
    if cell.world.systemd.fail_starts.get("strata.service") != 0:
        missed.append("the resident's failing start was never tried")
    if not _after(_phases(record), "DEGRADED", "RESTORING"):
        missed.append(f"no DEGRADED followed by RESTORING: {_phases(record)}")
    return missed + _served(record)


def adopted(cell: Cell) -> list[str]:
    """adopt: the window left READY was adopted by the new window (not rolled back), served, closed."""
    record, missed = _one_window(cell)
    if record is None:
        return missed
    if cell.left_open is None or record["id"] != cell.left_open:
        missed.append(f"the finished window {record['id']} is not the one left open ({cell.left_open})")
    if record["outcome"] == "recovered":
        missed.append("the window left open was rolled back, not adopted")
    return missed + _served(record)


def baseline_restored(cell: Cell) -> list[str]:
    """baseline: with no readable state, what gpuswapd had stopped was restored."""
    record, missed = _one_window(cell)
    if record is None:
        return missed
    if record["outcome"] != "baseline_restored" or not record["baseline"]:
        missed.append(f"no baseline restore: outcome {record['outcome']}, baseline {record['baseline']}")
    return missed


def parked_then_woken(cell: Cell) -> list[str]:
    """park: a cold window parked its engine; the next window woke it (warm) instead of booting one."""
    history = cell.world.store.history_records
    if len(history) != 2:
        return [f"expected two finished windows, found {len(history)}"]
    missed = _served(history[0]) + _served(history[1])
    if history[0]["start"] != "cold" or history[1]["start"] != "warm" or "WAKING" not in _phases(history[1]):
        missed.append(f"not cold then warm: {history[0]['start']}, {history[1]['start']} {_phases(history[1])}")
    c = cell.world.docker.containers.get("hyperqwen")
    if c is None or c.starts != 1 or c.wakes < 1:
        missed.append(f"the engine was not booted once and woken: {c}")
    return missed


MILESTONES: dict[str, Callable[[Cell], list[str]]] = {
    "cycle": served_once, "engine_dies": restarted, "restore_fails_once": degraded_then_restored,
    "adopt": adopted, "baseline": baseline_restored, "park": parked_then_woken}

_traces: dict[str, set[tuple[str, str, str]]] = {}


def trace(name: str) -> set[tuple[str, str, str]]:
    """Run a scenario once without faults and list the (system, call, phase) it made."""
    if name not in _traces:
        cell = asyncio.run(run_cell(SCENARIOS[name], None))
        assert not cell.problems, cell.problems
        missed = MILESTONES[name](cell)
        assert not missed, f"the fault-free {name} did not do what it is named for: {missed}"
        _traces[name] = cell.trace
    return _traces[name]


async def _run_all(name: str, entries: list[tuple[str, str, str, str]]) -> list[str]:
    gate = asyncio.Semaphore(CONCURRENCY)
    alone = asyncio.Lock()

    async def one(system: str, call: str, phase: str, kind: str) -> list[str]:
        async with gate:
            cell = await run_cell(SCENARIOS[name], Fault(system, call, phase, kind))
        if cell.problems == ["the fault never fired"]:
            # A loaded machine missed a deadline early and took another path: run it once more alone.
            async with alone:
                cell = await run_cell(SCENARIOS[name], Fault(system, call, phase, kind))
        return [f"{cell.fault}: {p}" for p in cell.problems]

    results = await asyncio.gather(*(one(*entry) for entry in entries))
    return [p for r in results for p in r]


@pytest.fixture(autouse=True)
def quiet() -> Any:
    """Keep only critical lines: the faults make every cell log errors, each cell's problems say enough."""
    setup_logging("critical", json=False, cache=False)
    yield
    setup_logging("warning", json=False, cache=False)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_call_failing_in_every_phase_strands_nothing(name: str) -> None:
    cells = [(*entry, kind) for entry in sorted(trace(name)) for kind in KINDS]
    problems = asyncio.run(_run_all(name, cells))
    assert not problems, "\n".join(problems)


def test_the_matrix_covers_every_registered_call() -> None:
    made = {(system, call) for name in SCENARIOS for system, call, _ in trace(name)}
    registered = {(system, call) for system, calls in CALLS.items() for call in calls}
    assert registered - made - NOT_THE_DRIVER == set(), "registered calls no scenario makes"
    assert made <= registered  # a call outside the registry fails loudly in the lane itself
    cells = sum(len(trace(name)) for name in SCENARIOS) * len(KINDS)
    phases = {phase for name in SCENARIOS for _, _, phase in trace(name)}
    print(f"\nfault matrix: {len(made)} calls x {len(phases)} phases x {len(KINDS)} kinds; "
          f"{cells} cells where the call is made")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_does_what_it_is_named_for(name: str) -> None:
    trace(name)  # the fault-free run, with its milestones checked


async def _never_ready(cell: Cell) -> None:
    """cycle, on a machine where the engine's image is missing: every window rolls back before READY."""
    cell.world.docker.images.clear()
    await cycle(cell)


def test_a_scenario_that_never_reaches_ready_is_caught() -> None:
    cell = asyncio.run(run_cell(_never_ready, None))
    assert cell.problems == []  # the end state alone cannot tell: the resident is back, nothing is left
    missed = served_once(cell)
    assert any("never reached READY" in m for m in missed), missed
    assert any("never answered a completion" in m for m in missed), missed


def test_a_resident_verified_only_before_its_last_start_is_not_verified() -> None:
    world = FakeWorld()
    world.systemd.started_at[:] = [(1, "strata.service"), (3, "llama-swap.service")]
    world.http.completed_at[:] = [(2, RESIDENT_URL), (4, ENGINE_URL)]
    assert not resident_verified(world)
    world.http.completed_at.append((5, RESIDENT_URL))
    assert resident_verified(world)
    assert resident_verified(FakeWorld())  # never stopped, never started: nothing to verify
