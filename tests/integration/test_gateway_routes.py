"""Every client through the front door: llama-swap's routes and names through gpuswapd-gateway, on the real world.

The official ``anthropic`` client to the resident's real llama-server (it serves ``/v1/messages``)
and to the engine's model (the vLLM simulator serves it too, and the window opens); the official
``openai`` client's Responses API to the engine's model; ``/infill`` and ``/completion`` to the
real llama-server; llama-swap's other routes, its aliases, a model added while the gateway runs,
and its ``apiKeys``, through the llama-swap stand-in. Assertions on real state: the answers'
tokens, gpuswapd's status and history, the units over D-Bus.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.integration.conftest import assert_resident_back, wait_for
from tests.stack.daemon import RunningDaemon
from tests.stack.gateway import URL, RunningGateway, gateway_sections, get
from tests.stack.probe import Probe
from tests.stack.world import Stack

Start = Callable[..., RunningDaemon]
Gate = Callable[..., RunningGateway]
HELLO = [{"role": "user", "content": "Say hi"}]


@pytest.fixture
def gateway() -> Iterator[Gate]:
    """Start gpuswapd-gateway for a daemon; stopped after the test."""
    started: list[RunningGateway] = []

    def start(daemon: RunningDaemon) -> RunningGateway:
        gw = RunningGateway(daemon)
        started.append(gw)
        return gw.start()

    yield start
    for gw in started:
        gw.stop()


def _leases(daemon: RunningDaemon) -> list[dict[str, Any]]:
    return list((daemon.status()["window"] or {}).get("leases") or [])


def test_anthropic_and_responses_clients_and_fill_in_the_middle_reach_the_resident_and_the_engine(
        gpuswapd: Start, gateway: Gate, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(**gateway_sections())
    gateway(daemon)
    claude = anthropic.Anthropic(base_url=URL, api_key="not-needed", max_retries=0, timeout=120)

    # The resident: llama.cpp's server answers Anthropic's Messages API itself; no window.
    message = claude.messages.create(model="strata", max_tokens=8, messages=HELLO)  # type: ignore[arg-type]
    assert message.content[0].text and message.usage.output_tokens == 8, message  # type: ignore[union-attr]
    with claude.messages.stream(model="strata", max_tokens=8, messages=HELLO) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens == 8, final
    counted = claude.messages.count_tokens(model="strata", messages=HELLO)  # type: ignore[arg-type]
    assert counted.input_tokens > 0
    with httpx.Client(base_url=URL, timeout=120) as http:
        done = http.post("/completion", json={"model": "strata", "prompt": "Once upon", "n_predict": 6}).json()
        assert done["content"] and done["tokens_predicted"] == 6, done
        fim = http.post("/infill", json={"model": "strata", "input_prefix": "def add(a, b):\n    return ",
                                         "input_suffix": "\n", "n_predict": 4})
        assert fim.status_code == 200 and fim.json()["tokens_predicted"] == 4, fim.text
    assert daemon.status()["phase"] == "IDLE" and daemon.ctl_json("history")["windows"] == []

    # The engine's model: the first request opens its window; each client's answer is whole.
    message = claude.messages.create(model="hyperqwen", max_tokens=6, messages=HELLO)  # type: ignore[arg-type]
    assert len(message.content[0].text.split()) == message.usage.output_tokens == 6  # type: ignore[union-attr]
    [lease] = _leases(daemon)
    assert lease["holder"].startswith("gpuswapd-gateway[") and daemon.status()["phase"] == "READY"
    with claude.messages.stream(model="hyperqwen", max_tokens=64, messages=HELLO) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert len(text.split()) == final.usage.output_tokens > 6 and final.stop_reason == "end_turn"
    client = OpenAI(base_url=f"{URL}/v1", api_key="not-needed", max_retries=0, timeout=120)
    response = client.responses.create(model="hyperqwen", input="Write a haiku", max_output_tokens=5)
    assert len(response.output_text.split()) == 5 and response.usage and response.usage.output_tokens == 5
    with client.responses.stream(model="hyperqwen", input="Write a haiku") as events:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        streamed = events.get_final_response()
    assert "".join(deltas) == streamed.output_text and streamed.usage and streamed.usage.output_tokens > 5
    # Anthropic's route gets Anthropic's error shape from the gateway itself.
    with pytest.raises(anthropic.NotFoundError) as lost:
        claude.messages.create(model="gpt-9", max_tokens=4, messages=HELLO)  # type: ignore[arg-type]
    assert lost.value.body["type"] == "error" and "hyperqwen" in lost.value.body["error"]["message"]  # type: ignore[index]
    status = daemon.wait_phase("IDLE", timeout=90)
    assert status["last"]["outcome"] == "closed" and len(daemon.ctl_json("history")["windows"]) == 1
    assert_resident_back(probe)


def test_llama_swaps_other_routes_names_and_keys_pass_the_front_door(gpuswapd: Start, gateway: Gate, probe: Probe,
                                                                    world: Stack) -> None:
    daemon = gpuswapd(**gateway_sections())
    gateway(daemon)
    with httpx.Client(base_url=URL, timeout=60) as http:
        preflight = http.options("/v1/chat/completions?x=1", headers={"Origin": "http://ui.example",
                                                                      "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == "http://ui.example"
        assert preflight.headers["x-llama-swap-saw"] == "/v1/chat/completions?x=1"
        for target in ("/running?verbose=1", "/logs?n=2", "/ui/models", "/upstream/strata/health?x=1"):
            reply = http.get(target)
            assert reply.status_code == 200, (target, reply.text)
            if not target.startswith("/upstream/"):
                assert reply.headers["x-llama-swap-saw"] == target
        props = http.get("/upstream/strata/props")  # the real llama-server's own route, through llama-swap
        assert props.status_code == 200 and "default_generation_settings" in props.json()
        audio = http.post("/v1/audio/transcriptions?lang=en", files={"file": ("a.wav", b"RIFF" + bytes(2048))},
                          data={"model": "strata"})
        assert audio.status_code == 200 and audio.json()["model"] == "strata", audio.text
        unload = http.post("/unload")
        assert unload.status_code == 403 and "gpuswapctl acquire" in unload.json()["error"]["message"]
        assert probe.active_state("strata.service") == "active"

        # An endless stream passed through (/api/events) holds no drain: the window opens under it.
        opened: dict[str, Any] = {}
        with http.stream("GET", "/api/events") as events:
            assert events.status_code == 200 and events.headers["content-type"].startswith("text/event-stream")
            lines = events.iter_lines()
            assert next(lines).startswith(":")
            asker = threading.Thread(target=lambda: opened.update(r=http.post("/v1/chat/completions", json={
                "model": "hyperqwen", "max_tokens": 4, "messages": HELLO})))
            asker.start()
            asker.join(120)
        assert opened["r"].status_code == 200, opened["r"].text
        daemon.wait_phase("IDLE", timeout=90)

        # Names llama-swap learns while the gateway runs: an alias, an added model, then apiKeys.
        control = world.paths.control / "llama-swap.json"
        control.write_text(json.dumps({"aliases": ["coder"], "models": ["added"]}))
        for name in ("coder", "added"):
            reply = http.post("/v1/chat/completions", json={"model": name, "max_tokens": 4, "messages": HELLO})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, (name, reply.text)
        control.write_text(json.dumps({"models": ["keyed"], "api_keys": ["sk-llama-swap"]}))
        time.sleep(1.1)  # an unknown name asks llama-swap again at most once a second
        keyed = {"model": "keyed", "max_tokens": 4, "messages": HELLO}
        assert http.post("/v1/chat/completions", json=keyed).status_code == 404  # llama-swap lists nothing without
        reply = http.post("/v1/chat/completions", json=keyed, headers={"Authorization": "Bearer sk-llama-swap"})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text
        lost = http.post("/v1/chat/completions", json={"model": "x" * 5000, "messages": HELLO},
                         headers={"Authorization": "Bearer sk-llama-swap"})
        assert lost.status_code == 404 and "keyed" in lost.json()["error"]["message"] and len(lost.text) < 1500
    metrics = get("/metrics")[1]
    assert 'model="(passed)"' in metrics and 'model="keyed"' in metrics
    wait_for(lambda: daemon.status()["phase"] == "IDLE", "the gateway's window to end", 90)
    assert_resident_back(probe)
