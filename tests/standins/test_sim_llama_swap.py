"""The llama-swap-like proxy and the agent job."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]
LOADING = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'


class FakeUpstream:
    """A scriptable llama-server stand-in: health answers in order, streams that may break."""

    def __init__(self) -> None:
        self.health: list[int] = [200]
        self.health_calls = 0
        self.break_stream = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                """Stay quiet."""

            def do_GET(self) -> None:
                """Answer /health with the next scripted status."""
                outer.health_calls += 1
                status = outer.health[min(outer.health_calls, len(outer.health)) - 1]
                body = b'{"status":"ok"}' if status == 200 else LOADING
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                """Stream three events, or break off after two."""
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("X-Upstream", "fake")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(3):
                    data = f"data: {json.dumps({'n': i})}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                    if outer.break_stream and i == 1:
                        self.close_connection = True  # vanish without the last chunk
                        return
                    time.sleep(0.05)
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeUpstream]:
    """A fake upstream in a thread of the test process."""
    up = FakeUpstream()
    yield up
    up.close()


@pytest.fixture
def proxy(kit: Any, procs: Any) -> Callable[..., int]:
    """Start llama_swap.py in front of an upstream port; returns its port."""

    def start(upstream_port: int, *extra: str, port: int = 0) -> int:
        """Run the proxy and wait until it listens."""
        port = port or kit.free_port()
        procs.start(
            "llama_swap.py",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            f"http://127.0.0.1:{upstream_port}",
            "--model",
            "strata",
            "--poll",
            "0.05",
            *extra,
            name="proxy",
        )
        kit.wait_until(lambda: kit.port_open(port))
        return port

    return start


def start_engine(kit: Any, procs: Any, gpusim: Path, port: int, **env: str) -> Any:
    """Run the engine simulator as the member (served model id strata)."""
    base = {
        "PORT": str(port),
        "ENGINE_HOST": "127.0.0.1",
        "GPUSIM_DIR": str(gpusim),
        "ENGINE_MODEL": "strata",
        "ENGINE_NAME": "strata",
        "ENGINE_BOOT_DELAY": "0.05",
        "ENGINE_CHUNK_DELAY": "0.002",
    }
    return procs.start("engine_sim.py", env={**base, **env}, name="member")


def test_forwards_a_stream_unbuffered(kit: Any, procs: Any, gpusim: Path, proxy: Any) -> None:
    """A stream is relayed as it comes, with the member's headers."""
    up = kit.free_port()
    start_engine(
        kit,
        procs,
        gpusim,
        up,
        ENGINE_CHUNK_DELAY="0.1",
        ENGINE_REASONING_TOKENS="3",
        ENGINE_ANSWER_TOKENS="12",
    )
    kit.wait_until(lambda: kit.port_open(up))
    port = proxy(up)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    start = time.monotonic()
    body = {
        "model": "strata",
        "messages": HELLO,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn.request("POST", CHAT, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    assert resp.getheader("Server") == "uvicorn"  # the member's headers are kept
    first = resp.readline()
    first_at = time.monotonic() - start
    events = kit.sse_events(first + resp.read())
    total = time.monotonic() - start
    conn.close()
    assert first_at < total - 0.3, "the first chunk must not wait for the whole stream"
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 15


def test_routing_errors_and_passthrough(kit: Any, procs: Any, gpusim: Path, proxy: Any) -> None:
    """Model routing errors, member errors passed through, local routes."""
    up = kit.free_port()
    start_engine(kit, procs, gpusim, up)
    kit.wait_until(lambda: kit.port_open(up))
    port = proxy(up)
    status, _, raw = kit.request(port, "POST", CHAT, {"model": "other", "messages": HELLO})
    assert status == 400 and json.loads(raw) == {"error": "could not find real modelID for other"}
    status, _, raw = kit.request(port, "POST", CHAT, {"messages": HELLO})
    assert status == 400 and "missing or invalid 'model' key" in raw.decode()
    # The member's own error passes through untouched.
    status, _, raw = kit.request(port, "POST", CHAT, {"model": "strata", "messages": []})
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"
    status, _, raw = kit.request(port, "POST", CHAT, {"model": "strata", "messages": HELLO})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 20
    status, _, raw = kit.request(port, "GET", "/v1/models")
    assert [m["id"] for m in json.loads(raw)["data"]] == ["strata"]
    assert kit.request(port, "GET", "/health")[:3:2] == (200, b"OK")
    assert kit.request(port, "POST", "/unload")[0] == 200
    status, _, raw = kit.request(port, "GET", "/running")
    assert json.loads(raw)["running"][0] | {"proxy": None} == {
        "model": "strata",
        "state": "ready",
        "proxy": None,
    }


def test_waits_for_member_health(kit: Any, fake: FakeUpstream, proxy: Any) -> None:
    """Requests wait while the member's /health says 503."""
    fake.health = [503, 503, 503, 200]
    port = proxy(fake.port)
    status, _, raw = kit.request(port, "GET", "/running")
    assert json.loads(raw)["running"][0]["state"] == "starting"
    status, headers, raw = kit.request(port, "POST", CHAT, {"model": "strata", "messages": HELLO})
    assert status == 200 and headers["X-Upstream"] == "fake"
    assert [e["n"] for e in kit.sse_events(raw)] == [0, 1, 2]
    assert fake.health_calls >= 4


def test_waits_for_member_to_start_listening(
    kit: Any, procs: Any, gpusim: Path, proxy: Any
) -> None:
    """Requests wait while the member does not listen yet."""
    up = kit.free_port()
    port = proxy(up)
    assert json.loads(kit.request(port, "GET", "/running")[2])["running"][0]["state"] == "stopped"
    timer = threading.Timer(0.3, start_engine, (kit, procs, gpusim, up))
    timer.start()
    status, _, raw = kit.request(port, "POST", CHAT, {"model": "strata", "messages": HELLO})
    timer.join()
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "stop"


def test_gives_up_when_member_never_comes(kit: Any, fake: FakeUpstream, proxy: Any) -> None:
    """Health timeout: 502 if unreachable, 503 if still unhealthy."""
    port = proxy(kit.free_port(), "--health-timeout", "0.3")
    status, _, raw = kit.request(port, "POST", CHAT, {"model": "strata", "messages": HELLO})
    assert status == 502 and "not ready" in json.loads(raw)["error"]
    fake.health = [503]
    port = proxy(fake.port, "--health-timeout", "0.3")
    status, _, raw = kit.request(port, "POST", CHAT, {"model": "strata", "messages": HELLO})
    assert status == 503 and "health 503" in json.loads(raw)["error"]


def test_member_vanishing_mid_stream(kit: Any, fake: FakeUpstream, proxy: Any) -> None:
    """A member vanishing mid-stream truncates that response; the proxy lives on."""
    fake.break_stream = True
    port = proxy(fake.port)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(
        "POST",
        CHAT,
        json.dumps({"model": "strata", "messages": HELLO}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    with pytest.raises(http.client.IncompleteRead) as err:
        resp.read()
    conn.close()
    assert [e["n"] for e in kit.sse_events(err.value.partial)] == [0, 1]
    # The proxy is still there and serves the next request.
    fake.break_stream = False
    assert kit.request(port, "GET", "/health")[0] == 200
    status, _, raw = kit.request(port, "POST", CHAT, {"model": "strata", "messages": HELLO})
    assert status == 200 and len(kit.sse_events(raw)) == 3


# -- agent_job.py


def agent(kit: Any, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run agent_job.py; returns the result and how long it took."""
    start = time.monotonic()
    proc = subprocess.run(
        [kit.PY, str(kit.SIM / "agent_job.py"), *args], capture_output=True, text=True, timeout=20
    )
    return proc, time.monotonic() - start


def test_agent_job(kit: Any, procs: Any, gpusim: Path, proxy: Any, tmp_path: Path) -> None:
    """agent_job.py succeeds through the proxy, holds when told, fails on HTTP errors."""
    up = kit.free_port()
    start_engine(kit, procs, gpusim, up)
    port = proxy(up)
    url = f"http://127.0.0.1:{port}{CHAT}"
    proc, took = agent(kit, "--url", url, "--model", "strata", "--name", "a1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("agent a1: ok finish=length completion_tokens=16")
    hold = tmp_path / "hold"
    hold.write_text("0.6\n")
    proc, took = agent(kit, "--url", url, "--name", "a2", "--hold-file", str(hold))
    assert proc.returncode == 0 and took >= 0.6
    proc, _ = agent(kit, "--url", url, "--model", "nope", "--name", "a3")
    assert proc.returncode == 1 and "HTTP 400" in proc.stderr


def test_agent_job_retries_connection_errors_only_briefly(
    kit: Any, procs: Any, gpusim: Path, proxy: Any
) -> None:
    """agent_job.py retries connection errors for a short while only."""
    dead = f"http://127.0.0.1:{kit.free_port()}{CHAT}"
    proc, took = agent(kit, "--url", dead, "--name", "a4", "--retry-for", "0.3")
    assert proc.returncode == 1 and "cannot reach" in proc.stderr and took >= 0.3
    # A server that appears within the retry window is reached.
    up = kit.free_port()
    start_engine(kit, procs, gpusim, up)
    kit.wait_until(lambda: kit.port_open(up))
    late = kit.free_port()
    timer = threading.Timer(0.4, proxy, (up,), {"port": late})
    timer.start()
    proc, _ = agent(kit, "--url", f"http://127.0.0.1:{late}{CHAT}", "--name", "a5")
    timer.join()
    assert proc.returncode == 0, proc.stderr


def _ask(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_llama_swaps_other_routes_names_and_keys(kit: Any, procs: Any, gpusim: Path, proxy: Any,
                                                  tmp_path: Path) -> None:
    """CORS, its own routes with the target seen, /upstream/, forms by model, aliases, added models, apiKeys."""
    up = kit.free_port()
    start_engine(kit, procs, gpusim, up)
    kit.wait_until(lambda: kit.port_open(up))
    port = proxy(up, "--control", str(tmp_path))
    status, headers, _ = _ask(port, "OPTIONS", "/v1/chat/completions?x=1", headers={"Origin": "http://ui"})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://ui"
    assert headers["X-Llama-Swap-Saw"] == "/v1/chat/completions?x=1"
    for path in ("/running?verbose=1", "/logs?n=2", "/ui/models", "/health"):
        status, headers, _ = _ask(port, "GET", path)
        assert status == 200 and headers["X-Llama-Swap-Saw"] == path, path
    status, _, raw = _ask(port, "GET", "/upstream/strata/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["owned_by"] == "vllm"  # the member's own
    assert _ask(port, "GET", "/upstream/other/health")[0] == 404
    form = (b"--B\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nstrata\r\n"
            b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--B--\r\n")
    kind = {"Content-Type": "multipart/form-data; boundary=B"}
    status, _, raw = _ask(port, "POST", "/v1/audio/transcriptions", form, kind)
    assert status == 200 and json.loads(raw)["model"] == "strata"
    assert _ask(port, "POST", "/v1/audio/transcriptions", form.replace(b"strata", b"whisp"), kind)[0] == 400
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/api/events")
    events = conn.getresponse()
    assert events.status == 200 and events.readline()  # a stream that does not end; the client goes
    conn.close()
    # Names and keys a test sets while it runs.
    (tmp_path / "llama-swap.json").write_text(json.dumps({"aliases": ["coder"], "models": ["added"],
                                                          "api_keys": ["sk-1"]}))
    hello = json.dumps({"model": "coder", "messages": HELLO, "max_tokens": 4}).encode()
    json_kind = {"Content-Type": "application/json"}
    assert _ask(port, "POST", CHAT, hello, json_kind)[0] == 401
    assert _ask(port, "GET", "/v1/models")[0] == 401
    status, _, raw = _ask(port, "GET", "/v1/models", headers={"Authorization": "Bearer sk-1"})
    assert [m["id"] for m in json.loads(raw)["data"]] == ["strata", "added", "coder"]
    status, _, raw = _ask(port, "POST", CHAT, hello, {**json_kind, "x-api-key": "sk-1"})
    assert status == 200 and json.loads(raw)["model"] == "strata"  # the member's own name given
    assert _ask(port, "GET", "/running")[0] == 200  # its own routes need no key
