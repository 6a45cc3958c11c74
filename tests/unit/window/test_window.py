"""The window on in-process fakes: the whole cycle, one window at a time, supervision, cancellation."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpuswapd.errors import BadResponse, Degraded, GpuswapError, StateError, WontFit
from gpuswapd.leases import Lease
from gpuswapd.outside import Outside
from gpuswapd.phases import Phase
from gpuswapd.window.window import Window
from tests.fakes import BASELINE, DEADLINES, ENGINE_URL, FakeUnit, FakeWorld, GiB, running, settle


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_window_opens_and_closes_and_the_world_is_as_before() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            assert w.phase is Phase.READY
            assert world.snapshot()["units"] == {"strata.service": "inactive", "llama-swap.service": "inactive"}
            assert world.snapshot()["containers"] == ["hyperqwen"]
            await w.release(lease.id)
            await settle(w)
            assert w.last is not None and w.last.outcome == "closed"

    run(main())
    assert world.snapshot() == BASELINE
    timings = world.store.history_records[-1]["timings"]
    stages = [(t["phase"], t["stage"]) for t in timings]
    assert ("WAITING_VRAM", "open") in stages and ("WAITING_VRAM", "close") in stages
    assert stages[-1] == ("RESUMING_TIMERS", "close")
    assert world.store.document is not None and world.store.document.window is None


def test_an_acquire_while_closing_waits_for_the_restore_then_opens_a_new_window() -> None:
    world = FakeWorld()
    events: list[dict[str, Any]] = []

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("first", 60)
            first = w.record
            gate = asyncio.Event()
            real_start = w.resident.start

            async def slow_start(units: list[str], since: float | None = None) -> None:
                await gate.wait()
                await real_start(units, since)

            w.resident.start = slow_start  # type: ignore[method-assign]
            await w.release(lease.id)
            while w.phase is not Phase.RESTORING:
                await asyncio.sleep(0.001)
            second = asyncio.create_task(w.acquire("second", 60, listener=events.append))
            await asyncio.sleep(0.02)
            assert not second.done() and w.record is first  # the old record is not overwritten
            gate.set()
            lease2 = await second
            assert w.record is not first and w.phase is Phase.READY
            assert world.store.history_records[-1]["id"] == first.id  # the first finished first
            await w.release(lease2.id)
            await settle(w)

    run(main())
    assert events[0] == {"event": "waiting", "reason": "restoring the previous window", "phase": "RESTORING",
                         "window": events[0]["window"]}
    assert world.snapshot() == BASELINE


def test_an_acquire_while_degraded_fails_at_once_with_the_reason() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            world.systemd.units["strata.service"].gpu_bytes = 30 * (1 << 30)  # cannot fit: fails to start
            await w.release(lease.id)
            while w.phase is not Phase.DEGRADED:
                await asyncio.sleep(0.001)
            with pytest.raises(Degraded, match="could not be closed yet"):
                await w.acquire("other", 60)
            world.systemd.units["strata.service"].gpu_bytes = 21 * (1 << 30)
            await settle(w)
            assert w.last is not None and w.last.outcome == "closed"

    run(main())
    assert world.snapshot() == BASELINE


def test_a_window_that_cannot_fit_is_refused_before_anything_is_touched() -> None:
    world = FakeWorld()
    world.gpu.free("strata.service")
    world.systemd.units["strata.service"].gpu_bytes = 18 * GiB
    world.gpu.claim("strata.service", 1001, 18 * GiB)
    world.systemd.add_unit(FakeUnit("notebook.service", gpu_bytes=5 * GiB, pid=777))

    async def main() -> None:
        async with running(world.window()) as w:
            with pytest.raises(WontFit, match=r"5.0 GiB by pid 777 \(notebook.service\)"):
                await w.acquire("job", 60)
            await settle(w)
            assert w.last is not None and w.last.outcome == "refused"

    run(main())
    assert world.systemd.started == []  # nothing was stopped, so nothing had to start again
    snap = world.snapshot()
    assert snap["units"] == BASELINE["units"] and snap["timers"] == BASELINE["timers"]


def test_a_client_that_hangs_up_while_its_grant_is_being_saved_leaves_no_lease() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            keeper = await w.acquire("keeper", 60)
            gate = asyncio.Event()
            real_write = world.store.write

            def slow_write(data: bytes) -> None:
                while not gate.is_set():
                    __import__("time").sleep(0.001)
                real_write(data)

            world.store.write = slow_write  # type: ignore[method-assign]
            w.writer.request()  # a write in flight
            await asyncio.sleep(0.01)
            hung_up = asyncio.create_task(w.acquire("vanishes", 60))
            await asyncio.sleep(0.01)
            hung_up.cancel()  # the client went away while its grant waited for the disk
            with pytest.raises(asyncio.CancelledError):
                await hung_up
            gate.set()
            # Nothing is wedged: a release answers at once, and the vanished client holds nothing.
            await asyncio.wait_for(w.release(keeper.id), 1.0)
            assert [x.holder for x in w.leases()] == []
            await settle(w)

    run(main())
    assert world.snapshot() == BASELINE


def _renewals_on_a_failing_write(during: Callable[[Window, Lease], Awaitable[list[asyncio.Task[Any]]]]) -> None:
    """Hold a lease of 60 s, make the state writes hang until ``during`` returns and then fail, and check the end.

    ``during`` asks for renewals (none may be granted) and checks what it must meanwhile; after
    it, the lease is still held and ends when the last write that reached the disk said.
    """
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            assert lease is not None
            recorded = lease.expires_at
            gate = threading.Event()
            real_write = world.store.write

            def failing_write(data: bytes) -> None:
                gate.wait(5)
                raise OSError(errno.EIO, "Input/output error")

            world.store.write = failing_write  # type: ignore[method-assign]
            renewals = await during(w, lease)
            gate.set()
            for renewal in renewals:
                with pytest.raises(StateError, match="could not be recorded"):
                    await renewal
            await asyncio.sleep(0.05)
            assert [x.id for x in w.leases()] == [lease.id] and lease.expires_at == recorded
            world.store.write = real_write  # type: ignore[method-assign]
            await w.release(lease.id)
            await settle(w)

    run(main())
    assert world.snapshot() == BASELINE


def test_renewals_that_overlap_on_a_failing_write_leave_the_lease_ending_when_the_disk_says() -> None:
    """Neither of two renewals waiting on the same slow write that fails is granted, nor half-kept.

    The second one began while the first one's new expiry was in memory only: undoing it must not
    put that unrecorded expiry back.
    """
    async def overlapping(w: Window, lease: Lease) -> list[asyncio.Task[Any]]:
        was = lease.expires_at
        first = asyncio.create_task(w.renew(lease.id, 600))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(w.renew(lease.id, 900))
        await asyncio.sleep(0.01)
        assert lease.expires_at > was + 800  # in memory while the write is under way
        return [first, second]

    _renewals_on_a_failing_write(overlapping)


def test_a_renewal_that_shortens_a_lease_takes_effect_only_once_recorded() -> None:
    """A renewal for less than is left, whose write hangs and fails: the lease is not ended meanwhile, nor after."""
    async def shorter(w: Window, lease: Lease) -> list[asyncio.Task[Any]]:
        renewal = asyncio.create_task(w.renew(lease.id, 0.05))
        await asyncio.sleep(0.2)
        w.wake.set()  # past the shorter end, the holding loop looks (another request, say)
        await asyncio.sleep(0.1)
        assert [x.id for x in w.leases()] == [lease.id]
        return [renewal]

    _renewals_on_a_failing_write(shorter)


def test_a_lease_that_ended_while_its_grant_was_being_recorded_does_not_break_the_window() -> None:
    """The write that grants READY's leases hangs; meanwhile a holder's unit stops, ending its lease; then the
    write fails. The grant is refused, the window closes as any failed opening does, and the driver lives."""
    world = FakeWorld()
    hanging = threading.Event()

    def hangs(cleared: bool, data: bytes) -> None:
        if not cleared and b'"READY"' in data and not hanging.is_set():
            hanging.set()
            time.sleep(0.5)  # past the lane's deadline: the write fails (and lands late)

    world.store.on_write = hangs

    async def main() -> None:
        async with running(world.window(Outside(dataclasses.replace(DEADLINES, state=0.2)))) as w:
            acquire = asyncio.create_task(w.acquire("job", 60, unit="job.service"))
            while not hanging.is_set():
                await asyncio.sleep(0.005)
            assert w.record is not None and [x.unit for x in w.record.leases.all()] == ["job.service"]
            await w.unit_gone("job.service")
            with pytest.raises(StateError, match="could not be recorded"):
                await acquire
            await settle(w)
            assert w.last is not None and w.last.outcome == "rolled_back"
            assert await w.acquire("again", 60) is not None  # the driver still serves

    run(main())


def test_a_create_that_lands_late_is_recorded_as_an_engine_to_take_down_before_its_take_down() -> None:
    """Docker's create outlives its deadline: the window fails and closes with no engine, then the create
    lands. Before the late take-down, the record says the engine is not removed, so that a start after a
    crash meanwhile takes it down too (it was left running by a kill at that moment)."""
    world = FakeWorld()
    create, remove = world.docker.create, world.docker.remove
    seen: list[bool | None] = []

    def late_create(spec: Any, labels: dict[str, str]) -> str:
        time.sleep(0.4)  # past the docker lane's deadline
        return create(spec, labels)

    def removing(name: str) -> None:
        doc = world.store.document
        rec = doc.window if doc is not None else None
        seen.append(None if rec is None or rec.container is None else rec.container.removed)
        remove(name)

    world.docker.create = late_create  # type: ignore[method-assign]
    world.docker.remove = removing  # type: ignore[method-assign]

    async def main() -> None:
        async with running(world.window(Outside(dataclasses.replace(DEADLINES, docker=0.2)))) as w:
            with pytest.raises(GpuswapError):
                await w.acquire("job", 60)
            await settle(w)
            assert w.phase is Phase.IDLE and "hyperqwen" not in world.docker.containers
            assert False in seen, seen  # the late one's take-down, with the record saying it is there

    run(main())


def test_a_hung_docker_top_holds_the_window_no_longer_than_the_pids_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's pids are best effort: a `docker top` that hangs gives up after PIDS_S, not Docker's full
    deadline, so it cannot hold the window's driver (and its leases' expiry) that long."""
    from gpuswapd.parts import engine as engine_module

    monkeypatch.setattr(engine_module, "PIDS_S", 0.1)
    world = FakeWorld()
    top = world.docker.top

    def slow_top(name: str) -> list[int]:
        time.sleep(0.6)  # under the fakes' 2 s Docker deadline, past the pids bound
        return top(name)

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            world.docker.top = slow_top  # type: ignore[method-assign]
            started = time.monotonic()
            assert await w.engine.pids() == []  # unknown: given up on
            assert time.monotonic() - started < 0.5
            await w.release(lease.id)
            await settle(w)

    run(main())


def test_a_bug_in_a_step_rolls_the_window_back() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            async def broken() -> None:
                raise KeyError("a bug")

            w.engine.warm = broken  # type: ignore[method-assign]
            with pytest.raises(GpuswapError, match="failed while opening the window"):
                await w.acquire("job", 60)
            await settle(w)
            assert w.last is not None and w.last.outcome == "rolled_back"

    run(main())
    assert world.snapshot() == BASELINE


def test_a_bug_while_holding_gives_the_gpu_back() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await w.acquire("job", 60)
            calls = 0

            def broken_expire(now: float) -> list[Any]:
                nonlocal calls
                calls += 1
                raise RuntimeError("a bug in the hold loop")

            assert w.record is not None
            w.record.leases.expire = broken_expire  # type: ignore[method-assign]
            w.wake.set()
            await settle(w)
            assert calls >= 1 and w.last is not None and w.last.outcome == "rolled_back"

    run(main())
    assert world.snapshot() == BASELINE


def test_adopting_with_docker_failing_does_not_kill_the_driver() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await w.acquire("job", 60)
            record = w.record
            w.stopping.set()  # as on SIGKILL: the record stays
        assert record is not None
        assert world.store.document and world.store.document.window
        left = world.store.document.window

        def docker_down(name: str) -> Any:
            raise __import__("gpuswapd.errors", fromlist=["DockerUnavailable"]).DockerUnavailable("down")

        world.docker.state = docker_down  # type: ignore[method-assign]
        async with running(world.window(), world.store.document.seq) as w2:
            w2.recover(left)
            await asyncio.sleep(0.05)
            assert w2.phase is Phase.READY  # adopted on health and a verifying completion
            for lease in w2.leases():
                await w2.release(lease.id)
            await settle(w2)

    run(main())
    assert world.snapshot() == BASELINE


@pytest.mark.parametrize("answers", [True, False])
def test_an_engine_started_again_since_the_recorded_ready_must_answer_a_completion_to_be_adopted(answers: bool) -> None:
    """The document says READY, but the engine runs a later start (a watchdog restart whose write never
    landed): health is not enough, the engine must answer the verifying completion, else the window closes."""
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await w.acquire("job", 60)
            w.stopping.set()  # as on SIGKILL: the record stays
        assert world.store.document and world.store.document.window
        left = world.store.document.window
        world.docker.stop("hyperqwen", 0)
        world.docker.start("hyperqwen")  # started again behind the record
        asked: list[str] = []
        verify = world.http.verify

        async def engine_verify(check: Any, retry_until: float | None = None, fields: Any = None) -> Any:
            asked.append(check.url)
            if not answers and check.url == ENGINE_URL:
                raise BadResponse(f"POST {check.url}: HTTP 500: CUDA error")
            return await verify(check, retry_until, fields)

        world.http.verify = engine_verify  # type: ignore[method-assign]
        async with running(world.window(), world.store.document.seq) as w2:
            w2.recover(left)
            await asyncio.sleep(0.05)
            assert asked[:1] == [ENGINE_URL]
            if answers:
                assert w2.phase is Phase.READY and [x.holder for x in w2.leases()] == ["job"]
                for lease in w2.leases():
                    await w2.release(lease.id)
            await settle(w2)
            assert w2.last is not None and w2.last.outcome == ("closed" if answers else "recovered")

    run(main())
    assert world.snapshot() == BASELINE


def test_an_engine_running_the_start_its_ready_recorded_is_adopted_on_health() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await w.acquire("job", 60)
            w.stopping.set()
        assert world.store.document and world.store.document.window
        left = world.store.document.window
        before = len(world.http.completions)
        async with running(world.window(), world.store.document.seq) as w2:
            w2.recover(left)
            await asyncio.sleep(0.05)
            assert w2.phase is Phase.READY and len(world.http.completions) == before
            for lease in w2.leases():
                await w2.release(lease.id)
            await settle(w2)

    run(main())
    assert world.snapshot() == BASELINE


def test_a_restart_ends_the_leases_bound_to_the_connections_of_the_gpuswapd_that_stopped() -> None:
    from gpuswapd.window.recovery import recover_at_start

    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await w.acquire("gpuswapd-gateway[7]", 600, bound=True)
            await w.acquire("job", 600)
            await w.shutdown(restore=False)
        again = world.window()
        await recover_at_start(again)
        async with running(again):
            deadline = asyncio.get_running_loop().time() + 5
            while again.phase is not Phase.READY:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            assert [(x.holder, x.bound) for x in again.leases()] == [("job", False)]  # its connection is gone
            await again.release(again.leases()[0].id)
            await settle(again)

    run(main())
    assert world.snapshot() == BASELINE
