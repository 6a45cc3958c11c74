"""The gateway's side of the schedule on the real world: leases kept through trouble, the card moved when it pays.

gpuswapd is the real daemon (killed with SIGKILL and started again in one test), the engines the
simulator in Docker, the gateway a process of its own. Assertions are on real state: the
engine's boot count, gpuswapd's status and history, every request's answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.integration.conftest import assert_resident_back, wait_for
from tests.stack.config import ENGINE_ENV, profile_sections
from tests.stack.daemon import RunningDaemon
from tests.stack.gateway import URL, RunningGateway, gateway_sections, get, request
from tests.stack.probe import Probe
from tests.stack.world import Stack

Start = Callable[..., RunningDaemon]
Gate = Callable[..., RunningGateway]


def chat(model: str, **more: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **more}


def boots(world: Stack) -> int:
    try:
        return int((world.paths.gpu / "engine-boots").read_text() or 0)
    except (OSError, ValueError):
        return 0


@pytest.fixture
def gateway() -> Iterator[Gate]:
    """Start gpuswapd-gateway for a daemon; stopped after the test."""
    started: list[RunningGateway] = []

    def start(daemon: RunningDaemon, config: Any = None) -> RunningGateway:
        gw = RunningGateway(daemon, config)
        started.append(gw)
        return gw.start()

    yield start
    for gw in started:
        gw.stop()


def test_a_client_with_a_5s_timeout_retrying_against_an_8s_boot_is_answered_by_its_third_try(
        gpuswapd: Start, gateway: Gate, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(**gateway_sections(), window__container={"env": {**ENGINE_ENV, "ENGINE_BOOT_DELAY": "8"}})
    gateway(daemon)
    before = boots(world)
    tries: list[str] = []
    for _ in range(3):
        try:
            status, body, _ = request("POST", "/v1/chat/completions", chat("hyperqwen"), timeout=5)
        except OSError as err:  # the client's own timeout: it hangs up and tries again
            tries.append(f"hung up: {err!r}")
            continue
        tries.append(str(status))
        assert status == 200, body
        break
    assert tries[-1] == "200", tries
    assert boots(world) - before == 1, tries  # each retry rejoined the one boot
    daemon.wait_phase("IDLE", timeout=90)  # gateway.idle = 2 s after the answer
    assert_resident_back(probe)


def test_the_gateways_lease_is_given_back_as_its_stream_ends_while_its_request_for_another_profile_waits(
        gpuswapd: Start, gateway: Gate, probe: Probe, world: Stack) -> None:
    profiles = profile_sections(world)
    profiles["profiles__eval"]["serves"] = ["qwen-eval"]
    slow = {**ENGINE_ENV, "ENGINE_CHUNK_DELAY": "0.4", "ENGINE_ANSWER_TOKENS": "24"}
    daemon = gpuswapd(**profiles, daemon={"linger": "1s"}, **gateway_sections(idle="10m"),
                      window__container={"env": slow})
    gateway(daemon)
    ended: dict[str, float] = {}

    def stream() -> None:
        with httpx.Client(timeout=120) as http, http.stream(
                "POST", f"{URL}/v1/chat/completions", json=chat("hyperqwen", stream=True, max_tokens=64)) as resp:
            assert resp.status_code == 200
            ended["chunks"] = float(sum(1 for line in resp.iter_lines() if line.startswith("data: {")))
        ended["at"] = time.monotonic()

    streaming = threading.Thread(target=stream)
    streaming.start()
    wait_for(lambda: (daemon.status()["window"] or {}).get("phase") == "READY", "the default window", 60)
    other: dict[str, Any] = {}
    asking = threading.Thread(target=lambda: other.update(r=request("POST", "/v1/chat/completions",
                                                                    chat("qwen-eval")), at=time.monotonic()))
    asking.start()
    wait_for(lambda: get("/health")[1]["waiting"] == 1, "the request for eval to wait", 20)
    streaming.join(120)
    assert ended.get("chunks", 0) > 3, ended  # the stream was answered whole, eval waiting behind it
    asking.join(120)
    assert other["r"][0] == 200 and other["r"][1]["model"] == "qwen-eval", other
    # The default window was given back as the stream ended, not gateway.idle (10 min) later.
    assert other["at"] - ended["at"] < 60, (other["at"] - ended["at"])
    assert (daemon.status()["window"] or {}).get("profile") == "eval"


def test_sigkill_and_restart_of_gpuswapd_with_6_requests_waiting_through_the_gateway_answers_all(
        gpuswapd: Start, gateway: Gate, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(**gateway_sections(), window__container={"env": {**ENGINE_ENV, "ENGINE_BOOT_DELAY": "6"}})
    gateway(daemon)
    replies: list[tuple[int, Any]] = []

    def ask() -> None:
        status, body, _ = request("POST", "/v1/chat/completions", chat("hyperqwen"), timeout=150)
        replies.append((status, body))

    askers = [threading.Thread(target=ask) for _ in range(6)]
    for t in askers:
        t.start()
    wait_for(lambda: get("/health")[1]["waiting"] == 6, "6 requests waiting for the window", 20)
    wait_for(lambda: daemon.status()["phase"] not in ("IDLE",), "the window to be opening", 30)
    daemon.kill()
    time.sleep(1)  # gpuswapd away for a moment: the waiting requests keep waiting
    assert get("/health")[1]["waiting"] == 6
    daemon.start()
    for t in askers:
        t.join(150)
    assert [status for status, _ in replies] == [200] * 6, replies
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)


def renew_failures() -> float:
    _, text, _ = get("/metrics")
    return sum(float(line.split()[-1]) for line in str(text).splitlines()
               if line.startswith("gpuswapd_gateway_renew_failures_total"))


def test_a_failed_renewal_is_retried_and_the_stream_under_it_outlives_the_leases_first_grant(
        gpuswapd: Start, gateway: Gate, probe: Probe, world: Stack) -> None:
    # gpuswapd grants leases of 20 s at most (max_lease): the gateway renews its own at 10 s left.
    # Around that moment gpuswapd's socket is moved away (as a cleaner of /run would): every renewal
    # fails to connect and is tried again; put back, the next one lands and the stream goes on.
    # 200 tokens, 3 to a chunk every 0.5 s: a stream of ~33 s; the window's own warm-up and verify
    # ask 12 (8 of them reasoning).
    slow = {**ENGINE_ENV, "ENGINE_CHUNK_DELAY": "0.5", "ENGINE_ANSWER_TOKENS": "200"}
    daemon = gpuswapd(daemon={"max_lease": "20s", "default_lease": "20s", "linger": "1s"},
                      **gateway_sections(), window__container={"env": slow},
                      window__warmup={"max_tokens": 12}, window__verify={"max_tokens": 12})
    gateway(daemon)
    streamed: dict[str, Any] = {}

    def stream() -> None:
        with httpx.Client(timeout=120) as http, http.stream(
                "POST", f"{URL}/v1/chat/completions", json=chat("hyperqwen", stream=True, max_tokens=200)) as resp:
            lines = list(resp.iter_lines())
            streamed.update(status=resp.status_code, lines=lines, at=time.time())

    streaming = threading.Thread(target=stream)
    streaming.start()
    wait_for(lambda: bool(((daemon.status()["window"] or {}).get("phase") == "READY")
                          and daemon.status()["window"]["leases"]), "the gateway's lease on a READY window", 60)
    lease = daemon.status()["window"]["leases"][0]
    first_end = float(lease["expires_at"])  # wall clock
    assert first_end - time.time() <= 20.5, lease  # capped by max_lease
    time.sleep(max(0.0, first_end - 13 - time.time()))  # 3 s before the renewal is due
    away = daemon.socket.with_name(daemon.socket.name + ".away")
    daemon.socket.rename(away)
    try:
        wait_for(lambda: renew_failures() >= 1, "a renewal to fail", 15)
        assert time.time() < first_end - 5, "the failure came too late to tell a retry from the first grant"
        time.sleep(2)  # tried again meanwhile (after 0.5 s, then 1 s), and failing again
    finally:
        away.rename(daemon.socket)
    streaming.join(120)
    assert streamed.get("status") == 200, streamed
    chunks = [json.loads(line[6:]) for line in streamed["lines"] if line.startswith("data: {")]
    assert "data: [DONE]" in streamed["lines"] and not [c for c in chunks if "error" in c], streamed["lines"][-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]  # all 200 tokens: the stream ran whole
    assert streamed["at"] > first_end + 5, "the stream did not outlive the lease's first grant"
    assert renew_failures() >= 2, "a failed renewal was not tried again within seconds"
    renewed = [e for e in daemon.logged("lease_renewed") if e.get("lease") == lease["id"]]
    assert renewed, "the lease was never renewed"
    assert not [e for e in daemon.logged("lease_expired") if e.get("lease") == lease["id"]]
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)
