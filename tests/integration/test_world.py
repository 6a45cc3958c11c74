"""The test world itself and the systemd adapter, against the real systemd and dockerd."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from gpuswapd.adapters.systemd import Systemd
from gpuswapd.errors import UnitNotFound
from tests.stack.config import ENGINE_ENV
from tests.stack.probe import AGENT_TIMERS, Probe
from tests.stack.world import ENGINE_IMAGE, OTHER_TIMER, PROXY_PORT, RESIDENT_PORT, Stack

GiB = 1 << 30


@pytest.fixture
def systemd(world: Stack) -> Systemd:
    sd = Systemd()
    sd.connect()
    return sd


def _post(url: str, body: dict, timeout: float = 30) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def test_stopping_strata_stops_llama_swap_and_starting_swap_starts_strata(
        systemd: Systemd, probe: Probe, world: Stack) -> None:
    systemd.stop("strata.service", timeout=30)
    assert probe.states(["strata.service", "llama-swap.service"]) == {
        "strata.service": "inactive", "llama-swap.service": "inactive"}
    # As on a real GPU, strata's memory comes free only after the release lag: starting it again
    # earlier fails with CUDA out of memory (the ledger's own test).
    while world.ledger()["used_bytes"]:
        time.sleep(0.05)
    systemd.start("llama-swap.service", timeout=30)
    assert probe.states(["strata.service", "llama-swap.service"]) == {
        "strata.service": "active", "llama-swap.service": "active"}


def test_stop_closure_of_strata_is_strata_and_llama_swap(systemd: Systemd) -> None:
    assert set(systemd.stop_closure(["strata.service"])) == {"strata.service", "llama-swap.service"}
    # The configured unit comes first: restore starts it before what depends on it.
    assert systemd.stop_closure(["strata.service"])[0] == "strata.service"


def test_stop_closure_names_a_missing_unit(systemd: Systemd) -> None:
    with pytest.raises(UnitNotFound, match=r"nosuch\.service"):
        systemd.stop_closure(["nosuch.service"])


def test_timer_pattern_matches_the_seven_agents_and_not_the_other(systemd: Systemd) -> None:
    timers = systemd.timers(["agent-*.timer"])
    assert sorted(t.name for t in timers) == sorted(AGENT_TIMERS)
    assert OTHER_TIMER not in {t.name for t in timers}
    assert all(t.service == t.name.replace(".timer", ".service") for t in timers)


def test_unit_of_pid_names_the_resident(systemd: Systemd, world: Stack) -> None:
    pid = next(h["pid"] for h in world.ledger()["holders"] if h["name"] == "strata")
    assert systemd.unit_of_pid(pid) == "strata.service"


def test_resident_is_the_real_llama_server(world: Stack) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{RESIDENT_PORT}/health", timeout=5) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}
    with urllib.request.urlopen(f"http://127.0.0.1:{RESIDENT_PORT}/slots", timeout=5) as resp:
        slots = json.loads(resp.read())
    assert len(slots) == 2 and all("is_processing" in s and "n_ctx" in s for s in slots)
    body = _post(f"http://127.0.0.1:{PROXY_PORT}/v1/chat/completions", {
        "model": "strata", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    final = events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] > 0
    assert body.decode().rstrip().endswith("data: [DONE]")


def test_ledger_holds_21gib_while_strata_runs_and_frees_after_the_lag(systemd: Systemd, world: Stack) -> None:
    held = {h["name"]: h["bytes"] for h in world.ledger()["holders"]}
    assert held["strata"] == 21 * GiB
    systemd.stop("strata.service", timeout=30)
    stopped = time.monotonic()
    assert world.ledger()["used_bytes"] == 21 * GiB  # released only after the lag
    while world.ledger()["used_bytes"]:
        assert time.monotonic() - stopped < 5, "VRAM never came free"
        time.sleep(0.05)
    assert time.monotonic() - stopped >= world.release_lag_s * 0.8


def _run_engine(world: Stack, name: str, **env: str) -> None:
    args = ["run", "-d", "--name", name, "--network", "host", "-v", "/usr:/usr:ro",
            "-v", f"{world.paths.gpu}:/gpu"]
    for key, value in {**ENGINE_ENV, **env}.items():
        args += ["-e", f"{key}={value}"]
    world.docker(*args, ENGINE_IMAGE, check=True)


def _wait_health(status: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen("http://127.0.0.1:18020/health", timeout=2) as resp:
                if resp.status == status:
                    return
        except urllib.error.HTTPError as err:
            if err.code == status:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"/health never answered {status}")


def test_engine_started_while_strata_holds_the_gpu_dies_of_cuda_oom(world: Stack, probe: Probe) -> None:
    _run_engine(world, "oom-engine")
    deadline = time.monotonic() + 20
    while probe.containers()[0]["State"] != "exited":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    logs = world.docker("logs", "oom-engine").stderr
    assert "out of memory" in logs.lower()
    assert [o["name"] for o in world.ooms()] == ["hyperqwen"]


def test_engine_streams_more_tokens_than_chunks(systemd: Systemd, world: Stack) -> None:
    systemd.stop("strata.service", timeout=30)
    while world.ledger()["used_bytes"]:
        time.sleep(0.05)
    _run_engine(world, "stream-engine")
    _wait_health(200)
    body = _post("http://127.0.0.1:18020/v1/chat/completions", {
        "model": "hyperqwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
        "stream": True, "stream_options": {"include_usage": True}}).decode()
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    chunks = [e for e in events if e["choices"] and (e["choices"][0]["delta"].get("content")
                                                    or e["choices"][0]["delta"].get("reasoning"))]
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == []
    assert usage["completion_tokens"] > len(chunks) > 0
    assert any(e["choices"][0]["delta"].get("reasoning") for e in chunks)


def _smi_apps(world: Stack) -> list[tuple[int, int]]:
    """The card's processes as gpuswapd's nvidia-smi lists them: (pid, MiB)."""
    out = subprocess.run([str(world.paths.bin / "nvidia-smi"), "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30, check=True)
    return [(int(pid), int(mib)) for pid, mib in (line.split(", ") for line in out.stdout.splitlines())]


def test_the_card_lists_an_engine_under_its_docker_top_pid_while_its_memory_comes_free(
        systemd: Systemd, world: Stack, honest_lag: float) -> None:
    # Real drivers list host pids; dockerd sees the host's PID namespace, as gpuswapd's nvidia-smi
    # does: the pid the card lists an engine's memory under is one docker top gives gpuswapd.
    from gpuswapd.adapters.docker import Docker

    systemd.stop("strata.service", timeout=30)
    while world.ledger()["used_bytes"]:
        time.sleep(0.05)
    _run_engine(world, "listed-engine", VLLM_SERVER_DEV_MODE="1")
    _wait_health(200)
    [(pid, mib)] = _smi_apps(world)
    assert mib == int(19.5 * 1024)
    assert pid in Docker().top("listed-engine")
    # A sleep lets 18.5 GiB go: the card lists them under the same pid for the lag, then not.
    _post("http://127.0.0.1:18020/sleep?level=1", {})
    assert _smi_apps(world) == [(pid, int(19.5 * 1024))]
    assert world.ledger()["free_bytes"] == int(4.5 * GiB)
    deadline = time.monotonic() + honest_lag + 5
    while _smi_apps(world) != [(pid, 1024)]:
        assert time.monotonic() < deadline, _smi_apps(world)
        time.sleep(0.1)
    # An exit: the process is gone, and its memory is still listed under its pid for the lag.
    world.docker("stop", "-t", "2", "listed-engine", check=True)
    assert not Path(f"/proc/{pid}").exists()
    assert _smi_apps(world) == [(pid, 1024)]
    deadline = time.monotonic() + honest_lag + 5
    while _smi_apps(world):
        assert time.monotonic() < deadline, _smi_apps(world)
        time.sleep(0.1)
    assert world.ledger()["used_bytes"] == 0


def _restart(world: Stack, name: str) -> None:
    """Restart a container the way a GPU needs it: stop, wait for the VRAM, start."""
    world.docker("stop", "-t", "2", name, check=True)
    while world.ledger()["used_bytes"]:
        time.sleep(0.05)
    world.docker("start", name, check=True)


def test_engine_dead_error_outlives_the_configured_restarts(systemd: Systemd, world: Stack) -> None:
    systemd.stop("strata.service", timeout=30)
    while world.ledger()["used_bytes"]:
        time.sleep(0.05)
    _run_engine(world, "dying-engine", VLLM_KEEP_ALIVE_ON_ENGINE_DEATH="1", ENGINE_DEAD_AFTER="0.5")
    _wait_health(200)
    _post("http://127.0.0.1:18020/sim/die", {"failing_boots": 2})
    _wait_health(503)
    with pytest.raises(urllib.error.HTTPError) as err:
        _post("http://127.0.0.1:18020/v1/chat/completions",
              {"model": "hyperqwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert err.value.code == 500 and b"EngineDeadError" in err.value.read()
    for _ in range(2):  # two more boots die too
        _restart(world, "dying-engine")
        _wait_health(200)
        _wait_health(503)
    _restart(world, "dying-engine")
    _wait_health(200)
    time.sleep(1.0)  # past ENGINE_DEAD_AFTER: a healed boot stays up
    _wait_health(200, timeout=1)


def test_down_spares_tmp_and_leaves_nothing_running(stack: Stack) -> None:
    canary = Path("/tmp") / f"gpuswapd-canary-{time.time_ns()}"
    canary.write_text("still here")
    try:
        pids = json.loads(stack.paths.pids.read_text())
        stack.down()
        assert canary.read_text() == "still here"
        for name, p in pids.items():
            assert not Path(f"/proc/{p['pid']}").exists(), f"{name} still runs"
        leftovers = subprocess.run(["pgrep", "-a", "-f", str(stack.paths.root)], capture_output=True, text=True).stdout
        assert leftovers == ""
        stack.up()
        assert canary.read_text() == "still here"
        assert Probe(stack).active_state("strata.service") == "active"
    finally:
        canary.unlink(missing_ok=True)


def test_up_after_a_world_died_without_down(stack: Stack) -> None:
    """A restart of the machine kills the world without down(): the pid files stay behind.

    dockerd's, and its containerd's: dockerd trusts that one, and a PID reused by any live process
    (here PID 1) would make it wait for a containerd that is not there.
    """
    stack.down()
    pidfile = stack.paths.docker / "dockerd.pid"
    pidfile.write_text("1")
    containerd = stack.paths.docker / "exec" / "containerd"
    containerd.mkdir(parents=True, exist_ok=True)
    (containerd / "containerd.pid").write_text("1")
    stack.up()
    assert stack.running()
    assert stack.docker("version", "--format", "{{.Server.Version}}").returncode == 0
    assert Probe(stack).active_state("strata.service") == "active"
