"""Parking the engine asleep between windows, on the real world: warm re-opens and every way out."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from tests.conftest import TEST_BOOT_DELAY
from tests.integration.conftest import (
    SLEEPY,
    acquire_in_background,
    assert_resident_back,
    assert_switched_cleanly,
    engine_holds,
    engine_state,
    inactive_since,
    pauses_then_gives_up,
    wait_for,
    wait_persisted,
)
from tests.stack.config import profile_sections
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import AGENT_TIMERS, RESIDENT_UNITS, Probe
from tests.stack.world import ENGINE_PORT, OTHER_TIMER, Stack

Start = Callable[..., RunningDaemon]
GiB = 1 << 30


def parking(gpuswapd: Start, env: dict[str, str] | None = None, park: dict[str, Any] | None = None,
            **sections: dict[str, Any]) -> RunningDaemon:
    """Start gpuswapd with park mode "sleep" and an engine that offers sleep mode."""
    return gpuswapd(window__park={"mode": "sleep", **(park or {})},
                    window__container={"env": {**SLEEPY, **(env or {})}}, **sections)


def cycle(daemon: RunningDaemon) -> None:
    out = daemon.ctl("acquire", "--for", "2m")
    assert out.returncode == 0, out.stderr
    assert daemon.ctl("release").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)


def assert_resident_back_beside_parked(probe: Probe) -> None:
    """The resident and every timer are back, and the engine is there, asleep."""
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "active")
    assert probe.states([*AGENT_TIMERS, OTHER_TIMER]) == dict.fromkeys([*AGENT_TIMERS, OTHER_TIMER], "active")
    assert [(c["Names"], c["State"]) for c in probe.containers()] == [("hyperqwen", "running")]
    assert engine_state()["sleeping"] is True
    assert probe.stack.ooms() == []


def is_sleeping() -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{ENGINE_PORT}/is_sleeping", timeout=5) as resp:
        return bool(json.loads(resp.read())["is_sleeping"])


def history(daemon: RunningDaemon) -> list[dict[str, Any]]:
    windows: list[dict[str, Any]] = daemon.ctl_json("history")["windows"]
    return windows


def test_release_parks_the_engine_and_the_next_acquire_wakes_it(gpuswapd: Start, probe: Probe,
                                                                 honest_lag: float) -> None:
    # With the card's real lag, the 18.5 GiB the sleeping engine let go is still listed under it for
    # 1.5 s: park waits for the resident's 22 GiB to come free (window.park.settle), then parks.
    daemon = parking(gpuswapd)
    cycle(daemon)
    assert_resident_back_beside_parked(probe)
    assert is_sleeping()
    assert engine_holds(probe.stack) == 1 * GiB  # its residual, in the ledger
    [parked] = daemon.logged("engine_parked")
    assert (parked["need"], parked["free"], parked["residual"], parked["sleep_level"]) == ("22.0 GiB", "23.0 GiB",
                                                                                     "1.0 GiB", 1)
    assert daemon.logged("engine_not_parked") == []
    status = daemon.status()
    assert status["next_open"] == "warm"
    assert status["parked"]["level"] == 1 and status["parked"]["container"] == "hyperqwen"
    assert "asleep at level 1" in daemon.ctl("park").stdout
    assert "next open:     warm" in daemon.ctl("plan").stdout
    boots = engine_state()["boots"]

    out = daemon.ctl("acquire", "--for", "2m")
    assert out.returncode == 0, out.stderr
    assert engine_state()["boots"] == boots  # woken, not booted
    assert not is_sleeping()
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    assert daemon.status()["window"]["start"] == "warm"
    assert daemon.ctl("release").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back_beside_parked(probe)
    assert [w["start"] for w in history(daemon)[-2:]] == ["cold", "warm"]


def test_a_residual_that_leaves_the_resident_short_removes_the_engine(gpuswapd: Start, probe: Probe,
                                                                      honest_lag: float) -> None:
    # 24 GiB card, 3 GiB kept asleep: 21 GiB free once the lag has passed, the resident needs 22. Park
    # waits its settle (longer than the lag) for memory that never comes, then removes the engine.
    daemon = parking(gpuswapd, env={"ENGINE_SLEEP_RESIDUAL_1": "3GiB"}, park={"settle": "3s"})
    cycle(daemon)
    assert_resident_back(probe)  # no container, no out-of-memory
    assert not any(h["name"] == "hyperqwen" for h in probe.stack.ledger()["holders"])
    assert daemon.status()["parked"] is None
    [refused] = daemon.logged("engine_not_parked")
    assert (refused["reason"], refused["need"], refused["free"], refused["settle_s"]) == (
        "what comes next would not fit beside the sleeping engine", "22.0 GiB", "21.0 GiB", 3.0)
    assert refused["waited_s"] >= 3.0
    assert daemon.logged("engine_parked") == []


def test_a_switch_to_a_bare_window_parks_the_engine_under_a_real_lag(gpuswapd: Start, probe: Probe,
                                                                     honest_lag: float) -> None:
    # engine -> bare with park on: the engine sleeps, its memory comes free 1.5 s later, it is parked
    # beside the bare window (20 GiB of 24 with 1 GiB asleep), and the resident waits for the end.
    sections = profile_sections(probe.stack)
    daemon = gpuswapd(window__park={"mode": "sleep"}, window__container={"env": {**SLEEPY, "ENGINE_BOOT_DELAY":
                                                                                  TEST_BOOT_DELAY}},
                      daemon={"linger": "1s"}, profiles__bare=sections["profiles__bare"])
    up_since = probe.entered_active_us("strata.service")
    assert daemon.ctl("acquire", "--holder", "chat", "--for", "2m").returncode == 0
    down_since = inactive_since(probe, "strata.service")
    trainer = acquire_in_background(daemon, "--profile", "bare", "--holder", "trainer", "--for", "2m")
    wait_for(lambda: len(daemon.status()["queue"]) == 1, "the bare request to queue")
    assert daemon.ctl("release", "--holder", "chat").returncode == 0
    _, err = trainer.communicate(timeout=90)
    assert trainer.returncode == 0, err
    window = daemon.status()["window"]
    assert window["kind"] == "bare" and window["switched_from"]
    assert [(c["Names"], c["State"]) for c in probe.containers()] == [("hyperqwen", "running")]
    assert is_sleeping() and engine_holds(probe.stack) == 1 * GiB
    [parked] = daemon.logged("engine_parked")
    assert (parked["need"], parked["free"]) == ("20.0 GiB", "23.0 GiB")
    # The resident was not started between the windows.
    assert inactive_since(probe, "strata.service") == down_since
    assert probe.entered_active_us("strata.service") == up_since
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    assert_switched_cleanly(daemon, probe)

    assert daemon.ctl("release", "--holder", "trainer").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back_beside_parked(probe)  # the resident fits beside the parked engine
    assert probe.entered_active_us("strata.service") > up_since
    assert_switched_cleanly(daemon, probe)
    windows = history(daemon)[-2:]
    assert [(w["profile"], w["outcome"]) for w in windows] == [("default", "closed"), ("bare", "closed")]


def test_a_canary_mismatch_after_a_wake_boots_the_engine_cold(gpuswapd: Start, probe: Probe) -> None:
    daemon = parking(gpuswapd)
    cycle(daemon)
    boots = engine_state()["boots"]
    (probe.stack.paths.gpu / "engine-fault.json").write_text(json.dumps({"garbled_wakes": 1}))
    out = daemon.ctl("acquire", "--for", "2m")
    assert out.returncode == 0, out.stderr
    assert engine_state()["boots"] == boots + 1  # booted cold after the garbled wake
    window = daemon.status()["window"]
    assert window["start"] == "cold" and window["restarts"] == 1
    phases = [t["phase"] for t in window["timings"]]
    assert phases[-5:] == ["WAKING", "WAITING_VRAM", "BOOTING", "WARMING", "READY"]
    assert daemon.ctl("release").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back_beside_parked(probe)


def test_an_engine_without_sleep_mode_is_removed_as_before(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(window__park={"mode": "sleep"})  # the engine runs without VLLM_SERVER_DEV_MODE
    cycle(daemon)
    assert_resident_back(probe)
    assert daemon.status()["parked"] is None
    assert any("--enable-sleep-mode" in e["reason"] for e in daemon.logged("engine_sleep_unavailable"))


def test_sigkill_while_parked_then_restart_adopts_the_parked_engine(gpuswapd: Start, probe: Probe) -> None:
    daemon = parking(gpuswapd)
    cycle(daemon)
    boots = engine_state()["boots"]
    daemon.kill()
    daemon.start()
    assert daemon.status()["parked"] is not None
    assert_resident_back_beside_parked(probe)
    assert daemon.ctl("acquire", "--for", "2m").returncode == 0
    assert engine_state()["boots"] == boots
    assert daemon.status()["window"]["start"] == "warm"


def test_sigkill_while_waking_then_restart_parks_the_engine_again(gpuswapd: Start, probe: Probe) -> None:
    daemon = parking(gpuswapd, daemon={"on_shutdown": "keep"})
    cycle(daemon)
    daemon.stop()  # with "keep", the parked engine stays for the next start
    daemon.start(env={"GPUSWAPD_FAILPOINT_DELAY": "WAKING=60"})
    client = acquire_in_background(daemon, "--for", "2m")
    wait_persisted(daemon, "WAKING")
    daemon.kill()
    pauses_then_gives_up(client)
    daemon.start(env={"GPUSWAPD_FAILPOINT_DELAY": ""})
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "recovered"
    # The window had taken the engine over: its close put it back to sleep, the resident is back.
    assert_resident_back_beside_parked(probe)
    assert status["parked"] is not None
    assert daemon.ctl("acquire", "--for", "2m").returncode == 0  # and it wakes and passes the canary
    assert daemon.status()["window"]["start"] == "warm"


def test_keep_expiry_removes_the_parked_engine_and_leaves_the_resident_alone(gpuswapd: Start, probe: Probe) -> None:
    daemon = parking(gpuswapd, park={"keep": "2s"}, window={"watch_interval": "200ms"})
    cycle(daemon)
    resident_since = probe.entered_active_us("strata.service")
    _until(lambda: probe.containers() == [], 15, daemon)
    assert daemon.status()["parked"] is None
    assert probe.entered_active_us("strata.service") == resident_since
    assert_resident_back(probe)


def test_a_parked_engine_that_dies_is_removed_and_the_resident_left_alone(gpuswapd: Start, probe: Probe) -> None:
    daemon = parking(gpuswapd, env={"ENGINE_DEATH_EXIT_DELAY": "0.5"}, window={"watch_interval": "200ms"})
    cycle(daemon)
    resident_since = probe.entered_active_us("strata.service")
    req = urllib.request.Request(f"http://127.0.0.1:{ENGINE_PORT}/sim/die", data=b"{}", method="POST")
    urllib.request.urlopen(req, timeout=5).close()
    _until(lambda: probe.containers() == [], 30, daemon)
    assert daemon.status()["parked"] is None
    assert probe.entered_active_us("strata.service") == resident_since
    assert_resident_back(probe)


def test_a_changed_container_spec_removes_the_parked_engine_at_restart(gpuswapd: Start, probe: Probe) -> None:
    daemon = parking(gpuswapd)
    cycle(daemon)
    daemon.stop()  # on_shutdown = "restore" removes it anyway: keep it for the next start instead
    assert probe.containers() == []
    daemon = parking(gpuswapd, daemon={"on_shutdown": "keep"})
    cycle(daemon)
    daemon.stop()
    assert [c["Names"] for c in probe.containers()] == ["hyperqwen"]
    changed = parking(gpuswapd, env={"ENGINE_MODEL": "hyperqwen", "ENGINE_ANSWER_TOKENS": "13"},
                      daemon={"on_shutdown": "keep", "state_dir": str(daemon.state_dir)})
    assert changed.status()["parked"] is None
    assert probe.containers() == []
    assert [e["reason"] for e in changed.logged("parked_engine_dropped")] == [
        "the container's configuration changed since it was parked"]
    assert_resident_back(probe)


def test_park_remove_on_request(gpuswapd: Start, probe: Probe) -> None:
    daemon = parking(gpuswapd)
    cycle(daemon)
    out = daemon.ctl("park", "--remove")
    assert out.returncode == 0, out.stderr
    assert probe.containers() == []
    assert daemon.status()["next_open"] == "cold"
    again = daemon.ctl("park", "--remove")
    assert again.returncode == 4 and "no engine is parked" in again.stderr


def _until(check: Callable[[], Any], timeout: float, daemon: RunningDaemon) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"did not happen in {timeout}s; log:\n{daemon.tail()}"
        time.sleep(0.1)


def test_check_config_warns_when_the_engine_shows_no_sleep_mode(world: Stack, tmp_path: Any) -> None:
    from tests.stack.config import stack_config
    from tests.stack.daemon import BIN

    config = stack_config(world, "check-config-park", window__park={"mode": "sleep"})
    out = subprocess.run([str(BIN / "gpuswapd"), "--config", str(config), "--check-config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--enable-sleep-mode" in out.stderr and "VLLM_SERVER_DEV_MODE" in out.stderr
