"""The operator's word is final, on the real systemd (issue 34).

gpuswapd starts a unit or a timer only to undo its own stop. A resident its operator stopped
(even while gpuswapd was down), one whose stop ended ``failed``, a masked one, and one that
crashed under ``Restart=on-failure`` are systemd's and the operator's: gpuswapd reports them and
starts nothing. What gpuswapd did stop is recorded a second time under its runtime directory,
so that a torn state document still brings back exactly that.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.integration.conftest import free_port, wait_for, with_profiles
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import AGENT_TIMERS, RESIDENT_UNITS, Probe
from tests.stack.world import Stack

Start = Callable[..., RunningDaemon]
RECONCILE = {"reconcile": "1s"}
TWO_PERIODS_S = 2.5  # two reconciles of 1 s, and some


def _metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in wanted))


def _down(daemon: RunningDaemon) -> dict[str, str]:
    down: dict[str, str] = daemon.status()["resident_down"]
    return down


def _started_nothing(daemon: RunningDaemon) -> None:
    """gpuswapd queued no start of a unit or timer, and restored no baseline."""
    assert daemon.logged("units_started") == [] and daemon.logged("timers_resumed") == []
    assert daemon.logged("baseline_restore") == []


def _marks(daemon: RunningDaemon) -> list[str]:
    d = Path(daemon.socket).parent / "default.stopped"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_an_operators_stop_while_gpuswapd_is_down_stands_through_reconciles_and_a_restart(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    port = free_port()
    daemon = gpuswapd(daemon=RECONCILE, metrics={"listen": f"127.0.0.1:{port}"})
    daemon.kill()  # an upgrade, the Restart= gap: nobody watches
    world.manager("StopUnit", "ss", "strata.service", "replace")  # systemctl stop strata
    wait_for(lambda: probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive"),
             "strata and llama-swap to stop")
    for _ in range(2):  # two starts of gpuswapd, each watching two reconcile periods
        daemon.start()
        wait_for(lambda: _down(daemon) == {"strata.service": "stopped"}, "status to report it down", timeout=20)
        time.sleep(TWO_PERIODS_S)
        assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
        assert _metric(port, "gpuswapd_resident_down", unit="strata.service", cause="stopped") == 1
        daemon.kill()
    daemon.start()
    _started_nothing(daemon)
    assert [e["cause"] for e in daemon.logged("resident_down")] == ["stopped"] * 3
    # Not held against the card: a window opens and closes, and leaves the resident as it found it.
    assert daemon.ctl("acquire", "--for", "5m", "--holder", "job").returncode == 0
    assert daemon.ctl("release", "--holder", "job").returncode == 0
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "closed" and status["last"]["units"] == []
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    assert probe.states(list(AGENT_TIMERS)) == dict.fromkeys(AGENT_TIMERS, "active")  # its own pause, undone
    assert daemon.logged("units_started") == [] and _marks(daemon) == []
    # Its operator starts it again once the card is free: with no resident to restore, the close
    # does not wait out the engine's release lag, and llama-server started into the engine's
    # memory still being freed fails (out of memory).
    wait_for(lambda: world.ledger()["holders"] == [], "the engine's memory to come free", timeout=30)
    world.manager("StartUnit", "ss", "llama-swap.service", "replace")
    wait_for(lambda: _down(daemon) == {}, "the report to clear", timeout=20)


def test_a_stop_that_ends_failed_and_a_mask_are_left_as_they_are(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    # A wrapper that exits non-zero on its stop: systemctl stop leaves the unit failed.
    world.install_unit("strata.service", None, {"stop-fails.conf": "[Service]\nExecStopPost=/bin/false\n"})
    daemon = gpuswapd(daemon=RECONCILE)
    since = probe.entered_active_us("strata.service")
    world.manager("StopUnit", "ss", "strata.service", "replace")
    wait_for(lambda: probe.active_state("strata.service") == "failed", "strata to end failed")
    wait_for(lambda: _down(daemon).get("strata.service") == "failed", "status to report it failed", timeout=20)
    time.sleep(TWO_PERIODS_S)
    assert probe.active_state("strata.service") == "failed"
    # systemctl mask strata: its unit file is /dev/null (this world's systemd reads only its own unit directory).
    unit_file = world.paths.units / "strata.service"
    original = unit_file.read_bytes()
    try:
        unit_file.unlink()
        unit_file.symlink_to("/dev/null")
        world.manager("Reload")
        wait_for(lambda: probe.prop("strata.service", "LoadState") == "masked", "strata to be masked")
        wait_for(lambda: _down(daemon).get("strata.service") == "masked", "status to report it masked", timeout=20)
        time.sleep(TWO_PERIODS_S)
        assert probe.entered_active_us("strata.service") == since  # never started again
        _started_nothing(daemon)
        assert daemon.status()["phase"] == "IDLE" and daemon.logged("restore_failed") == []
    finally:
        unit_file.unlink(missing_ok=True)
        unit_file.write_bytes(original)
        world.manager("Reload")


def test_a_crash_under_restart_on_failure_is_systemds_to_undo(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    world.install_unit("strata.service", None, {"restart.conf": "[Service]\nRestart=on-failure\nRestartSec=1s\n"})
    daemon = gpuswapd(daemon=RECONCILE)
    since = probe.entered_active_us("strata.service")
    strata = next(h["pid"] for h in world.ledger()["holders"] if h["name"] == "strata" and h["dead_at"] is None)
    os.kill(strata, signal.SIGKILL)  # it crashes: no job of gpuswapd's, no window
    wait_for(lambda: probe.entered_active_us("strata.service") > since, "systemd to restart it", timeout=60)
    assert int(probe.prop("strata.service", "NRestarts", "org.freedesktop.systemd1.Service")) >= 1
    time.sleep(TWO_PERIODS_S)
    _started_nothing(daemon)
    assert probe.active_state("strata.service") == "active"


def test_a_resident_in_its_start_limit_is_reported_and_not_started_even_with_restart_crashed(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    # One start per two minutes: its operator's second start within them hits the limit.
    world.install_unit("strata.service", None, {"limit.conf": "[Unit]\nStartLimitIntervalSec=120\n"
                                                "StartLimitBurst=1\n"})
    world.manager("ResetFailedUnit", "s", "strata.service")  # the world's own starts of it no longer count
    for _ in range(2):  # systemctl restart strata, twice: the second start is refused
        world.manager("StopUnit", "ss", "strata.service", "replace")
        wait_for(lambda: probe.active_state("strata.service") in ("inactive", "failed"), "strata to stop")
        world.manager("StartUnit", "ss", "strata.service", "replace", check=False)
    wait_for(lambda: probe.prop("strata.service", "Result", "org.freedesktop.systemd1.Service") == "start-limit-hit",
             "strata to end in its start limit", timeout=30)
    port = free_port()
    daemon = gpuswapd(daemon=RECONCILE, resident={"restart_crashed": True},
                      metrics={"listen": f"127.0.0.1:{port}"})
    wait_for(lambda: "strata.service" in _down(daemon), "status to report it down", timeout=20)
    time.sleep(TWO_PERIODS_S)
    assert probe.active_state("strata.service") == "failed"
    assert daemon.logged("resident_restarting_crashed") == [] and daemon.logged("units_started") == []
    assert _down(daemon) == {"strata.service": "start_limit"}
    assert _metric(port, "gpuswapd_resident_down", unit="strata.service", cause="start_limit") == 1
    said = [e for e in daemon.logged("resident_down") if e.get("cause") == "start_limit"]
    assert said and "systemctl reset-failed strata.service" in said[0]["consequence"], said


def test_a_resident_its_operator_stops_while_its_restore_retries_in_degraded_is_left_to_them(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    # The resident starts, but its verifying completion names a model nobody serves: every restore
    # fails, and gpuswapd retries in DEGRADED with the resident up.
    daemon = gpuswapd(daemon=RECONCILE, resident__verify={"model": "not-served"})
    assert daemon.ctl("acquire", "--for", "5m", "--holder", "job").returncode == 0
    assert daemon.ctl("release", "--holder", "job").returncode == 0
    daemon.wait_phase("DEGRADED", timeout=90)
    wait_for(lambda: probe.active_state("strata.service") == "active", "the restore to start strata")
    world.manager("StopUnit", "ss", "strata.service", "replace")  # systemctl stop strata: to mend it
    status = daemon.wait_phase("IDLE", timeout=60)
    assert status["last"]["outcome"] == "closed" and status["last"]["units"] == [], status["last"]
    assert daemon.logged("resident_left_stopped")
    time.sleep(TWO_PERIODS_S)
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    assert probe.states(list(AGENT_TIMERS)) == dict.fromkeys(AGENT_TIMERS, "active")  # its own pause, undone
    assert _down(daemon) == {"strata.service": "stopped"} and _marks(daemon) == []
    # Not held against the card: the next window opens and closes, and starts nothing of the resident.
    started = len(daemon.logged("units_started"))
    assert daemon.ctl("acquire", "--for", "5m", "--holder", "next").returncode == 0
    assert daemon.ctl("release", "--holder", "next").returncode == 0
    assert daemon.wait_phase("IDLE", timeout=90)["last"]["outcome"] == "closed"
    assert len(daemon.logged("units_started")) == started
    assert probe.active_state("strata.service") == "inactive"


def test_a_torn_state_after_a_bare_window_brings_back_exactly_what_gpuswapd_stopped(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = with_profiles(gpuswapd, probe, daemon=RECONCILE)
    off = AGENT_TIMERS[0]
    world.manager("StopUnit", "ss", off, "replace")  # its operator's: gpuswapd never starts it
    wait_for(lambda: probe.active_state(off) == "inactive", f"{off} to stop")
    assert daemon.ctl("acquire", "--profile", "bare", "--for", "5m", "--holder", "train").returncode == 0
    paused = sorted(AGENT_TIMERS[1:])
    assert _marks(daemon) == sorted([*RESIDENT_UNITS, *paused])  # recorded beside the socket, before the stop
    daemon.kill()
    for name in ("state.json", "state.prev.json"):  # every copy torn; a bare window has no container to tell
        (daemon.state_dir / name).write_bytes(b'{"version": 2, "seq": 7, "window": {"phase": "REA')
    daemon.start()
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "baseline_restored"
    assert status["baseline_restore"]["cause"] == "state_unreadable"
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "active")
    assert probe.states(paused) == dict.fromkeys(paused, "active")
    assert probe.active_state(off) == "inactive"
    assert _marks(daemon) == []
    assert world.ooms() == []
