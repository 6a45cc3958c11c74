"""The schedule on the real world: a restart of gpuswapd is a pause for its clients, a retry rejoins a boot.

gpuswapd runs socket-activated under the world's systemd and is killed with SIGKILL while a
``gpuswapctl run`` holds the card and six ``gpuswapctl acquire`` wait for another profile: none
exits 3, the run's command is never signalled, every acquire is served. A client whose timeout
is shorter than the boot retries, and its third try is served by the one window that kept booting.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import TEST_BOOT_DELAY
from tests.integration.conftest import assert_resident_back, wait_for, wait_state, with_profiles
from tests.stack.config import ENGINE_ENV, profile_sections, stack_config
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import Probe
from tests.stack.world import Stack

SERVICE = "gpuswapd-schedule.service"
Start = Callable[..., RunningDaemon]


def _activated(world: Stack, probe: Probe, **sections: dict[str, Any]) -> RunningDaemon:
    """Install gpuswapd as a socket-activated service of the world's systemd (Restart= as shipped)."""
    home = world.paths.root / "gpuswapd" / "schedule"
    home.mkdir(parents=True, exist_ok=True)
    config = stack_config(world, "schedule", **sections)
    sock = home / "activated.sock"
    env = world.env()
    world.install_unit("gpuswapd-schedule.socket",
                       f"[Unit]\nDefaultDependencies=no\n[Socket]\nListenStream={sock}\nSocketMode=0660\n")
    world.install_unit(
        SERVICE,
        f"[Unit]\nDefaultDependencies=no\n[Service]\nType=notify\nRestart=on-failure\nRestartSec=1\n"
        f"ExecStart={BIN}/gpuswapd --config {config}\n"
        f"Environment=DOCKER_HOST={env['DOCKER_HOST']} PATH={env['PATH']}\n"
        f"StandardOutput=append:{home}/gpuswapd.log\nStandardError=inherit\n",
    )
    world.manager("StartUnit", "ss", "gpuswapd-schedule.socket", "replace")
    wait_state(probe, "gpuswapd-schedule.socket", {"active"})
    return RunningDaemon(world, config, sock)


def _stop(world: Stack, probe: Probe) -> None:
    for unit in ("gpuswapd-schedule.socket", SERVICE):
        world.manager("StopUnit", "ss", unit, "replace")
        wait_state(probe, unit, {"inactive", "failed"})


def _ctl(daemon: RunningDaemon, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(BIN / "gpuswapctl"), *args], env=daemon.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sigkill_and_restart_with_six_acquires_waiting_and_a_run_holding_is_a_pause(
        world: Stack, probe: Probe, tmp_path: Path) -> None:
    daemon = _activated(world, probe, **profile_sections(world), daemon={"linger": "0.3s", "fair_after": "10m"},
                        window__container={"env": {**ENGINE_ENV, "ENGINE_BOOT_DELAY": TEST_BOOT_DELAY}})
    try:
        marks = tmp_path / "run.log"
        script = (f"trap 'echo SIGNALLED >> {marks}' TERM INT HUP; echo started >> {marks}; "
                  f"while [ ! -e {tmp_path}/go ]; do sleep 0.2; done; echo done >> {marks}")
        run = _ctl(daemon, "run", "--for", "20s", "--holder", "runner", "--", "sh", "-c", script)
        wait_for(lambda: marks.exists(), "the run's command to start", 120)
        lease = daemon.status()["window"]["leases"][0]
        waiting = [_ctl(daemon, "acquire", "--profile", "bare", "--for", "5m", "--holder", f"w{i}") for i in range(6)]
        wait_for(lambda: daemon.status()["schedule"]["queue"] == {"bare": 6}, "six requests to wait", 60)
        before = daemon.status()
        killed = int(probe.prop(SERVICE, "MainPID", "org.freedesktop.systemd1.Service"))  # in the world's pid space
        world.manager("KillUnit", "ssi", SERVICE, "main", str(int(signal.SIGKILL)))
        # Restart= brings it back (or the clients' connections start it): it adopts the window.
        wait_for(lambda: int(probe.prop(SERVICE, "MainPID", "org.freedesktop.systemd1.Service")) not in (0, killed),
                 "gpuswapd to be started again", 60)
        wait_for(lambda: daemon.status()["schedule"]["queue"] == {"bare": 6}, "the six to reclaim their places", 60)
        after = daemon.status()
        assert after["window"]["id"] == before["window"]["id"]  # adopted, not closed
        [kept] = after["window"]["leases"]
        assert kept["id"] == lease["id"] and kept.get("reclaim_by") is None  # the run reclaimed its own lease
        waited = {q["holder"]: q["waited_s"] for q in after["queue"]}
        assert min(waited.values()) >= min(q["waited_s"] for q in before["queue"])  # they kept their places
        assert all(p.poll() is None for p in [run, *waiting])  # nobody exited
        (tmp_path / "go").touch()
        assert run.wait(60) == 0, run.stderr.read() if run.stderr else ""
        codes = [p.wait(120) for p in waiting]
        errors = [p.stderr.read() if p.stderr else "" for p in waiting]
        assert codes == [0] * 6, (codes, errors)
        assert marks.read_text().split() == ["started", "done"]  # never signalled
        assert daemon.status()["window"]["profile"] == "bare"
        for i in range(6):
            assert daemon.ctl("release", "--holder", f"w{i}").returncode == 0
        daemon.wait_phase("IDLE", timeout=90)
        assert_resident_back(probe)
    finally:
        _stop(world, probe)


def test_a_client_that_hangs_up_during_boot_and_retries_rejoins_the_same_boot(world: Stack, probe: Probe) -> None:
    daemon = _activated(world, probe, daemon={"abandon_grace": "30s"},
                        window__container={"env": {**ENGINE_ENV, "ENGINE_BOOT_DELAY": "8"}})
    try:
        codes, windows = [], set()
        started = time.monotonic()
        for _ in range(4):
            out = daemon.ctl("acquire", "--for", "1m", "--holder", "impatient", "--timeout", "4s", "--json")
            codes.append(out.returncode)
            window = daemon.status()["window"]
            windows.add(window["id"] if window else None)
            if out.returncode == 0:
                break
        assert codes[-1] == 0 and len(codes) <= 3 and set(codes[:-1]) <= {6}, codes  # served by its third try
        assert len(windows) == 1, windows  # one window, never rolled back and opened again
        assert time.monotonic() - started < 60
        assert daemon.ctl("release", "--holder", "impatient").returncode == 0
        status = daemon.wait_phase("IDLE", timeout=90)
        assert status["last"]["outcome"] == "closed"
        assert_resident_back(probe)
    finally:
        _stop(world, probe)



def test_the_tenant_keeps_the_card_for_its_requests_until_another_has_waited_its_share(
        gpuswapd: Start, probe: Probe) -> None:
    # A share of 20 s whatever the price (residency_factor = 0): fair_after alone, long enough for
    # a loaded machine's gpuswapctl to join within it.
    daemon = with_profiles(gpuswapd, probe, daemon={"fair_after": "20s", "residency_factor": 0})
    first = daemon.ctl_json("acquire", "--holder", "agent-1", "--for", "3m")["lease"]
    window = daemon.status()["window"]["id"]
    other = _ctl(daemon, "acquire", "--profile", "eval", "--holder", "eval", "--for", "1m")
    wait_for(lambda: daemon.status()["schedule"]["queue"] == {"eval": 1}, "eval to queue")
    # Within eval's share, the tenant's next request joins the card: no swap.
    assert daemon.ctl("acquire", "--holder", "agent-2", "--for", "3m").returncode == 0
    status = daemon.status()
    assert status["window"]["id"] == window and status["schedule"]["swaps_avoided"] == 1
    assert status["schedule"]["tenant"] == "default" and status["schedule"]["next"] == "eval"
    wait_for(lambda: daemon.status()["schedule"]["residency_left_s"] == 0, "eval's share to pass", 60)
    # Past it, new requests for the tenant queue behind eval, and a renewal cannot outlast the claim.
    late = _ctl(daemon, "acquire", "--holder", "agent-3", "--for", "30s")
    wait_for(lambda: [q["holder"] for q in daemon.status()["queue"]] == ["eval", "agent-3"], "agent-3 to queue")
    renewed = daemon.ctl_json("renew", "--holder", "agent-1", "--for", "1h")
    assert renewed["capped_by"] == "fair_after" and renewed["lease"]["expires_at"] == first["expires_at"]
    for holder in ("agent-1", "agent-2"):  # the requests in flight finish; then the card moves
        assert daemon.ctl("release", "--holder", holder).returncode == 0
    assert other.wait(60) == 0, other.stderr.read() if other.stderr else ""
    assert daemon.status()["window"]["profile"] == "eval" and late.poll() is None
    assert daemon.ctl("release", "--holder", "eval").returncode == 0
    assert late.wait(60) == 0
    assert daemon.status()["window"]["profile"] == "default"
    assert daemon.ctl("release", "--holder", "agent-3").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)
