"""Shutdown, preemption and the queue keep their promises, on the real world (issue 23).

A restoring SIGTERM retries a failed start of the resident (and says so when it runs out of time),
a preemption whose request went away takes joins again, a preemptor that could not open is refused
before anyone is told, a released lease hears no later notice, a lost record is never left behind
two SIGKILLs, and an idle gpuswapd brings back a resident that died, but not one its operator stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import TEST_BOOT_DELAY
from tests.integration.conftest import (
    acquire_in_background,
    assert_resident_back,
    assert_restored_and_verified,
    assert_window_open,
    free_port,
    wait_for,
    with_profiles,
)
from tests.stack.config import profile_sections
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import AGENT_TIMERS, RESIDENT_UNITS, Probe
from tests.stack.world import ENGINE_IMAGE, Stack

Start = Callable[..., RunningDaemon]


def _fail_starts(world: Stack, once: bool) -> Path:
    """Make strata's start fail: once (a flag file its ExecStartPre= consumes), or every time."""
    flag = world.paths.control / "strata-fails-once"
    if once:
        flag.touch()
        pre = f"/bin/sh -c 'if [ -e {flag} ]; then rm -f {flag}; exit 1; fi'"
    else:
        pre = "/bin/false"
    world.install_unit("strata.service", None, {"fails.conf": f"[Service]\nExecStartPre={pre}\n"})
    return flag


def test_sigterm_retries_a_resident_that_fails_to_start_and_exits_0_once_it_is_back(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(daemon={"on_shutdown": "restore"})
    assert daemon.ctl("acquire", "--for", "5m").returncode == 0
    flag = _fail_starts(world, once=True)
    daemon.signal(signal.SIGTERM)
    assert daemon.proc is not None and daemon.proc.wait(120) == 0
    assert not flag.exists()  # the first start did fail
    assert len(daemon.logged("restore_failed")) == 1  # and the close tried again, within the bound
    assert_resident_back(probe)  # units, every timer, no container, no out-of-memory
    assert daemon.state_phase() is None


def test_sigterm_whose_bound_runs_out_exits_non_zero_and_leaves_the_window_for_the_next_start(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    # The real bound is 10 minutes (under the units' TimeoutStopSec=11min); a test shortens it.
    daemon = gpuswapd(daemon={"on_shutdown": "restore"}, env={"GPUSWAPD_FAILPOINT_SHUTDOWN_BOUND": "4"})
    assert daemon.ctl("acquire", "--for", "5m").returncode == 0
    _fail_starts(world, once=False)
    daemon.signal(signal.SIGTERM)
    assert daemon.proc is not None and daemon.proc.wait(60) == 1  # the GPU was not given back
    [reached] = daemon.logged("shutdown_bound_reached")
    assert reached["bound_s"] <= 4
    assert [e["given_back"] for e in daemon.logged("gpuswapd_stopped")] == [False]
    assert daemon.state_phase() is not None  # the record stays for the next start
    assert probe.active_state("strata.service") in ("inactive", "failed")
    assert probe.states(list(AGENT_TIMERS)) == dict.fromkeys(AGENT_TIMERS, "inactive")
    world.remove_dropins("strata.service")
    daemon.start(env={"GPUSWAPD_FAILPOINT_SHUTDOWN_BOUND": ""})
    status = assert_restored_and_verified(daemon, probe)  # the next start finishes the restore
    assert status["last"]["outcome"] == "recovered"


def test_a_preemptor_that_hangs_up_during_the_grace_lets_the_window_take_joins_again(
        gpuswapd: Start, probe: Probe) -> None:
    daemon = with_profiles(gpuswapd, probe, daemon={"preempt_grace": "30s"})
    assert daemon.ctl("acquire", "--holder", "chat", "--for", "2m").returncode == 0
    window = daemon.status()["window"]["id"]
    urgent = acquire_in_background(daemon, "--profile", "bare", "--priority", "10", "--holder", "urgent")
    wait_for(lambda: (daemon.status()["window"] or {}).get("preempted") is not None, "the notice")
    early = daemon.ctl("acquire", "--no-wait", "--holder", "early", "--for", "1m")
    assert early.returncode == 5, early.stderr  # a window being preempted takes no joins
    urgent.terminate()  # the preemptor hangs up during the grace
    urgent.wait(30)
    wait_for(lambda: (daemon.status()["window"]["preempted"] or {}).get("abandoned_at") is not None,
             "the preemption to be abandoned")
    late = daemon.ctl("acquire", "--no-wait", "--holder", "late", "--for", "1m")
    assert late.returncode == 0, late.stderr  # it joins the open window again
    status = daemon.status()
    assert status["phase"] == "READY" and status["window"]["id"] == window
    assert sorted(x["holder"] for x in status["window"]["leases"]) == ["chat", "late"]
    assert status["window"]["preempted"]["revoked_at"] is None
    assert [e["reason"] for e in daemon.logged("preemption_abandoned")] == [
        "the request that preempted it is no longer waiting"]
    assert_window_open(probe)
    assert daemon.ctl("release", "--holder", "chat").returncode == 0
    assert daemon.ctl("release", "--holder", "late").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)


def test_a_preemptor_whose_image_was_removed_is_refused_at_once_and_nothing_is_revoked(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    image = "qwen-eval-sim:latest"  # a tag of its own: removing it leaves the default engine's image
    world.docker("tag", ENGINE_IMAGE, image, check=True)
    try:
        profiles = profile_sections(probe.stack)
        profiles["profiles__eval__container"]["image"] = image
        profiles["profiles__eval__container"]["env"]["ENGINE_BOOT_DELAY"] = TEST_BOOT_DELAY
        daemon = gpuswapd(**profiles, daemon={"linger": "1s", "preempt_grace": "30s"})
        assert daemon.ctl("acquire", "--holder", "chat", "--for", "2m").returncode == 0
        window = daemon.status()["window"]["id"]
    finally:
        world.docker("rmi", image, check=True)  # an image prune while gpuswapd runs
    started = time.monotonic()
    urgent = daemon.ctl("acquire", "--profile", "eval", "--priority", "10", "--holder", "urgent", "--for", "1m",
                        timeout=60)
    assert time.monotonic() - started < 20  # at once, not after the 30 s grace
    assert urgent.returncode == 1, urgent.stderr
    # Checked when it asks (the preflight of a request for another profile), before any notice.
    assert f"image {image!r} is not in Docker" in urgent.stderr and f"docker pull {image}" in urgent.stderr
    status = daemon.status()
    assert status["phase"] == "READY" and status["window"]["id"] == window
    assert status["window"]["preempted"] is None  # nobody was told, nothing revoked
    assert [x["holder"] for x in status["window"]["leases"]] == ["chat"]
    assert status["queue"] == []
    assert_window_open(probe)
    # A request that would only queue for it is refused at once too, not after the window closed.
    queued = daemon.ctl("acquire", "--profile", "eval", "--holder", "later", "--for", "1m", timeout=60)
    assert queued.returncode == 1 and f"image {image!r} is not in Docker" in queued.stderr
    assert daemon.status()["queue"] == []
    assert daemon.ctl("release", "--holder", "chat").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)


def test_a_run_whose_lease_was_released_hears_no_later_window_s_notice(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = with_profiles(gpuswapd, probe, daemon={"preempt_grace": "1s"})
    signalled = world.paths.control / "runner.signalled"
    command = f"trap 'touch {signalled}; exit 143' TERM; while :; do sleep 0.1; done"
    runner = subprocess.Popen([str(BIN / "gpuswapctl"), "run", "--for", "2m", "--holder", "runner", "--", "sh", "-c",
                               command], env=daemon.env, text=True, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: bool((daemon.status()["window"] or {}).get("leases")), "the run's lease", timeout=90)
        [lease] = daemon.status()["window"]["leases"]
        assert daemon.ctl("release", lease["id"]).returncode == 0  # root ends it behind run's back
        daemon.wait_phase("IDLE", timeout=90)
        # A later window, preempted: its holders are told; the old run must not be.
        assert daemon.ctl("acquire", "--holder", "chat", "--for", "2m").returncode == 0
        urgent = daemon.ctl("acquire", "--profile", "bare", "--priority", "10", "--holder", "urgent", "--for", "1m")
        assert urgent.returncode == 0, urgent.stderr
        assert daemon.ctl_json("history", "--limit", "1")["windows"][-1]["preempted"]["by"] == "urgent"
        assert not signalled.exists()
        assert runner.poll() is None  # its command still runs, untouched
        assert daemon.ctl("release", "--holder", "urgent").returncode == 0
        daemon.wait_phase("IDLE", timeout=90)
    finally:
        runner.terminate()
        _, err = runner.communicate(timeout=30)
    assert "preempted by" not in err
    assert_resident_back(probe)


def test_two_sigkills_just_after_an_adoption_bring_the_resident_and_timers_back(
        gpuswapd: Start, probe: Probe) -> None:
    daemon = with_profiles(gpuswapd, probe)
    assert daemon.ctl("acquire", "--holder", "chat", "--for", "5m").returncode == 0
    window = daemon.status()["window"]["id"]
    queued = acquire_in_background(daemon, "--profile", "eval", "--holder", "eval", "--for", "2m")
    wait_for(lambda: len(daemon.status()["queue"]) == 1, "eval to queue")
    daemon.kill()
    queued.kill()  # its client is gone too: nobody reclaims its place
    queued.wait(30)
    daemon.start()
    status = daemon.wait_phase("READY", timeout=60)  # adopted; the queue's request was not reclaimed
    assert status["window"]["id"] == window and status["queue"] == []
    wait_for(lambda: bool(daemon.logged("window_adopted")), "the adoption")
    time.sleep(3)
    daemon.kill()  # a few seconds later, again
    daemon.start()
    status = daemon.wait_phase("READY", timeout=60)
    assert status["window"]["id"] == window  # the record survived both
    assert [x["holder"] for x in status["window"]["leases"]] == ["chat"]
    assert daemon.logged("orphan_engine_removed") == []
    assert_window_open(probe)
    assert daemon.ctl("release", "--holder", "chat").returncode == 0
    status = assert_restored_and_verified(daemon, probe)  # the resident and all seven timers are back
    assert status["last"]["id"] == window and status["last"]["outcome"] == "closed"


def _metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in wanted))


def _state(daemon: RunningDaemon) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((daemon.state_dir / "state.json").read_text())
    return document


def _held_down(daemon: RunningDaemon) -> dict[str, Any]:
    """The holds in the state document; none while gpuswapd has not written one yet (a loaded machine)."""
    if not (daemon.state_dir / "state.json").exists():  # written by a rename: never there half-written
        return {}
    held: dict[str, Any] = _state(daemon).get("held_down", {})
    return held


def test_a_resident_that_dies_while_idle_is_brought_back_within_reconcile(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    port = free_port()
    daemon = gpuswapd(daemon={"reconcile": "1s"}, metrics={"listen": f"127.0.0.1:{port}"})
    since = probe.entered_active_us("strata.service")
    strata = next(h["pid"] for h in world.ledger()["holders"] if h["name"] == "strata" and h["dead_at"] is None)
    os.kill(strata, signal.SIGKILL)  # behind gpuswapd's back: no job of its, no window; strata fails
    wait_for(lambda: probe.entered_active_us("strata.service") > since, "the reconcile to start it", timeout=60)
    status = daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)
    assert status["baseline_restore"]["cause"] == "found_down"
    assert "strata.service failed" in status["baseline_restore"]["reason"]
    assert [e["cause"] for e in daemon.logged("baseline_restore")] == ["found_down"]
    assert _metric(port, "gpuswapd_baseline_restores_total", cause="found_down") == 1
    assert daemon.logged("resident_held_down") == []


def test_an_operators_stop_while_idle_is_left_alone_until_they_start_it_again(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(daemon={"reconcile": "1s"})
    world.manager("StopUnit", "ss", "strata.service", "replace")  # systemctl stop strata
    wait_for(lambda: probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive"),
             "strata and llama-swap to stop")
    wait_for(lambda: "strata.service" in _held_down(daemon), "the hold, in the state")
    time.sleep(3.5)  # three reconciles and more
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")  # left down
    assert daemon.logged("baseline_restore") == []
    assert [e["unit"] for e in daemon.logged("resident_held_down")] == ["strata.service"]
    assert daemon.status()["phase"] == "IDLE"
    # The hold outlives a restart of gpuswapd: it is in the state document.
    daemon.kill()
    daemon.start()
    time.sleep(2.5)
    assert probe.active_state("strata.service") == "inactive" and daemon.logged("baseline_restore") == []
    world.manager("StartUnit", "ss", "llama-swap.service", "replace")  # systemctl start llama-swap (and strata)
    wait_for(lambda: probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "active"), "the start")
    wait_for(lambda: "held_down" not in _state(daemon), "the hold to be lifted")
    assert [e["unit"] for e in daemon.logged("resident_hold_lifted")] == ["strata.service"]
    time.sleep(1.5)
    assert daemon.logged("baseline_restore") == []
    assert_resident_back(probe)
