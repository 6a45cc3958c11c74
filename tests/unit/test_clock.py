"""Durations survive the clock: a wall step moves no lease, a suspend counts (CLOCK_BOOTTIME)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuswapd import clock, naps
from gpuswapd.leases import Lease
from gpuswapd.phases import Phase
from gpuswapd.tasks import sleep_unless
from tests.fakes import FakeWorld, running, settle


class Clocks:
    """The real clocks, with a wall step and a suspend that the test makes.

    The event loop keeps sleeping on CLOCK_MONOTONIC, which a suspend stops: only the wall
    clock and CLOCK_BOOTTIME move by the suspend's length, as on a machine that wakes.
    """

    def __init__(self) -> None:
        self.wall_shift = 0.0
        self.boot_shift = 0.0

    def step(self, seconds: float) -> None:
        """Step the wall clock (NTP, date -s)."""
        self.wall_shift += seconds

    def suspend(self, seconds: float) -> None:
        """Suspend the machine for ``seconds``, and resume it (logind's PrepareForSleep(false))."""
        self.wall_shift += seconds
        self.boot_shift += seconds
        naps.resumed()


@pytest.fixture
def clocks() -> Iterator[Clocks]:
    made = Clocks()
    clock.use(lambda: time.time() + made.wall_shift,
              lambda: time.clock_gettime(time.CLOCK_BOOTTIME) + made.boot_shift)
    try:
        yield made
    finally:
        clock.reset()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_wall_step_moves_the_daemons_time_not_and_the_wire_follows_the_wall(clocks: Clocks) -> None:
    before = clock.now()
    lease = Lease("a", "job", before, before + 600)
    clocks.step(3600)
    assert clock.now() - before < 1.0
    assert lease.remaining(clock.now()) > 599
    wire = lease.to_dict(clock.now())
    assert abs(wire["expires_at"] - (time.time() + 3600 + 600)) < 1.0  # the wall-clock moment it ends
    assert wire["remaining_s"] > 599
    back = Lease.from_dict(wire)  # as the state document is read back
    assert abs(back.expires_at - lease.expires_at) < 1e-6
    clocks.step(-7200)
    assert clock.now() - before < 1.0
    assert abs(lease.to_dict()["expires_at"] - (time.time() - 3600 + 600)) < 1.0


def test_a_lease_stepped_back_an_hour_still_ends_on_time(clocks: Clocks) -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await w.acquire("job", 1.0)
            granted = time.monotonic()
            clocks.step(-3600)
            [lease] = w.status()["window"]["leases"]
            assert lease["remaining_s"] <= 1.0  # not 3,601 s
            await settle(w)
            assert time.monotonic() - granted < 5.0
            assert w.last is not None and w.last.outcome == "closed"

    run(main())


def test_a_lease_stepped_forward_an_hour_keeps_its_ten_minutes(clocks: Clocks) -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 600)
            clocks.step(3600)
            w.wake.set()  # the window looks again (a request, a renew, an event)
            await asyncio.sleep(0.2)
            assert w.phase is Phase.READY
            [held] = w.status()["window"]["leases"]
            assert held["id"] == lease.id and held["remaining_s"] > 599
            assert abs(held["expires_at"] - (time.time() + 3600 + 600)) < 2.0
            await w.release(lease.id)
            await settle(w)

    run(main())


def test_a_lease_shorter_than_a_suspend_ends_at_resume(clocks: Clocks) -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await w.acquire("job", 60)
            await asyncio.sleep(0.1)
            clocks.suspend(600)  # ten minutes: the loop's monotonic timers have not moved
            resumed = time.monotonic()
            await settle(w)
            assert time.monotonic() - resumed < 3.0  # at resume, not 60 s of monotonic time later
            assert w.last is not None and w.last.outcome == "closed"

    run(main())


def test_a_sleep_counts_the_suspend_and_ends_at_resume(clocks: Clocks) -> None:
    async def main() -> float:
        never = asyncio.Event()
        sleeping = asyncio.create_task(sleep_unless(never, 300))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        clocks.suspend(600)
        assert await asyncio.wait_for(sleeping, 3) is False
        return time.monotonic() - started

    assert run(main()) < 1.0


def test_without_word_of_resumes_no_nap_is_longer_than_a_few_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    naps.resumes_told(False)
    assert naps.longest() == naps.NAP_S <= 5.0
    monkeypatch.setattr(naps, "_longest", 0.05)  # a nap ends by itself: a resume nobody told of is seen

    async def main() -> float:
        started = time.monotonic()
        await naps.nap(300)
        return time.monotonic() - started

    assert run(main()) < 1.0
    naps.resumes_told(True)
    assert naps.longest() == naps.TOLD_NAP_S
    naps.resumes_told(False)


@pytest.mark.parametrize("step", [-3600.0, 3600.0])
def test_a_lease_keeps_its_length_across_a_restart_after_a_wall_step(clocks: Clocks, step: float) -> None:
    """The state document keeps the daemon's time: the next start in this boot goes on with it."""
    from gpuswapd.record import WindowRecord
    from gpuswapd.state.store import Document, decode, encode

    clock.anchor()  # the first gpuswapd starts
    rec = WindowRecord.new()
    lease = rec.leases.grant("job", 600, clock.now(), None, None, 0, False, None)
    data = encode(Document(seq=1, window=rec))
    clocks.step(step)  # the wall clock steps; gpuswapd is killed before it writes again
    clock.anchor()  # the next gpuswapd starts, in the same boot
    document = decode(data)
    assert clock.continue_from(document.clock)
    assert document.window is not None
    [back] = document.window.leases.all()
    assert back.id == lease.id and 599 < back.remaining(clock.now()) <= 600  # not 600 -/+ 3600
    assert abs(back.to_dict(clock.now())["expires_at"] - (time.time() + step + 600)) < 2.0  # the wire: the wall
    stranger = {**document.clock, "boot_id": "another-boot"}  # after a reboot: the wall clock is the only bridge
    assert not clock.continue_from(stranger) and not clock.continue_from(None)
