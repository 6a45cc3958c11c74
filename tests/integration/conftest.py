"""What the world's tests share: running gpuswapctl, waiting on the world, and checks of its real state.

A test module imports these from here (``from tests.integration.conftest import ...``), never from
another test module: ``tests/unit/test_layout.py`` fails on an import of a test module. The world
itself and gpuswapd on it are fixtures of ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpuswapd.ctl.main import main as gpuswapctl
from tests.conftest import TEST_BOOT_DELAY
from tests.stack.config import ENGINE_ENV, profile_sections
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import AGENT_TIMERS, RESIDENT_UNITS, Probe
from tests.stack.users import User, as_user
from tests.stack.world import ENGINE_PORT, OTHER_TIMER, PROXY_PORT, REPO, RESIDENT_PORT, Stack

Start = Callable[..., RunningDaemon]

# The shipped lease drop-in, as a consumer unit gets it.
DROPIN = (REPO / "units" / "examples" / "gpuswap-lease.conf").read_text()
# The engine with vLLM's sleep mode on, waking and sleeping quickly.
SLEEPY = {**ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1", "ENGINE_WAKE_DELAY_1": "0.3", "ENGINE_SLEEP_DELAY": "0.05"}


# -- the window's state ------------------------------------------------------------------------


def assert_window_open(probe: Probe) -> None:
    """Check that the resident and the agent timers are down, the other timer up, the engine running."""
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    assert probe.states(list(AGENT_TIMERS)) == dict.fromkeys(AGENT_TIMERS, "inactive")
    assert probe.active_state(OTHER_TIMER) == "active"
    assert [(c["Names"], c["State"]) for c in probe.containers()] == [("hyperqwen", "running")]
    assert probe.stack.ooms() == []


def assert_resident_back(probe: Probe) -> None:
    """Check that the resident and every timer are up, no engine is left, and nothing ran out of memory."""
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "active")
    assert probe.states([*AGENT_TIMERS, OTHER_TIMER]) == dict.fromkeys([*AGENT_TIMERS, OTHER_TIMER], "active")
    assert probe.containers() == []
    assert probe.stack.ooms() == []


def assert_restored_and_verified(daemon: RunningDaemon, probe: Probe) -> dict[str, Any]:
    """Wait for IDLE, check the resident is back and has answered gpuswapd's verifying completion."""
    status = daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)
    assert metric("llamacpp:tokens_predicted_total") > 0  # gpuswapd's verifying completion
    return status


def assert_switched_cleanly(daemon: RunningDaemon, probe: Probe) -> None:
    """Check that no window failed (no wont_fit, no rollback) and nothing ran out of memory on the card."""
    assert [(e.get("code"), e.get("error")) for e in daemon.logged("window_failed")] == []
    assert probe.stack.ooms() == []


def engine_state() -> dict[str, Any]:
    """Return the engine simulator's own account (requests served, sleeping, ...)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{ENGINE_PORT}/sim/state", timeout=5) as resp:
        state: dict[str, Any] = json.loads(resp.read())
    return state


def engine_holds(stack: Stack) -> int:
    """Return the bytes the engine holds in the VRAM ledger (0 if it holds none)."""
    return sum(h["bytes"] for h in stack.ledger()["holders"] if h["name"] == "hyperqwen")


def metric(name: str) -> float:
    """Return the sum of the resident llama-server's samples whose name starts with ``name``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{RESIDENT_PORT}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def inactive_since(probe: Probe, unit: str) -> int:
    """Return when ``unit`` last went inactive (CLOCK_MONOTONIC, µs)."""
    return int(probe.prop(unit, "InactiveEnterTimestampMonotonic"))


# -- waiting -----------------------------------------------------------------------------------


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def wait_persisted(daemon: RunningDaemon, phase: str, timeout: float = 60) -> None:
    """Wait until gpuswapd has written ``phase`` to its state file."""
    deadline = time.monotonic() + timeout
    while daemon.state_phase() != phase:
        assert time.monotonic() < deadline, f"{phase} never persisted; log:\n{daemon.tail()}"
        time.sleep(0.01)


def wait_state(probe: Probe, unit: str, states: set[str], timeout: float = 60) -> str:
    """Wait until ``unit``'s ActiveState is one of ``states``; return it."""
    deadline = time.monotonic() + timeout
    while (state := probe.active_state(unit)) not in states:
        assert time.monotonic() < deadline, f"{unit} stayed {state}, wanted {states}"
        time.sleep(0.1)
    return state


# -- gpuswapd and its clients ------------------------------------------------------------------


def with_profiles(gpuswapd: Start, probe: Probe, **sections: dict[str, Any]) -> RunningDaemon:
    """Start gpuswapd with the world's two engine profiles and the bare one, lingering 1 s."""
    daemon_keys = sections.pop("daemon", {})
    profiles = profile_sections(probe.stack)
    profiles["profiles__eval__container"]["env"]["ENGINE_BOOT_DELAY"] = TEST_BOOT_DELAY
    return gpuswapd(**profiles, daemon={"linger": "1s", **daemon_keys}, **sections)


def acquire_in_background(daemon: RunningDaemon, *args: str) -> subprocess.Popen[str]:
    """Start ``gpuswapctl acquire ARGS`` and return it running."""
    return subprocess.Popen([str(BIN / "gpuswapctl"), "acquire", *args], env=daemon.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def pauses_then_gives_up(client: subprocess.Popen[str]) -> None:
    """Check a waiting ``gpuswapctl acquire`` takes gpuswapd's death as a pause, then make it give up.

    It waits to reclaim its place with its token (it does not exit); once it is stopped, nobody
    comes back for the opening it asked for, and the next gpuswapd rolls it back.
    """
    try:
        client.wait(3)
    except subprocess.TimeoutExpired:
        pass
    else:
        raise AssertionError(f"gpuswapctl acquire exited {client.returncode} when gpuswapd died: {client.stderr}")
    client.terminate()
    assert client.wait(10) != 0  # the GPU was not obtained


def ctl_as(user: User, daemon: RunningDaemon, *args: str) -> tuple[int, str, str]:
    """Run gpuswapctl as ``user`` (in a child that dropped root); return exit code, stdout, stderr."""
    code, out, err = as_user(user, lambda: ctl_output(daemon, args))
    return int(code), str(out), str(err)


def ctl_output(daemon: RunningDaemon, args: tuple[str, ...]) -> tuple[int, str, str]:
    """Run gpuswapctl ARGS in this process against ``daemon``; return exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = gpuswapctl(["--socket", str(daemon.socket), *args])
        except SystemExit as exit_:  # argparse
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def readable_package(world: Stack) -> Path:
    """Copy this checkout's package where any user can read it (this checkout's .venv is root's); return it."""
    pkg = world.paths.root / "pkg"
    # A fresh copy each time: one left by an earlier run of the world may be another version's.
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(REPO / "gpuswapd", pkg / "gpuswapd", ignore=shutil.ignore_patterns("__pycache__"))
    return pkg


def ctl_for_anyone(world: Stack) -> str:
    """Return a gpuswapctl command line that any user may run: the system Python on a readable copy."""
    return f"/usr/bin/env PYTHONPATH={readable_package(world)} /usr/bin/python3 -m gpuswapd.ctl.main"


def as_nobody(daemon: RunningDaemon, world: Stack, *args: str, groups: str = "") -> subprocess.CompletedProcess[str]:
    """Run gpuswapctl as user nobody (optionally in supplementary groups), from a copy it can read."""
    pkg = readable_package(world)
    group_args = [f"--groups={groups}"] if groups else ["--clear-groups"]
    return subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            *group_args,
            "/usr/bin/python3",
            "-m",
            "gpuswapd.ctl.main",
            "--socket",
            str(daemon.socket),
            *args,
        ],
        env={"PYTHONPATH": str(pkg), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def consumer(
    world: Stack, daemon: RunningDaemon, name: str, exec_start: str, dropin: str = DROPIN, group: str = "",
    ctl: str = "", **service: str
) -> None:
    """Install a consumer service with the shipped drop-in, pointed at this checkout's gpuswapctl.

    The drop-in's ``SupplementaryGroups=gpuswap`` names ``group`` instead (the world's gpuswapd has
    a socket group of its own; none by default); ``ctl`` is the gpuswapctl to run (this checkout's
    by default: root's only).
    """
    dropin = dropin.replace("/usr/bin/gpuswapctl", ctl or str(BIN / "gpuswapctl"))
    dropin = dropin.replace("SupplementaryGroups=gpuswap\n", f"SupplementaryGroups={group}\n")
    body = (
        f"[Unit]\nDescription=a consumer of the GPU window\nDefaultDependencies=no\n\n[Service]\n"
        f"Environment=GPUSWAPD_SOCKET={daemon.socket}\nExecStart={exec_start}\n"
        + "".join(f"{k}={v}\n" for k, v in service.items())
    )
    world.install_unit(name, body, {"gpuswap-lease.conf": dropin})


@contextlib.contextmanager
def resident_busy() -> Iterator[None]:
    """Keep the resident serving a long streamed request (the slow model's) while inside."""
    stop = threading.Event()
    holder = threading.Thread(target=_hold_a_request, args=(stop,), daemon=True)
    holder.start()
    try:
        deadline = time.monotonic() + 20
        while metric("llamacpp:requests_processing") < 1:
            assert time.monotonic() < deadline, "the request never reached the resident"
            time.sleep(0.05)
        yield
    finally:
        stop.set()


def _hold_a_request(stop: threading.Event) -> None:
    body = json.dumps({"model": "strata", "messages": [{"role": "user", "content": "write a long story"}],
                       "max_tokens": 2000, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PROXY_PORT}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        while not stop.is_set() and resp.readline():
            pass


# -- metrics -----------------------------------------------------------------------------------


def free_port() -> int:
    """Return a TCP port on the loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, Any]:
    """Scrape gpuswapd's ``/metrics`` on ``port``: its families by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def value(families: dict[str, Any], family: str, sample: str | None = None, **labels: str) -> float:
    """Return the one sample of ``family`` (named ``sample``, if given) whose labels include ``labels``."""
    [found] = [s.value for s in families[family].samples
               if (sample is None or s.name == sample) and labels.items() <= s.labels.items()]
    return float(found)
