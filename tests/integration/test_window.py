"""The whole GPU window, driven by the real gpuswapctl against the real gpuswapd and test world."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import TEST_BOOT_DELAY
from tests.integration.conftest import assert_resident_back, assert_window_open, engine_state, metric, resident_busy
from tests.stack import llama
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import AGENT_TIMERS, RESIDENT_UNITS, Probe
from tests.stack.world import Stack

Start = Callable[..., RunningDaemon]


def test_acquire_opens_the_window_only_after_a_real_completion(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd()
    out = daemon.ctl("acquire", "--for", "2m")
    assert out.returncode == 0, out.stderr
    assert "acquired lease" in out.stdout
    assert_window_open(probe)
    served = engine_state()
    # two warmup completions and the verifying one were answered before acquire returned
    assert served["requests_served"] >= 3, served
    status = daemon.status()
    assert status["phase"] == "READY"
    [lease] = status["window"]["leases"]
    assert 100 < lease["remaining_s"] <= 120


def test_release_restores_verifies_and_resumes_timers_last(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd()
    assert daemon.ctl("acquire", "--for", "2m").returncode == 0
    out = daemon.ctl("release")
    assert out.returncode == 0, out.stderr
    status = daemon.wait_phase("IDLE")
    assert_resident_back(probe)
    # The fresh llama-server has answered exactly gpuswapd's verifying completion.
    assert metric("llamacpp:tokens_predicted_total") > 0
    last = status["last"]
    assert last["outcome"] == "closed" and last["error"] is None
    phases = [t["phase"] for t in last["timings"]]
    assert phases.index("RESUMING_TIMERS") > phases.index("RESTORING")
    restored = next(t for t in last["timings"] if t["phase"] == "RESTORING")
    resident_up_us = max(probe.entered_active_us(u) for u in RESIDENT_UNITS)
    for timer in AGENT_TIMERS:
        entered = probe.entered_active_us(timer)
        assert entered > resident_up_us, f"{timer} came back before the resident"
        assert entered / 1e6 >= restored["ended_at"] - 0.01, f"{timer} came back before the resident verified"


def test_second_acquire_joins_at_once_and_window_waits_for_both(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(daemon={"linger": "1s"})
    first = daemon.ctl_json("acquire", "--for", "2m", "--holder", "first")
    started = time.monotonic()
    second = daemon.ctl_json("acquire", "--for", "2m", "--holder", "second")
    assert time.monotonic() - started < 2.0 and second["waited_s"] < 0.5
    daemon.ctl("release", first["lease"]["id"])
    time.sleep(2.0)  # well past linger: the second lease still holds the window
    assert daemon.status()["phase"] == "READY"
    assert_window_open(probe)
    daemon.ctl("release", "--holder", "second")
    daemon.wait_phase("IDLE")
    assert_resident_back(probe)


def test_a_lease_that_expires_closes_the_window_after_linger(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(daemon={"linger": "2s"})
    reply = daemon.ctl_json("acquire", "--for", "2s")
    expires = reply["lease"]["expires_at"]
    while time.time() < expires + 1.0:  # expired, but still within linger
        time.sleep(0.1)
    status = daemon.status()
    assert status["phase"] == "READY" and status["window"]["leases"] == []
    daemon.wait_phase("IDLE", timeout=60)
    closing = next(t for t in daemon.status()["last"]["timings"] if t["phase"] == "CLOSING")
    assert closing["started_at"] >= expires + 2.0 - 0.05
    assert_resident_back(probe)


def test_busy_resident_fails_the_acquire_and_changes_nothing(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    world.use_model(llama.ensure_model(world.cache, "slow"))
    world.restart_resident()
    daemon = gpuswapd(resident__idle={"wait": "1s", "on_busy": "fail"})
    with resident_busy():
        out = daemon.ctl("acquire", "--for", "2m")
    assert out.returncode == 1
    assert "strata.service is busy" in out.stderr and "1 of 2 slots" in out.stderr
    assert_resident_back(probe)
    assert daemon.status()["last"]["outcome"] == "refused"


def test_a_running_agent_job_finishes_before_the_resident_stops(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    (world.paths.control / "agent-triage.hold").write_text("3")
    world.manager("StartUnit", "ss", "agent-triage.service", "replace")
    deadline = time.monotonic() + 10
    while probe.active_state("agent-triage.service") != "activating":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    daemon = gpuswapd()
    assert daemon.ctl("acquire", "--for", "2m").returncode == 0
    assert probe.prop("agent-triage.service", "Result", "org.freedesktop.systemd1.Service") == "success"
    job_ended = int(probe.prop("agent-triage.service", "InactiveEnterTimestamp"))
    resident_stopped = int(probe.prop("strata.service", "InactiveEnterTimestamp"))
    assert job_ended < resident_stopped


def test_plan_shows_what_a_window_would_do_and_changes_nothing(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd()
    before = probe.snapshot()
    plan = daemon.ctl_json("plan")["plan"]
    assert plan["ok"] and plan["problems"] == []
    assert set(plan["units"]) == set(RESIDENT_UNITS)
    assert sorted(plan["timers"]) == sorted(AGENT_TIMERS)
    assert plan["container"]["image"] == "hyperqwen-sim:latest"
    assert plan["vram"]["window_needs"] == "21.0 GiB" and plan["vram"]["free_after_stop"] == "24.0 GiB"
    human = daemon.ctl("plan")
    assert human.returncode == 0 and "llama-swap.service" in human.stdout and "agent-triage.timer" in human.stdout
    after = probe.snapshot()
    for key in ("units", "timers", "containers", "ooms"):
        assert before[key] == after[key]
    assert daemon.status()["phase"] == "IDLE"


def test_status_json_has_phase_leases_and_last_timings(gpuswapd: Start) -> None:
    daemon = gpuswapd()
    daemon.ctl_json("acquire", "--for", "90s", "--holder", "nightly-eval")
    daemon.ctl("release", "--holder", "nightly-eval")
    daemon.wait_phase("IDLE")
    daemon.ctl_json("acquire", "--for", "5m")
    status = daemon.status()
    assert status["phase"] == "READY"
    [lease] = status["window"]["leases"]
    assert 280 < lease["remaining_s"] <= 300
    last = status["last"]
    took = {t["phase"]: t["took_s"] for t in last["timings"]}
    for phase in ("DRAINING", "PAUSING_TIMERS", "STOPPING_RESIDENT", "WAITING_VRAM", "BOOTING", "WARMING",
                  "READY", "CLOSING", "RESTORING", "RESUMING_TIMERS"):
        assert phase in took and took[phase] >= 0
    assert took["BOOTING"] >= float(TEST_BOOT_DELAY)  # the engine's simulated boot delay


@pytest.mark.parametrize(("patch", "names"), [
    ({"daemon": {"lingr": "1s"}}, "daemon.lingr: unknown key"),
    ({"daemon": {"linger": "1 fortnight"}}, "daemon.linger"),
    ({"window__container": {"image": "nosuch:latest"}}, "window.container.image: 'nosuch:latest' is not in Docker"),
])
def test_bad_config_exits_non_zero_naming_it_and_touches_nothing(gpuswapd: Start, probe: Probe,
                                                                 patch: dict[str, Any], names: str) -> None:
    before = probe.snapshot()
    daemon = gpuswapd(wait=False, **patch)
    assert daemon.proc is not None
    assert daemon.proc.wait(30) == 78
    assert names in daemon.log.read_text()
    after = probe.snapshot()
    for key in ("units", "timers", "containers"):
        assert before[key] == after[key]
    assert not daemon.socket.exists()
