"""The resident comes back as it was, on fakes: its baseline, the comparison, the repair, "restored, smaller"."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import structlog

from gpuswapd.adapters.props import parse_model_ids, parse_props
from gpuswapd.config import parse_config
from gpuswapd.errors import BadResponse, BusUnavailable, ConfigError, EndpointUnreachable
from gpuswapd.observe.metrics import window_now
from gpuswapd.parts.vram import Holder
from gpuswapd.state.store import Loaded, decode, encode
from gpuswapd.window import identity
from gpuswapd.window.baseline import Identity, Known
from gpuswapd.window.identity import record_at_start
from gpuswapd.window.recovery import recover_at_start
from tests.fakes import CONFIG, FakeFit, FakeWorld, GiB, running, settle

FIT = FakeFit()  # 12 GiB + 1 MiB x 8192 + 1 GiB = 21 GiB at full context; 1 GiB left free besides
FULL = FIT.ctx // FIT.slots
STRAY = "stray"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def fit_world(resident_needs: str = "22GiB", park: bool = False, server: str = "llama.cpp",
              residual: float = 1.0) -> FakeWorld:
    """A world whose resident fits itself to the free memory (llama.cpp's --fit)."""
    text = CONFIG + ('[window.park]\nmode = "sleep"\nsettle = "100ms"\n' if park else "")
    text = text.replace('resident_needs = "22GiB"', f'resident_needs = "{resident_needs}"')
    text = text.replace('server = "llama.cpp"', f'server = "{server}"')
    world = FakeWorld(config=parse_config(text, "<fit>"), fit=FIT)
    world.docker.residual = int(residual * GiB)
    return world


async def cycle(w: Any, during: Any = None) -> Any:
    lease = await w.acquire("job", 60)
    rec = w.record
    if during is not None:
        during()
    await w.release(lease.id)
    await settle(w)
    return rec


def n_ctx(world: FakeWorld) -> int:
    return world.systemd.units["strata.service"].n_ctx


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


# -- what the servers say --------------------------------------------------------------------------


def test_props_are_read_as_llama_server_says_them() -> None:
    raw = (b'{"default_generation_settings": {"n_ctx": 4096, "params": {}}, "total_slots": 2, '
           b'"model_path": "/m/coder.gguf", "model_alias": "strata", "build_info": "b1"}')
    props = parse_props(raw, "GET /props")
    assert (props.n_ctx, props.slots, props.model_path, props.alias) == (4096, 2, "/m/coder.gguf", "strata")
    assert parse_model_ids(b'{"object": "list", "data": [{"id": "b"}, {"id": "a"}, {"id": "a"}]}', "x") == ["a", "b"]


@pytest.mark.parametrize("raw", [b"[]", b"not json", b'{"total_slots": 2}', b'{"default_generation_settings": '
                                 b'{"n_ctx": 0}, "total_slots": 2}', b'{"default_generation_settings": {"n_ctx": '
                                 b'true}, "total_slots": 1}'])
def test_an_answer_that_is_not_props_names_the_key_to_check(raw: bytes) -> None:
    with pytest.raises(BadResponse, match=r"props|JSON"):
        parse_props(raw, "GET http://x/props")


def test_models_without_ids_are_a_bad_response() -> None:
    for raw in (b'{"data": [{"name": "x"}]}', b'{"models": []}', b"[1]"):
        with pytest.raises(BadResponse):
            parse_model_ids(raw, "GET /v1/models")


def test_llama_cpp_needs_its_props_url_and_other_does_not() -> None:
    text = CONFIG.replace('props_url = "http://resident.test:8081/props"\n', "")
    with pytest.raises(ConfigError, match=r"resident\.props_url: required when resident\.server = \"llama\.cpp\""):
        parse_config(text)
    other = parse_config(text.replace('server = "llama.cpp"', 'server = "other"'))
    assert other.resident.server == "other" and other.resident.props_url == ""
    assert parse_config(text.replace('server = "llama.cpp"\n', "")).resident.server == "other"  # the default
    with pytest.raises(ConfigError, match=r"resident\.server: 'vllm' is not one of"):
        parse_config(text.replace('server = "llama.cpp"', 'server = "vllm"'))
    with pytest.raises(ConfigError, match=r"resident\.props_url: not an http\(s\) URL"):
        parse_config(CONFIG.replace("http://resident.test:8081/props", "resident:8081/props"))


def test_the_models_are_listed_on_the_base_of_the_verify_url() -> None:
    config = parse_config(CONFIG)
    assert config.resident.models_url == "http://resident.test:8080/v1/models"
    prefixed = parse_config(CONFIG.replace("http://resident.test:8080/v1/chat/completions",
                                           "https://proxy.test/llama/v1/chat/completions"))
    assert prefixed.resident.models_url == "https://proxy.test/llama/v1/models"


def test_props_through_the_gateway_are_refused() -> None:
    text = CONFIG.replace("http://resident.test:8081/props", "http://127.0.0.1:8080/props") + "[gateway]\n"
    with pytest.raises(ConfigError, match=r"resident\.props_url: .* is the gateway's own address"):
        parse_config(text)


# -- the baseline ---------------------------------------------------------------------------------------


def test_the_baseline_is_recorded_at_start_and_read_back_after_a_restart() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            base = w.known.baseline
            assert base is not None
            assert (base.n_ctx, base.slots, base.models, base.alias) == (4096, 2, ("strata",), "strata")
            assert base.held_bytes == 21 * GiB and [h.unit for h in base.held] == ["strata.service"]
            await w.writer.save()
        doc = world.store.document
        assert doc is not None and doc.resident is not None
        assert decode(encode(doc)).resident == doc.resident
        again = world.window()
        await recover_at_start(again)
        try:
            assert again.known.baseline == base
            assert again.status()["resident"]["baseline"]["n_ctx"] == 4096
        finally:
            again.stopping.set()
            await again.writer.stop(1.0)

    run(main())


def test_a_state_document_without_the_resident_reads_as_before() -> None:
    assert Known.from_dict(None) == Known()
    assert Known().to_dict() is None
    with pytest.raises(ValueError, match=r"resident\.baseline\.models"):
        Known.from_dict({"baseline": {"models": "strata"}})


def test_a_restore_that_finds_it_as_it_was_keeps_the_baseline() -> None:
    world = fit_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            rec = await cycle(w)
            assert rec.restored == "as_it_was" and rec.resident_changed is None
            assert n_ctx(world) == FULL and w.known.changed is None
            assert world.store.history_records[-1]["restored"] == "as_it_was"

    run(main())


# -- smaller, and repaired ---------------------------------------------------------------------------------


def test_a_parked_residual_beside_a_low_resident_needs_is_repaired() -> None:
    # resident_needs 19 GiB for a 21 GiB resident that needs 22 free (its 1 GiB --fit margin); the
    # engine keeps 2.5 GiB asleep: 21.5 free passes the learned 21 GiB, and the resident fits itself
    # smaller beside it.
    world = fit_world("19GiB", park=True, residual=2.5)

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            with structlog.testing.capture_logs() as logs:
                rec = await cycle(w)
            assert w.known.footprint == 21 * GiB and w.resident_needs == 21 * GiB
            [warned] = events(logs, "resident_footprint_larger")
            assert (warned["footprint"], warned["resident_needs"]) == ("21.0 GiB", "19.0 GiB")
            [changed] = events(logs, "resident_changed")
            assert "n_ctx 3840 (was 4096)" in changed["smaller"]
            assert n_ctx(world) == FULL  # back as it was after the repair
            assert w.parked is None and "hyperqwen" not in world.docker.containers
            assert rec.restored == "as_it_was"
            history = world.store.history_records[-1]
            assert history["resident_changed"]["repaired"] is True
            assert history["resident_changed"]["now"]["n_ctx"] == 3840
            assert history["resident_changed"]["after"]["n_ctx"] == FULL
            assert w.known.changed is None and not window_now(w).resident_degraded
            assert [u for u in world.systemd.started if u == "strata.service"] == ["strata.service"] * 2

    run(main())
    assert not world.gpu.ooms


def test_a_resident_its_operator_reconfigured_unseen_is_still_repaired_when_a_parked_residual_squeezes_it() -> None:
    """Its operator changed how it runs (a drop-in, the same context) and restarted it; no reconcile saw it
    before the next window.

    The window's open takes that resident as the baseline before it stops it, so the restore that
    comes back fitted into less beside the parked engine is repaired, not taken for their wish.
    """
    world = fit_world("19GiB", park=True, residual=2.5)

    async def main() -> None:
        async with running(world.window()) as w:
            old = await _reconfigured_and_restarted(world, w)
            with structlog.testing.capture_logs() as logs:
                rec = await cycle(w)
            [changed] = events(logs, "resident_changed")
            assert "n_ctx 3840 (was 4096)" in changed["smaller"]
            assert rec.restored == "as_it_was" and n_ctx(world) == FULL  # repaired
            assert w.known.baseline.n_ctx == FULL and w.known.baseline.config not in (None, old)

    run(main())
    assert not world.gpu.ooms


async def _reconfigured_and_restarted(world: FakeWorld, w: Any) -> Any:
    """Record the baseline at start; its operator then adds a drop-in (the same context) and restarts it.

    Return how it ran at the baseline (its configuration's digest).
    """
    await record_at_start(w)
    assert w.known.baseline is not None
    old = w.known.baseline.config
    world.systemd.exec_start["strata.service"] = ("/usr/bin/llama-server", "-m", "/models/strata.gguf",
                                                  "--threads", "8")
    world.systemd._stop("strata.service")
    assert world.systemd._start("llama-swap.service") == "done" and n_ctx(world) == FULL
    return old


def _unsaid_while(w: Any, flag: dict[str, bool]) -> None:
    """Make systemd fail to say how the resident runs (its ExecStart= and Environment=) while ``flag["on"]``."""
    runs_as = w.resident.runs_as

    async def unsaid() -> str:
        if flag["on"]:
            raise BusUnavailable("systemd (D-Bus) did not answer (commands) within 35s")
        return await runs_as()

    w.resident.runs_as = unsaid


def test_a_start_that_cannot_say_how_the_resident_runs_keeps_what_systemd_said_last() -> None:
    """gpuswapd restarts while systemd does not say how the resident runs; the baseline keeps the digest it had.

    Without it, the next close could not tell its operator's change from a parked residual's squeeze,
    and the smaller resident would go unrepaired.
    """
    world = fit_world("19GiB", park=True, residual=2.5)

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            assert w.known.baseline is not None and w.known.baseline.config is not None
            old = w.known.baseline.config
            await w.writer.save()
        again = world.window()
        await recover_at_start(again)
        flag = {"on": True}
        _unsaid_while(again, flag)
        async with running(again) as w:
            await record_at_start(w)
            assert w.known.baseline is not None and w.known.baseline.config == old
            flag["on"] = False
            rec = await cycle(w)
            assert rec.restored == "as_it_was" and n_ctx(world) == FULL  # repaired

    run(main())
    assert not world.gpu.ooms


def test_gpuswapds_own_unchecked_restore_is_not_taken_for_its_operators_restart() -> None:
    """A close could not compare the resident (systemd did not say how it runs), and left it fitted smaller.

    The idle reconcile then sees an InvocationID that is gpuswapd's own start, not its operator's:
    the baseline stays, and the next close repairs the resident.
    """
    world = fit_world("19GiB", park=True, residual=2.5)

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            flag = {"on": False}
            _unsaid_while(w, flag)
            rec = await cycle(w, during=lambda: flag.update(on=True))
            assert rec.restored == "unchecked" and n_ctx(world) < FULL
            flag["on"] = False
            await w.reconcile()
            assert w.known.baseline is not None and w.known.baseline.n_ctx == FULL
            rec = await cycle(w)
            assert rec.restored == "as_it_was" and n_ctx(world) == FULL

    run(main())
    assert not world.gpu.ooms


def test_a_repair_whose_start_fails_is_retried_not_taken_for_its_operators_stop() -> None:
    """The repair stops the smaller resident; its start again fails on systemd: that stop is gpuswapd's own.

    DEGRADED retries the start, and the resident comes back as it was (not left to its operator
    as one stopped after the restore's first start brought it up).
    """
    world = fit_world("19GiB", park=True, residual=2.5)
    queue = world.systemd.queue_jobs
    starts = 0

    def jobs(method: str, units: list[str]) -> Any:
        nonlocal starts
        if method == "StartUnit" and "strata.service" in units:
            starts += 1
            if starts == 2:  # the repair's start
                raise BusUnavailable("the system bus went away")
        return queue(method, units)

    world.systemd.queue_jobs = jobs  # type: ignore[method-assign]

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            with structlog.testing.capture_logs() as logs:
                rec = await cycle(w)
            assert not events(logs, "resident_left_stopped")
            assert rec.restored == "as_it_was" and rec.units == ["strata.service", "llama-swap.service"]
            assert n_ctx(world) == FULL

    run(main())
    assert world.snapshot()["units"]["strata.service"] == "active"


def test_a_stray_process_across_the_close_ends_restored_smaller_and_the_next_close_tries_again() -> None:
    world = fit_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            with structlog.testing.capture_logs() as logs:
                rec = await cycle(w, lambda: world.gpu.claim(STRAY, 777, 3 * GiB))
            assert rec.restored == "smaller" and rec.outcome == "closed" and rec.degraded is None
            assert n_ctx(world) < FULL  # it serves, smaller
            snap = world.snapshot()
            assert snap["units"] == {"strata.service": "active", "llama-swap.service": "active"}
            assert snap["timers"]["agent-triage.timer"] == "active"
            changed = world.store.history_records[-1]["resident_changed"]
            assert changed["was"]["n_ctx"] == FULL and changed["now"]["n_ctx"] == n_ctx(world)
            assert changed["repaired"] is False
            assert {"pid": 777, "unit": "session-1.scope", "bytes": 3 * GiB} in changed["holders"]
            [warning] = events(logs, "resident_restored_smaller")
            assert "3.0 GiB by pid 777 (session-1.scope)" in warning["error"]
            assert "raise gpu.resident_needs" in warning["error"]
            assert window_now(w).resident_degraded
            assert w.status()["resident"]["degraded"] is True
            assert w.known.baseline is not None and w.known.baseline.n_ctx == FULL  # the baseline stays

            world.gpu.free(STRAY)
            again = await cycle(w)
            assert again.restored == "as_it_was" and n_ctx(world) == FULL
            assert not window_now(w).resident_degraded and w.known.changed is None

    run(main())


def test_a_baseline_restore_waits_for_memory_an_exited_process_still_frees_even_with_room_for_resident_needs() -> None:
    """Its state lost, gpuswapd knows only the configured need; a process that just exited still holds memory.

    Started beside it, the resident would come up smaller and be taken for the baseline, which
    every later restore would then keep it to. It waits until the dying process's memory is gone.
    """
    world = fit_world(resident_needs="19GiB")
    dying = 424242
    unit_of = world.systemd.unit_of_pid
    world.systemd.unit_of_pid = lambda pid: None if pid == dying else unit_of(pid)  # type: ignore[method-assign]

    async def main() -> None:
        async with running(world.window()) as w:
            assert await w.acquire("survivor", 60) is not None
            await w.shutdown(restore=False)  # as a SIGKILL leaves it
        world.store.load = lambda: Loaded(None, ["state.json: checksum mismatch: torn or corrupted"])  # type: ignore
        world.gpu.claim("engine:dying", dying, 3 * GiB)  # an engine's process, exited, still freeing
        asyncio.get_running_loop().call_later(0.3, world.gpu.free, "engine:dying")
        w = world.window()
        async with running(w):
            await recover_at_start(w)
            await settle(w)
            assert w.last is not None and w.last.outcome == "baseline_restored"
            assert n_ctx(world) == FULL  # started once the memory was free, not beside it
            assert w.known.baseline is not None and w.known.baseline.n_ctx == FULL

    run(main())


def test_a_resident_that_is_not_llama_cpp_is_compared_by_its_models_only() -> None:
    world = fit_world(server="other")
    asked: list[str] = []
    props = world.http.props

    async def counted(url: str, timeout: float) -> Any:
        asked.append(url)
        return await props(url, timeout)

    world.http.props = counted  # type: ignore[method-assign]

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            assert w.known.baseline is not None and w.known.baseline.n_ctx is None
            # A smaller context is not seen: only the models are compared.
            rec = await cycle(w, lambda: world.gpu.claim(STRAY, 777, 3 * GiB))
            assert rec.restored == "as_it_was" and n_ctx(world) < FULL
            world.gpu.free(STRAY)
            # A model gone is.
            rec = await cycle(w, lambda: setattr(world.http, "models", ["strata-lite"]))
            assert rec.restored == "smaller"
            assert rec.resident_changed is not None
            assert rec.resident_changed["smaller"] == ["model(s) strata missing (it lists strata-lite)"]
            assert "other models" in rec.resident_changed["message"]
        assert asked == []

    run(main())


def test_props_that_cannot_be_read_leave_the_restore_unchecked_not_degraded() -> None:
    world = fit_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            world.http.props_answer = "{}"
            rec = await cycle(w)
            assert rec.restored == "unchecked" and rec.degraded is None and rec.error is None
            assert world.snapshot()["units"]["strata.service"] == "active"

    run(main())


def test_at_start_a_resident_left_smaller_keeps_its_baseline_until_it_is_as_it_was() -> None:
    world = fit_world()

    async def main() -> None:
        async with running(world.window()) as w:
            await record_at_start(w)
            await cycle(w, lambda: world.gpu.claim(STRAY, 777, 3 * GiB))
            assert w.known.changed is not None
            await w.writer.save()
        restarted = world.window()
        await recover_at_start(restarted)  # it starts the writer
        try:
            await record_at_start(restarted)
            assert restarted.known.changed is not None and restarted.known.baseline is not None
            assert restarted.known.baseline.n_ctx == FULL  # still smaller: the baseline stays
            # Its operator restarts it with the stray gone: the reconcile sees it as it was.
            world.gpu.free(STRAY)
            world.systemd._stop("strata.service")
            world.systemd._start("llama-swap.service")
            await restarted.reconcile()
            assert restarted.known.changed is None and not window_now(restarted).resident_degraded
        finally:
            restarted.stopping.set()
            await restarted.writer.stop(1.0)

    run(main())


def test_smaller_compares_context_slots_and_models() -> None:
    from gpuswapd.window.baseline import smaller

    was = Identity(4096, 2, "/m", "strata", ("a", "b"), 21 * GiB, (Holder(1, 21 * GiB, "strata.service"),))
    assert smaller(was, was, "llama.cpp") == []
    assert smaller(dataclasses.replace(was, n_ctx=8192, models=("a", "b", "c")), was, "llama.cpp") == []
    assert smaller(dataclasses.replace(was, n_ctx=2048, slots=1, models=("a",)), was, "llama.cpp") == [
        "n_ctx 2048 (was 4096)", "total_slots 1 (was 2)", "model(s) b missing (it lists a)"]
    assert smaller(dataclasses.replace(was, n_ctx=2048), was, "other") == []
    assert Identity.from_dict(was.to_dict(), "x") == was


def test_status_and_history_say_restored_smaller() -> None:
    import io

    from gpuswapd.ctl.main import _history_line
    from gpuswapd.ctl.render import print_status

    out = io.StringIO()
    print_status({"phase": "IDLE", "resident": {
        "baseline": {"n_ctx": 4096, "slots": 2, "models": ["strata"]},
        "changed": {"message": "the resident came back smaller than its baseline: n_ctx 3584 (was 4096)"}}}, out)
    lines = out.getvalue().splitlines()
    assert "resident baseline: n_ctx 4096 x 2 slots, models strata" in lines
    assert "RESIDENT SMALLER: the resident came back smaller than its baseline: n_ctx 3584 (was 4096)" in lines
    window = {"id": "w1", "outcome": "closed", "start": "cold", "opened_at": 0.0, "closed_at": 12.0,
              "restored": "smaller"}
    assert _history_line(window).endswith("restored, smaller")
    assert "smaller" not in _history_line({**window, "restored": "as_it_was"})


def _props_refused_while(monkeypatch: pytest.MonkeyPatch, on: bool) -> dict[str, bool]:
    """Refuse the resident's /props while the returned flag's "on" is set (a resident still loading)."""
    unread = {"on": on}
    real_read = identity.read

    async def read(w: Any, units: list[str]) -> Any:
        if unread["on"]:
            raise EndpointUnreachable("GET http://resident/props: connection refused")
        return await real_read(w, units)

    monkeypatch.setattr(identity, "read", read)
    return unread


def test_a_resident_reconfigured_and_unread_before_the_window_is_measured_without_the_parked_residual(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its operator changed how it runs (the same context) and restarted it; the window's open could not read it
    (still loading: its /props refused), so the first look at the new configuration is the restore's.

    That restore came back fitted into less beside the parked engine: which part is the operator's
    and which the squeeze cannot be told. The parked engine is removed and the resident started
    again with the room it had, and that is the baseline (seed 10124241 recorded the squeezed one).
    """
    world = fit_world("19GiB", park=True, residual=2.5)
    unread = _props_refused_while(monkeypatch, on=False)

    async def main() -> None:
        async with running(world.window()) as w:
            old = await _reconfigured_and_restarted(world, w)
            unread["on"] = True
            with structlog.testing.capture_logs() as logs:
                rec = await cycle(w, during=lambda: unread.update(on=False))
            assert events(logs, "resident_reconfigured_beside_parked")
            assert rec.restored == "as_it_was" and n_ctx(world) == FULL  # measured with its room
            assert w.known.baseline.n_ctx == FULL and w.known.baseline.config not in (None, old)
            assert w.parked is None
            assert [u for u in world.systemd.started if u == "strata.service"].count("strata.service") >= 2

    run(main())
    assert not world.gpu.ooms


def test_a_first_baseline_a_restore_would_take_beside_the_parked_engine_is_measured_with_the_card_to_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No baseline (the state that held it was lost) and the resident's /props refused as the window opens:
    the first look at it is the restore's, which brought it back fitted into what the parked engine left.

    Taken as it is, the squeezed resident would be the baseline and never repaired (seed 10157477). The
    parked engine is removed and the resident started again, and what it runs alone is the baseline.
    """
    world = fit_world("19GiB", park=True, residual=2.5)
    unread = _props_refused_while(monkeypatch, on=True)

    async def main() -> None:
        async with running(world.window()) as w:
            assert w.known.baseline is None and n_ctx(world) == FULL
            with structlog.testing.capture_logs() as logs:
                rec = await cycle(w, during=lambda: unread.update(on=False))
            assert events(logs, "resident_first_seen_beside_parked")
            assert rec.restored == "as_it_was" and n_ctx(world) == FULL  # measured with the card to itself
            assert w.known.baseline is not None and w.known.baseline.n_ctx == FULL
            assert w.parked is None
            assert [u for u in world.systemd.started if u == "strata.service"].count("strata.service") >= 2

    run(main())
    assert not world.gpu.ooms
