"""Parking the engine asleep between windows, on in-process fakes: warm re-opens and every way out."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from gpuswapd import clock, naps
from gpuswapd.config import parse_config
from gpuswapd.phases import Phase
from gpuswapd.record import Parked, needs_less_residual
from gpuswapd.window.recovery import recover_at_start
from tests.fakes import BASELINE, CONFIG, PARK_CONFIG, RESIDUAL_BYTES, FakeWorld, running, settle

ENGINE = "engine:hyperqwen"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def park_world(**park: str) -> FakeWorld:
    """A world whose gpuswapd parks its engine (``park`` overrides keys of [window.park])."""
    keys = "".join(f'{k} = "{v}"\n' for k, v in {"settle": "100ms", **park}.items())
    text = CONFIG + f'[window.park]\nmode = "sleep"\n{keys}'
    config = parse_config(text, "<park>") if park else PARK_CONFIG
    return FakeWorld(config=config)


def resident_back(world: FakeWorld) -> bool:
    snap = world.snapshot()
    return snap["units"] == BASELINE["units"] and snap["timers"] == BASELINE["timers"]


async def cycle(w: Any) -> Any:
    lease = await w.acquire("job", 60)
    rec = w.record
    await w.release(lease.id)
    await settle(w)
    return rec


def test_a_closed_window_parks_its_engine_and_the_next_opens_warm() -> None:
    world = park_world()

    async def main() -> None:
        async with running(world.window()) as w:
            first = await cycle(w)
            assert first.start == "cold"
            c = world.docker.containers["hyperqwen"]
            assert c.status == "running" and c.sleeping == 1
            assert world.gpu.holders[ENGINE][1] == RESIDUAL_BYTES
            assert resident_back(world)
            assert w.parked is not None and world.store.document is not None
            assert world.store.document.parked is not None and world.store.document.window is None
            assert w.status()["next_open"] == "warm"
            assert w.status()["parked"]["residual_bytes"] == RESIDUAL_BYTES

            second = await cycle(w)
            assert second.start == "warm"
            assert Phase.WAKING in [t.phase for t in second.timings]
            assert Phase.BOOTING not in [t.phase for t in second.timings]
            assert c.starts == 1 and c.wakes == 1  # no cold boot
            assert world.docker.containers["hyperqwen"].sleeping == 1  # parked again
            assert [r["start"] for r in world.store.history_records] == ["cold", "warm"]

    run(main())
    assert not world.gpu.ooms


def test_an_engine_whose_residual_leaves_the_resident_short_is_removed() -> None:
    world = park_world()
    world.config = dataclasses.replace(world.config, gpu=dataclasses.replace(world.config.gpu,
                                                                             resident_needs=int(23.5 * (1 << 30))))

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            assert w.parked is None

    run(main())
    assert world.snapshot() == BASELINE
    assert not world.gpu.ooms


def test_a_garbled_wake_boots_the_engine_cold() -> None:
    world = park_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            world.http.garble_wakes = 1
            second = await cycle(w)
            assert second.start == "cold" and second.restarts == 1
            phases = [t.phase for t in second.timings if t.stage == "open"]
            assert phases[-4:] == [Phase.WAKING, Phase.WAITING_VRAM, Phase.BOOTING, Phase.WARMING] or \
                phases[-5:-1] == [Phase.WAKING, Phase.WAITING_VRAM, Phase.BOOTING, Phase.WARMING]
            assert world.docker.containers["hyperqwen"].starts == 1  # created anew
            assert w.parked is not None  # the fresh engine parks in its turn

    run(main())
    assert not world.gpu.ooms


def test_a_garbled_wake_without_restarts_fails_the_window_and_restores_the_resident() -> None:
    world = park_world()
    world.config = dataclasses.replace(world.config, window=dataclasses.replace(world.config.window, max_restarts=0))

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            world.http.garble_wakes = 1
            try:
                await w.acquire("job", 60)
            except Exception as err:
                assert "canary" in str(err)
            else:
                raise AssertionError("the window opened on a garbled engine")
            await settle(w)

    run(main())
    assert world.snapshot() == BASELINE


def test_an_engine_without_sleep_mode_is_removed_as_before() -> None:
    world = park_world()
    world.http.sleep_mode = False

    async def main() -> None:
        async with running(world.window()) as w:
            rec = await cycle(w)
            assert rec.container is not None and rec.container.sleep is False
            assert w.parked is None

    run(main())
    assert world.snapshot() == BASELINE


def test_a_parked_engine_that_dies_is_removed_and_the_resident_left_alone() -> None:
    world = park_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            starts = list(world.systemd.started)
            world.docker.die("hyperqwen")
            deadline = time.monotonic() + 5
            while w.parked is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert w.parked is None
            assert world.systemd.started == starts

    run(main())
    assert world.snapshot() == BASELINE


def test_keep_expiry_removes_the_parked_engine() -> None:
    world = park_world(keep="1s")

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            assert w.parked is not None
            deadline = time.monotonic() + 5
            while w.parked is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert w.parked is None

    run(main())
    assert world.snapshot() == BASELINE


def test_a_restart_keeps_a_parked_engine_that_still_sleeps_and_matches() -> None:
    world = park_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            await w.shutdown(restore=False)
        again = world.window()
        await recover_at_start(again)
        async with running(again):
            assert again.parked is not None and "hyperqwen" in world.docker.containers
            rec = await cycle(again)
            assert rec.start == "warm"

    run(main())


def test_a_restart_with_a_changed_container_spec_removes_the_parked_engine() -> None:
    world = park_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            await w.shutdown(restore=False)
        c = world.config.window.container
        world.config = dataclasses.replace(world.config, window=dataclasses.replace(
            world.config.window, container=dataclasses.replace(c, env={"NEW": "1"})))
        again = world.window()
        await recover_at_start(again)
        assert again.parked is None

    run(main())
    assert world.snapshot() == BASELINE


def test_stopping_with_restore_removes_the_parked_engine() -> None:
    world = park_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            await w.shutdown(restore=True)
            assert w.parked is None

    run(main())
    assert world.snapshot() == BASELINE
    assert world.store.document is not None and world.store.document.parked is None


def test_park_remove_on_request() -> None:
    world = park_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            removed = await w.remove_parked()
            assert removed["container"] == "hyperqwen"
            assert w.parked is None

    run(main())
    assert world.snapshot() == BASELINE


def test_level_1_needs_the_host_ram_it_asks_for(monkeypatch: Any) -> None:
    from gpuswapd.window import parking

    world = park_world(host_ram_needs="64GiB")
    monkeypatch.setattr(parking, "mem_available", lambda: 8 << 30)

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            assert w.parked is not None and w.parked.level == 2
            assert world.docker.containers["hyperqwen"].sleeping == 2

    run(main())
    monkeypatch.setattr(parking, "mem_available", lambda: 128 << 30)
    roomy = park_world(host_ram_needs="64GiB")

    async def again() -> None:
        async with running(roomy.window()) as w:
            await cycle(w)
            assert w.parked is not None and w.parked.level == 1

    run(again())


def test_a_window_waits_for_its_needs_less_what_its_own_parked_engine_holds() -> None:
    gib = 1024**3
    parked = Parked(container={"name": "qwen"}, since=0.0, level=1, residual_bytes=3 * gib, canary="2, 3",
                    profile="eval")
    assert needs_less_residual(20 * gib, "eval", parked) == 17 * gib  # woken: it holds its residual already
    assert needs_less_residual(20 * gib, "default", parked) == 20 * gib  # another profile's: removed or beside
    assert needs_less_residual(20 * gib, "eval", None) == 20 * gib
    assert needs_less_residual(2 * gib, "eval", parked) == 0


def test_a_stale_record_parks_its_sleeping_engine_beside_a_resident_that_runs() -> None:
    """gpuswapd was killed in a window (READY on disk) whose engine slept since and whose resident runs again.

    The close the next start makes of that stale record parks the engine: the memory the card
    lacks for the resident is the resident's own, so the park does not wait its settle time out,
    nor does it remove the engine, and the resident is verified before anything else can happen
    to it (a wait there once let it crash first, and the timers resumed on a dead resident).
    """
    world = park_world(settle="5s")

    async def main() -> None:
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            assert lease is not None and w.phase is Phase.READY
            await w.shutdown(restore=False)
        world.docker.sleep("hyperqwen", 2)
        world.systemd._start("llama-swap.service")  # strata comes up with it (Requires=)
        assert world.snapshot()["units"] == BASELINE["units"]
        again = world.window()
        started = time.monotonic()
        await recover_at_start(again)
        async with running(again):
            await settle(again)
            assert again.last is not None and again.last.outcome == "recovered"
            assert again.parked is not None and again.parked.residual_bytes == RESIDUAL_BYTES
        assert time.monotonic() - started < 5.0  # (not the settle time waited out)

    run(main())
    assert resident_back(world) and world.docker.containers["hyperqwen"].sleeping == 2
    assert not world.gpu.ooms


def test_a_keep_a_sliver_from_its_end_is_over_and_the_engine_is_not_asked_again_and_again(
        monkeypatch: Any) -> None:
    """The daemon's time stands 0.5 ms short of ``park.keep``'s end: a pause toward it is over at once.

    The watch takes the keep for over (``naps.EARLY_S``), as its pause does; else it would ask
    Docker whether the engine still sleeps again and again until the clock caught up.
    """
    world = park_world(keep="1h")

    async def main() -> None:
        async with running(world.window()) as w:
            await cycle(w)
            parked = w.parked
            assert parked is not None
            asked: list[str] = []
            engine = w.engine_of(parked.profile)
            why_not = engine.why_not_parked

            async def counted(container: Any) -> str | None:
                asked.append(container.name)
                return await why_not(container)

            monkeypatch.setattr(engine, "why_not_parked", counted)
            monkeypatch.setattr(clock, "now", lambda: parked.since + 3600 - 5e-4)
            naps.resumed()  # (the watch's nap ends: it looks at the keep again)
            deadline = time.monotonic() + 5
            while w.parked is not None and time.monotonic() < deadline and len(asked) < 50:
                await asyncio.sleep(0.02)
            assert w.parked is None and len(asked) <= 1, len(asked)

    run(main())
