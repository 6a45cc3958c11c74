"""Leases that fit systemd: consumer units with the shipped drop-in, run, socket activation, who may ask."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable

from tests.integration.conftest import (
    DROPIN,
    as_nobody,
    assert_resident_back,
    assert_window_open,
    consumer,
    ctl_for_anyone,
    wait_state,
)
from tests.stack.config import stack_config
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import Probe
from tests.stack.users import GROUP, STRANGER, User
from tests.stack.world import Stack

Start = Callable[..., RunningDaemon]


def test_consumer_unit_holds_the_window_from_exec_start_pre_until_it_stops(
    gpuswapd: Start, probe: Probe, world: Stack
) -> None:
    daemon = gpuswapd()
    seen = world.paths.control / "consumer.status"
    consumer(
        world, daemon, "consumer.service", f"/bin/sh -c '{BIN}/gpuswapctl status --json > {seen}; exec sleep 300'"
    )
    world.manager("StartUnit", "ss", "consumer.service", "replace")
    wait_state(probe, "consumer.service", {"active"})
    deadline = time.monotonic() + 10
    while not seen.exists() or not seen.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    at_exec_start = json.loads(seen.read_text())
    assert at_exec_start["phase"] == "READY"  # the window was open before ExecStart= ran
    [lease] = at_exec_start["window"]["leases"]
    assert lease["holder"] == "consumer.service" and lease["unit"] == "consumer.service"
    assert_window_open(probe)
    world.manager("StopUnit", "ss", "consumer.service", "replace")
    status = daemon.wait_phase("IDLE", timeout=60)
    assert status["last"]["outcome"] == "closed"
    assert_resident_back(probe)


def test_a_service_with_user_may_acquire_through_the_drop_ins_group_and_not_without_it(
    gpuswapd: Start, probe: Probe, world: Stack, users: dict[str, User]
) -> None:
    daemon = gpuswapd(daemon={"socket_group": GROUP})
    anyone = ctl_for_anyone(world)  # the service runs as a user who is not in the socket's group
    without = DROPIN.replace("SupplementaryGroups=gpuswap\n", "")
    consumer(world, daemon, "consumer-user.service", "/bin/sleep 300", without, ctl=anyone, User=STRANGER)
    world.manager("StartUnit", "ss", "consumer-user.service", "replace")
    assert wait_state(probe, "consumer-user.service", {"failed", "active"}, timeout=30) == "failed"  # exit 4
    assert daemon.status()["window"] is None and probe.containers() == []
    consumer(world, daemon, "consumer-user.service", "/bin/sleep 300", group=GROUP, ctl=anyone, User=STRANGER)
    world.manager("StartUnit", "ss", "consumer-user.service", "replace")
    wait_state(probe, "consumer-user.service", {"active"})
    [lease] = daemon.status()["window"]["leases"]
    assert lease["unit"] == "consumer-user.service" and lease["uid"] == users[STRANGER].uid
    assert_window_open(probe)
    world.manager("StopUnit", "ss", "consumer-user.service", "replace")
    daemon.wait_phase("IDLE", timeout=60)
    assert_resident_back(probe)


def test_a_failed_consumer_without_exec_stop_post_loses_its_lease(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(daemon={"linger": "2s"})
    dropin = "\n".join(line for line in DROPIN.splitlines() if not line.startswith("ExecStopPost="))
    consumer(world, daemon, "consumer-crash.service", "/bin/sh -c 'sleep 1; exit 1'", dropin)
    world.manager("StartUnit", "ss", "consumer-crash.service", "replace")
    wait_state(probe, "consumer-crash.service", {"active"})
    assert daemon.status()["window"]["leases"][0]["unit"] == "consumer-crash.service"
    wait_state(probe, "consumer-crash.service", {"failed"})
    failed_at = time.monotonic()
    while daemon.status()["window"]["leases"]:
        assert time.monotonic() - failed_at < 3, "the failed unit's lease outlived it"
        time.sleep(0.05)
    daemon.wait_phase("IDLE", timeout=60)
    closing = next(t for t in daemon.status()["last"]["timings"] if t["phase"] == "CLOSING")
    ready = next(t for t in daemon.status()["last"]["timings"] if t["phase"] == "READY")
    assert ready["took_s"] >= 1.0 + 2.0 - 0.2  # the unit's second of work, then linger
    assert closing["started_at"] >= ready["started_at"]
    assert_resident_back(probe)


def test_run_returns_the_commands_exit_code_and_leaves_no_lease(gpuswapd: Start) -> None:
    daemon = gpuswapd(daemon={"linger": "30s"})
    out = daemon.ctl("run", "--for", "5m", "--", "sh", "-c", "exit 7")
    assert out.returncode == 7, out.stderr
    status = daemon.status()
    assert status["phase"] == "READY" and status["window"]["leases"] == []


def test_run_killed_with_sigkill_leaves_no_lease_until_its_expiry(gpuswapd: Start, probe: Probe,
                                                                 world: Stack) -> None:
    daemon = gpuswapd(daemon={"linger": "0.3s"})
    marker = world.paths.control / "run-sigkill.pid"
    marker.unlink(missing_ok=True)
    run = subprocess.Popen([str(BIN / "gpuswapctl"), "run", "--for", "30m", "--holder", "doomed", "--",
                            "sh", "-c", f"echo $$ > {marker}; exec sleep 300"], env=daemon.env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text().strip():
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.05)
        [lease] = daemon.status()["window"]["leases"]
        assert lease["holder"] == "doomed" and lease["bind"] == "connection" and lease["remaining_s"] > 600
        killed = time.monotonic()
        run.kill()  # no release, no ExecStopPost=: only its connection ends
        run.wait()
        while daemon.status()["window"] and daemon.status()["window"]["leases"]:
            assert time.monotonic() - killed < 5, "the killed run's lease outlived it"
            time.sleep(0.05)
    finally:
        if marker.exists() and marker.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(marker.read_text()), signal.SIGKILL)  # the orphaned command
    daemon.wait_phase("IDLE", timeout=60)
    assert_resident_back(probe)


def test_run_without_the_gpu_does_not_run_the_command(gpuswapd: Start, world: Stack) -> None:
    daemon = gpuswapd(window__container={"image": "hyperqwen-sim:latest", "command": ["/usr/bin/false"]})
    marker = world.paths.control / "ran"
    out = daemon.ctl("run", "--for", "5m", "--", "touch", str(marker))
    assert out.returncode == 1 and "exited with code 1" in out.stderr
    assert not marker.exists()


def test_only_root_and_the_socket_group_may_acquire(gpuswapd: Start, world: Stack) -> None:
    daemon = gpuswapd(daemon={"socket_group": "users", "linger": "1s"})
    # status_public: anyone may connect (and read status); the daemon itself refuses the rest.
    assert oct(daemon.socket.stat().st_mode & 0o777) == "0o666"
    refused = as_nobody(daemon, world, "acquire", "--for", "1m")
    assert refused.returncode == 4
    assert "user nobody (uid 65534) may not acquire" in refused.stderr and "users" in refused.stderr
    assert daemon.status()["phase"] == "IDLE"
    assert as_nobody(daemon, world, "status").returncode == 0  # read-only status is public
    member = as_nobody(daemon, world, "acquire", "--for", "1m", groups="100")
    assert member.returncode == 0, member.stderr
    assert daemon.status()["window"]["leases"][0]["holder"].startswith("nobody[")
    assert daemon.ctl("release", "--holder", daemon.status()["window"]["leases"][0]["holder"]).returncode == 0


def test_socket_activation_serves_on_the_socket_systemd_hands_over(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    home = world.paths.root / "gpuswapd" / "activated"
    home.mkdir(parents=True, exist_ok=True)
    config = stack_config(world, "activated")
    text = config.read_text().replace(str(home / "gpuswapd.sock"), str(home / "not-used.sock"))
    config.write_text(text)
    sock = home / "activated.sock"
    env = world.env()
    world.install_unit(
        "gpuswapd-test.socket", f"[Unit]\nDefaultDependencies=no\n[Socket]\nListenStream={sock}\nSocketMode=0660\n"
    )
    world.install_unit(
        "gpuswapd-test.service",
        f"[Unit]\nDefaultDependencies=no\n[Service]\nType=notify\n"
        f"ExecStart={BIN}/gpuswapd --config {config}\n"
        f"Environment=DOCKER_HOST={env['DOCKER_HOST']} PATH={env['PATH']}\n"
        f"StandardOutput=append:{home}/gpuswapd.log\nStandardError=inherit\n",
    )
    world.manager("StartUnit", "ss", "gpuswapd-test.socket", "replace")
    wait_state(probe, "gpuswapd-test.socket", {"active"})
    assert probe.active_state("gpuswapd-test.service") == "inactive"
    daemon = RunningDaemon(world, config, sock)
    out = daemon.ctl("status", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["phase"] == "IDLE"
    assert probe.active_state("gpuswapd-test.service") == "active"
    assert not (home / "not-used.sock").exists()  # it served systemd's socket, not one of its own


def test_a_consumer_killed_by_timeout_start_sec_rolls_the_window_back(
    gpuswapd: Start, probe: Probe, world: Stack
) -> None:
    daemon = gpuswapd(
        daemon={"abandon_grace": "0"},  # no grace for a retry: the opening nobody waits for is rolled back at once
        window__container={
            "env": {"PORT": "18020", "GPUSIM_DIR": "/gpu", "ENGINE_VRAM": "19.5GiB", "ENGINE_BOOT_DELAY": "8"}
        }
    )
    consumer(
        world,
        daemon,
        "consumer-slow.service",
        "/bin/sleep 300",
        DROPIN.replace("TimeoutStartSec=20min", "TimeoutStartSec=3s"),
    )
    world.manager("StartUnit", "ss", "consumer-slow.service", "replace")
    assert wait_state(probe, "consumer-slow.service", {"failed"}, timeout=30) == "failed"
    assert probe.prop("consumer-slow.service", "Result", "org.freedesktop.systemd1.Service") == "timeout"
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "rolled_back"
    assert status["last"]["error"]["code"] == "window_cancelled"
    assert status["window"] is None
    assert_resident_back(probe)
