"""ModelHttp against real servers: the vLLM-like engine, the llama-swap-like proxy, llama-server.

Every server is a real process on a free port (or, for wire-format corner cases, a real TCP
server in the test's own event loop); all are killed by PID when the test ends.
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest

from gpuswapd.adapters.openai import ModelHttp
from gpuswapd.config import CompletionCheck, IdleConfig
from gpuswapd.errors import BadResponse, EndpointError, EndpointTimeout, EndpointUnreachable

STACK = Path(__file__).resolve().parents[1] / "stack"
SIM = STACK / "standins"
# The simulators run on the interpreter the test world gives them (stdlib only).
SIM_PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
T = TypeVar("T")


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"gpuswapd_test_{path.stem}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(body: Callable[[ModelHttp], Awaitable[T]]) -> T:
    """Run ``body`` with a fresh ModelHttp in a fresh event loop, closing it after."""

    async def main() -> T:
        http = ModelHttp()
        try:
            return await body(http)
        finally:
            await http.aclose()

    return asyncio.run(main())


def post(port: int, path: str, body: Any = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=json.dumps(body or {}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def chat_url(self) -> str:
        return f"{self.base}/v1/chat/completions"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class World:
    """The servers of one test; each killed by PID at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.gpu = tmp / "gpu"
        subprocess.run([SIM_PY, str(SIM / "ledger.py"), "init", "--dir", str(self.gpu),
                        "--total", "24GiB", "--lag", "0.2"], check=True)

    def _start(self, name: str, argv: list[str], env: dict[str, str], port: int) -> Server:
        log = self.tmp / f"{name}-{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **env})
        self.procs.append(proc)
        return Server(proc, port, log)

    def engine(self, port: int | None = None, **env: str) -> Server:
        """Start the vLLM-like engine; it listens after ENGINE_BOOT_DELAY (default 0.3 s)."""
        port = port or free_port()
        settings = {"PORT": str(port), "ENGINE_HOST": "127.0.0.1", "GPUSIM_DIR": str(self.gpu),
                    "ENGINE_BOOT_DELAY": "0.3", "ENGINE_CHUNK_DELAY": "0.005", **env}
        return self._start("engine", [SIM_PY, str(SIM / "engine_sim.py")], settings, port)

    def proxy(self, upstream: int, model: str, *args: str) -> Server:
        """Start the llama-swap-like proxy in front of 127.0.0.1:upstream."""
        port = free_port()
        argv = [SIM_PY, str(SIM / "llama_swap.py"), "--listen", f"127.0.0.1:{port}",
                "--upstream", f"http://127.0.0.1:{upstream}", "--model", model, *args]
        server = self._start("llama-swap", argv, {}, port)
        wait_port(port)
        return server

    def llama(self, kind: str = "tiny", port: int | None = None,
              change: Callable[[list[str]], list[str]] = lambda a: a) -> Server:
        """Start a real llama-server on a random-weight model, its model named "strata"."""
        llama = load(STACK / "llama.py")
        binary = llama.ensure_llama_server()
        model = llama.ensure_model(kind=kind)
        port = port or free_port()
        args = llama.llama_server_args(model, port, 2048, 2, threads=2, alias="strata")
        return self._start(f"llama-{kind}", [str(binary), *change(args)], {}, port)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.02)
    raise AssertionError(f"nothing listens on {port} after {timeout}s")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.stop_all()


def check(server: Server | int, model: str = "hyperqwen", max_tokens: int = 64,
          timeout: float = 20.0) -> CompletionCheck:
    """The check of a server, or of a port where nothing listens yet."""
    url = (server.chat_url if isinstance(server, Server)
           else f"http://127.0.0.1:{server}/v1/chat/completions")
    return CompletionCheck(url=url, model=model, prompt="Reply with: ready",
                           max_tokens=max_tokens, timeout=timeout)


# -- health ---------------------------------------------------------------------------------------


def test_wait_healthy_through_the_engines_boot(world: World) -> None:
    engine = world.engine(ENGINE_BOOT_DELAY="1.0")

    async def body(http: ModelHttp) -> tuple[int, float, int]:
        before = await http.health(f"{engine.base}/health")
        waited = await http.wait_healthy(f"{engine.base}/health", timeout=20,
                                         abort=lambda: None)
        return before, waited, await http.health(f"{engine.base}/health")

    before, waited, after = run(body)
    assert before == 0  # connection refused while the model "loads"
    assert 0.7 < waited < 10 and after == 200


def test_wait_healthy_deadline_names_url_last_answer_and_time() -> None:
    url = f"http://127.0.0.1:{free_port()}/health"

    async def body(http: ModelHttp) -> float:
        started = time.monotonic()
        with pytest.raises(EndpointTimeout) as info:
            await http.wait_healthy(url, timeout=0.8, interval=0.1)
        message = info.value.message
        assert url in message and "within 0.8s" in message
        assert "All connection attempts failed" in message or "refused" in message, message
        return time.monotonic() - started

    assert 0.75 < run(body) < 3


def test_wait_healthy_deadline_on_a_dead_engine_says_503(world: World) -> None:
    engine = world.engine(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH="1")
    wait_port(engine.port)
    assert post(engine.port, "/sim/die")[0] == 200

    async def body(http: ModelHttp) -> str:
        with pytest.raises(EndpointTimeout) as info:
            await http.wait_healthy(f"{engine.base}/health", timeout=0.5)
        return info.value.message

    assert "(last: HTTP 503)" in run(body)


def test_wait_healthy_abort_ends_the_wait_with_the_callers_reason(world: World) -> None:
    # No room on the simulated GPU: the engine fails like CUDA out of memory and exits 1.
    engine = world.engine(ENGINE_VRAM="30GiB")

    def exited() -> str | None:
        code = engine.proc.poll()
        if code is None:
            return None
        lines = engine.output().strip().splitlines()
        cause = next((x for x in lines if "out of memory" in x), lines[-1])
        return f"the container exited with code {code}: {cause}"

    async def body(http: ModelHttp) -> tuple[str, float]:
        started = time.monotonic()
        with pytest.raises(EndpointError) as info:
            await http.wait_healthy(f"{engine.base}/health", timeout=30, abort=exited)
        assert type(info.value) is EndpointError
        return info.value.message, time.monotonic() - started

    message, took = run(body)
    assert message.startswith("the container exited with code 1: ")
    assert "out of memory" in message.lower() and took < 10


def test_health_is_0_when_the_port_accepts_and_hangs_up() -> None:
    # What Docker's port proxy does while the engine inside the container is still loading.
    async def body(http: ModelHttp) -> int:
        async def hang_up(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await http.health(f"http://127.0.0.1:{port}/health")

    assert run(body) == 0


# -- chat against the vLLM-like engine -------------------------------------------------------------


def test_chat_counts_tokens_from_usage_not_chunks(world: World) -> None:
    engine = world.engine(ENGINE_TOKENS_PER_CHUNK="3", ENGINE_REASONING_TOKENS="8",
                          ENGINE_ANSWER_TOKENS="12", ENGINE_CHUNK_DELAY="0.02")
    wait_port(engine.port)
    reply = run(lambda http: http.chat(engine.chat_url, "hyperqwen", "Say hi", 256, 20))
    assert reply.completion_tokens == 20 and reply.prompt_tokens == 2
    assert reply.chunks == 7  # ceil(8/3) reasoning + ceil(12/3) answer chunks
    assert reply.completion_tokens > reply.chunks
    assert len(reply.reasoning.split()) == 8 and len(reply.text.split()) == 12
    assert reply.text.startswith("You said: Say hi")
    assert reply.finish_reason == "stop" and reply.answered
    assert reply.ttft_s is not None and 0 < reply.ttft_s < reply.total_s


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_chat_splits_reasoning_from_the_answer(world: World, field: str) -> None:
    engine = world.engine(ENGINE_REASONING_FIELD=field, ENGINE_REASONING_TOKENS="5",
                          ENGINE_ANSWER_TOKENS="4", ENGINE_TOKENS_PER_CHUNK="2")
    wait_port(engine.port)
    reply = run(lambda http: http.chat(engine.chat_url, "hyperqwen", "x", 256, 20))
    assert reply.reasoning == "Let me think about this"
    assert reply.text == "You said: x --"
    assert (reply.chunks, reply.completion_tokens) == (5, 9)


def test_thinking_that_eats_max_tokens_leaves_no_answer(world: World) -> None:
    engine = world.engine(ENGINE_REASONING_TOKENS="8", ENGINE_ANSWER_TOKENS="12")
    wait_port(engine.port)

    async def body(http: ModelHttp) -> str:
        reply = await http.chat(engine.chat_url, "hyperqwen", "hi", 5, 20)
        assert reply.finish_reason == "length" and not reply.answered
        assert reply.completion_tokens == 5 and len(reply.reasoning.split()) == 5
        with pytest.raises(BadResponse) as info:
            await http.verify(check(engine, max_tokens=5))
        return info.value.message

    message = run(body)
    assert "max_tokens = 5" in message and "thinking" in message
    assert "raise max_tokens" in message and engine.chat_url in message


def test_engine_death_mid_stream_is_a_bad_response(world: World) -> None:
    engine = world.engine(ENGINE_ANSWER_TOKENS="400", ENGINE_TOKENS_PER_CHUNK="1",
                          ENGINE_CHUNK_DELAY="0.02", VLLM_KEEP_ALIVE_ON_ENGINE_DEATH="1")
    wait_port(engine.port)

    async def body(http: ModelHttp) -> tuple[str, str]:
        task = asyncio.create_task(http.chat(engine.chat_url, "hyperqwen", "go", 1000, 30))
        await asyncio.sleep(0.5)
        assert (await asyncio.to_thread(post, engine.port, "/sim/die"))[0] == 200
        with pytest.raises(BadResponse) as mid:
            await task
        # Now dead: every request gets HTTP 500 before any stream starts.
        with pytest.raises(BadResponse) as after:
            await http.chat(engine.chat_url, "hyperqwen", "go", 10, 10)
        return mid.value.message, after.value.message

    mid, after = run(body)
    assert mid.startswith(f"POST {engine.chat_url}: the server failed mid-stream")
    assert "EngineDeadError" in mid
    assert f"POST {engine.chat_url}: HTTP 500" in after and "EngineDeadError" in after


def test_wrong_model_is_a_bad_response_with_the_servers_message(world: World) -> None:
    engine = world.engine()
    wait_port(engine.port)

    async def body(http: ModelHttp) -> str:
        with pytest.raises(BadResponse) as info:
            await http.chat(engine.chat_url, "nosuch", "hi", 10, 10)
        return info.value.message

    assert run(body) == (f"POST {engine.chat_url}: HTTP 404: NotFoundError: "
                         "The model `nosuch` does not exist.")


def test_chat_is_bounded_by_its_timeout(world: World) -> None:
    engine = world.engine(ENGINE_CHUNK_DELAY="0.4", ENGINE_TOKENS_PER_CHUNK="1")
    wait_port(engine.port)

    async def body(http: ModelHttp) -> tuple[str, float]:
        started = time.monotonic()
        with pytest.raises(EndpointTimeout) as info:
            await http.chat(engine.chat_url, "hyperqwen", "hi", 100, 1.0)
        return info.value.message, time.monotonic() - started

    message, took = run(body)
    assert 0.9 < took < 2.5
    assert re.search(r"no complete answer within 1s \([1-3] chunks so far, the first after", message)


def test_chat_to_nothing_is_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/chat/completions"

    async def body(http: ModelHttp) -> str:
        with pytest.raises(EndpointUnreachable) as info:
            await http.chat(url, "m", "hi", 10, 5)
        return info.value.message

    message = run(body)
    assert message.startswith(f"POST {url}: nothing answers") and "is the server running?" in message


# -- verify ----------------------------------------------------------------------------------------


def test_verify_retries_until_the_engine_comes_up(world: World) -> None:
    port = free_port()

    async def body(http: ModelHttp) -> tuple[float, int]:
        started = time.monotonic()
        verifying = asyncio.create_task(http.verify(check(port), retry_until=started + 30))
        await asyncio.sleep(1.0)  # refused meanwhile: retried every 0.25 s
        world.engine(port=port, ENGINE_BOOT_DELAY="0.5")
        reply = await verifying
        assert reply.answered and reply.completion_tokens == 20
        return time.monotonic() - started, reply.chunks

    took, chunks = run(body)
    assert 1.5 < took < 15 and chunks == 7


def test_verify_through_llama_swap_retries_its_502_until_the_member_is_up(world: World) -> None:
    port = free_port()
    proxy = world.proxy(port, "hyperqwen", "--health-timeout", "0.3", "--poll", "0.1")

    async def body(http: ModelHttp) -> None:
        with pytest.raises(BadResponse) as info:  # one try: the proxy's 502 as it is
            await http.verify(check(proxy))
        assert "HTTP 502: upstream hyperqwen not ready after 0.3s (unreachable)" in info.value.message
        verifying = asyncio.create_task(http.verify(check(proxy), retry_until=time.monotonic() + 30))
        await asyncio.sleep(1.0)
        world.engine(port=port, ENGINE_BOOT_DELAY="0.3")
        assert (await verifying).answered

    run(body)


def test_verify_does_not_retry_a_wrong_model(world: World) -> None:
    engine = world.engine()
    wait_port(engine.port)
    proxy = world.proxy(engine.port, "hyperqwen")

    async def body(http: ModelHttp) -> float:
        started = time.monotonic()
        with pytest.raises(BadResponse) as info:
            await http.verify(check(proxy, model="strata"), retry_until=started + 30)
        assert info.value.message == (f"POST {proxy.chat_url}: HTTP 400: "
                                      "could not find real modelID for strata")
        return time.monotonic() - started

    assert run(body) < 2


def test_verify_gives_up_at_retry_until_and_says_how_long_it_tried() -> None:
    port = free_port()

    async def body(http: ModelHttp) -> tuple[str, float]:
        started = time.monotonic()
        with pytest.raises(EndpointUnreachable) as info:
            await http.verify(check(port), retry_until=started + 1.0)
        return info.value.message, time.monotonic() - started

    message, took = run(body)
    assert 0.95 < took < 2.5
    assert re.search(r"\(tried ([4-9]|\d\d) times over 1\.\d+s\)$", message), message


# -- idle ------------------------------------------------------------------------------------------


def test_idle_prometheus_busy_while_a_slow_stream_is_in_flight(world: World) -> None:
    engine = world.engine(ENGINE_ANSWER_TOKENS="60", ENGINE_TOKENS_PER_CHUNK="1",
                          ENGINE_CHUNK_DELAY="0.03")
    wait_port(engine.port)
    idle = IdleConfig(kind="prometheus", url=f"{engine.base}/metrics",
                      metric="vllm:num_requests_running")

    async def body(http: ModelHttp) -> tuple[str, str, str]:
        before = await http.idle(idle)
        stream = asyncio.create_task(http.chat(engine.chat_url, "hyperqwen", "x", 200, 30))
        await asyncio.sleep(0.5)
        during = await http.idle(idle)
        assert not stream.done() and during.busy
        await stream
        after = await http.idle(idle)
        assert not before.busy and not after.busy
        return before.detail, during.detail, after.detail

    assert run(body) == ("vllm:num_requests_running = 0", "vllm:num_requests_running = 1",
                         "vllm:num_requests_running = 0")


def test_idle_prometheus_missing_metric_names_it_and_the_url(world: World) -> None:
    engine = world.engine()
    wait_port(engine.port)
    idle = IdleConfig(kind="prometheus", url=f"{engine.base}/metrics",
                      metric="llamacpp:requests_processing")

    async def body(http: ModelHttp) -> str:
        with pytest.raises(BadResponse) as info:
            await http.idle(idle)
        return info.value.message

    assert run(body).startswith(f"GET {engine.base}/metrics: no metric llamacpp:requests_processing")


def test_idle_of_an_unreachable_resident() -> None:
    url = f"http://127.0.0.1:{free_port()}/slots"

    async def body(http: ModelHttp) -> None:
        with pytest.raises(EndpointUnreachable, match=re.escape(f"GET {url}: nothing answers")):
            await http.idle(IdleConfig(kind="llama.cpp-slots", url=url))

    run(body)


def test_idle_command_and_none() -> None:
    async def body(http: ModelHttp) -> None:
        free = await http.idle(IdleConfig(kind="command", command=["true"]))
        assert not free.busy and free.detail == "true exited 0"
        held = await http.idle(IdleConfig(
            kind="command", command=["sh", "-c", "echo checking; echo held by agent-x; exit 3"]))
        assert held.busy and held.detail.endswith("exited 3: held by agent-x")
        started = time.monotonic()
        with pytest.raises(EndpointTimeout, match=r"idle command sleep 30 did not finish within 0\.5s"):
            await http.idle(IdleConfig(kind="command", command=["sleep", "30"]), timeout=0.5)
        assert time.monotonic() - started < 2
        with pytest.raises(EndpointError, match="cannot run idle command /nonexistent/probe"):
            await http.idle(IdleConfig(kind="command", command=["/nonexistent/probe"]))
        # kind = "none" never asks anyone: a URL where nothing listens does not matter.
        nobody = await http.idle(IdleConfig(kind="none", url="http://127.0.0.1:1/x"))
        assert not nobody.busy

    run(body)


# -- wire-format corner cases from a real socket ---------------------------------------------------


async def raw_server(pieces: list[bytes], head: bytes = b"HTTP/1.1 200 OK\r\n"
                     b"Content-Type: text/event-stream\r\nConnection: close\r\n\r\n",
                     gap: float = 0.03) -> tuple[asyncio.Server, str]:
    """Serve one canned response written in ``pieces``, each its own TCP write."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", request)
        await reader.readexactly(int(length.group(1)) if length else 0)
        writer.write(head)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(gap)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def delta(**fields: Any) -> dict[str, Any]:
    finish = fields.pop("finish", None)
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}], "usage": None}


def test_events_split_across_and_packed_into_network_chunks() -> None:
    stream = (": ping\r\n\r\n" + sse(delta(role="assistant", content="")) + sse(delta(reasoning="Hm"))
              + sse(delta(content="Hello")) + "data:" + json.dumps(delta(content=" world"))
              + "\r\n\r\n" + sse(delta(content="!", finish="stop"))
              + sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9}})
              + "data: [DONE]\n\n" + sse(delta(content="after done")))
    raw = stream.encode()
    cuts = [0, 3, 17, 18, 60, 61, 200, 201, 202, 260, len(raw)]  # mid-line, mid-JSON, mid-CRLF
    pieces = [raw[a:b] for a, b in itertools.pairwise(cuts)]

    async def body(http: ModelHttp) -> None:
        server, url = await raw_server(pieces)
        async with server:
            reply = await http.chat(url, "m", "hi", 10, 10)
        assert (reply.text, reply.reasoning, reply.chunks) == ("Hello world!", "Hm", 4)
        assert (reply.prompt_tokens, reply.completion_tokens, reply.finish_reason) == (4, 9, "stop")

    run(body)


def test_llama_cpp_error_line_and_broken_off_stream() -> None:
    error = 'error: {"code":500,"message":"llama_decode failed","type":"server_error"}\n\n'

    async def body(http: ModelHttp) -> None:
        server, url = await raw_server([sse(delta(content="a")).encode(), error.encode()])
        async with server:
            with pytest.raises(BadResponse, match="server_error: llama_decode failed"):
                await http.chat(url, "m", "hi", 10, 10)
        server, url = await raw_server([sse(delta(content="a")).encode()])
        async with server:
            with pytest.raises(BadResponse, match=r"ended without \[DONE\] or a finish_reason after 1"):
                await http.chat(url, "m", "hi", 10, 10)
        server, url = await raw_server([b"data: {\"choices\": [oops\n\n"])
        async with server:
            with pytest.raises(BadResponse, match=r"POST .*: an event is not JSON: \{\"choices"):
                await http.chat(url, "m", "hi", 10, 10)

    run(body)


def test_a_json_answer_to_a_stream_request_is_read_whole() -> None:
    answer = {"choices": [{"message": {"content": "ready", "reasoning_content": "ok"},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    body_bytes = json.dumps(answer).encode()
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body_bytes)).encode() + b"\r\n\r\n")

    async def body(http: ModelHttp) -> None:
        server, url = await raw_server([body_bytes], head=head)
        async with server:
            reply = await http.chat(url, "m", "hi", 10, 10)
        assert (reply.text, reply.reasoning, reply.completion_tokens) == ("ready", "ok", 2)

    run(body)


# -- the real llama.cpp llama-server ---------------------------------------------------------------


@pytest.mark.stack
def test_llama_server_chat_health_and_verify_through_llama_swap(world: World) -> None:
    port = free_port()
    proxy = world.proxy(port, "strata", "--health-timeout", "0.3", "--poll", "0.1")

    async def body(http: ModelHttp) -> None:
        started = time.monotonic()
        verifying = asyncio.create_task(http.verify(check(proxy, model="strata", max_tokens=16),
                                                    retry_until=started + 120))
        await asyncio.sleep(0.8)  # the proxy answers 502 meanwhile; verify keeps trying
        server = world.llama("tiny", port=port)
        reply = await verifying
        assert reply.answered and reply.completion_tokens == 16 and reply.finish_reason == "length"
        # One token per chunk, but a chunk may wait for the rest of a UTF-8 character.
        assert 1 <= reply.chunks <= 16 and reply.ttft_s is not None
        assert await http.wait_healthy(f"{server.base}/health", 30) < 0.5
        direct = await http.chat(server.chat_url, "strata", "Tell me a story", 40, 60)
        assert direct.completion_tokens == 40 and direct.prompt_tokens and direct.answered

    run(body)


@pytest.mark.stack
def test_llama_server_idle_slots_and_metrics_busy_during_a_stream(world: World) -> None:
    server = world.llama("tiny")
    slots = IdleConfig(kind="llama.cpp-slots", url=f"{server.base}/slots")
    gauge = IdleConfig(kind="prometheus", url=f"{server.base}/metrics",
                       metric="llamacpp:requests_processing")

    async def body(http: ModelHttp) -> None:
        await http.wait_healthy(f"{server.base}/health", 60)
        quiet = await http.idle(slots)
        assert not quiet.busy and quiet.detail == "0 of 2 slots processing"
        assert not (await http.idle(gauge)).busy
        # ~1.5 s on an idle 2-core box; probes must see it busy before it ends.
        stream = asyncio.create_task(http.chat(server.chat_url, "strata", "Go on", 2000, 300))
        seen: set[str] = set()
        while not stream.done() and len(seen) < 2:
            for probe in (slots, gauge):
                busy = await http.idle(probe)
                if busy.busy:
                    seen.add(busy.detail)
            await asyncio.sleep(0.05)
        assert seen == {"1 of 2 slots processing", "llamacpp:requests_processing = 1"}
        reply = await stream
        assert reply.completion_tokens == 2000
        assert not (await http.idle(slots)).busy and not (await http.idle(gauge)).busy

    run(body)


@pytest.mark.stack
def test_llama_server_without_slots_endpoint_says_how_to_fix_it(world: World) -> None:
    server = world.llama("tiny", change=lambda a: [x for x in a if x != "--slots"] + ["--no-slots"])

    async def body(http: ModelHttp) -> str:
        await http.wait_healthy(f"{server.base}/health", 30)
        with pytest.raises(BadResponse) as info:
            await http.idle(IdleConfig(kind="llama.cpp-slots", url=f"{server.base}/slots"))
        return info.value.message

    message = run(body)
    assert message.startswith(f"GET {server.base}/slots: HTTP 501: ")
    assert "--slots" in message and 'kind = "prometheus"' in message
