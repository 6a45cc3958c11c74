"""gpuswapd-gateway on the real world: the official openai client, windows on demand, the swap back.

The gateway runs as a process of its own (its leases then carry ``gpuswapd-gateway[PID]``), or as
its shipped units in the world's systemd (socket-activated on 127.0.0.1:8080); gpuswapd is the
real daemon, the resident a real llama-server behind the llama-swap simulator (moved to 8090), the
engine the simulator in Docker. Every assertion is on real state: units over D-Bus, ``docker ps``,
gpuswapd's status and history, the engine's boot count.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.integration.conftest import (
    acquire_in_background,
    assert_resident_back,
    assert_window_open,
    wait_for,
    with_profiles,
)
from tests.stack import llama
from tests.stack.config import stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.gateway import URL, RunningGateway, gateway_sections, get, install_units, request
from tests.stack.probe import RESIDENT_UNITS, Probe
from tests.stack.world import REPO, Stack

Start = Callable[..., RunningDaemon]
CHAT_STRATA = {"model": "strata", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
Gate = Callable[..., RunningGateway]


def boots(world: Stack) -> int:
    try:
        return int((world.paths.gpu / "engine-boots").read_text() or 0)
    except (OSError, ValueError):
        return 0


@pytest.fixture
def gateway() -> Iterator[Gate]:
    """Start gpuswapd-gateway for a daemon (its own config file, if given); stopped after the test."""
    started: list[RunningGateway] = []

    def start(daemon: RunningDaemon, config: Any = None) -> RunningGateway:
        gw = RunningGateway(daemon, config)
        started.append(gw)
        return gw.start()

    yield start
    for gw in started:
        gw.stop()


def _client() -> OpenAI:
    return OpenAI(base_url=f"{URL}/v1", api_key="not-needed", max_retries=0, timeout=120)


def _leases(daemon: RunningDaemon) -> list[dict[str, Any]]:
    return list((daemon.status()["window"] or {}).get("leases") or [])


def test_the_openai_client_gets_every_model_and_a_window_opens_on_demand(gpuswapd: Start, gateway: Gate,
                                                                         probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(**gateway_sections())
    gateway(daemon)
    client = _client()
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert models["strata"] == {"tenant": "resident", "on_card": True}
    assert models["hyperqwen"] == {"tenant": "default", "on_card": False}

    plain = client.chat.completions.create(model="strata", max_tokens=8,
                                           messages=[{"role": "user", "content": "Say hi"}])
    assert plain.choices[0].message.content and plain.usage and plain.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model="strata", max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "Say hi"}]))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert daemon.status()["phase"] == "IDLE"  # the resident needs no window

    # The engine's model: a window opens; meanwhile the resident and the timers are down.
    seen: dict[str, Any] = {}

    def look() -> None:
        wait_for(lambda: daemon.status()["phase"] == "READY", "the window to open", 60)
        try:
            assert_window_open(probe)
            seen["open"] = True
        except AssertionError as err:
            seen["open"] = err

    looker = threading.Thread(target=look)
    looker.start()
    text, usage, leases, ctl_status, on_card = "", None, None, "", None
    for chunk in client.chat.completions.create(model="hyperqwen", max_tokens=64, stream=True,
                                                stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": "Write a haiku"}]):
        if leases is None:  # while the stream runs, the gateway's lease holds the window
            leases = _leases(daemon)
            ctl_status = daemon.ctl("status").stdout
            on_card = {m.id: m.model_extra for m in client.models.list().data}["hyperqwen"]["on_card"]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    looker.join(60)
    assert seen.get("open") is True, seen
    assert text and usage is not None and usage.completion_tokens >= len(text.split())
    [lease] = leases or []
    assert lease["holder"].startswith("gpuswapd-gateway[") and lease["bind"] == "connection"
    assert "ends with its connection" in ctl_status  # gpuswapctl status shows it
    assert on_card is True

    # idle (2 s) after the last request, the lease is given back and the resident restored.
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "closed"
    assert_resident_back(probe)
    assert daemon.logged("resident_verified")


def test_a_resident_request_swaps_back_or_waits_or_fails_as_configured(gpuswapd: Start, gateway: Gate,
                                                                       probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(**gateway_sections(idle="10m"))
    gw = gateway(daemon)
    status, body, _ = request("POST", "/v1/chat/completions",
                              {"model": "hyperqwen", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
    assert status == 200, body
    assert [x["holder"] for x in _leases(daemon)] == [f"gpuswapd-gateway[{gw.proc.pid}]"]  # type: ignore[union-attr]
    # The gateway's own idle lease is all that keeps the window: a resident request closes it at once.
    started = time.monotonic()
    status, body, _ = request("POST", "/v1/chat/completions",
                              {"model": "strata", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and body["choices"][0]["message"]["content"], body
    assert time.monotonic() - started < 60  # not idle (10 minutes) later
    # The resident serves from RESUMING_TIMERS on: the answer may come before the timers' resume ends.
    daemon.wait_phase("IDLE", timeout=30)
    assert daemon.status()["last"]["outcome"] == "closed"
    assert_resident_back(probe)

    # Another holder keeps the card: with on_resident_busy = "wait" the request waits for it.
    assert daemon.ctl("acquire", "--holder", "trainer", "--for", "2m").returncode == 0
    answered: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: answered.update(r=request(
        "POST", "/v1/chat/completions",
        {"model": "strata", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})))
    waiter.start()
    time.sleep(2)
    assert not answered and daemon.status()["phase"] == "READY"
    assert daemon.ctl("release", "--holder", "trainer").returncode == 0
    waiter.join(90)
    assert answered["r"][0] == 200, answered
    assert_resident_back(probe)

    # With "fail": 503, Retry-After from gpuswapd's estimate, and the body names the holder.
    gw.stop()
    failing = stack_config(world, "gateway-fail", **gateway_sections(on_resident_busy="fail"),
                           daemon={"socket": str(daemon.socket), "linger": "0.3s"})
    gateway(daemon, failing)
    assert daemon.ctl("acquire", "--holder", "trainer", "--for", "2m").returncode == 0
    status, body, headers = request("POST", "/v1/chat/completions", CHAT_STRATA)
    assert status == 503, body
    assert "trainer until in " in body["error"]["message"]
    retry = int({k.lower(): v for k, v in headers.items()}["retry-after"])
    back = daemon.status()["resident_back"]["in_s"]
    # 2 minutes less what has passed, and the close with the resident's restart (their measured price)
    assert 100 <= retry <= 120 + 60 and abs(retry - back) < 5, (retry, back)
    assert [x["holder"] for x in _leases(daemon)] == ["trainer"]  # nothing else changed
    assert daemon.ctl("release", "--holder", "trainer").returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)


def test_a_client_that_hangs_up_while_waiting_leaves_nothing(gpuswapd: Start, gateway: Gate, probe: Probe,
                                                             world: Stack) -> None:
    # A slow boot: the window is still opening when the client hangs up. With no grace for a retry
    # (daemon.abandon_grace = 0), the opening is rolled back at once.
    daemon = gpuswapd(**gateway_sections(), daemon={"abandon_grace": "0"},
                      window__container={"env": {**_engine_env(), "ENGINE_BOOT_DELAY": "4"}})
    gateway(daemon)
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{URL}/v1/chat/completions",
            json={"model": "hyperqwen", "stream": True, "max_tokens": 8,
                  "messages": [{"role": "user", "content": "x"}]}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept: a dropped iterator closes the stream, hanging up at once
        first = next(lines)
        assert first.startswith(": gpuswapd "), first  # an SSE comment while the window opens
        # gpuswapd's log, not status: a status call is slow on a loaded machine, and the boot is 4 s.
        wait_for(lambda: any(e.get("phase") in ("BOOTING", "WAITING_VRAM", "STOPPING_RESIDENT")
                             for e in daemon.logged("phase_entered")), "the window to be opening", 30)
    # Hung up: the request withdraws, nobody else waits, the window is rolled back.
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "rolled_back", status["last"]
    assert daemon.logged("window_abandoned")
    assert_resident_back(probe)
    assert get("/health")[1]["waiting"] == 0


def test_resident_requests_in_flight_hold_the_drain_and_new_ones_wait_for_the_swap_back(
        gpuswapd: Start, gateway: Gate, probe: Probe, world: Stack) -> None:
    world.use_model(llama.ensure_model(world.cache, "slow"))
    world.restart_resident()
    daemon = gpuswapd(**{**gateway_sections(), "resident__idle": {"kind": "gateway", "wait": "90s"}})
    gateway(daemon)
    ended: dict[str, float] = {}

    def long_resident_stream() -> None:
        with httpx.Client(timeout=120) as http, http.stream(
                "POST", f"{URL}/v1/chat/completions",
                json={"model": "strata", "stream": True, "max_tokens": 48, "stream_options": {"include_usage": True},
                      "messages": [{"role": "user", "content": "write a long story"}]}) as resp:
            ended["usage"] = float(any(e.get("usage") for e in _events("\n".join(resp.iter_lines()))))
        ended["at"] = time.time()

    streaming = threading.Thread(target=long_resident_stream)
    streaming.start()
    wait_for(lambda: get("/health")[1]["resident_in_flight"] == 1, "the resident request to be in flight", 20)
    engine: dict[str, Any] = {}
    opener = threading.Thread(target=lambda: engine.update(r=request(
        "POST", "/v1/chat/completions",
        {"model": "hyperqwen", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})))
    opener.start()
    # The gateway batches: the engine's request asks for the card once the resident's request in
    # flight has ended, or has run past the resident's residency (at most hold / 4); either way the
    # drain waits for what is in flight.
    wait_for(lambda: daemon.status()["phase"] != "IDLE", "the window to open", 90)
    # While the window opens a new resident request waits (it would keep a drain going for ever).
    late: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: late.update(r=request("POST", "/v1/chat/completions", CHAT_STRATA)))
    waiter.start()
    streaming.join(120)
    assert ended.get("usage") == 1.0, ended  # the request in flight was answered whole
    opener.join(120)
    assert engine["r"][0] == 200, engine
    stopped = int(probe.prop("strata.service", "InactiveEnterTimestamp")) / 1e6
    assert stopped > ended["at"] - 0.5, (stopped, ended)  # the resident stopped only after it was answered
    # The engine's request ended and only the gateway's idle lease keeps the window: the waiting
    # resident request swaps it back and is answered by the resident.
    waiter.join(120)
    assert late["r"][0] == 200, late
    daemon.wait_phase("IDLE", timeout=30)  # answered from RESUMING_TIMERS on: the timers' resume may still end
    assert daemon.status()["last"]["outcome"] == "closed"
    assert_resident_back(probe)


def test_sigkill_of_the_gateway_mid_window_ends_its_lease(gpuswapd: Start, gateway: Gate, probe: Probe) -> None:
    daemon = gpuswapd(**gateway_sections(idle="10m"))
    gw = gateway(daemon)
    status, body, _ = request("POST", "/v1/chat/completions",
                              {"model": "hyperqwen", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
    assert status == 200, body
    [lease] = _leases(daemon)
    assert lease["remaining_s"] > 60
    killed = time.monotonic()
    gw.kill()
    wait_for(lambda: not _leases(daemon), "the lease to end with the gateway", 10)
    assert time.monotonic() - killed < 5  # at once, not at its expiry
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "closed"
    assert_resident_back(probe)


def test_bad_input_changes_no_window_and_a_crowd_opens_one(gpuswapd: Start, gateway: Gate, probe: Probe,
                                                           world: Stack) -> None:
    daemon = gpuswapd(**gateway_sections(max_waiting=16, max_body="64KiB"))
    gateway(daemon)
    before = boots(world)
    assert request("POST", "/v1/chat/completions", None, raw=b"{not json")[0] == 400
    assert request("POST", "/v1/chat/completions", {"messages": []})[0] == 400
    assert request("POST", "/v1/chat/completions", {"model": "hyperqwen", "pad": "x" * 70_000})[0] == 413
    status, body, _ = request("POST", "/v1/chat/completions", {"model": "gpt-9"})
    assert status == 404 and "hyperqwen" in body["error"]["message"] and "strata" in body["error"]["message"]
    time.sleep(0.5)
    assert daemon.status()["phase"] == "IDLE" and daemon.ctl_json("history")["windows"] == []
    assert boots(world) == before
    assert_resident_back(probe)

    # 40 clients at once ask for the engine's model; 16 may wait: one window opens, some get 429.
    results: list[int] = []
    lock = threading.Lock()

    def ask() -> None:
        code = request("POST", "/v1/chat/completions", {"model": "hyperqwen", "max_tokens": 8,
                                                         "messages": [{"role": "user", "content": "x"}]})[0]
        with lock:
            results.append(code)

    crowd = [threading.Thread(target=ask) for _ in range(40)]
    for t in crowd:
        t.start()
    for t in crowd:
        t.join(120)
    assert len(results) == 40 and set(results) <= {200, 429}, sorted(results)
    assert results.count(429) >= 1 and results.count(200) >= 16, sorted(results)
    assert boots(world) == before + 1  # one window, one engine
    daemon.wait_phase("IDLE", timeout=90)
    assert len(daemon.ctl_json("history")["windows"]) == 1
    assert_resident_back(probe)


def test_a_preemption_revokes_the_gateways_lease_and_leaves_its_unit_running(gpuswapd: Start, probe: Probe,
                                                                           world: Stack) -> None:
    # The shipped units, socket-activated, as a dynamic user in the gpuswap group.
    subprocess.run(["systemd-sysusers", str(REPO / "units" / "sysusers.d" / "gpuswapd.conf")], check=True,
                   capture_output=True, timeout=60)
    daemon = with_profiles(gpuswapd, probe, daemon={"preempt_grace": "2s", "socket_group": "gpuswap"},
                           **gateway_sections(idle="10m"))
    install_units(world, daemon.config, daemon.socket)
    world.manager("StartUnit", "ss", "gpuswapd-gateway.socket", "replace")
    assert probe.active_state("gpuswapd-gateway.service") == "inactive"
    status, body, _ = get("/health")  # the first connection starts the service
    assert status == 200, body
    assert probe.active_state("gpuswapd-gateway.service") == "active"
    # It follows gpuswapd (socket-activated too) once it has reached it: a moment on a loaded machine.
    deadline = time.monotonic() + 30
    while not body["gpuswapd"] and time.monotonic() < deadline:
        time.sleep(0.2)
        status, body, _ = get("/health")
    assert status == 200 and body["gpuswapd"], body

    status, body, _ = request("POST", "/v1/chat/completions",
                              {"model": "hyperqwen", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
    assert status == 200, body
    [lease] = _leases(daemon)
    assert lease["holder"] == "gpuswapd-gateway.service" and lease["unit"] == "gpuswapd-gateway.service"
    urgent = acquire_in_background(daemon, "--profile", "bare", "--priority", "10", "--holder", "urgent",
                                    "--for", "2m")
    _, err = urgent.communicate(timeout=90)
    assert urgent.returncode == 0, err
    last = daemon.ctl_json("history", "--limit", "1")["windows"][-1]
    assert last["preempted"]["holders"][0]["holder"] == "gpuswapd-gateway.service"
    assert last["preempted"]["stopped_units"] == []  # never_stop: only its lease was revoked
    assert probe.active_state("gpuswapd-gateway.service") == "active"
    # A new request for the engine waits for the preemptor's window to end, then gets its own.
    answered: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: answered.update(r=request(
        "POST", "/v1/chat/completions",
        {"model": "hyperqwen", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})))
    waiter.start()
    time.sleep(1.5)
    assert not answered and daemon.status()["window"]["kind"] == "bare"
    assert daemon.ctl("release", "--holder", "urgent").returncode == 0
    waiter.join(120)
    assert answered["r"][0] == 200, answered
    assert [x["holder"] for x in _leases(daemon)] == ["gpuswapd-gateway.service"]
    world.manager("StopUnit", "ss", "gpuswapd-gateway.service", "replace")  # its lease ends with it
    wait_for(lambda: not _leases(daemon), "the stopped unit's lease to end", 30)
    daemon.wait_phase("IDLE", timeout=90)
    world.manager("StopUnit", "ss", "gpuswapd-gateway.socket", "replace")
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "active")


def _engine_env() -> dict[str, str]:
    from tests.conftest import TEST_BOOT_DELAY
    from tests.stack.config import ENGINE_ENV

    return {**ENGINE_ENV, "ENGINE_BOOT_DELAY": TEST_BOOT_DELAY}


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
