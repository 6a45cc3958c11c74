"""Window profiles, the bare window, the fair queue and direct switches, on in-process fakes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpuswapd.config import parse_config
from gpuswapd.errors import (
    BusUnavailable,
    ConfigError,
    DockerUnavailable,
    GpuswapError,
    NotReady,
    QueueFull,
    StateError,
    UnknownProfile,
)
from gpuswapd.outside import Outside
from gpuswapd.phases import Phase
from gpuswapd.state.marks import memory_marks
from gpuswapd.state.store import Document
from gpuswapd.window.recovery import recover_at_start
from gpuswapd.window.window import Window
from tests.fakes import CONFIG, DEADLINES, PROFILE_CONFIG, PROFILES, FakeWorld, GiB, running, settle
from tests.unit.conftest import resident_back, run, until, world

HOLDER_PID = 7777  # a process of the bare window's holder, outside every unit


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(("patch", "says"), [
    ('[profiles.x]\nkind = "vm"\n', "profiles.x.kind"),
    ('[profiles.x]\nneeds = "1GiB"\n', "profiles.x.kind: missing"),
    ('[profiles.default]\nkind = "bare"\n', "reserved"),
    ('[profiles.Big]\nkind = "bare"\n', "profiles.Big: a profile name"),
    ('[profiles.x]\nkind = "bare"\nimage = "y"\n', "profiles.x.image: unknown key"),
    ('[profiles.x]\nkind = "bare"\nneeds = "lots"\n', "profiles.x.needs"),
    ('[profiles.x]\nkind = "engine"\n', "profiles.x.health_url: missing"),
])
def test_bad_profiles_name_the_key(patch: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        parse_config(CONFIG + patch)


def test_a_bare_profile_needs_a_gpu_probe() -> None:
    text = CONFIG.replace('probe = "nvidia-smi"', 'probe = "none"') + '[profiles.b]\nkind = "bare"\n'
    with pytest.raises(ConfigError, match=re.escape("profiles.b: a bare profile needs a GPU probe")):
        parse_config(text)


def test_two_engine_profiles_may_not_share_a_container() -> None:
    text = CONFIG + PROFILES.replace('name = "qwen-eval"', 'name = "hyperqwen"')
    with pytest.raises(ConfigError, match=re.escape("profiles.eval.container.name: 'hyperqwen' is also the "
                                                    "container of window")):
        parse_config(text)


def test_profiles_parse_with_their_own_keys() -> None:
    config = PROFILE_CONFIG
    assert [p.name for p in config.all_profiles()] == ["default", "bare", "eval"]
    assert config.profile("bare").kind == "bare" and config.profile("bare").needs == 20 * GiB
    assert config.profile("eval").engine.container.name == "qwen-eval"
    assert config.profile("eval").needs == config.gpu.window_needs  # none inherited: the default
    assert config.profile("default").engine is config.window
    assert config.daemon.max_queue == 64 and config.daemon.fair_after == 300


# -- a bare window --------------------------------------------------------------------------------


def test_a_bare_window_hands_over_the_card_and_restores_when_the_memory_is_free() -> None:
    fw = world()

    async def main() -> None:
        async with running(fw.window()) as w:
            lease = await w.acquire("train", 60, profile="bare")
            assert w.record is not None and w.record.kind == "bare" and w.phase is Phase.READY
            assert fw.docker.containers == {} and fw.gpu.read().free_bytes >= 20 * GiB
            assert [t.phase for t in w.record.timings][-2:] == [Phase.WAITING_VRAM, Phase.READY]
            assert fw.gpu.claim("holder:train", HOLDER_PID, 20 * GiB)
            await w.release(lease.id)
            # The holder keeps its memory: the close waits, names it, and goes DEGRADED, no OOM.
            await until(lambda: w.phase is Phase.DEGRADED)
            assert w.record is not None and f"pid {HOLDER_PID}" in (w.record.degraded or "")
            assert fw.systemd.units["strata.service"].active_state != "active"
            fw.gpu.free("holder:train")
            await settle(w)
            assert resident_back(fw) and w.last is not None and w.last.profile == "bare"

    run(main())
    assert not fw.gpu.ooms


# -- the queue and the direct switch --------------------------------------------------------------


def test_another_profile_waits_then_switches_directly_without_the_resident() -> None:
    fw = world()

    async def main() -> None:
        async with running(fw.window()) as w:
            first = await w.acquire("chat", 60)
            events: list[dict[str, Any]] = []
            waiting = asyncio.create_task(w.acquire("eval", 60, profile="eval", listener=events.append))
            await until(lambda: len(w.queue.queued()) == 1)
            assert w.status()["queue"][0]["position"] == 1 and w.status()["queue"][0]["profile"] == "eval"
            assert events and events[0]["event"] == "queued"
            starts = len(fw.systemd.started)
            await w.release(first.id)
            second = await waiting
            assert w.record is not None and w.record.profile == "eval" and w.record.switched_from is not None
            assert len(fw.systemd.started) == starts  # the resident was not started in between
            assert "hyperqwen" not in fw.docker.containers and "qwen-eval" in fw.docker.containers
            phases = [t.phase for t in w.record.timings]
            assert Phase.PAUSING_TIMERS not in phases and Phase.STOPPING_RESIDENT not in phases
            assert w.last is not None and w.last.switched_to == w.record.id
            await w.release(second.id)
            await settle(w)
            assert resident_back(fw) and fw.docker.containers == {}
            history = fw.store.history(10)
            assert [h["profile"] for h in history] == ["default", "eval"]
            assert history[1]["switched_from"] == history[0]["id"]
            assert history[1]["units"] == history[0]["units"]

    run(main())
    assert not fw.gpu.ooms


def test_a_stream_of_joins_cannot_keep_a_waiting_profile_out() -> None:
    fw = world(fair_after="50ms")

    async def main() -> None:
        async with running(fw.window()) as w:
            held = [await w.acquire("chat-0", 60)]
            waiting = asyncio.create_task(w.acquire("eval", 60, profile="eval"))
            await until(lambda: len(w.queue.queued()) == 1)
            held.append(await w.acquire("chat-1", 60))  # before fair_after: it joins
            await asyncio.sleep(0.06)
            late = asyncio.create_task(w.acquire("chat-2", 60))  # after: it queues behind eval
            await until(lambda: len(w.queue.queued()) == 2)
            assert [q["holder"] for q in w.status()["queue"]] == ["eval", "chat-2"]
            for lease in held:
                await w.release(lease.id)
            eval_lease = await waiting
            assert w.record is not None and w.record.profile == "eval"
            assert not late.done()
            await w.release(eval_lease.id)
            chat = await late
            assert w.record is not None and w.record.profile == "default"
            await w.release(chat.id)
            await settle(w)
            assert resident_back(fw)

    run(main())


def test_queue_limits_and_refusals() -> None:
    fw = world(max_queue=1)

    async def main() -> None:
        async with running(fw.window()) as w:
            lease = await w.acquire("chat", 60)
            with pytest.raises(UnknownProfile):
                await w.acquire("x", 60, profile="nope")
            with pytest.raises(NotReady):
                await w.acquire("x", 60, profile="eval", wait=False)
            waiting = asyncio.create_task(w.acquire("eval", 60, profile="eval"))
            await until(lambda: len(w.queue.queued()) == 1)
            with pytest.raises(QueueFull):
                await w.acquire("bare", 60, profile="bare")
            waiting.cancel()
            await until(lambda: not w.queue.queued())
            await w.release(lease.id)
            await settle(w)
            assert resident_back(fw)

    run(main())


def test_eta_comes_from_history_and_is_null_before() -> None:
    fw = world()

    async def main() -> None:
        async with running(fw.window()) as w:
            lease = await w.acquire("chat", 60)
            waiting = asyncio.create_task(w.acquire("eval", 60, profile="eval"))
            await until(lambda: len(w.queue.queued()) == 1)
            assert w.status()["queue"][0]["eta_s"] is None  # no eval window in history yet
            await w.release(lease.id)
            await w.release((await waiting).id)
            await settle(w)
            lease = await w.acquire("chat", 60)
            waiting = asyncio.create_task(w.acquire("eval", 60, profile="eval"))
            await until(lambda: len(w.queue.queued()) == 1)
            eta = w.status()["queue"][0]["eta_s"]
            assert eta is not None and 55 <= eta <= 61  # the lease's minute, plus a fake open time
            await w.release(lease.id)
            await w.release((await waiting).id)
            await settle(w)

    run(main())


def test_a_switch_killed_before_the_next_window_opened_restores_on_restart() -> None:
    fw = world()

    async def main() -> None:
        async with running(fw.window()) as w:
            first = await w.acquire("chat", 60)
            waiting = asyncio.create_task(w.acquire("eval", 60, profile="eval"))
            await until(lambda: len(w.queue.queued()) == 1)
            # The queue is written in the background: for the record, not for a restart to keep.
            await until(lambda: fw.store.document is not None and len(fw.store.document.queue) == 1)
            await w.release(first.id)
            await waiting
            rec = w.record
            assert rec is not None
            await w.shutdown(restore=False)  # as SIGKILL leaves it: the switched window READY
        # The document of a switch not yet begun (phase IDLE, carrying the units and timers).
        pending = dataclasses.replace(rec, phase=Phase.IDLE, timings=[], container=None)
        pending.leases.clear()
        fw.docker.containers.clear()
        fw.gpu.free("engine:qwen-eval")
        fw.store.document = Document(window=pending, queue=[{"holder": "gone", "profile": "bare", "since": 0}])
        async with running(fw.window()) as w2:
            await recover_at_start(w2)
            await settle(w2)
            assert resident_back(fw)
            assert fw.store.document is not None and fw.store.document.queue == []

    run(main())
    assert not fw.gpu.ooms


@pytest.mark.parametrize("told", [True, False])
def test_a_recovered_close_whose_resident_is_up_again_does_not_switch_directly_but_stops_it_as_its_own(
        told: bool) -> None:
    """A close restored the resident, but its end never reached the disk (the state directory refused writes):
    the next start finds the window still CLOSING, with a bare request waiting. The resident is up, so the
    close only verifies it, and the bare window stops the resident itself, marked first. A direct switch would
    carry the record's units as gpuswapd's stop while they run, and start them at its close after a crash
    had taken them down (seed 10183802). The same when systemd cannot say at start whether they run (``told``
    False): the close restores them (or finds them up) before anything else opens."""
    fw = world()

    async def main() -> None:
        async with running(fw.window()) as w:
            await w.acquire("chat", 60)
            rec = w.record
            assert rec is not None and rec.units == ["strata.service", "llama-swap.service"]
            left = dataclasses.replace(rec, phase=Phase.CLOSING)
            assert await w.shutdown(restore=True)  # the close restores the resident...
        assert resident_back(fw) and memory_marks(fw.store).read() == []
        fw.store.document = Document(window=left)  # ...but the disk still says CLOSING
        # The recovered close's engine removal waits for the bare request to queue (as a client that
        # sends its acquire again at once would): the switch is decided once CLOSING is done.
        queued, remove = threading.Event(), fw.docker.remove
        fw.docker.remove = lambda name: (queued.wait(5), remove(name))[1]  # type: ignore[method-assign]
        async with running(fw.window()) as w2:
            if not told:
                states, asked = w2.resident.unit_states, []

                async def unanswered(units: list[str]) -> Any:
                    asked.append(units)
                    if len(asked) <= 2:  # the two looks of the start, before the close
                        raise BusUnavailable("systemd did not answer (simulated)")
                    return await states(units)
                w2.resident.unit_states = unanswered  # type: ignore[method-assign]
            await recover_at_start(w2)  # the close goes on in the background...
            assert w2.record is not None and w2.record.id == left.id
            train = asyncio.create_task(w2.acquire("train", 60, profile="bare"))  # ...and the request queues
            await until(lambda: len(w2.queue.queued()) == 1)
            assert w2.record is not None and w2.record.id == left.id and w2.record.phase is Phase.CLOSING
            queued.set()
            await until(lambda: w2.record is not None and w2.record.profile == "bare"
                        and w2.record.phase in (Phase.WAITING_VRAM, Phase.READY))
            assert w2.last is not None and w2.last.id == left.id and w2.last.switched_to is None
            assert fw.systemd.units["strata.service"].active_state == "inactive"
            assert "strata.service" in memory_marks(fw.store).read()  # gpuswapd's own stop, marked
            await w2.release((await train).id)
            await settle(w2)
            assert resident_back(fw) and memory_marks(fw.store).read() == []

    run(main())
    assert not fw.gpu.ooms


@pytest.mark.parametrize(("needs", "stays"), [("21GiB", True), ("23.5GiB", False)])
def test_a_parked_engine_of_another_profile_stays_only_if_the_next_window_fits(needs: str, stays: bool) -> None:
    profiles = PROFILES.replace('kind = "engine"\n', f'kind = "engine"\nneeds = "{needs}"\n', 1)
    fw = FakeWorld(config=parse_config(CONFIG + '[window.park]\nmode = "sleep"\nsettle = "100ms"\n' + profiles,
                                      "<park+profiles>"))

    async def main() -> None:
        async with running(fw.window()) as w:
            await w.release((await w.acquire("chat", 60)).id)
            await settle(w)
            assert w.parked is not None and w.parked.profile == "default"
            await w.release((await w.acquire("eval", 60, profile="eval")).id)
            await settle(w)
            assert (w.parked is not None) is stays
            assert ("hyperqwen" in fw.docker.containers) is stays
            assert resident_back(fw)

    run(main())
    assert not fw.gpu.ooms


def test_a_bare_window_left_ready_is_adopted_after_a_restart() -> None:
    fw = world()

    async def main() -> None:
        async with running(fw.window()) as w:
            await w.acquire("train", 60, profile="bare")
            await w.shutdown(restore=False)  # as SIGKILL leaves it
        assert fw.store.document is not None and fw.store.document.window is not None
        async with running(fw.window()) as w2:
            await recover_at_start(w2)
            assert w2.phase is Phase.READY and w2.record is not None and w2.record.kind == "bare"
            assert [lease.holder for lease in w2.leases()] == ["train"]
            await w2.release(w2.leases()[0].id)
            await settle(w2)
            assert resident_back(fw)

    run(main())


# -- priorities and preemption ---------------------------------------------------------------------


def test_the_queue_runs_by_priority_then_age_and_aging_orders_but_never_preempts() -> None:
    fw = world(aging="50ms", preempt_grace="20ms")

    async def main() -> None:
        async with running(fw.window()) as w:
            lease = await w.acquire("chat", 60, priority=5)
            old = asyncio.create_task(w.acquire("old", 60, profile="eval", priority=0))
            await until(lambda: len(w.queue.queued()) == 1)
            await asyncio.sleep(0.12)  # aged two levels: effective 2
            new = asyncio.create_task(w.acquire("new", 60, profile="bare", priority=1))
            await until(lambda: len(w.queue.queued()) == 2)
            assert [q["holder"] for q in w.status()["queue"]] == ["old", "new"]
            await asyncio.sleep(0.1)
            assert w.record is not None and w.record.preempted is None  # aging never preempts
            await w.release(lease.id)
            await w.release((await old).id)
            await w.release((await new).id)
            await settle(w)
            assert resident_back(fw)

    run(main())


def test_a_higher_priority_request_preempts_after_the_grace_and_switches_directly() -> None:
    fw = world(preempt_grace="100ms")

    async def main() -> None:
        async with running(fw.window()) as w:
            told: list[dict[str, Any]] = []
            held = await w.acquire("chat", 60)
            w.lease_watchers[held.id] = told.append
            equal = asyncio.create_task(w.acquire("equal", 60, profile="eval"))
            await until(lambda: len(w.queue.queued()) == 1)
            await asyncio.sleep(0.05)
            assert w.record is not None and w.record.preempted is None  # equal priority waits its turn
            starts = len(fw.systemd.started)
            urgent = asyncio.create_task(w.acquire("urgent", 60, profile="bare", priority=10))
            await until(lambda: bool(told))
            assert told[0]["event"] == "preempting" and told[0]["by"] == "urgent" and told[0]["grace_s"] == 0.1
            assert w.record is not None and w.record.preempted is not None and len(w.record.leases) == 1
            with pytest.raises(NotReady):  # a window being preempted takes no new leases
                await w.acquire("late", 60, wait=False)
            lease = await urgent
            assert [e["event"] for e in told] == ["preempting", "preempted", "lease_ended"]
            assert w.record is not None and w.record.kind == "bare" and w.record.switched_from
            assert len(fw.systemd.started) == starts  # the resident was not started in between
            assert w.last is not None and w.last.preempted is not None and w.last.preempted.revoked_at
            await w.release(lease.id)
            await w.release((await equal).id)
            await settle(w)
            assert resident_back(fw)

    run(main())
    assert not fw.gpu.ooms


def test_a_slow_preflight_does_not_eat_the_holders_grace() -> None:
    """``docker top`` answers slowly while gpuswapd checks the preemptor could open: the holders' grace counts
    from the notice they get, not from when the check began."""
    fw = world(preempt_grace="150ms")
    top = fw.docker.top

    async def main() -> None:
        async with running(fw.window()) as w:
            told: list[tuple[float, dict[str, Any]]] = []
            held = await w.acquire("chat", 60)
            w.lease_watchers[held.id] = lambda e: told.append((time.monotonic(), e))

            def slow_top(name: str) -> list[int]:
                time.sleep(0.25)  # longer than the grace
                return top(name)

            fw.docker.top = slow_top  # type: ignore[method-assign]
            urgent = asyncio.create_task(w.acquire("urgent", 60, profile="bare", priority=10))
            lease = await urgent
            fw.docker.top = top  # type: ignore[method-assign]
            moments = {e["event"]: t for t, e in told}
            assert moments["preempted"] - moments["preempting"] >= 0.12  # the whole grace, give or take a poll
            assert w.last is not None and w.last.preempted is not None
            p = w.last.preempted
            assert p.revoked_at is not None and p.revoked_at - p.at >= 0.12
            await w.release(lease.id)
            await settle(w)

    run(main())


def test_the_holders_are_told_preempted_as_their_leases_end_even_while_the_state_directory_hangs() -> None:
    fw = world(preempt_grace="100ms")
    told: list[dict[str, Any]] = []
    at_write: list[list[str]] = []

    def hangs(cleared: bool, data: bytes) -> None:
        if not at_write and re.search(rb'"revoked_at":\d', data):
            at_write.append([e["event"] for e in told])
            time.sleep(0.5)  # past the lane's deadline: the write fails, and gpuswapd carries on

    fw.store.on_write = hangs

    async def main() -> None:
        async with running(fw.window(Outside(dataclasses.replace(DEADLINES, state=0.2)))) as w:
            held = await w.acquire("chat", 60)
            w.lease_watchers[held.id] = told.append
            urgent = asyncio.create_task(w.acquire("urgent", 60, profile="eval", priority=10))
            await until(lambda: bool(at_write), timeout=5)
            assert at_write == [["preempting", "preempted", "lease_ended"]]  # told before the write, not after
            with contextlib.suppress(StateError):  # the switch's own write may meet the directory still hung
                await w.release((await urgent).id)
            await settle(w)
            assert resident_back(fw)

    run(main())


def test_a_preemption_beside_a_parked_engine_whose_processes_docker_could_not_list_is_not_refused() -> None:
    """`docker top` failed while the default engine ran, so gpuswapd parked it without knowing its pids. A bare
    window opens beside it; a higher priority request for eval must not be refused "won't fit" for memory
    that is gpuswapd's own parked engine's (it is removed to make room, and the window waits for its memory)."""
    text = CONFIG.replace("[daemon]\n", '[daemon]\npreempt_grace = "100ms"\n', 1) + PROFILES.replace(
        '[profiles.eval]\nkind = "engine"\n', '[profiles.eval]\nkind = "engine"\nneeds = "23.5GiB"\n')  # not beside it
    fw = FakeWorld(config=parse_config(text + '[window.park]\nmode = "sleep"\nsettle = "100ms"\n', "<park>"))

    def no_top(name: str) -> list[int]:
        raise DockerUnavailable("Docker did not answer (top)")

    fw.docker.top = no_top  # type: ignore[method-assign]

    async def main() -> None:
        async with running(fw.window()) as w:
            first = await w.acquire("chat", 60)
            await w.release(first.id)
            await settle(w)
            assert w.parked is not None and w.parked.pids == []  # parked, its processes unknown
            bare = await w.acquire("batch", 60, profile="bare")
            urgent = await w.acquire("urgent", 60, profile="eval", priority=10)  # not refused: wont_fit
            assert w.record is not None and w.record.profile == "eval" and bare.id != urgent.id
            await w.release(urgent.id)
            await settle(w)
            assert resident_back(fw)

    run(main())
    assert not fw.gpu.ooms


def _eval_beside_default(park: bool) -> FakeWorld:
    """Return a world whose eval profile (8 GiB, its own image) fits beside a parked default engine (``park``)."""
    text = CONFIG.replace("[daemon]\n", '[daemon]\npreempt_grace = "100ms"\n', 1) + PROFILES.replace(
        '[profiles.eval]\nkind = "engine"\n', '[profiles.eval]\nkind = "engine"\nneeds = "8GiB"\n').replace(
        'name = "qwen-eval"\nimage = "engine:latest"', 'name = "qwen-eval"\nimage = "eval:latest"')
    park_keys = '[window.park]\nmode = "sleep"\nsettle = "100ms"\n' if park else ""
    fw = FakeWorld(config=parse_config(text + park_keys, "<park>" if park else "<profiles>"))
    fw.docker.images.add("eval:latest")
    return fw


def _on_lookup(fw: FakeWorld, meanwhile: Callable[[], object]) -> list[int]:
    """Make systemd run ``meanwhile`` (a prune, a hang) in each lookup of a process's unit; return the pids asked."""
    unit_of = fw.systemd.unit_of_pid
    looked: list[int] = []

    def looking(pid: int) -> str | None:
        looked.append(pid)
        meanwhile()
        return unit_of(pid)
    fw.systemd.unit_of_pid = looking  # type: ignore[method-assign]
    return looked


async def _urgent_refused_and_eval_kept(fw: FakeWorld, w: Window, batch: str) -> None:
    """A priority 10 request for default is refused (its image is gone); the eval window keeps lease ``batch``."""
    with pytest.raises(GpuswapError, match="engine:latest"):
        await w.acquire("urgent", 60, priority=10)
    assert w.record is not None and w.record.profile == "eval" and w.record.preempted is None
    assert [x.id for x in w.record.leases.all()] == [batch]
    await w.release(batch)
    await settle(w)
    assert resident_back(fw)


def test_a_request_for_a_parked_engine_that_is_gone_is_checked_as_a_new_one_before_anyone_is_preempted() -> None:
    """The parked default engine's container is gone (a removal gpuswapd gave up on landed late) and its image
    was pruned meanwhile: a higher priority request for it is refused at once, as for any engine that cannot be
    created, and the eval window's holder keeps its lease (seed 10161526 revoked it for a window that could
    not open)."""
    fw = _eval_beside_default(park=True)

    async def main() -> None:
        async with running(fw.window()) as w:
            chat = await w.acquire("chat", 60)
            await w.release(chat.id)
            await settle(w)
            assert w.parked is not None and w.parked.profile == "default"
            batch = await w.acquire("batch", 60, profile="eval")
            assert w.parked is not None  # eval fits beside it
            fw.docker.remove(w.parked.container.name)
            fw.docker.images.discard("engine:latest")
            await _urgent_refused_and_eval_kept(fw, w, batch.id)

    run(main())
    assert not fw.gpu.ooms


def test_the_preemptors_image_is_checked_after_its_fit_so_an_image_pruned_during_a_slow_fit_refuses_it() -> None:
    """The fit check looks up the unit of each process on the card; the default image is pruned while it does
    (seed 10182557: the lookup hung 35 s, and the image went in the meantime). The request is refused, and the
    eval window's holder keeps its lease: the notice would have gone on a check of the image made before."""
    fw = _eval_beside_default(park=False)

    async def main() -> None:
        async with running(fw.window()) as w:
            batch = await w.acquire("batch", 60, profile="eval")
            assert fw.gpu.claim("stranger", 31337, GiB)  # a process whose unit the fit must look up
            looked = _on_lookup(fw, lambda: fw.docker.images.discard("engine:latest"))
            await _urgent_refused_and_eval_kept(fw, w, batch.id)
            assert looked[0] == 31337  # the fit looked the stranger up

    run(main())
    assert not fw.gpu.ooms


def test_leases_end_at_their_expiry_while_the_check_of_a_preemptor_waits_on_systemd() -> None:
    """The check that a preemptor's window could open looks up the unit of each process on the card; systemd
    hangs on it. A lease of the open window ends at its expiry all the same (seed 10186889: one was held 61 s
    past it while four lookups hung in turn)."""
    fw = world()
    answer = threading.Event()

    async def main() -> None:
        async with running(fw.window()) as w:
            short = await w.acquire("batch", 0.3, profile="eval")
            assert fw.gpu.claim("stranger", 31337, GiB)  # a process whose unit the fit must look up
            _on_lookup(fw, lambda: answer.wait(1.5))  # hangs, within the systemd lane's deadline (2 s)
            urgent = asyncio.create_task(w.acquire("urgent", 60, priority=10))
            await until(lambda: len(w.queue.queued()) == 1)
            started = time.monotonic()
            await until(lambda: w.record is not None and short.id not in [x.id for x in w.record.leases.all()],
                        timeout=1.2)
            assert time.monotonic() - started < 1.0 and not answer.is_set()  # ended while the lookup hung
            answer.set()
            fw.gpu.free("stranger")
            await w.release((await urgent).id)
            await settle(w)
            assert resident_back(fw)

    run(main())
    assert not fw.gpu.ooms


def test_a_preemption_whose_request_went_away_is_abandoned() -> None:
    fw = world(preempt_grace="10s")

    async def main() -> None:
        async with running(fw.window()) as w:
            held = await w.acquire("chat", 60)
            urgent = asyncio.create_task(w.acquire("urgent", 60, profile="eval", priority=3))
            await until(lambda: w.record is not None and w.record.preempted is not None)
            urgent.cancel()
            await until(lambda: w.record is not None and w.record.preempted is not None
                        and w.record.preempted.abandoned_at is not None, timeout=20)
            assert [lease.id for lease in w.leases()] == [held.id]  # it runs on
            await w.release(held.id)
            await settle(w)
            assert resident_back(fw)

    run(main())
