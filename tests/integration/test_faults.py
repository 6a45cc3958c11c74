"""Nothing lost under faults: crashes in every phase, engine death, Docker dying, SIGTERM, broken restores."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Callable

import pytest

from tests.integration.conftest import (
    acquire_in_background,
    assert_resident_back,
    assert_restored_and_verified,
    assert_window_open,
    metric,
    pauses_then_gives_up,
    wait_persisted,
)
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import AGENT_TIMERS, Probe
from tests.stack.world import ENGINE_PORT, Stack

Start = Callable[..., RunningDaemon]


OPENING = ["DRAINING", "PAUSING_TIMERS", "STOPPING_RESIDENT", "WAITING_VRAM", "BOOTING", "WARMING"]
CLOSING = ["CLOSING", "WAITING_VRAM:closing", "RESTORING:closing", "RESUMING_TIMERS:closing"]


@pytest.mark.parametrize("phase", OPENING)
def test_sigkill_while_opening_rolls_back_to_the_resident(gpuswapd: Start, probe: Probe, phase: str) -> None:
    daemon = gpuswapd(env={"GPUSWAPD_FAILPOINT_DELAY": f"{phase}=60"})
    client = acquire_in_background(daemon, "--for", "2m")
    wait_persisted(daemon, phase)
    daemon.kill()
    pauses_then_gives_up(client)
    daemon.start(env={"GPUSWAPD_FAILPOINT_DELAY": ""})
    if OPENING.index(phase) < OPENING.index("STOPPING_RESIDENT"):
        # The resident was never stopped: the roll-back starts nothing and has nothing to verify.
        status = daemon.wait_phase("IDLE", timeout=90)
        assert_resident_back(probe)
    else:
        status = assert_restored_and_verified(daemon, probe)
    assert status["last"]["outcome"] == "recovered"


@pytest.mark.parametrize("phase", CLOSING)
def test_sigkill_while_closing_finishes_the_close(gpuswapd: Start, probe: Probe, phase: str) -> None:
    daemon = gpuswapd(env={"GPUSWAPD_FAILPOINT_DELAY": f"{phase}=60"})
    assert daemon.ctl("acquire", "--for", "2m").returncode == 0
    assert daemon.ctl("release").returncode == 0
    wait_persisted(daemon, phase.split(":")[0])
    daemon.kill()
    daemon.start(env={"GPUSWAPD_FAILPOINT_DELAY": ""})
    status = assert_restored_and_verified(daemon, probe)
    assert status["last"]["outcome"] == "recovered"


def test_sigkill_while_ready_with_a_live_lease_is_adopted(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd()
    lease = daemon.ctl_json("acquire", "--for", "5m", "--holder", "survivor")["lease"]
    daemon.kill()
    daemon.start()
    status = daemon.status()
    assert status["phase"] == "READY"
    assert [x["id"] for x in status["window"]["leases"]] == [lease["id"]]
    assert_window_open(probe)
    assert daemon.ctl("release", lease["id"]).returncode == 0
    assert_restored_and_verified(daemon, probe)


def test_sigkill_while_ready_after_the_lease_ran_out_rolls_back(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(daemon={"linger": "1m"})
    lease = daemon.ctl_json("acquire", "--for", "1s")["lease"]
    while time.time() < lease["expires_at"] + 0.2:
        time.sleep(0.05)
    daemon.kill()
    daemon.start()
    assert assert_restored_and_verified(daemon, probe)["last"]["outcome"] == "recovered"


def _die(failing_boots: int) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{ENGINE_PORT}/sim/die",
                                 data=json.dumps({"failing_boots": failing_boots}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()


@pytest.mark.parametrize("heals_after", [1, 2])
def test_engine_death_heals_within_max_restarts(gpuswapd: Start, probe: Probe, heals_after: int) -> None:
    daemon = gpuswapd(window={"watch_interval": "300ms", "max_restarts": 2})
    lease = daemon.ctl_json("acquire", "--for", "5m")["lease"]
    _die(heals_after - 1)
    daemon.wait_phase("RECOVERING", timeout=20)
    deadline = time.monotonic() + 90
    while (status := daemon.status())["phase"] != "READY" or status["window"]["restarts"] < heals_after:
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    time.sleep(1.5)  # the healed engine stays healthy past ENGINE_DEAD_AFTER
    status = daemon.status()
    assert status["phase"] == "READY" and status["window"]["restarts"] == heals_after
    assert [x["id"] for x in status["window"]["leases"]] == [lease["id"]]
    assert_window_open(probe)


def test_engine_death_beyond_max_restarts_gives_the_gpu_back(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(window={"watch_interval": "300ms", "max_restarts": 2},
                      window__container={"env": {"PORT": "18020", "GPUSIM_DIR": "/gpu", "ENGINE_VRAM": "19.5GiB",
                                                 "ENGINE_BOOT_DELAY": "1.0", "ENGINE_DEAD_AFTER": "0.1"}})
    daemon.ctl_json("acquire", "--for", "5m")
    _die(2)  # heals only after 3 restarts
    daemon.wait_phase("RECOVERING", timeout=20)
    waiting = acquire_in_background(daemon, "--for", "1m")
    status = assert_restored_and_verified(daemon, probe)
    assert status["last"]["outcome"] == "engine_failed"
    assert "2 restart(s) did not bring it back" in status["last"]["error"]["message"]
    _, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 1 and "did not bring it back" in err
    renew = daemon.ctl("renew", "--for", "1m")
    assert renew.returncode == 4 and "did not bring it back" in renew.stderr


def test_docker_dying_mid_window_gives_the_gpu_back(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(window={"watch_interval": "300ms", "max_restarts": 1})
    assert daemon.ctl("acquire", "--for", "5m").returncode == 0
    world.stop_dockerd()
    try:
        # Docker took the engine down with itself: the resident and the timers come back at once...
        deadline = time.monotonic() + 120
        while (status := daemon.status())["window"] is None or not status["window"]["degraded"]:
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert "could not be removed yet" in status["window"]["degraded"]
        assert probe.states(["strata.service", "llama-swap.service"]) == {
            "strata.service": "active", "llama-swap.service": "active"}
        assert set(probe.states(list(AGENT_TIMERS)).values()) == {"active"}
        assert metric("llamacpp:tokens_predicted_total") > 0
        assert world.ooms() == []
        # ...but the window is not over while its container is left: a new one is refused, clearly.
        refused = daemon.ctl("acquire", "--for", "1m")
        assert refused.returncode == 1 and "could not be removed yet" in refused.stderr
    finally:
        world.start_dockerd()
    status = daemon.wait_phase("IDLE", timeout=120)
    assert status["last"]["outcome"] == "engine_failed"
    assert probe.containers() == []  # removed as soon as Docker was back
    assert daemon.ctl("acquire", "--for", "1m").returncode == 0
    assert [(c["Names"], c["State"]) for c in probe.containers()] == [("hyperqwen", "running")]


def test_docker_unreachable_at_acquire_stops_nothing(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(env={"DOCKER_HOST": "unix:///var/tmp/gpuswapd-no-docker.sock"})
    out = daemon.ctl("acquire", "--for", "1m")
    assert out.returncode == 1
    assert "Docker is not answering at unix:///var/tmp/gpuswapd-no-docker.sock" in out.stderr
    assert_resident_back(probe)
    assert daemon.status()["last"]["outcome"] == "refused"


def test_gpu_probe_failing_at_acquire_stops_nothing(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd()
    (world.paths.gpu / "nvidia-smi.fail").write_text(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    out = daemon.ctl("acquire", "--for", "1m")
    assert out.returncode == 1 and "couldn't communicate with the NVIDIA driver" in out.stderr
    assert_resident_back(probe)


def test_port_taken_at_acquire_stops_nothing(gpuswapd: Start, probe: Probe) -> None:
    import socket

    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", ENGINE_PORT))
    squatter.listen()
    try:
        daemon = gpuswapd()
        out = daemon.ctl("acquire", "--for", "1m")
    finally:
        squatter.close()
    assert out.returncode == 1 and f"port {ENGINE_PORT}" in out.stderr and "already in use" in out.stderr
    assert_resident_back(probe)


def test_sigterm_with_restore_gives_the_gpu_back_before_exiting(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(daemon={"on_shutdown": "restore"})
    assert daemon.ctl("acquire", "--for", "5m").returncode == 0
    daemon.signal(signal.SIGTERM)
    assert daemon.proc is not None and daemon.proc.wait(120) == 0
    assert_resident_back(probe)
    assert metric("llamacpp:tokens_predicted_total") > 0
    assert daemon.state_phase() is None  # nothing left to undo


def test_sigterm_with_keep_leaves_the_window_for_the_next_start(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(daemon={"on_shutdown": "keep"})
    lease = daemon.ctl_json("acquire", "--for", "5m")["lease"]
    daemon.signal(signal.SIGTERM)
    assert daemon.proc is not None and daemon.proc.wait(30) == 0
    assert_window_open(probe)
    assert daemon.state_phase() == "READY"
    daemon.start()
    assert [x["id"] for x in daemon.status()["window"]["leases"]] == [lease["id"]]
    daemon.ctl("release", lease["id"])
    assert_restored_and_verified(daemon, probe)


def test_a_resident_that_fails_to_start_is_retried_and_timers_wait(gpuswapd: Start, probe: Probe,
                                                                    world: Stack) -> None:
    daemon = gpuswapd()
    assert daemon.ctl("acquire", "--for", "5m").returncode == 0
    world.install_unit("strata.service", None, {"broken.conf": "[Service]\nExecStartPre=/bin/false\n"})
    daemon.ctl("release")
    deadline = time.monotonic() + 30
    while (status := daemon.status())["window"] is None or not status["window"]["degraded"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    assert status["phase"] in ("DEGRADED", "RESTORING")
    assert "strata.service" in status["window"]["degraded"]
    assert probe.states(["agent-triage.timer"]) == {"agent-triage.timer": "inactive"}  # not while down
    daemon.kill()  # the record survives a restart while degraded
    daemon.start()
    time.sleep(1.0)
    assert daemon.status()["window"]["degraded"]
    world.remove_dropins("strata.service")
    status = assert_restored_and_verified(daemon, probe)
    assert status["last"]["outcome"] == "recovered"


def test_an_engine_no_record_knows_is_removed_at_start(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd()
    assert daemon.ctl("acquire", "--for", "5m").returncode == 0
    daemon.kill()
    for name in ("state.json", "state.prev.json"):
        (daemon.state_dir / name).unlink()  # the record is lost (a wiped state directory)
    assert [c["State"] for c in probe.containers()] == ["running"]
    daemon.start()
    # Nobody knows what that window stopped: the configuration's baseline comes back, which takes
    # gpuswapd's own container (of a window nobody knows) down on the way.
    status = assert_restored_and_verified(daemon, probe)  # IDLE, the resident and timers up, no container
    assert status["baseline_restore"]["cause"] == "lost_record"
    assert status["last"]["outcome"] == "baseline_restored"
    assert status["last"]["baseline"]["cause"] == "lost_record"
    assert [e["cause"] for e in daemon.logged("baseline_restore")] == ["lost_record"]
