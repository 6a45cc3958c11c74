"""Priorities and preemption on the real world: notice, grace, revoked leases, a stopped consumer unit."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

from tests.integration.conftest import (
    acquire_in_background,
    as_nobody,
    assert_resident_back,
    assert_switched_cleanly,
    consumer,
    inactive_since,
    wait_for,
    wait_state,
    with_profiles,
)
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import RESIDENT_UNITS, Probe
from tests.stack.world import Stack

Start = Callable[..., RunningDaemon]


def test_an_urgent_bare_request_preempts_after_notice_and_grace(gpuswapd: Start, probe: Probe,
                                                                 world: Stack, honest_lag: float) -> None:
    # With the card's real lag: the engine's memory is still listed for 1.5 s after the preemption
    # took it down, and the bare window waits for it.
    daemon = with_profiles(gpuswapd, probe, daemon={"preempt_grace": "2s"})
    up_since = probe.entered_active_us("strata.service")
    stopped = world.paths.control / "consumer.stopped"
    stopped.unlink(missing_ok=True)
    consumer(world, daemon, "consumer.service", "/bin/sleep 300", ExecStopPost=f"/bin/touch {stopped}")
    world.manager("StartUnit", "ss", "consumer.service", "replace")
    wait_state(probe, "consumer.service", {"active"})
    runner = subprocess.Popen([str(BIN / "gpuswapctl"), "run", "--for", "2m", "--holder", "runner", "--",
                               "sleep", "300"], env=daemon.env, text=True, stderr=subprocess.PIPE)
    wait_for(lambda: len((daemon.status()["window"] or {}).get("leases", [])) == 2, "the run's lease")
    down_since = inactive_since(probe, "strata.service")
    # A request of equal priority for another profile waits its turn: no preemption.
    equal = acquire_in_background(daemon, "--profile", "eval", "--holder", "equal", "--for", "2m")
    wait_for(lambda: len(daemon.status()["queue"]) == 1, "the equal request to queue")
    time.sleep(0.5)
    assert daemon.status()["window"]["preempted"] is None

    urgent = acquire_in_background(daemon, "--profile", "bare", "--priority", "10", "--holder", "urgent",
                                    "--for", "2m")
    # The notice: run's command gets SIGTERM at once, and run says why.
    _, err = runner.communicate(timeout=30)
    assert runner.returncode == 143, err
    assert "preempted by urgent" in err and "SIGTERM" in err
    notice = daemon.status()["window"]["preempted"]
    assert notice["by"] == "urgent" and notice["priority"] == 10 and notice["revoked_at"] is None
    assert probe.active_state("consumer.service") == "active"  # its grace is not over yet

    _, err = urgent.communicate(timeout=90)
    assert urgent.returncode == 0, err
    status = daemon.status()
    assert status["window"]["kind"] == "bare" and status["window"]["switched_from"]
    # The unit-bound holder was stopped through systemd after the grace; its ExecStopPost= ran.
    wait_state(probe, "consumer.service", {"inactive", "failed"})
    wait_for(stopped.exists, "the consumer's ExecStopPost=")
    last = daemon.ctl_json("history", "--limit", "1")["windows"][-1]
    assert last["preempted"]["revoked_at"] >= last["preempted"]["deadline"] - 0.01
    assert last["preempted"]["stopped_units"] == ["consumer.service"]
    # The resident was not started between the two windows.
    assert inactive_since(probe, "strata.service") == down_since
    assert probe.entered_active_us("strata.service") == up_since
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    assert_switched_cleanly(daemon, probe)

    assert daemon.ctl("release", "--holder", "urgent").returncode == 0
    _, err = equal.communicate(timeout=90)  # then the equal request gets its turn
    assert equal.returncode == 0, err
    assert daemon.ctl("release", "--holder", "equal").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)
    assert probe.entered_active_us("strata.service") > up_since
    assert_switched_cleanly(daemon, probe)


def test_aging_orders_the_queue_but_never_preempts(gpuswapd: Start, probe: Probe) -> None:
    daemon = with_profiles(gpuswapd, probe, daemon={"aging": "500ms", "preempt_grace": "1s"})
    assert daemon.ctl("acquire", "--holder", "chat", "--priority", "1", "--for", "2m").returncode == 0
    old = acquire_in_background(daemon, "--profile", "eval", "--holder", "old", "--for", "2m")
    wait_for(lambda: len(daemon.status()["queue"]) == 1, "the old request to queue")
    time.sleep(1.1)  # two levels gained: effective 2
    new = acquire_in_background(daemon, "--profile", "bare", "--priority", "1", "--holder", "new", "--for", "2m")
    wait_for(lambda: len(daemon.status()["queue"]) == 2, "the new request to queue")
    queue = daemon.status()["queue"]
    assert [(q["holder"], q["priority"]) for q in queue] == [("old", 0), ("new", 1)]
    assert queue[0]["effective_priority"] >= 2
    time.sleep(1.0)
    assert daemon.status()["window"]["preempted"] is None  # neither preempts a priority-1 window
    for proc in (old, new):
        proc.terminate()  # the requests withdraw
        proc.wait(timeout=30)
    assert daemon.ctl("release", "--holder", "chat").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)


def test_a_priority_above_the_non_root_limit_is_refused(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = with_profiles(gpuswapd, probe, daemon={"socket_group": "users"})
    refused = as_nobody(daemon, world, "acquire", "--priority", "1", "--for", "1m", groups="100")
    assert refused.returncode == 4, refused.stderr
    assert "priority_max_nonroot = 0" in refused.stderr
    assert daemon.ctl("acquire", "--priority", "many").returncode == 2
    assert daemon.status()["phase"] == "IDLE" and daemon.status()["queue"] == []


def test_sigkill_during_the_grace_abandons_the_preemption(gpuswapd: Start, probe: Probe) -> None:
    daemon = with_profiles(gpuswapd, probe, daemon={"preempt_grace": "30s"})
    assert daemon.ctl("acquire", "--holder", "chat", "--for", "2m").returncode == 0
    urgent = acquire_in_background(daemon, "--profile", "bare", "--priority", "10", "--holder", "urgent")
    wait_for(lambda: (daemon.status()["window"] or {}).get("preempted") is not None, "the notice")
    daemon.kill()
    urgent.kill()  # and its client is gone too: nobody reclaims the request after the restart
    urgent.communicate(timeout=30)
    daemon.start()
    wait_for(lambda: ((daemon.status()["window"] or {}).get("preempted") or {}).get("abandoned_at") is not None,
             "the preemption to be abandoned")
    status = daemon.status()
    assert status["phase"] == "READY" and [x["holder"] for x in status["window"]["leases"]] == ["chat"]
    assert status["window"]["preempted"]["revoked_at"] is None
    assert daemon.ctl("release", "--holder", "chat").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)
