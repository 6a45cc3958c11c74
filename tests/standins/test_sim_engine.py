"""The vLLM-like engine simulator."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

GiB = 1 << 30
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello there engine"}]


@pytest.fixture
def engine(kit: Any, gpusim: Path, procs: Any) -> Callable[..., tuple[Any, int]]:
    """Start an engine (fast settings); returns (process, port). Call again to restart."""
    port = kit.free_port()

    def start(wait: bool = True, **env: str) -> tuple[Any, int]:
        """Run engine_sim.py with these environment overrides."""
        base = {
            "PORT": str(port),
            "ENGINE_HOST": "127.0.0.1",
            "GPUSIM_DIR": str(gpusim),
            "ENGINE_BOOT_DELAY": "0.1",
            "ENGINE_CHUNK_DELAY": "0.002",
            "ENGINE_DEATH_EXIT_DELAY": "0.3",
            "ENGINE_DEAD_AFTER": "0.3",
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "",
        }
        proc = procs.start("engine_sim.py", env={**base, **env}, name="engine")
        if wait:
            kit.wait_until(lambda: kit.port_open(port) or proc.poll() is not None)
            assert proc.poll() is None, proc.log.read_text()
        return proc, port

    return start


def chat(kit: Any, port: int, **body: Any) -> tuple[int, Any]:
    """POST a chat completion; return status and decoded JSON (or SSE events)."""
    status, headers, raw = kit.request(port, "POST", CHAT, {"messages": HELLO, **body})
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        return status, kit.sse_events(raw)
    return status, json.loads(raw)


def test_boot_delay_refuses_then_serves(kit: Any, gpusim: Path, engine: Any) -> None:
    """While loading, VRAM is claimed but the port refuses; then the API serves."""
    start = time.monotonic()
    proc, port = engine(wait=False, ENGINE_BOOT_DELAY="0.6")
    # Loading: the weights are on the GPU already, but nothing listens.
    entry = kit.wait_until(lambda: kit.ledger.snapshot(gpusim)["holders"])[0]
    assert (entry["name"], entry["pid"], entry["bytes"]) == ("hyperqwen", proc.pid, 19.5 * GiB)
    assert not kit.port_open(port)
    kit.wait_until(lambda: kit.port_open(port), timeout=5)
    assert time.monotonic() - start >= 0.6
    assert kit.request(port, "GET", "/health")[0] == 200
    status, _, raw = kit.request(port, "GET", "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "hyperqwen"
    status, _, raw = kit.request(port, "GET", "/metrics")
    assert 'vllm:num_requests_running{model_name="hyperqwen"} 0.0' in raw.decode()
    assert 'vllm:num_requests_waiting{model_name="hyperqwen"} 0.0' in raw.decode()
    state = json.loads(kit.request(port, "GET", "/sim/state")[2])
    assert (state["boots"], state["dead"], state["pid"]) == (1, False, proc.pid)


def test_stream_usage_counts_tokens_not_chunks(kit: Any, engine: Any) -> None:
    """usage.completion_tokens counts emitted tokens, several per chunk."""
    _, port = engine(
        ENGINE_TOKENS_PER_CHUNK="3", ENGINE_REASONING_TOKENS="8", ENGINE_ANSWER_TOKENS="12"
    )
    status, events = chat(
        kit, port, model="hyperqwen", stream=True, stream_options={"include_usage": True}
    )
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["prompt_tokens"] == 3
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    emitted = len(reasoning.split()) + len(content.split())
    assert (len(reasoning.split()), len(content.split())) == (8, 12)
    assert final["usage"]["completion_tokens"] == emitted == 20
    assert final["usage"]["total_tokens"] == 23
    assert emitted > len(deltas)  # several tokens per chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1]][-1] == "stop"
    # Reasoning comes first.
    assert content.startswith("You said: hello there engine")


def test_stream_without_usage_and_old_reasoning_field(kit: Any, engine: Any) -> None:
    """Without include_usage no chunk has usage; the reasoning field is configurable."""
    _, port = engine(ENGINE_REASONING_FIELD="reasoning_content")
    status, events = chat(kit, port, stream=True)
    assert status == 200 and events[-1] == "[DONE]"
    assert all("usage" not in c for c in events[:-1])
    assert any("reasoning_content" in c["choices"][0]["delta"] for c in events[:-1])


def test_non_stream_and_length_finish(kit: Any, engine: Any) -> None:
    """Non-stream replies carry content, reasoning and usage; max_tokens cuts reasoning first."""
    _, port = engine(ENGINE_REASONING_TOKENS="8", ENGINE_ANSWER_TOKENS="12")
    status, body = chat(kit, port)
    message = body["choices"][0]["message"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert len(message["reasoning"].split()) == 8 and len(message["content"].split()) == 12
    assert body["usage"]["completion_tokens"] == 20
    # Thinking eats max_tokens: a small budget ends inside the reasoning, with no answer.
    status, body = chat(kit, port, max_tokens=5)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert len(choice["message"]["reasoning"].split()) == 5
    assert body["usage"]["completion_tokens"] == 5
    status, events = chat(
        kit, port, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    deltas = [c["choices"][0] for c in events[1:-2]]
    content = "".join(d["delta"].get("content", "") for d in deltas)
    assert len(content.split()) == 2 and deltas[-1]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 10


def test_bad_requests(kit: Any, engine: Any) -> None:
    """Bad input gets OpenAI-style errors: 400, and 404 for an unknown model."""
    _, port = engine()
    status, _, raw = kit.request(port, "POST", CHAT, b"{not json")
    assert status == 400 and json.loads(raw)["error"]["code"] == 400
    status, body = chat(kit, port, model="gpt-4")
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    status, _, raw = kit.request(port, "POST", CHAT, {"messages": []})
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"
    status, body = chat(kit, port, stream_options={"include_usage": True})
    assert status == 400
    status, body = chat(kit, port, max_tokens=0)
    assert status == 400
    assert kit.request(port, "GET", "/nope")[0] == 404


def test_engine_death(kit: Any, gpusim: Path, engine: Any) -> None:
    """After death: an open stream gets an error chunk, requests 500, /health 503, exit."""
    proc, port = engine(
        ENGINE_CHUNK_DELAY="0.05", ENGINE_ANSWER_TOKENS="60", ENGINE_DEATH_EXIT_DELAY="0.5"
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(
        "POST",
        CHAT,
        json.dumps({"messages": HELLO, "stream": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the stream is open
    status = kit.request(port, "POST", "/sim/die", {})[0]
    died = time.monotonic()
    assert status == 200
    events = kit.sse_events(resp.read())
    conn.close()
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"].startswith("EngineDeadError")
    assert events[-2]["error"]["code"] == 500
    status, body = chat(kit, port)
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    assert body["error"]["message"].startswith("EngineDeadError")
    assert kit.request(port, "GET", "/health")[0] == 503
    assert proc.wait(timeout=5) != 0
    assert time.monotonic() - died >= 0.4
    assert kit.ledger.snapshot(gpusim)["holders"][0]["dead_at"] is not None


def test_engine_death_keep_alive(kit: Any, engine: Any) -> None:
    """With VLLM_KEEP_ALIVE_ON_ENGINE_DEATH the dead engine stays up."""
    proc, port = engine(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH="1", ENGINE_DEATH_EXIT_DELAY="0.1")
    assert kit.request(port, "POST", "/sim/die")[0] == 200
    time.sleep(0.4)
    assert proc.poll() is None
    assert kit.request(port, "GET", "/health")[0] == 503
    assert chat(kit, port)[0] == 500


def test_failing_boots_persist_across_restarts(kit: Any, gpusim: Path, engine: Any) -> None:
    """failing_boots=1: the first restart dies by itself, the second is healed."""

    def vram_free() -> bool:
        """Whether the dead engine's memory has been released."""
        return bool(kit.ledger.snapshot(gpusim)["free_bytes"] == 24 * GiB)

    proc, port = engine()
    assert kit.request(port, "POST", "/sim/die", {"failing_boots": 1})[0] == 200
    assert proc.wait(timeout=5) != 0
    kit.wait_until(vram_free)
    # Restart 1: comes up healthy, then dies by itself.
    proc, port = engine()
    assert kit.request(port, "GET", "/health")[0] == 200
    kit.wait_until(lambda: kit.request(port, "GET", "/health")[0] == 503, timeout=3)
    assert proc.wait(timeout=5) != 0
    kit.wait_until(vram_free)
    # Restart 2: healed.
    proc, port = engine()
    time.sleep(0.5)
    assert kit.request(port, "GET", "/health")[0] == 200
    assert chat(kit, port)[0] == 200
    state = json.loads(kit.request(port, "GET", "/sim/state")[2])
    assert (state["boots"], state["boot"], state["failing_boots"], state["dead"]) == (
        3,
        3,
        0,
        False,
    )
    assert state["requests_served"] == 1
    assert (gpusim / "engine-boots").read_text().strip() == "3"


def test_oom_at_boot(kit: Any, gpusim: Path, engine: Any) -> None:
    """No room in the ledger: the engine fails like CUDA OOM and exits 1."""
    fd = kit.ledger.claim(gpusim, "strata", 21 * GiB)
    proc, port = engine(wait=False)
    assert proc.wait(timeout=5) == 1
    assert "torch.OutOfMemoryError: CUDA out of memory" in proc.log.read_text()
    assert not kit.port_open(port)
    assert kit.ledger.ooms(gpusim)[0]["name"] == "hyperqwen"
    os.close(fd)


SLEEPY = {
    "ENGINE_SLEEP_RESIDUAL_1": "1GiB",
    "ENGINE_SLEEP_RESIDUAL_2": "0.5GiB",
    "ENGINE_SLEEP_DELAY": "0.05",
    "ENGINE_WAKE_DELAY_1": "0.1",
    "ENGINE_WAKE_DELAY_2": "0.2",
}
CANARY = {"temperature": 0, "seed": 1234, "max_tokens": 12}


def state(kit: Any, port: int) -> Any:
    """The engine's ``/sim/state``."""
    return json.loads(kit.request(port, "GET", "/sim/state")[2])


def asleep(kit: Any, port: int) -> bool:
    """What ``/is_sleeping`` says."""
    status, _, raw = kit.request(port, "GET", "/is_sleeping")
    assert status == 200
    return bool(json.loads(raw)["is_sleeping"])


def engine_entry(kit: Any, gpusim: Path) -> tuple[str, int | None, int]:
    """(name, pid, bytes) of the engine's live ledger entry (not what it is still freeing)."""
    [entry] = [h for h in kit.ledger.snapshot(gpusim)["holders"] if h["name"] == "hyperqwen" and h["dead_at"] is None]
    return entry["name"], entry["pid"], entry["bytes"]


def text(kit: Any, port: int, **body: Any) -> str:
    """The raw text of a non-streamed completion: reasoning, then content."""
    status, reply = chat(kit, port, **body)
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    return f"{message['reasoning'] or ''}|{message['content'] or ''}"


def timed(kit: Any, port: int, path: str) -> tuple[int, float]:
    """POST ``path``; return the status and how long it took."""
    start = time.monotonic()
    status = kit.request(port, "POST", path)[0]
    return status, time.monotonic() - start


def test_sleep_and_wake(kit: Any, gpusim: Path, engine: Any) -> None:
    """Asleep, the engine holds its level's residual (same holder, same PID) once the lag has passed; awake, all."""
    proc, port = engine(**SLEEPY)
    assert engine_entry(kit, gpusim) == ("hyperqwen", proc.pid, int(19.5 * GiB))
    for bad in ("3", "0", "deep"):
        status, _, raw = kit.request(port, "POST", f"/sleep?level={bad}")
        error = json.loads(raw)["error"]
        assert (status, error["code"], error["param"]) == (400, 400, "level")
    assert asleep(kit, port) is False
    for level, residual, wake_delay in ((1, GiB, 0.1), (2, GiB // 2, 0.2)):
        status, took = timed(kit, port, f"/sleep?level={level}")
        assert status == 200 and took >= 0.05
        assert asleep(kit, port) is True
        assert engine_entry(kit, gpusim) == ("hyperqwen", proc.pid, residual)
        # What it let go is still its own for the lag (0.5 s here), under its PID: then free.
        assert kit.ledger.snapshot(gpusim)["free_bytes"] == 24 * GiB - int(19.5 * GiB)
        settled = 24 * GiB - residual
        kit.wait_until(lambda settled=settled: kit.ledger.snapshot(gpusim)["free_bytes"] == settled, timeout=2)
        # Asleep already: nothing changes, not even the level.
        assert kit.request(port, "POST", "/sleep?level=1")[0] == 200
        assert engine_entry(kit, gpusim)[2] == residual
        assert state(kit, port)["sleep_level"] == level
        status, took = timed(kit, port, "/wake_up")
        assert status == 200 and took >= wake_delay
        assert asleep(kit, port) is False
        assert engine_entry(kit, gpusim) == ("hyperqwen", proc.pid, int(19.5 * GiB))
        assert chat(kit, port)[0] == 200
    # Awake already: nothing changes.
    status, took = timed(kit, port, "/wake_up")
    assert status == 200 and took < 0.1
    got = state(kit, port)
    assert (got["sleep_level"], got["wakes"], got["garbled"]) == (None, 2, False)
    assert got["dead"] is False
    assert kit.ledger.ooms(gpusim) == []


def test_wake_without_room_fails_and_stays_asleep(kit: Any, gpusim: Path, engine: Any) -> None:
    """Someone took the room meanwhile: waking fails like CUDA OOM, the engine stays asleep."""
    led = kit.ledger
    proc, port = engine(**SLEEPY)
    assert kit.request(port, "POST", "/sleep?level=1")[0] == 200
    kit.wait_until(lambda: led.snapshot(gpusim)["free_bytes"] == 23 * GiB, timeout=2)  # after the lag
    fd = led.claim(gpusim, "strata", 10 * GiB)  # 13 GiB left; waking needs 18.5 more
    status, _, raw = kit.request(port, "POST", "/wake_up")
    error = json.loads(raw)["error"]
    assert status == 500 and "out of memory" in error["message"]
    assert error["type"] == "InternalServerError"
    assert asleep(kit, port) is True
    assert engine_entry(kit, gpusim) == ("hyperqwen", proc.pid, GiB)
    [oom] = led.ooms(gpusim)
    assert (oom["name"], oom["wanted_bytes"]) == ("hyperqwen", int(18.5 * GiB))
    assert kit.request(port, "GET", "/health")[0] == 200  # still alive, just asleep
    led.release(gpusim, "strata", fd)
    assert kit.request(port, "POST", "/wake_up")[0] == 200
    assert engine_entry(kit, gpusim) == ("hyperqwen", proc.pid, int(19.5 * GiB))
    assert chat(kit, port)[0] == 200
    assert state(kit, port)["wakes"] == 1


def test_completion_while_asleep_kills_the_engine(kit: Any, gpusim: Path, engine: Any) -> None:
    """The other endpoints answer while asleep; a completion gets 500 and the engine dies."""
    proc, port = engine(**SLEEPY, ENGINE_DEATH_EXIT_DELAY="0.3")
    assert kit.request(port, "POST", "/sleep?level=2")[0] == 200
    for path in ("/health", "/v1/models", "/version", "/metrics", "/is_sleeping", "/sim/state"):
        assert kit.request(port, "GET", path)[0] == 200, path
    status, body = chat(kit, port, stream=True)
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    assert body["error"]["message"].startswith("EngineDeadError")
    assert "asleep" in body["error"]["message"]
    assert kit.request(port, "GET", "/health")[0] == 503
    assert kit.request(port, "POST", "/wake_up")[0] == 500
    assert proc.wait(timeout=5) == 1
    assert kit.ledger.snapshot(gpusim)["holders"][0]["dead_at"] is not None


def test_same_request_same_text(kit: Any, engine: Any) -> None:
    """Completions are deterministic: the same request gets the same text, streamed or not."""
    _, port = engine()
    first = text(kit, port, **CANARY)
    assert text(kit, port, **CANARY) == first
    status, events = chat(kit, port, stream=True, **CANARY)
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    streamed = "".join(d.get("reasoning", "") for d in deltas)
    streamed += "|" + "".join(d.get("content", "") for d in deltas)
    assert status == 200 and streamed == first
    other = [{"role": "user", "content": "something else"}]
    assert text(kit, port, **CANARY, messages=other) != first


def test_garbled_wakes(kit: Any, gpusim: Path, engine: Any) -> None:
    """Each of the next N wakes counts the fault down and garbles the text; a clean one heals."""
    fault = gpusim / "engine-fault.json"
    _, port = engine(**{**SLEEPY, "ENGINE_WAKE_DELAY_2": "0.1"})
    clean = text(kit, port, **CANARY)
    fault.write_text(json.dumps({"failing_boots": 0, "garbled_wakes": 2}))
    garbled = []
    for left, level in ((1, 2), (0, 1)):
        assert kit.request(port, "POST", f"/sleep?level={level}")[0] == 200
        assert kit.request(port, "POST", "/wake_up")[0] == 200
        assert json.loads(fault.read_text()) == {"failing_boots": 0, "garbled_wakes": left}
        got = text(kit, port, **CANARY)
        assert got != clean and len(got.split()) == len(clean.split())
        assert text(kit, port, **CANARY) == got  # still deterministic
        garbled.append(got)
        assert state(kit, port)["garbled"] is True
    status, body = chat(kit, port, **CANARY)
    assert status == 200 and body["usage"]["completion_tokens"] == 12
    # Garbled the whole way: every word differs, even a one-token reply.
    assert text(kit, port, **{**CANARY, "max_tokens": 1}).split("|")[0] != "Let"
    # The next wake is clean: the original text is back.
    assert kit.request(port, "POST", "/sleep?level=1")[0] == 200
    assert kit.request(port, "POST", "/wake_up")[0] == 200
    assert text(kit, port, **CANARY) == clean
    got = state(kit, port)
    assert (got["garbled"], got["wakes"], got["garbled_wakes"]) == (False, 3, 0)


def test_residual_over_vram_refused_at_start(kit: Any, gpusim: Path, engine: Any) -> None:
    """A sleep residual larger than ENGINE_VRAM is a configuration error: exit 1, no claim."""
    proc, port = engine(wait=False, ENGINE_VRAM="2GiB", ENGINE_SLEEP_RESIDUAL_2="3GiB")
    assert proc.wait(timeout=5) == 1
    assert not kit.port_open(port)
    assert "ENGINE_SLEEP_RESIDUAL_2" in proc.log.read_text()
    assert kit.ledger.snapshot(gpusim)["holders"] == []
    assert not (gpusim / "engine-boots").exists()


def test_sleep_needs_dev_mode(kit: Any, engine: Any) -> None:
    """Sleep endpoints exist only with VLLM_SERVER_DEV_MODE=1, as in vLLM."""
    _, port = engine(VLLM_SERVER_DEV_MODE="")
    assert kit.request(port, "POST", "/sleep?level=1")[0] == 404
    assert kit.request(port, "POST", "/wake_up")[0] == 404
    assert kit.request(port, "GET", "/is_sleeping")[0] == 404


def test_sigterm_exits_promptly(kit: Any, gpusim: Path, engine: Any) -> None:
    """SIGTERM: exit 0 at once, and the claim dies with the process."""
    proc, _ = engine()
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=2) == 0
    assert kit.ledger.snapshot(gpusim)["holders"][0]["dead_at"] is not None


def test_warm_delay_and_concurrent_streams(kit: Any, engine: Any) -> None:
    """The first completions are slow (cold); streams run concurrently."""
    _, port = engine(ENGINE_WARM_DELAY="0.4", ENGINE_CHUNK_DELAY="0.03")
    results: list[tuple[int, Any]] = []

    def one() -> None:
        """Run one streamed completion."""
        results.append(chat(kit, port, stream=True, stream_options={"include_usage": True}))

    start = time.monotonic()
    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    metric = 'vllm:num_requests_running{model_name="hyperqwen"} 2.0'
    kit.wait_until(lambda: metric in kit.request(port, "GET", "/metrics")[2].decode())
    for t in threads:
        t.join(timeout=10)
    cold = time.monotonic() - start
    assert cold >= 0.4
    assert [r[1][-2]["usage"]["completion_tokens"] for r in results] == [20, 20]
    start = time.monotonic()
    assert chat(kit, port)[0] == 200
    assert time.monotonic() - start < cold - 0.25  # warm now


def test_anthropic_and_responses_clients_get_the_chat_words(kit: Any, engine: Any) -> None:
    """vLLM serves /v1/messages and /v1/responses: the official clients read the same words a chat gets."""
    import anthropic
    import openai

    _, port = engine(ENGINE_REASONING_TOKENS="2", ENGINE_ANSWER_TOKENS="6")
    words = chat(kit, port, max_tokens=5)[1]["choices"][0]["message"]
    said = (words.get("reasoning") or words.get("reasoning_content") or "").split() + (words["content"] or "").split()
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="x", max_retries=0, timeout=10)
    message = claude.messages.create(model="hyperqwen", max_tokens=5, messages=HELLO)  # type: ignore[arg-type]
    assert message.content[0].text.split() == said and message.usage.output_tokens == 5  # type: ignore[union-attr]
    assert message.stop_reason == "max_tokens"
    with claude.messages.stream(model="hyperqwen", max_tokens=64, messages=HELLO) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert len(text.split()) == final.usage.output_tokens == 8 and final.stop_reason == "end_turn"
    assert claude.messages.count_tokens(model="hyperqwen", messages=HELLO).input_tokens == 3  # type: ignore[arg-type]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10)
    response = client.responses.create(model="hyperqwen", input="hello there engine", max_output_tokens=5)
    assert response.output_text.split() == said and response.usage and response.usage.output_tokens == 5
    with client.responses.stream(model="hyperqwen", input="hello there engine") as events:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        done = events.get_final_response()
    assert "".join(deltas) == done.output_text and done.usage and done.usage.output_tokens == 8
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="other", max_tokens=5, messages=HELLO)  # type: ignore[arg-type]
