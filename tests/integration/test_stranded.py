"""Nothing stranded, on the real world: vanishing clients, torn and lost state, a full disk, Docker away."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import assert_resident_back, assert_window_open, metric
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import AGENT_TIMERS, RESIDENT_UNITS, Probe
from tests.stack.world import Stack

Start = Callable[..., RunningDaemon]


def _request(path: Path, message: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
    """Send one request on a connection of its own and return the final reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"no reply to {message}")
            data += chunk
            for line in data.splitlines():
                reply = json.loads(line)
                if "event" not in reply:
                    return reply


def _wait_for(what: str, check: Callable[[], Any], timeout: float, daemon: RunningDaemon) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout}s; log:\n{daemon.tail()}"
        time.sleep(0.1)
    return result


def test_clients_that_hang_up_mid_acquire_while_renewals_keep_the_writer_busy_wedge_nothing(
        gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd()
    lease = daemon.ctl_json("acquire", "--for", "5m", "--holder", "keeper")["lease"]
    stop = threading.Event()
    counts = {"renewed": 0, "vanished": 0}

    def renew() -> None:  # every renewal is an fsync'd write: the writer is always busy
        while not stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                if _request(daemon.socket, {"op": "renew", "lease": lease["id"], "for": "5m"})["ok"]:
                    counts["renewed"] += 1

    def vanish() -> None:  # acquire on the READY window and hang up before the answer
        while not stop.is_set():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(daemon.socket))
                sock.sendall(json.dumps({"op": "acquire", "for": "10m",
                                         "holder": f"vanished-{counts['vanished']}"}).encode() + b"\n")
            counts["vanished"] += 1
            time.sleep(0.002)

    threads = [threading.Thread(target=renew) for _ in range(2)] + [threading.Thread(target=vanish) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(5)
    stop.set()
    for t in threads:
        t.join()
    assert counts["renewed"] > 20 and counts["vanished"] > 200, counts
    started = time.monotonic()
    released = daemon.ctl("release", lease["id"], "--json")
    assert released.returncode == 0, released.stderr
    assert time.monotonic() - started < 5  # answered at once: no save waits on a future nobody resolves

    def no_vanished_leases() -> bool:
        window = daemon.status()["window"]
        return window is None or not any(x["holder"].startswith("vanished-") for x in window["leases"])

    _wait_for("every lease of a vanished client to be gone", no_vanished_leases, 10, daemon)
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "closed"
    assert_resident_back(probe)


def test_a_torn_state_document_across_a_restart_mid_window_brings_everything_back(
        gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd()
    daemon.ctl_json("acquire", "--for", "5m", "--holder", "torn")
    assert_window_open(probe)
    daemon.kill()
    current = daemon.state_dir / "state.json"
    data = current.read_bytes()
    current.write_bytes(data[: len(data) // 2])  # torn mid-write, as by a crash of the disk or the kernel
    daemon.start()
    # The previous copy is READY before the lease was granted: nobody holds the window, it closes.
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "recovered"
    assert status["baseline_restore"] is None  # the previous copy was readable: no baseline needed
    assert_resident_back(probe)
    assert metric("llamacpp:tokens_predicted_total") > 0
    assert "state_unreadable" in daemon.log.read_text()


def test_no_readable_copy_restores_the_baseline_and_status_says_so(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd()
    daemon.ctl_json("acquire", "--for", "5m")
    assert_window_open(probe)
    daemon.kill()
    for name in ("state.json", "state.prev.json"):
        (daemon.state_dir / name).write_bytes(b'{"version": 2, "seq": 7, "window": {"phase": "REA')
    daemon.start()
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "baseline_restored"
    baseline = status["baseline_restore"]
    assert "no copy of the state could be read" in baseline["reason"] and "state.json" in baseline["reason"]
    assert baseline["at"] <= time.time()
    assert_resident_back(probe)  # units, every matching timer, no container, no out-of-memory
    assert metric("llamacpp:tokens_predicted_total") > 0
    assert sorted(p.name for p in daemon.state_dir.glob("*.unreadable")) == [
        "state.json.unreadable", "state.prev.json.unreadable"]
    assert json.loads((daemon.state_dir / "state.json").read_text())["window"] is None
    assert daemon.ctl("status").stdout.count("baseline restored") == 1


@pytest.fixture
def small_disk(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tmpfs of 256 KiB for a state directory, filled on demand, unmounted afterwards."""
    mounts: list[Path] = []

    def make(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0750", "tmpfs", str(path)], check=True)
        mounts.append(path)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path: Path) -> Path:
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # ENOSPC: full
        pass
    finally:
        os.close(fd)
    return filler


def test_a_state_directory_that_fills_up_mid_window_still_restores_everything(
        gpuswapd: Start, probe: Probe, world: Stack, small_disk: Any) -> None:
    home = world.paths.root / "gpuswapd" / "full-disk"
    state_dir = small_disk(home / "state")
    daemon = gpuswapd(daemon={"state_dir": str(state_dir)})
    lease = daemon.ctl_json("acquire", "--for", "5m")["lease"]
    filler = _fill(state_dir)
    assert daemon.ctl("release", lease["id"]).returncode == 0
    status = daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)
    assert metric("llamacpp:tokens_predicted_total") > 0
    assert status["state_writable"] is False and "No space left on device" in status["state_error"]
    filler.unlink()  # room again: the writer's retries land the cleared document
    _wait_for("the state to be writable again", lambda: daemon.status()["state_writable"], 60, daemon)
    assert json.loads((state_dir / "state.json").read_text())["window"] is None
    assert daemon.ctl_json("history")["windows"][-1]["outcome"] == "closed"


def test_a_full_state_directory_refuses_a_window_before_anything_moves(
        gpuswapd: Start, probe: Probe, world: Stack, small_disk: Any) -> None:
    state_dir = small_disk(world.paths.root / "gpuswapd" / "full-at-start" / "state")
    daemon = gpuswapd(daemon={"state_dir": str(state_dir)})
    strata_since = probe.entered_active_us("strata.service")
    _fill(state_dir)
    out = daemon.ctl("acquire", "--for", "1m")
    assert out.returncode == 1 and "cannot write the state" in out.stderr
    assert probe.entered_active_us("strata.service") == strata_since  # never stopped
    assert_resident_back(probe)


def _freeze(world: Stack, sig: int) -> None:
    world._procs()["dockerd"].signal(sig)


@pytest.mark.parametrize("docker", ["frozen", "stopped"])
def test_a_restart_while_docker_is_away_still_ends_the_window_when_its_lease_does(
        gpuswapd: Start, probe: Probe, world: Stack, docker: str) -> None:
    daemon = gpuswapd(daemon={"call_timeout": "1s"}, window={"watch_interval": "300ms"})
    lease = daemon.ctl_json("acquire", "--for", "15s", "--holder", "short")["lease"]
    daemon.kill()
    if docker == "frozen":
        _freeze(world, signal.SIGSTOP)
    else:
        world.stop_dockerd()
    try:
        daemon.start()
        if docker == "frozen":
            # The engine still answers: the window is adopted on its health and, since Docker
            # cannot say which start of the container runs, a verifying completion; it ends when
            # its lease does, although Docker cannot be asked anything.
            status = daemon.wait_phase("READY", timeout=30)
            assert [x["id"] for x in status["window"]["leases"]] == [lease["id"]]
            _wait_for("the window to start closing", lambda: daemon.status()["phase"] != "READY",
                      lease["expires_at"] - time.time() + 15, daemon)
            assert time.time() >= lease["expires_at"] - 1
        else:
            # Docker took the engine with it: nothing to adopt; the resident comes back at once.
            _wait_for("the resident and the timers to be back",
                      lambda: set(probe.states([*RESIDENT_UNITS, *AGENT_TIMERS]).values()) == {"active"}, 90, daemon)
    finally:
        if docker == "frozen":
            _freeze(world, signal.SIGCONT)
        else:
            world.start_dockerd()
    status = daemon.wait_phase("IDLE", timeout=120)
    assert status["last"]["outcome"] in ("closed", "recovered")
    assert_resident_back(probe)
    assert metric("llamacpp:tokens_predicted_total") > 0
    assert os.path.exists(daemon.socket)
