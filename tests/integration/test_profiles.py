"""Profiles on the real world: a bare window, two engines with a direct switch, the fair queue, crashes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.integration.conftest import (
    acquire_in_background,
    assert_resident_back,
    assert_switched_cleanly,
    inactive_since,
    wait_for,
    wait_persisted,
    with_profiles,
)
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import RESIDENT_UNITS, Probe

Start = Callable[..., RunningDaemon]
GPU_HOLD = Path(__file__).resolve().parents[1] / "stack" / "standins" / "gpu_hold.py"


def hold_vram(probe: Probe, name: str, size: str, *command: str) -> list[str]:
    """A command line that claims ``size`` in the simulated GPU, then runs ``command`` holding it."""
    return [sys.executable, str(GPU_HOLD), "--dir", str(probe.stack.paths.gpu), "--name", name, "--bytes", size,
            "--", *command]


def test_run_on_a_bare_window_gets_the_cleared_card(gpuswapd: Start, probe: Probe, tmp_path: Path) -> None:
    daemon = with_profiles(gpuswapd, probe)
    seen = tmp_path / "cuda"
    # While it runs the trainer holds 20 GiB of the 24 in the simulated GPU; the resident is down.
    cmd = hold_vram(probe, "trainer", "20GiB", "sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {seen}; '
                    "nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits >> " + str(seen))
    out = daemon.ctl("run", "--profile", "bare", "--for", "2m", "--", *cmd)
    assert out.returncode == 0, out.stderr
    cuda, free_mib = seen.read_text().split()
    assert cuda == "0" and int(free_mib) <= 4 * 1024  # it had the card
    daemon.wait_phase("IDLE", timeout=60)
    assert_resident_back(probe)
    last = daemon.ctl_json("history", "--limit", "1")["windows"][-1]
    assert last["profile"] == "bare" and last["kind"] == "bare" and last["outcome"] == "closed"
    assert "BOOTING" not in [t["phase"] for t in last["timings"]]


def test_a_bare_holder_that_keeps_its_memory_holds_the_resident_back(gpuswapd: Start, probe: Probe) -> None:
    daemon = with_profiles(gpuswapd, probe, gpu={"release_timeout": "2s"})
    assert daemon.ctl("acquire", "--profile", "bare", "--for", "2m").returncode == 0
    holder = subprocess.Popen(hold_vram(probe, "trainer", "20GiB", "sleep", "600"))
    try:
        wait_for(lambda: any(h["name"] == "trainer" for h in probe.stack.ledger()["holders"]), "the claim")
        assert daemon.ctl("release").returncode == 0
        status = daemon.wait_phase("DEGRADED", timeout=30)
        assert f"pid {holder.pid}" in status["window"]["degraded"]
        assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
        assert probe.stack.ooms() == []  # the resident was never started into the held memory
    finally:
        holder.kill()
        holder.wait()
    daemon.wait_phase("IDLE", timeout=60)
    assert_resident_back(probe)


def test_profiles_switch_directly_and_the_queue_is_fair(gpuswapd: Start, probe: Probe, honest_lag: float) -> None:
    # With the card's real lag: each engine's memory is still listed under its pids (docker top's)
    # for 1.5 s after it stopped, and the next window waits for it instead of calling it a stranger's.
    daemon = with_profiles(gpuswapd, probe, daemon={"fair_after": "1s"})
    up_since = probe.entered_active_us("strata.service")
    assert daemon.ctl("acquire", "--holder", "chat-1", "--for", "2m").returncode == 0
    down_since = inactive_since(probe, "strata.service")
    evaluation = acquire_in_background(daemon, "--profile", "eval", "--holder", "eval", "--for", "2m")
    wait_for(lambda: len(daemon.status()["queue"]) == 1, "eval to queue")
    time.sleep(1.2)  # past fair_after: joins to the open profile now queue behind eval
    chat2 = acquire_in_background(daemon, "--holder", "chat-2", "--for", "2m")
    wait_for(lambda: len(daemon.status()["queue"]) == 2, "chat-2 to queue")
    queue = daemon.status()["queue"]
    assert [(q["holder"], q["profile"], q["position"]) for q in queue] == [("eval", "eval", 1),
                                                                           ("chat-2", "default", 2)]
    assert queue[0]["eta_s"] is None  # no eval window in history yet
    assert queue[0]["waited_s"] >= 1
    assert daemon.status()["profiles"]["eval"]["endpoint"]["model"] == "qwen-eval"

    assert daemon.ctl("release", "--holder", "chat-1").returncode == 0
    _, err = evaluation.communicate(timeout=90)
    assert evaluation.returncode == 0, err
    assert "queued for profile eval: position 1" in err
    status = daemon.status()
    assert status["window"]["profile"] == "eval" and status["window"]["switched_from"]
    assert [c["Names"] for c in probe.containers()] == ["qwen-eval"]
    assert chat2.poll() is None  # it waits its turn

    assert daemon.ctl("release", "--holder", "eval").returncode == 0
    _, err = chat2.communicate(timeout=90)
    assert chat2.returncode == 0, err
    assert daemon.status()["window"]["profile"] == "default"
    # Three windows, and the resident stayed down from the first to the last: never started between.
    assert inactive_since(probe, "strata.service") == down_since
    assert probe.entered_active_us("strata.service") == up_since
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    assert_switched_cleanly(daemon, probe)
    assert daemon.ctl("release", "--holder", "chat-2").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)
    assert probe.entered_active_us("strata.service") > up_since  # back after the last window
    assert_switched_cleanly(daemon, probe)
    windows = daemon.ctl_json("history", "--limit", "3")["windows"]
    assert [w["profile"] for w in windows] == ["default", "eval", "default"]
    assert windows[1]["switched_from"] == windows[0]["id"] and windows[2]["switched_from"] == windows[1]["id"]
    assert windows[1]["switched_to"] == windows[2]["id"]
    assert all(w["outcome"] == "closed" for w in windows)


def test_sigkill_with_a_queue_and_during_a_switch_loses_nothing(gpuswapd: Start, probe: Probe) -> None:
    daemon = with_profiles(gpuswapd, probe)
    assert daemon.ctl("acquire", "--holder", "chat", "--for", "2m").returncode == 0
    queued = acquire_in_background(daemon, "--profile", "eval", "--holder", "eval", "--for", "2m")
    wait_for(lambda: len(daemon.status()["queue"]) == 1, "eval to queue")
    daemon.kill()
    daemon.start()
    status = daemon.wait_phase("READY", timeout=60)  # the window was adopted
    assert status["window"]["leases"][0]["holder"] == "chat"
    # The queued client sent its request again with its token: a restart is a pause for it.
    wait_for(lambda: [q["holder"] for q in daemon.status()["queue"]] == ["eval"], "eval to queue again")
    assert queued.poll() is None

    # Now a switch, killed while the next engine boots: the restart restores like any window, and
    # the client, back with its token, gets its window after that.
    assert daemon.ctl("release", "--holder", "chat").returncode == 0
    wait_persisted(daemon, "BOOTING")
    daemon.kill()
    daemon.start()
    _, err = queued.communicate(timeout=120)
    assert queued.returncode == 0, err
    last = daemon.ctl_json("history", "--limit", "1")["windows"][-1]  # the switch the restart rolled back
    assert last["profile"] == "eval" and last["outcome"] == "recovered"
    assert daemon.status()["window"]["profile"] == "eval"
    assert daemon.ctl("release", "--holder", "eval").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)


def test_profile_errors_on_the_command_line(gpuswapd: Start, probe: Probe) -> None:
    daemon = with_profiles(gpuswapd, probe)
    out = daemon.ctl("acquire", "--profile", "nope")
    assert out.returncode == 4 and "no profile 'nope'" in out.stderr
    out = daemon.ctl("acquire", "--profile", "eval", "--no-wait")
    assert out.returncode == 5
    out = daemon.ctl("bench", "--profile", "bare")
    assert out.returncode == 2 and "bare" in out.stderr
    out = daemon.ctl("acquire", "--profile", "Bad!")
    assert out.returncode == 2
    plan = daemon.ctl_json("plan", "--profile", "bare")["plan"]
    assert plan["kind"] == "bare" and plan["container"] is None
    assert daemon.status()["phase"] == "IDLE"
    assert_resident_back(probe)
