"""The operator's word is final: gpuswapd starts a unit or a timer only to undo its own stop.

A resident unit down for any other reason (stopped, failed, masked) is reported and never
started; a baseline restore starts exactly what the second record (state/marks.py) says
gpuswapd stopped; ``resident.restart_crashed`` opts in to starting a failed unit, never a
masked or disabled one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from gpuswapd import clock
from gpuswapd.adapters.unitstates import UnitState
from gpuswapd.config import parse_config
from gpuswapd.ctl.render import print_status
from gpuswapd.errors import BusUnavailable, DockerUnavailable, EndpointError, GpuProbeError, GpuswapError
from gpuswapd.phases import Phase
from gpuswapd.record import WindowRecord
from gpuswapd.state.marks import Marks, memory_marks
from gpuswapd.state.store import Document, Loaded
from gpuswapd.window import closing
from gpuswapd.window.identity import record_at_start
from gpuswapd.window.plan import make_plan
from gpuswapd.window.recovery import recover_at_start
from gpuswapd.window.window import down_cause
from tests.fakes import BASELINE, CONFIG, FAKE_CONFIG, PROFILE_CONFIG, RESIDENT_URL, FakeWorld, running, settle
from tests.unit.conftest import run, until

TORN = Loaded(None, ["state.json: checksum mismatch: torn or corrupted"])


def _crash(world: FakeWorld) -> None:
    """The resident crashes: strata fails, llama-swap (Requires=strata) goes with it, strata's memory is free."""
    world.systemd.units["strata.service"].active_state = "failed"
    world.systemd.units["llama-swap.service"].active_state = "inactive"
    world.gpu.free("strata.service")


def _fails_first(call: Callable[[], Awaitable[Any]], err: GpuswapError,
                 calls: list[int]) -> Callable[[], Awaitable[Any]]:
    """Wrap an async call so that its first call raises ``err`` (systemd or the disk did not answer); count calls."""
    async def once() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise err
        return await call()
    return once


def _a_window_that_stops_nothing(world: FakeWorld, at_idle: Callable[[], None] = lambda: None) -> None:
    """Open a window whose record has no unit of the resident, release it, see it close, then check ``at_idle``."""
    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            assert lease is not None and w.record is not None and w.record.units == []
            await w.release(lease.id)
            await settle(w)
            assert w.last is not None and w.last.outcome == "closed"
            at_idle()

    run(main())


async def _ready_then_writes_refused(world: FakeWorld, w: Any) -> str:
    """Open a window to READY, then have the state directory refuse every write; return the lease's id."""
    def refused(cleared: bool, data: bytes) -> None:
        raise OSError(13, "Permission denied")

    lease = await w.acquire("job", 60)
    assert lease is not None and w.phase is Phase.READY
    world.store.on_write = refused
    return str(lease.id)


def _operator_stops(world: FakeWorld, unit: str = "strata.service") -> None:
    """``systemctl stop``: a stop job that is not gpuswapd's."""
    assert world.systemd._stop(unit) == "done"


def test_the_reconcile_reports_a_resident_down_and_starts_nothing() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            _operator_stops(world)
            for _ in range(2):
                await w.reconcile()
            assert w.resident_down == {"strata.service": "stopped"}
            assert w.status()["resident_down"] == {"strata.service": "stopped"}
            world.systemd.units["strata.service"].active_state = "failed"
            await w.reconcile()
            assert w.resident_down == {"strata.service": "failed"}
            world.systemd.units["strata.service"].masked = True
            await w.reconcile()
            assert w.resident_down == {"strata.service": "masked"}
            assert world.systemd.started == []  # nothing was started, whatever the cause
            # Not held against the card: a window opens, and its close leaves the resident as it found it.
            lease = await w.acquire("job", 60)
            await w.release(lease.id)
            await settle(w)
            assert w.last is not None and w.last.outcome == "closed"
            assert "strata.service" not in world.systemd.started
            world.systemd.units["strata.service"].masked = False
            assert world.systemd._start("strata.service") == "done"  # its operator starts it again
            await w.reconcile()
            assert w.resident_down == {}

    run(main())
    assert world.snapshot()["timers"] == BASELINE["timers"]


@pytest.mark.parametrize(("masked", "file_state", "result", "started"), [
    (False, "enabled", "exit-code", True), (True, "enabled", "exit-code", False),
    (False, "disabled", "exit-code", False), (False, "enabled", "start-limit-hit", False)])
def test_restart_crashed_starts_a_failed_unit_only_if_it_may_run(masked: bool, file_state: str, result: str,
                                                                 started: bool) -> None:
    config = dataclasses.replace(FAKE_CONFIG, resident=dataclasses.replace(FAKE_CONFIG.resident, restart_crashed=True))
    world = FakeWorld(config=config)

    async def main() -> None:
        async with running(world.window()) as w:
            unit = world.systemd.units["strata.service"]
            world.systemd._stop("strata.service")
            w.held_down.clear()
            unit.active_state, unit.masked, unit.unit_file_state, unit.result = "failed", masked, file_state, result
            await w.reconcile()
            assert w.resident_down == {"strata.service": "masked" if masked else "start_limit"
                                       if result == "start-limit-hit" else "failed"}

    run(main())
    assert (world.systemd.started == ["strata.service"]) is started
    # Only the failed unit: never its dependents nor a timer.
    assert "llama-swap.service" not in world.systemd.started


def test_a_torn_state_restores_exactly_what_gpuswapd_stopped() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            assert await w.acquire("survivor", 60) is not None
            await w.shutdown(restore=False)  # as a SIGKILL leaves it
        assert memory_marks(world.store).read() == ["agent-digest.timer", "agent-review.timer",
                                                    "agent-triage.timer", "llama-swap.service", "strata.service"]
        world.store.load = lambda: TORN  # type: ignore[method-assign]
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.last is not None and w.last.outcome == "baseline_restored"

    run(main())
    # agent-off.timer matches timers.pause but was off: it stays off (it was never gpuswapd's to start).
    assert world.snapshot() == BASELINE
    assert memory_marks(world.store).read() == []


def test_a_lost_record_without_an_engine_restores_what_gpuswapd_stopped_and_only_that() -> None:
    world = FakeWorld()
    world.systemd._stop("agent-triage.timer")  # its operator's stop: stays stopped
    world.systemd._stop("strata.service")  # gpuswapd's stop (with llama-swap), whose window's record was lost
    memory_marks(world.store).add(["llama-swap.service", "strata.service", "agent-review.timer"])
    world.systemd._stop("agent-review.timer")
    world.store.document = Document(window=None)

    async def main() -> None:
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.baseline_restore is not None and w.baseline_restore.cause == "lost_record"

    run(main())
    assert world.snapshot()["units"] == BASELINE["units"]
    assert world.snapshot()["timers"] == {**BASELINE["timers"], "agent-triage.timer": "inactive"}
    assert memory_marks(world.store).read() == []


def test_what_gpuswapd_stopped_unread_at_start_is_restored_by_the_idle_reconcile() -> None:
    """A lost window's record, and at start the second record (what gpuswapd stopped) cannot be read (a hung disk).

    gpuswapd starts serving; once the record reads again, the idle reconcile brings back what it
    names, rather than leave the timers paused for as long as gpuswapd runs.
    """
    world = FakeWorld()
    world.systemd._stop("agent-review.timer")
    world.systemd._stop("strata.service")  # (llama-swap with it)
    memory_marks(world.store).add(["agent-review.timer", "llama-swap.service", "strata.service"])
    world.store.document = Document(window=None)

    async def main() -> None:
        w = world.window()
        w.resident.stopped = _fails_first(  # type: ignore[method-assign]
            w.resident.stopped, GpuswapError("the state directory did not answer (read_marks) within 30s"), [])
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.baseline_restore is None and w.stopped_unread
            assert world.snapshot()["timers"]["agent-review.timer"] == "inactive"
            await w.reconcile()
            await settle(w)
            assert w.last is not None and w.last.outcome == "baseline_restored" and not w.stopped_unread

    run(main())
    assert world.snapshot()["units"] == BASELINE["units"] and world.snapshot()["timers"] == BASELINE["timers"]
    assert memory_marks(world.store).read() == []


def test_docker_down_does_not_keep_the_resident_down_in_a_baseline_restore() -> None:
    world = FakeWorld(config=PROFILE_CONFIG)

    async def main() -> None:
        async with running(world.window()) as w:
            assert await w.acquire("train", 60, profile="bare") is not None
            await w.shutdown(restore=False)
        world.store.load = lambda: TORN  # type: ignore[method-assign]
        calls = {"n": 0}

        def down(*_: object) -> None:
            calls["n"] += 1
            raise DockerUnavailable("Docker is down (injected)")

        world.docker.state = down  # type: ignore[assignment]
        world.docker.stop = down  # type: ignore[assignment]
        world.docker.remove = down  # type: ignore[assignment]
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            for _ in range(400):
                if world.snapshot()["units"]["strata.service"] == "active":
                    break
                await asyncio.sleep(0.005)
            assert world.snapshot()["units"] == {"strata.service": "active", "llama-swap.service": "active"}
            w.abort.set()

    run(main())


def test_the_second_record_on_disk(tmp_path: Path) -> None:
    marks = Marks(tmp_path / "default.stopped")
    assert marks.read() == []  # never written: nothing gpuswapd stopped
    marks.add(["strata.service", "agent-triage.timer", "../etc/passwd", ".hidden"])
    assert sorted(p.name for p in (tmp_path / "default.stopped").iterdir()) == ["agent-triage.timer", "strata.service"]
    assert Marks(tmp_path / "default.stopped").read() == ["agent-triage.timer", "strata.service"]  # another process
    marks.remove(["strata.service", "never-marked.service"])
    assert marks.read() == ["agent-triage.timer"]


def test_a_resident_unit_configured_by_an_alias_is_followed_by_the_name_signals_carry() -> None:
    world = FakeWorld()
    world.systemd.units["strata.service"].names = ("llm-server.service", "strata.service")  # Id, then the alias

    async def main() -> None:
        async with running(world.window()) as w:
            await w.reconcile()  # learns the unit's names
            w.resident_state("llm-server.service", "inactive")  # systemctl stop, as the signal names it
            assert w.held_down.keys() == {"strata.service"}
            w.resident_state("llm-server.service", "active")
            assert w.held_down == {}

    run(main())


def _reconfigure(world: FakeWorld, ctx: str, n_ctx: int) -> None:
    """Its operator lowers the context on purpose (a drop-in's ExecStart=) and restarts it."""
    world.systemd.exec_start["strata.service"] = ("/usr/bin/llama-server", "-m", "/models/strata.gguf", "-c", ctx)
    world.systemd._stop("strata.service")
    world.systemd.units["strata.service"].n_ctx = n_ctx
    assert world.systemd._start("llama-swap.service") == "done"


def test_a_window_that_opens_while_the_baseline_is_read_at_start_does_not_lose_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gpuswapd reads the resident at start; a window opens meanwhile and fails before it stops anything (its
    state cannot be written), so no restore records the baseline: it is recorded once that window is over."""
    import gpuswapd.window.identity as identity

    monkeypatch.setattr(identity, "WINDOW_LOOK_S", 0.01)
    world = FakeWorld()
    props = world.http.props

    def refused(cleared: bool, data: bytes) -> None:
        if not cleared:
            raise OSError(28, "No space left on device")

    async def main() -> None:
        async with running(world.window()) as w:
            acquires: list[asyncio.Task[Any]] = []

            async def window_opens_meanwhile(url: str, timeout: float) -> Any:
                result = await props(url, timeout)
                if not acquires:
                    world.http.props = props  # type: ignore[method-assign]
                    world.store.on_write = refused
                    acquires.append(asyncio.create_task(w.acquire("job", 60)))
                    while w.record is None:  # the window has opened
                        await asyncio.sleep(0)
                return result

            world.http.props = window_opens_meanwhile  # type: ignore[method-assign]
            baseline = asyncio.create_task(record_at_start(w))
            while not acquires:
                await asyncio.sleep(0.01)
            with pytest.raises(GpuswapError):
                await acquires[0]
            world.store.on_write = None
            await settle(w)
            await asyncio.wait_for(baseline, 5)
            assert w.known.baseline is not None and w.known.baseline.n_ctx == 4096
            assert w.last is not None and w.last.units == []

    run(main())
    assert world.snapshot() == BASELINE


def test_a_resident_its_operator_reconfigured_becomes_the_baseline_and_is_never_repaired() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            assert w.known.baseline is not None and w.known.baseline.n_ctx == 4096
            _reconfigure(world, "2048", 2048)
            w.held_down.clear()
            for _ in range(2):  # every close, not only the first
                lease = await w.acquire("job", 60)
                await w.release(lease.id)
                await settle(w)
                assert w.last is not None and w.last.restored == "as_it_was" and w.last.resident_changed is None
            assert w.known.baseline.n_ctx == 2048 and w.known.changed is None

    run(main())


def test_a_smaller_resident_is_not_repaired_while_systemd_cannot_say_how_it_runs() -> None:
    """Its operator lowered the context and restarted it; at the close, systemd does not say what the units run.

    gpuswapd cannot tell their change from a squeeze, so it repairs nothing (restored
    "unchecked": no second stop and start); the next close, with systemd answering, takes the
    operator's change as the baseline.
    """
    world = FakeWorld()
    commands = world.systemd.commands

    def unsaid(unit: str) -> Any:
        raise BusUnavailable("systemd (D-Bus) did not answer (commands) within 35s")

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            _reconfigure(world, "2048", 2048)
            w.held_down.clear()
            world.systemd.commands = unsaid  # type: ignore[method-assign]
            starts = world.systemd.started.count("strata.service")
            lease = await w.acquire("job", 60)
            await w.release(lease.id)
            await settle(w)
            assert w.last is not None and w.last.restored == "unchecked" and w.last.resident_changed is None
            assert world.systemd.started.count("strata.service") == starts + 1  # restored once, never repaired
            assert w.known.baseline is not None and w.known.baseline.n_ctx == 4096
            world.systemd.commands = commands  # type: ignore[method-assign]
            lease = await w.acquire("job", 60)
            await w.release(lease.id)
            await settle(w)
            assert w.last.restored == "as_it_was" and w.known.baseline.n_ctx == 2048

    run(main())


def test_what_the_resident_runs_is_read_even_when_its_state_is_not() -> None:
    """A read of the unit's state that fails loses its InvocationID only, not the digest of what it runs."""
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            config, _ = await w.resident.how_it_runs()
            assert config is not None

            async def unsaid(units: list[str]) -> Any:
                raise BusUnavailable("systemd (D-Bus) did not answer (unit_state) within 35s")

            w.resident.unit_states = unsaid  # type: ignore[method-assign]
            assert await w.resident.how_it_runs() == (config, None)

    run(main())


def test_a_resident_its_operator_restarted_while_idle_is_the_new_baseline() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            world.systemd._stop("strata.service")
            world.systemd.units["strata.service"].n_ctx = 2048  # what it came back as: theirs, not llama.cpp's fit
            assert world.systemd._start("llama-swap.service") == "done"
            await w.reconcile()
            assert w.known.baseline is not None and w.known.baseline.n_ctx == 2048
            lease = await w.acquire("job", 60)
            await w.release(lease.id)
            await settle(w)
            assert w.last is not None and w.last.restored == "as_it_was" and w.last.resident_changed is None

    run(main())


def test_a_resident_its_operator_stops_while_its_restore_retries_is_left_to_them_and_the_card_is_free() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            world.http.resident_500 = True  # it starts, and never answers its verify
            await w.release(lease.id)
            while w.phase is not Phase.DEGRADED:
                await asyncio.sleep(0.001)
            starts = world.systemd.started.count("strata.service")
            assert world.systemd._stop("strata.service") == "done"  # systemctl stop strata: to mend it
            await settle(w)
            assert w.last is not None and w.last.outcome == "closed" and w.last.units == []
            assert world.systemd.started.count("strata.service") == starts  # not started again
            assert memory_marks(world.store).read() == []
            await w.reconcile()
            assert w.resident_down == {"strata.service": "stopped"}  # reported, as after any stop of theirs
            lease = await w.acquire("next", 60)  # not refused DEGRADED: the card is not held for it
            await w.release(lease.id)
            await settle(w)
            assert world.systemd.started.count("strata.service") == starts

    run(main())
    assert world.snapshot()["timers"] == BASELINE["timers"]  # gpuswapd's own pause undone


def test_a_resident_that_came_up_while_its_slots_were_saved_is_restored_after_a_sigkill() -> None:
    """Still starting when the window recorded its stop, it came up during the slot save; then gpuswapd stopped it.

    A start after a SIGKILL takes that stop for gpuswapd's own and restores the resident: not for
    a stop undone meanwhile by someone else (its operator's start landed before the stop, not after).
    """
    world = FakeWorld()
    save = world.http.slot_file

    async def came_up_meanwhile(url: str, slot: int, action: str, filename: str, timeout: float) -> Any:
        if action == "save":
            await asyncio.sleep(0.02)
            for name in ("strata.service", "llama-swap.service"):  # their start jobs end now
                world.systemd.units[name].active_enter = clock.kernel_monotonic()
        return await save(url, slot, action, filename, timeout)

    world.http.slot_file = came_up_meanwhile  # type: ignore[method-assign]

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("survivor", 60)
            assert lease is not None and w.phase is Phase.READY
            assert world.snapshot()["units"]["strata.service"] == "inactive"
            await w.shutdown(restore=False)  # SIGKILL
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            for held in list(w.leases()):
                await w.release(held.id)
            await settle(w)
            assert w.last is not None and w.last.units == ["strata.service", "llama-swap.service"]

    run(main())
    assert world.snapshot()["units"]["strata.service"] == "active"
    assert world.systemd.started.count("strata.service") == 1  # the restore's start: gpuswapd's stop undone


def test_a_record_left_booting_whose_resident_is_up_again_is_stale_and_a_crash_since_is_left_to_systemd() -> None:
    """From WARMING on the state directory refuses every write: the window rolls back, restores the resident and
    resumes the timers in memory, while the disk still says BOOTING; then gpuswapd is killed. The next start
    finds the resident up: the record is stale. The resident crashes while that close waits: it is not started."""
    world = FakeWorld()
    refusing = {"on": False}

    def refuse(cleared: bool, data: bytes) -> None:
        if b'"WARMING"' in data:
            refusing["on"] = True
        if refusing["on"]:
            raise OSError(13, "Permission denied")

    world.store.on_write = refuse

    async def main() -> None:
        async with running(world.window()) as w:
            with pytest.raises(GpuswapError):
                await w.acquire("job", 60)
            await until(lambda: w.record is None and world.snapshot() == BASELINE)  # closed, in memory only
            await w.shutdown(restore=False)  # SIGKILL
        assert world.store.document is not None and world.store.document.window is not None
        assert world.store.document.window.phase is Phase.BOOTING
        crashed: list[int] = []

        def crash_once(cleared: bool, data: bytes) -> None:
            if not crashed and b'"CLOSING"' in data:  # the stale record's close begins
                crashed.append(world.systemd.started.count("strata.service"))
                _crash(world)

        world.store.on_write = crash_once
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            await settle(w)
        assert crashed and world.systemd.started.count("strata.service") == crashed[0]  # not started again
        assert world.snapshot()["units"]["strata.service"] == "failed"

    run(main())


def test_a_resident_that_failed_under_its_restores_start_is_restored_after_a_sigkill_whatever_the_disk_says() -> None:
    """The close's writes fail, so the disk still says READY; its restore starts the resident, which fails
    before its verify, and gpuswapd is killed.

    The next start finds the restore's start recorded (state/marks.py, ``starting``): the resident
    came up under gpuswapd's own start, not its operator's, so the restore goes on, and the timers
    run again only once it is verified.
    """
    world = FakeWorld()
    verify = world.http.verify
    verifying = asyncio.Event()

    async def fails_before_its_verify(check: Any, retry_until: float | None = None, fields: Any = None) -> Any:
        if check.url == RESIDENT_URL:
            _crash(world)  # out of memory, say
            verifying.set()
            await asyncio.sleep(3600)
        return await verify(check, retry_until, fields)

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await _ready_then_writes_refused(world, w)
            world.http.verify = fails_before_its_verify  # type: ignore[method-assign]
            await w.release(lease)
            await verifying.wait()
            await w.shutdown(restore=False)  # SIGKILL, before the verify
        assert world.store.document and world.store.document.window
        assert world.store.document.window.phase is Phase.READY
        assert world.snapshot()["timers"] != BASELINE["timers"]
        world.store.on_write = None
        world.http.verify = verify  # type: ignore[method-assign]
        resumed = []
        resume = None

        w = world.window()
        resume = w.resident.resume

        async def resumes(timers: list[str]) -> None:
            resumed.append(world.systemd.units["strata.service"].active_state)
            await resume(timers)

        w.resident.resume = resumes  # type: ignore[method-assign]
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.last is not None and w.last.units == ["strata.service", "llama-swap.service"]
        assert resumed == ["active"]

    run(main())
    assert world.snapshot() == BASELINE
    assert world.systemd.started.count("strata.service") == 2  # the window's restore, and its restore again


@pytest.mark.parametrize("silent_for", [1, 3])
def test_a_resident_that_crashed_after_an_unrecorded_close_is_not_started_when_systemd_answers_late(
        silent_for: int) -> None:
    """The close's writes fail, so the disk still says READY, though the close restored the resident and
    resumed the timers; gpuswapd is killed. The resident crashes. At the next start systemd cannot say
    at first what the units are: the record is judged again before its restore starts anything, and
    once systemd answers, the crash is left to it. ``silent_for``: systemd's reads that fail (3: the
    adoption's look too, and the restore's first judgement, which waits in DEGRADED)."""
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await w.release(await _ready_then_writes_refused(world, w))
            await until(lambda: w.record is None and world.snapshot() == BASELINE)  # closed, in memory only
            await w.shutdown(restore=False)  # SIGKILL
        assert world.store.document and world.store.document.window
        assert world.store.document.window.phase is Phase.READY
        world.store.on_write = None
        started = len(world.systemd.started)
        _crash(world)
        w = world.window()
        unit_states = w.resident.unit_states
        silent = [1] * silent_for
        degraded = []

        async def silent_once(units: list[str]) -> dict[str, UnitState]:
            if silent:
                silent.pop()
                degraded.append(w.phase)
                raise BusUnavailable("systemd (D-Bus) did not answer (unit_state) within 35s")
            return await unit_states(units)

        w.resident.unit_states = silent_once  # type: ignore[method-assign]
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert not silent and w.last is not None and w.last.units == []
            assert w.last.outcome == "recovered" and degraded[2:] == [Phase.RESTORING] * (silent_for - 2)
        assert world.systemd.started[started:] == []  # a crash's stop: systemd's, not gpuswapd's

    run(main())
    assert world.snapshot()["units"]["strata.service"] == "failed"
    assert world.snapshot()["timers"] == BASELINE["timers"]


def test_a_close_with_no_resident_to_restore_ends_once_the_engines_memory_is_released() -> None:
    """Its operator stopped the resident before the window, so the close restores nothing; yet IDLE
    comes only once the engine's memory is released: their `systemctl start` right after must fit."""
    world = FakeWorld()
    for name in ("strata.service", "llama-swap.service"):
        world.systemd.units[name].active_state = "inactive"
    world.gpu.free("strata.service")
    stop = world.docker.stop

    def lags(name: str, timeout: float) -> None:  # the driver frees an exited process's memory a little later
        held = world.gpu.holders.get(f"engine:{name}")
        stop(name, timeout)
        if held is not None:
            world.gpu.holders[f"engine:{name}"] = held
            threading.Timer(0.1, world.gpu.free, [f"engine:{name}"]).start()

    world.docker.stop = lags  # type: ignore[method-assign]

    def freed() -> None:
        assert world.gpu.holders == {}  # at IDLE already: the engine's memory was waited for

    _a_window_that_stops_nothing(world, freed)
    assert world.snapshot()["units"]["strata.service"] == "inactive"


def test_a_window_whose_stop_cannot_be_recorded_starts_nothing_in_its_rollback() -> None:
    """The resident crashes while the window pauses the timers; then the write that records the units it is to
    stop (entering STOPPING_RESIDENT) fails: the disk is full. Nothing was stopped: the rollback starts nothing."""
    world = FakeWorld()
    failed: list[bytes] = []

    def full(empty: bool, data: bytes) -> None:
        if b'"phase":"STOPPING_RESIDENT"' in data and not failed:
            failed.append(data)
            _crash(world)  # (a while before: what the write records is stale already)
            raise OSError(28, "No space left on device")

    async def main() -> None:
        async with running(world.window()) as w:
            world.store.on_write = full
            with pytest.raises(GpuswapError):
                await w.acquire("job", 60)
            world.store.on_write = None
            await settle(w)
            assert failed and w.last is not None and w.last.outcome == "rolled_back" and w.last.units == []

    run(main())
    assert "strata.service" not in world.systemd.started
    assert world.snapshot()["units"]["strata.service"] == "failed"
    assert world.snapshot()["timers"] == BASELINE["timers"]


def test_a_resident_that_crashes_while_its_slot_save_times_out_is_not_started_by_the_close() -> None:
    """Reading how the resident runs hangs, so the slot save times out with nothing saved; the resident crashes
    meanwhile. Its units are left out of the window before the stop: the crash is systemd's to undo."""
    world = FakeWorld(config=parse_config(CONFIG + '[resident.cache]\nsave_timeout = "100ms"\n', "<short save>"))
    commands = world.systemd.commands

    def hangs(unit: str) -> Any:
        _crash(world)  # meanwhile
        time.sleep(0.3)
        return commands(unit)

    world.systemd.commands = hangs  # type: ignore[method-assign]

    _a_window_that_stops_nothing(world)
    assert "strata.service" not in world.systemd.started
    assert world.snapshot()["units"]["strata.service"] == "failed"
    assert world.snapshot()["timers"] == BASELINE["timers"]


def test_a_close_with_nothing_to_restore_does_not_wait_on_a_resident_that_is_up() -> None:
    """A window fails before it stops anything: the resident up holds its own memory, which is no wait."""
    world = FakeWorld()

    def refused(cleared: bool, data: bytes) -> None:
        if not cleared:
            raise OSError(28, "No space left on device")

    async def main() -> None:
        async with running(world.window()) as w:
            world.store.on_write = refused
            with structlog.testing.capture_logs() as logs:
                with pytest.raises(GpuswapError):
                    await w.acquire("job", 60)
                world.store.on_write = None
                await settle(w)
            assert w.last is not None and w.last.units == [] and w.last.outcome == "rolled_back"
        assert [x for x in logs if x["event"] in ("vram_not_free_at_close", "vram_free")] == []

    run(main())
    assert world.snapshot() == BASELINE


def test_a_window_that_fails_before_its_resident_stop_leaves_the_resident_to_systemd_in_its_rollback() -> None:
    """systemd fails after the slot save, before any unit was stopped, and the resident crashes meanwhile.

    The rollback has none of its units to start again: their crash is systemd's (Restart=) to undo.
    """
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            closure = w.resident.closure

            async def failing() -> list[str]:
                if w.phase is Phase.STOPPING_RESIDENT:
                    world.systemd.units["strata.service"].active_state = "failed"  # it crashed meanwhile
                    world.gpu.free("strata.service")
                    raise BusUnavailable("the system bus went away")
                return await closure()

            w.resident.closure = failing  # type: ignore[method-assign]
            with pytest.raises(BusUnavailable):
                await w.acquire("job", 60)
            await settle(w)
            assert w.last is not None and w.last.outcome == "rolled_back"

    run(main())
    assert "strata.service" not in world.systemd.started  # neither stopped nor started by gpuswapd
    assert world.snapshot()["units"]["strata.service"] == "failed"
    assert world.snapshot()["timers"] == BASELINE["timers"]  # its own pause undone


@pytest.mark.parametrize("left_marks", [False, True])
def test_a_resident_whose_stop_was_never_issued_is_not_started_after_a_sigkill(left_marks: bool) -> None:
    """gpuswapd is killed during the slot save (STOPPING_RESIDENT, no unit stopped yet); the resident then crashes.

    The next start finds no stop mark for the units the record names: they were never gpuswapd's
    stop, and their crash is systemd's to undo. ``left_marks``: an earlier window's close could not
    remove its marks of them (older than this window's stop): they say nothing of this window.
    """
    world = FakeWorld()
    if left_marks:
        memory_marks(world.store).add(["strata.service", "llama-swap.service"])
    save = world.http.slot_file
    saving = asyncio.Event()

    async def hangs(url: str, slot: int, action: str, filename: str, timeout: float) -> Any:
        if action == "save":
            saving.set()
            await asyncio.sleep(3600)
        return await save(url, slot, action, filename, timeout)

    world.http.slot_file = hangs  # type: ignore[method-assign]

    async def main() -> None:
        async with running(world.window()) as w:
            acquire = asyncio.create_task(w.acquire("job", 60))
            await saving.wait()
            assert w.phase is Phase.STOPPING_RESIDENT
            await w.writer.save()
            await w.shutdown(restore=False)  # SIGKILL, in the slot save
            acquire.cancel()
            await asyncio.gather(acquire, return_exceptions=True)
        world.http.slot_file = save  # type: ignore[method-assign]
        world.systemd.units["strata.service"].active_state = "failed"  # it crashes meanwhile
        world.gpu.free("strata.service")
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.last is not None and w.last.units == []

    run(main())
    assert "strata.service" not in world.systemd.started
    assert world.snapshot()["units"]["strata.service"] == "failed"
    assert world.snapshot()["timers"] == BASELINE["timers"]  # its own pause undone
    assert memory_marks(world.store).read() == []


def test_a_resident_masked_while_its_restore_retries_is_left_to_its_operator_and_the_card_is_free() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            world.systemd.fail_starts["strata.service"] = 10**6  # it never starts again
            await w.release(lease.id)
            while w.phase is not Phase.DEGRADED:
                await asyncio.sleep(0.001)
            world.systemd.units["strata.service"].masked = True  # systemctl mask strata
            await settle(w)
            assert w.last is not None and w.last.outcome == "closed" and w.last.units == []
            assert memory_marks(world.store).read() == []
            lease = await w.acquire("next", 60)  # not refused DEGRADED: the card is not held for it
            await w.release(lease.id)
            await settle(w)

    run(main())
    assert world.snapshot()["timers"] == BASELINE["timers"]  # gpuswapd's own pause undone


def test_a_resident_whose_start_job_is_queued_is_not_reported_down() -> None:
    assert down_cause(UnitState("strata.service", "loaded", "inactive", "dead", job=True)) is None
    assert down_cause(UnitState("strata.service", "loaded", "inactive", "dead")) == "stopped"
    assert down_cause(UnitState("strata.service", "masked", "inactive", "dead", job=True)) == "masked"
    assert down_cause(UnitState("strata.service", "loaded", "failed", "failed", result="exit-code")) == "failed"
    # In its start limit: systemd refuses every start until reset-failed, so nothing tries one.
    assert down_cause(UnitState("strata.service", "loaded", "failed", "failed", result="start-limit-hit")) \
        == "start_limit"


def test_status_and_plan_say_the_resident_is_down_and_left_so() -> None:
    world = FakeWorld()
    _operator_stops(world)

    async def main() -> None:
        async with running(world.window()) as w:
            await w.reconcile()
            out = io.StringIO()
            print_status(w.status(), out)
            assert "resident down, left to systemd and its operator: strata.service (stopped)" in out.getvalue()
            plan = await make_plan(world.config, w.resident, w.engine, w.vram)
            assert any(x.startswith("resident down: strata.service") for x in plan.warnings)
            assert not plan.problems

    run(main())


def _marks_failing_removal(world: FakeWorld, times: int = 2, kind: str = "stopped") -> Marks:
    """The world's stop marks (``kind`` "starting": its restores' start records), whose next ``times``
    removals fail with EIO (the units' unmark, then the timers')."""
    marks = memory_marks(world.store, kind)
    remove = marks.remove
    failing = {"left": times}

    def flaky(names: list[str]) -> None:
        if failing["left"]:
            failing["left"] -= 1
            raise OSError(5, "Input/output error")
        remove(names)

    marks.remove = flaky  # type: ignore[method-assign]
    return marks


def test_marks_a_hung_state_directory_kept_are_removed_once_it_answers() -> None:
    """Started again, but the mark could not be removed: a later start would read it as gpuswapd's stop."""
    world = FakeWorld()
    marks = _marks_failing_removal(world)

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("survivor", 60)
            assert lease is not None
            await w.release(lease.id)
            await settle(w)
            assert w.phase is Phase.IDLE and world.snapshot() == BASELINE
            assert marks.read() != [] and w.resident.unmark_pending  # kept by the failed removal
            await w.reconcile()  # the state directory answers now
            assert marks.read() == [] and not w.resident.unmark_pending

    run(main())


@pytest.mark.parametrize("answers_at_exit", [True, False])
def test_marks_a_hung_state_directory_kept_through_a_restoring_shutdown_are_removed_before_gpuswapd_exits(
        answers_at_exit: bool) -> None:
    """A SIGTERM closes the window; its restore cannot remove the stop marks. A restore that ends in a
    shutdown has no idle reconcile after it: the marks are tried once more before gpuswapd exits, or a
    crash while it is down would be read by its next start as gpuswapd's own stop (seed 10157018)."""
    world = FakeWorld()
    marks = _marks_failing_removal(world, times=2 if answers_at_exit else 3)

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("survivor", 60)
            assert lease is not None and marks.read() != []
            with structlog.testing.capture_logs() as logs:
                given_back = await w.shutdown(restore=True)
            assert world.snapshot() == BASELINE and w.record is None
            events = [e["event"] for e in logs]
            assert "stopped_record_not_cleared" in events
            if answers_at_exit:
                assert given_back
                assert marks.read() == [] and not w.resident.unmark_pending
            else:
                # Left on disk, and said: gpuswapd exits non-zero, as when its state cannot be written.
                assert not given_back and "stopped_record_left_at_exit" in events
                assert marks.read() != [] and w.resident.unmark_pending

    run(main())


def test_a_mark_whose_unit_ran_again_since_is_stale_and_starts_nothing() -> None:
    """A mark left behind (its removal failed, gpuswapd killed before the retry) and an operator's stop while down."""
    world = FakeWorld()
    marks = _marks_failing_removal(world)

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("survivor", 60)
            assert lease is not None
            await w.release(lease.id)
            await settle(w)
            assert w.phase is Phase.IDLE and marks.read() != []
            await w.shutdown(restore=False)  # killed before the state directory answered again
        world.systemd._stop("strata.service")  # its operator's stop while gpuswapd is down
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.baseline_restore is None  # no lost record: every mark was stale
        assert marks.read() == []

    run(main())
    assert world.snapshot()["units"]["strata.service"] == "inactive"  # the operator's word stands


async def _killed_before_the_residents_verify(world: FakeWorld, failed_verifies: int = 0,
                                              meanwhile: Callable[[], None] = lambda: None) -> None:
    """A window closes; its restore's verify of the resident fails ``failed_verifies`` times, then hangs, and
    gpuswapd is killed there (SIGKILL). ``meanwhile`` runs just before the lease is released."""
    verify = world.http.verify
    verifying = asyncio.Event()
    failures = [failed_verifies]

    async def hangs(check: Any, retry_until: float | None = None, fields: Any = None) -> Any:
        if check.url == RESIDENT_URL:
            if failures[0]:
                failures[0] -= 1
                raise EndpointError("the model server did not answer (verify)")
            verifying.set()
            await asyncio.sleep(3600)
        return await verify(check, retry_until, fields)

    async with running(world.window()) as w:
        lease = await w.acquire("job", 60)
        assert lease is not None
        world.http.verify = hangs  # type: ignore[method-assign]
        meanwhile()
        await w.release(lease.id)
        await verifying.wait()
        await w.shutdown(restore=False)  # SIGKILL, before the verify
    world.http.verify = verify  # type: ignore[method-assign]


def _restart_torn_watching_the_resume(world: FakeWorld) -> tuple[Any, list[bool]]:
    """The next gpuswapd finds every copy of the state torn; at each resume of the timers, note whether the
    resident had answered a completion since that start."""
    world.store.load = lambda: TORN  # type: ignore[method-assign]
    w = world.window()
    verified_first: list[bool] = []
    resume = w.resident.resume
    answered = len(world.http.completions)

    async def resumes(timers: list[str]) -> None:
        verified_first.append(RESIDENT_URL in world.http.completions[answered:])
        await resume(timers)

    w.resident.resume = resumes  # type: ignore[method-assign]
    return w, verified_first


@pytest.mark.parametrize("failed_verifies", [0, 1])
def test_a_resident_up_under_an_unverified_restore_start_is_verified_by_the_baseline_restore(
        failed_verifies: int) -> None:
    """Killed between its restore's start and the verify, then every copy of the state torn.

    The units came up after their stop marks, but under gpuswapd's own start (recorded apart):
    not stale marks. The baseline restore takes them in and verifies the resident before the
    timers run again. Also when the kill came on a later attempt, after a verify that failed:
    that attempt's start found them up already (a no-op), and the record keeps the restore's
    first start, which they came up under.
    """
    world = FakeWorld()

    async def main() -> None:
        await _killed_before_the_residents_verify(world, failed_verifies)
        assert world.snapshot()["units"]["strata.service"] == "active"
        w, verified_first = _restart_torn_watching_the_resume(world)
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.last is not None and w.last.outcome == "baseline_restored"
            assert sorted(w.last.units) == ["llama-swap.service", "strata.service"]
        assert verified_first == [True]

    run(main())
    assert world.snapshot() == BASELINE
    assert memory_marks(world.store).read() == [] and memory_marks(world.store, "starting").read() == []


def test_a_resident_up_under_a_start_no_record_kept_is_verified_before_the_timers_resume() -> None:
    """The restore's start record could not be written (it starts all the same), then a SIGKILL before the verify,
    then every copy of the state torn.

    Nothing says the start was gpuswapd's: the units ran again after their stop marks, so the
    marks are stale and the baseline restore starts nothing. But the timers it resumes run agents
    against the resident: it hears a completion from it first.
    """
    world = FakeWorld()
    starting = memory_marks(world.store, "starting")
    add = starting.add

    def refused(names: list[str], since: float | None = None) -> None:
        raise OSError(5, "Input/output error")

    async def main() -> None:
        await _killed_before_the_residents_verify(world, meanwhile=lambda: setattr(starting, "add", refused))
        assert world.snapshot()["units"]["strata.service"] == "active" and starting.read() == []
        starting.add = add  # type: ignore[method-assign]
        w, verified_first = _restart_torn_watching_the_resume(world)
        starts = len(world.systemd.started)
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.last is not None and w.last.outcome == "baseline_restored" and w.last.units == []
        assert verified_first == [True] and len(world.systemd.started) == starts  # verified, and nothing started

    run(main())
    # (The lost window's slot file stays until the next save removes it: no record names it.)
    assert {**world.snapshot(), "slot_files": []} == BASELINE


def test_a_restore_that_ended_leaves_its_marks_stale_even_when_its_start_record_stayed() -> None:
    """The restore verified the resident and resumed the timers, but no mark, nor its start's record, could be
    removed; the resident then crashed while gpuswapd was down. The timers ran again after the start: that
    restore ended, and the crash is systemd's (Restart=), not gpuswapd's to undo."""
    world = FakeWorld()
    marks = _marks_failing_removal(world)
    starting = memory_marks(world.store, "starting")
    starting.remove = lambda names: (_ for _ in ()).throw(OSError(5, "Input/output error"))  # type: ignore[method-assign]

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("survivor", 60)
            assert lease is not None
            await w.release(lease.id)
            await settle(w)
            assert w.phase is Phase.IDLE and marks.read() != [] and starting.read() != []
            await w.shutdown(restore=False)
        world.systemd.units["strata.service"].active_state = "failed"  # it crashes while gpuswapd is down
        world.gpu.free("strata.service")
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.baseline_restore is None  # every mark was stale

    run(main())
    assert world.snapshot()["units"]["strata.service"] == "failed"
    assert world.systemd.started.count("strata.service") == 1  # the window's own restore only


def test_the_timers_marks_stay_while_the_restores_start_record_cannot_be_removed() -> None:
    """The restore's start record could not be removed (twice: after the verify, and before the timers'
    marks go): the timers' marks stay too, since they tell a later start that this restore ended; once the
    state directory answers, both go."""
    world = FakeWorld()
    starting = _marks_failing_removal(world, kind="starting")

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("survivor", 60)
            assert lease is not None
            await w.release(lease.id)
            await settle(w)
            assert w.phase is Phase.IDLE and world.snapshot() == BASELINE
            assert starting.read() == ["llama-swap.service", "strata.service"]
            assert memory_marks(world.store).read() == ["agent-digest.timer", "agent-review.timer",
                                                        "agent-triage.timer"]
            await w.resident.retry_unmark()  # the state directory answers again
            assert starting.read() == [] and memory_marks(world.store).read() == []

    run(main())


def test_a_resident_that_dies_while_its_start_record_is_ended_is_started_again_before_the_timers_resume(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ending the restore's start record is slow (a hung state directory), and the resident crashes
    meanwhile: the restore goes on (started again, verified) before the timers resume against it."""
    world = FakeWorld()
    monkeypatch.setattr(closing, "SLOW_STEP_S", 0.05)
    starting = memory_marks(world.store, "starting")
    remove = starting.remove
    crashed: list[int] = []

    def slow(names: list[str]) -> None:
        if not crashed:
            crashed.append(len(world.systemd.started))
            _crash(world)
            time.sleep(0.1)
        remove(names)

    starting.remove = slow  # type: ignore[method-assign]

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            assert lease is not None
            await w.release(lease.id)
            await settle(w)
            assert w.phase is Phase.IDLE and world.snapshot() == BASELINE
            assert world.systemd.started[crashed[0]:] == ["strata.service", "llama-swap.service"]  # started again

    run(main())


def test_a_start_record_of_a_unit_that_was_up_already_starts_nothing_after_a_crash() -> None:
    """A restore started the resident again while it was up (a restart of gpuswapd carried a finished close on),
    and could not remove that start's record; its paused timers had run again before it. The resident then
    crashed. The record says nothing: the unit did not come up under that start, and it is left to systemd."""
    world = FakeWorld()
    memory_marks(world.store, "starting").add(["strata.service", "llama-swap.service"])
    _crash(world)

    async def main() -> None:
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.baseline_restore is None

    run(main())
    assert "strata.service" not in world.systemd.started
    assert memory_marks(world.store, "starting").read() == []


def test_a_start_record_a_killed_gpuswapd_left_is_forgotten_when_the_next_window_opens() -> None:
    """A restore's start record and its stop marks were left behind (a hung state directory, then a SIGKILL
    that forgot they were owed). Its operator stops the resident; a window opens and closes beside it (and
    resumes its timers); gpuswapd restarts with no record: that stop is theirs, and nothing is started."""
    world = FakeWorld()
    memory_marks(world.store).add(["strata.service", "llama-swap.service"], stamp=clock.kernel_monotonic() - 60)
    memory_marks(world.store, "starting").add(["strata.service", "llama-swap.service"],
                                              stamp=clock.kernel_monotonic() - 30)
    for unit in ("strata.service", "llama-swap.service"):  # up under that restore's start
        world.systemd.units[unit].active_enter = clock.kernel_monotonic() - 20

    async def main() -> None:
        _operator_stops(world)
        started = len(world.systemd.started)
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            assert lease is not None and w.record is not None and "strata.service" not in w.record.units
            await w.release(lease.id)
            await settle(w)
            assert w.last is not None and w.last.outcome == "closed"
        assert memory_marks(world.store, "starting").read() == []
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.baseline_restore is None
        assert world.systemd.started[started:] == []

    run(main())
    assert world.snapshot()["units"]["strata.service"] == "inactive"


def test_a_mark_says_when_it_was_written_and_an_older_empty_one_says_nothing(tmp_path: Path) -> None:
    marks = Marks(tmp_path / "default.stopped")
    marks.add(["strata.service"])
    (tmp_path / "default.stopped" / "agent-sync.timer").write_text("")  # an older gpuswapd's
    (tmp_path / "default.stopped" / "odd.service").write_text("not a time")
    times = marks.read_times()
    assert times["agent-sync.timer"] is None and times["odd.service"] is None
    stamp = times["strata.service"]
    assert stamp is not None and abs(stamp - time.monotonic()) < 5  # CLOCK_MONOTONIC, as systemd's stamps


def test_a_close_does_not_wait_out_the_release_timeout_for_memory_its_resident_already_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A close whose first look at the resident fails (systemd did not answer) while the resident is up already.

    The memory the card lacks is the resident's own: the wait asks again while it waits and ends
    there, rather than hold the timers for the whole release timeout (a restart's baseline restore
    waited 59 s so, and the resident crashed meanwhile).
    """
    monkeypatch.setattr("gpuswapd.parts.vram.UNLESS_EVERY_S", 0.05)
    world = FakeWorld(config=parse_config(CONFIG.replace('release_timeout = "300ms"', 'release_timeout = "3s"'),
                                          "<fake>"))
    rec = WindowRecord.new()  # (no window opened: only the wait for memory is under test)
    rec.units = ["strata.service", "llama-swap.service"]

    async def main() -> None:
        w = world.window()
        calls: list[int] = []
        w.resident.closure = _fails_first(  # type: ignore[method-assign]
            w.resident.closure, BusUnavailable("the system bus went away"), calls)
        reading = await w.vram.read(processes=False)
        assert reading is not None and reading.free_bytes < w.resident_needs  # the resident holds it
        before = structlog.get_config()
        # (this layer logs warnings only: vram_wait_ended is info)
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
        try:
            with structlog.testing.capture_logs() as logs:
                await closing._wait_resident_vram(w, rec)
        finally:
            structlog.configure(**before)
        assert [x["event"] for x in logs if x["event"].startswith("vram_")] == ["vram_wait_ended"]
        assert len(calls) >= 2

    run(main())


def test_a_close_waiting_on_a_hung_probe_ends_at_its_deadline_without_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU probe is hung (every read fails at once), and the release timeout is a sliver from its end.

    A pause toward a deadline this close is over at once (``naps.EARLY_S``): the wait must take the
    deadline for come as well, or it asks the probe again and again without time moving on (on a
    real clock for a millisecond, a warning a turn; on the simulation's, for ever).
    """
    world = FakeWorld()
    rec = WindowRecord.new()
    rec.units = ["strata.service", "llama-swap.service"]
    _crash(world)  # (down: the wait is for the memory, not the resident's own)
    now: list[float] = []  # the last time read; once the probe is asked, where time stands

    def boottime() -> float:
        if len(now) < 2:
            now[:1] = [time.monotonic()]
        return now[-1]

    asked: list[int] = []

    async def hung(need: int, timeout: float, unless: Any = None) -> float:
        asked.append(need)
        if len(now) == 1:  # the deadline is now + timeout: time stands 0.5 ms short of it from here on
            now.append(now[0] + timeout - 5e-4)
        if len(asked) > 50:
            raise AssertionError("the wait keeps asking the probe at its deadline")
        raise GpuProbeError("the GPU probe is hung: 2 call(s) have not returned")

    async def main() -> None:
        w = world.window()
        w.parked = None
        monkeypatch.setattr(w.vram, "wait_free", hung)
        monkeypatch.setattr(clock, "_boot", boottime)
        await closing._wait_resident_vram(w, rec)

    run(main())
    assert 1 <= len(asked) <= 2
