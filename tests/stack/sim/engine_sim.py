"""A vLLM-like OpenAI server on the simulated GPU (runs in a container as its only process).

Configuration (environment)::

    PORT=8000  ENGINE_HOST=0.0.0.0      where to listen (after the boot delay)
    GPUSIM_DIR=/gpu                     ledger directory (bind-mounted into the container)
    ENGINE_NAME=hyperqwen               holder name in the ledger
    ENGINE_VRAM=19.5GiB                 claimed at start; no room: CUDA OOM on stderr, exit 1
    ENGINE_MODEL=hyperqwen              served model id
    ENGINE_BOOT_DELAY=2.0               seconds with nothing listening ("loading")
    ENGINE_TOKENS_PER_CHUNK=3           tokens per SSE chunk (speculative decoding)
    ENGINE_CHUNK_DELAY=0.01             seconds between chunks
    ENGINE_REASONING_TOKENS=8           reasoning tokens before the answer
    ENGINE_ANSWER_TOKENS=12             answer tokens
    ENGINE_REASONING_FIELD=reasoning    delta/message field of the reasoning (older vLLM:
                                        reasoning_content)
    ENGINE_WARM_DELAY=0                 extra latency of completions in the first seconds
                                        after the first one (cold kernels)
    ENGINE_DEATH_EXIT_DELAY=5           after engine death the process exits 1 this much later,
    VLLM_KEEP_ALIVE_ON_ENGINE_DEATH     ... unless this is set (then it stays up, dead)
    ENGINE_DEAD_AFTER=0.5               a doomed boot serves this long, then dies
    ENGINE_FAULT_FILE=$GPUSIM_DIR/engine-fault.json   {"failing_boots": N}
    VLLM_SERVER_DEV_MODE=1              enables /sleep, /wake_up, /is_sleeping (as in vLLM)

A token is a whitespace-separated word: the text of a reply has exactly ``completion_tokens``
words (reasoning + answer); ``max_tokens`` is spent on reasoning first.

Endpoints: ``GET /health`` (200, 503 once dead), ``GET /v1/models``, ``GET /metrics``,
``GET /version``, ``POST /v1/chat/completions`` (stream or not), sleep mode, and for tests
``POST /sim/die`` ``{"failing_boots": N}`` (die now; the next N boots die too: a boot counts
down the fault file, serves ENGINE_DEAD_AFTER seconds, then dies) and ``GET /sim/state``.
Every start adds one to ``$GPUSIM_DIR/engine-boots``. SIGTERM: exit 0 at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

try:
    from . import ledger
except ImportError:
    import ledger  # type: ignore[no-redef]

REASONING_WORDS = ["Let", "me", "think", "about", "this", "request", "carefully", "first."]
FILLER_WORDS = ["This", "is", "a", "simulated", "answer", "from", "the", "test", "engine."]
ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class Config:
    """The engine's settings, from the environment."""

    port: int
    host: str
    gpusim_dir: Path
    name: str
    vram: int
    model: str
    boot_delay: float
    tokens_per_chunk: int
    chunk_delay: float
    reasoning_tokens: int
    answer_tokens: int
    reasoning_field: str
    warm_delay: float
    keep_alive: bool
    death_exit_delay: float
    dead_after: float
    fault_file: Path
    dev_mode: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        """Read the configuration from ``env``."""
        gpusim_dir = Path(env.get("GPUSIM_DIR", "/gpu"))
        return cls(
            port=int(env.get("PORT", "8000")),
            host=env.get("ENGINE_HOST", "0.0.0.0"),
            gpusim_dir=gpusim_dir,
            name=env.get("ENGINE_NAME", "hyperqwen"),
            vram=ledger.parse_size(env.get("ENGINE_VRAM", "19.5GiB")),
            model=env.get("ENGINE_MODEL", "hyperqwen"),
            boot_delay=float(env.get("ENGINE_BOOT_DELAY", "2.0")),
            tokens_per_chunk=max(1, int(env.get("ENGINE_TOKENS_PER_CHUNK", "3"))),
            chunk_delay=float(env.get("ENGINE_CHUNK_DELAY", "0.01")),
            reasoning_tokens=int(env.get("ENGINE_REASONING_TOKENS", "8")),
            answer_tokens=int(env.get("ENGINE_ANSWER_TOKENS", "12")),
            reasoning_field=env.get("ENGINE_REASONING_FIELD", "reasoning"),
            warm_delay=float(env.get("ENGINE_WARM_DELAY", "0")),
            keep_alive=bool(env.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH")),
            death_exit_delay=float(env.get("ENGINE_DEATH_EXIT_DELAY", "5")),
            dead_after=float(env.get("ENGINE_DEAD_AFTER", "0.5")),
            fault_file=Path(env.get("ENGINE_FAULT_FILE", str(gpusim_dir / "engine-fault.json"))),
            dev_mode=env.get("VLLM_SERVER_DEV_MODE") == "1",
        )


class ApiError(Exception):
    """An error answered as an OpenAI-style error object."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` object."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


def log(message: str) -> None:
    """Log a line to stderr, vLLM style."""
    print(f"{time.strftime('%m-%d %H:%M:%S')} {message}", file=sys.stderr, flush=True)


def write_atomic(path: Path, text: str) -> None:
    """Replace a small state file atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_failing_boots(path: Path) -> int:
    """Failing boots left in the fault file (0 when there is none)."""
    try:
        return max(0, int(json.loads(path.read_text(encoding="utf-8")).get("failing_boots", 0)))
    except (OSError, ValueError, AttributeError):
        return 0


def read_boots(directory: Path) -> int:
    """How many times an engine has started with this ledger directory."""
    try:
        return int((directory / "engine-boots").read_text(encoding="ascii").strip() or 0)
    except (OSError, ValueError):
        return 0


class Engine:
    """The simulated engine: its ledger claim, its life and death, its counters."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.boot = 0
        self.dead: str | None = None
        self.sleeping = False
        self.running = 0
        self.served = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.warm_until: float | None = None

    def start(self) -> bool:
        """Count the boot, claim VRAM (exit 1 on OOM), load; return whether this boot is doomed."""
        cfg = self.cfg
        self.boot = read_boots(cfg.gpusim_dir) + 1
        write_atomic(cfg.gpusim_dir / "engine-boots", f"{self.boot}\n")
        log(f"INFO [api_server] vLLM API server (simulated), boot {self.boot}, model {cfg.model}")
        try:
            self.fd = ledger.claim(cfg.gpusim_dir, cfg.name, cfg.vram)
        except ledger.OutOfMemory as e:
            print(
                "ERROR [core.py] EngineCore failed to start.\n"
                "Traceback (most recent call last):\n"
                '  File "/opt/engine/engine_sim.py", in load_model\n'
                f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                f"{ledger.gib(e.wanted_bytes)}. GPU 0 has a total capacity of "
                f"{ledger.gib(e.total_bytes)} of which {ledger.gib(max(e.free_bytes, 0))} "
                "is free.\n"
                f"{e}\n"
                "RuntimeError: Engine core initialization failed. See root cause above.",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(1)
        left = read_failing_boots(cfg.fault_file)
        if left > 0:
            write_atomic(cfg.fault_file, json.dumps({"failing_boots": left - 1}) + "\n")
        time.sleep(cfg.boot_delay)
        return left > 0

    def die(self, reason: str) -> None:
        """Kill the engine: requests fail from now on; the process exits unless kept alive."""
        with self.lock:
            if self.dead is not None:
                return
            self.dead = f"EngineDeadError: {reason}"
        log(f"ERROR [async_llm.py] Engine core died: {reason}")
        if not self.cfg.keep_alive:
            timer = threading.Timer(self.cfg.death_exit_delay, self._exit_dead)
            timer.daemon = True
            timer.start()

    def _exit_dead(self) -> None:
        """Terminate the API server after engine death, as vLLM does."""
        log("ERROR [api_server.py] AsyncLLM has failed, terminating server process")
        os._exit(1)

    def check_alive(self) -> None:
        """Raise the error a request gets from a dead or sleeping engine."""
        if self.dead is not None:
            raise ApiError(500, self.dead, "InternalServerError")
        if self.sleeping:
            raise ApiError(
                503, "The engine is sleeping; POST /wake_up first.", "ServiceUnavailableError"
            )

    def wait_warm(self) -> None:
        """Delay requests that come while the kernels are still "compiling"."""
        with self.lock:
            if self.warm_until is None:
                self.warm_until = time.monotonic() + self.cfg.warm_delay
            remaining = self.warm_until - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def sleep(self) -> None:
        """Sleep mode: give the VRAM back at once (the process stays alive)."""
        with self.lock:
            if not self.sleeping and self.fd is not None:
                ledger.release(self.cfg.gpusim_dir, self.cfg.name, self.fd)
                self.fd = None
            self.sleeping = True

    def wake(self) -> None:
        """Leave sleep mode: claim the VRAM again (fails like CUDA when there is no room)."""
        with self.lock:
            if not self.sleeping:
                return
            try:
                self.fd = ledger.claim(self.cfg.gpusim_dir, self.cfg.name, self.cfg.vram)
            except ledger.LedgerError as e:
                raise ApiError(500, str(e), "InternalServerError") from None
            self.sleeping = False

    def state(self) -> dict[str, Any]:
        """The counters for ``GET /sim/state``."""
        return {
            "pid": os.getpid(),
            "boot": self.boot,
            "boots": read_boots(self.cfg.gpusim_dir),
            "dead": self.dead is not None,
            "failing_boots": read_failing_boots(self.cfg.fault_file),
            "sleeping": self.sleeping,
            "running": self.running,
            "requests_served": self.served,
        }


@dataclass
class Plan:
    """What one completion will emit."""

    prompt_tokens: int
    reasoning: list[str]
    answer: list[str]
    finish_reason: str
    stream: bool
    include_usage: bool


def text_of(content: Any) -> str:
    """The text of a message's content (a string or a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def words(seed: list[str], filler: list[str], n: int) -> list[str]:
    """``n`` words: the seed, then the filler repeated."""
    out = list(seed)
    while len(out) < n:
        out.extend(filler)
    return out[:n]


def plan_completion(body: Any, cfg: Config) -> Plan:
    """Validate a chat completion request and decide its output (deterministic)."""
    if not isinstance(body, dict):
        raise ApiError(400, "Input should be a valid dictionary", "BadRequestError")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model: Input should be a valid string", "BadRequestError", "model")
    if model is not None and model != cfg.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: a non-empty list is required", "BadRequestError", "messages")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages: invalid message {m!r}", "BadRequestError", "messages")
        if not isinstance(m.get("content"), str | list | None):
            raise ApiError(
                400,
                "messages: content must be a string or a list of parts",
                "BadRequestError",
                "messages",
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise ApiError(400, "stream: Input should be a valid boolean", "BadRequestError", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(
            400,
            "Stream options can only be defined when `stream=True`.",
            "BadRequestError",
            "stream_options",
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise ApiError(400, "max_tokens must be at least 1", "BadRequestError", "max_tokens")
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", "BadRequestError", "n")
    prompt = [text_of(m.get("content")) for m in messages]
    last_user = next(
        (text_of(m.get("content")) for m in reversed(messages) if m["role"] == "user"), ""
    )
    reasoning = words([], REASONING_WORDS, cfg.reasoning_tokens)
    answer = words(["You", "said:", *last_user.split()[:6], "--"], FILLER_WORDS, cfg.answer_tokens)
    budget = len(reasoning) + len(answer) if max_tokens is None else max_tokens
    kept_reasoning = reasoning[:budget]
    kept_answer = answer[: budget - len(kept_reasoning)]
    cut = len(kept_reasoning) + len(kept_answer) < len(reasoning) + len(answer)
    return Plan(
        prompt_tokens=sum(len(p.split()) for p in prompt),
        reasoning=kept_reasoning,
        answer=kept_answer,
        finish_reason="length" if cut else "stop",
        stream=bool(stream),
        include_usage=bool(options and options.get("include_usage")),
    )


def chunks(plan: Plan, per_chunk: int) -> list[tuple[str, str]]:
    """Split the output into ``(phase, text)`` pieces of up to ``per_chunk`` tokens each."""
    out = []
    for phase, toks in (("reasoning", plan.reasoning), ("content", plan.answer)):
        for i in range(0, len(toks), per_chunk):
            out.append((phase, (" " if i else "") + " ".join(toks[i : i + per_chunk])))
    return out


class Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 handler with vLLM's routes."""

    protocol_version = "HTTP/1.1"
    server: EngineServer

    def version_string(self) -> str:
        """Name the server like vLLM's uvicorn does."""
        return "uvicorn"

    def log_message(self, format: str, *args: Any) -> None:
        """Log requests to stderr like uvicorn's access log."""
        log(f"INFO:     {self.client_address[0]} - {format % args}")

    # -- plumbing

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        """Send a complete response."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        """Send a JSON response."""
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _body(self) -> bytes:
        """Read the request body."""
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _chunk(self, data: bytes) -> None:
        """Write one piece of a chunked response, flushed at once."""
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _event(self, obj: Any) -> None:
        """Write one server-sent event."""
        payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        self._chunk(f"data: {payload}\n\n".encode())

    # -- routes

    def do_GET(self) -> None:
        """Route GET requests."""
        engine, cfg = self.server.engine, self.server.engine.cfg
        path = urlsplit(self.path).path
        if path == "/health":
            self._send(503 if engine.dead else 200, b"", "application/json")
        elif path == "/v1/models":
            card = {
                "id": cfg.model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": cfg.model,
                "parent": None,
                "max_model_len": 32768,
            }
            self._json(200, {"object": "list", "data": [card]})
        elif path == "/metrics":
            self._send(200, self._metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/version":
            self._json(200, {"version": "0.16.0+sim"})
        elif path == "/is_sleeping" and cfg.dev_mode:
            self._json(200, {"is_sleeping": engine.sleeping})
        elif path == "/sim/state":
            self._json(200, engine.state())
        elif path in ("/v1/chat/completions", "/sleep", "/wake_up", "/sim/die"):
            self._json(405, {"detail": "Method Not Allowed"})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        """Route POST requests."""
        engine, cfg = self.server.engine, self.server.engine.cfg
        url = urlsplit(self.path)
        raw = self._body()
        try:
            if url.path == "/v1/chat/completions":
                self._chat(raw)
            elif url.path == "/sleep" and cfg.dev_mode:
                if engine.dead is not None:
                    raise ApiError(500, engine.dead, "InternalServerError")
                level = parse_qs(url.query).get("level", ["1"])[0]
                log(f"INFO [api_server.py] sleep level {level}")
                engine.sleep()
                self._send(200, b"", "application/json")
            elif url.path == "/wake_up" and cfg.dev_mode:
                engine.wake()
                self._send(200, b"", "application/json")
            elif url.path == "/sim/die":
                self._die(raw)
            else:
                self._json(404, {"detail": "Not Found"})
        except ApiError as e:
            self._json(e.status, e.body())

    def _die(self, raw: bytes) -> None:
        """Kill the engine now and arm the fault for the next boots."""
        try:
            body = json.loads(raw or b"{}")
            failing = int(body.get("failing_boots", 0))
        except (ValueError, AttributeError, TypeError):
            raise ApiError(400, 'expected {"failing_boots": N}', "BadRequestError") from None
        write_atomic(
            self.server.engine.cfg.fault_file, json.dumps({"failing_boots": max(0, failing)}) + "\n"
        )
        self.server.engine.die("simulated engine death (POST /sim/die)")
        self._json(200, {"dead": True, "failing_boots": max(0, failing)})

    def _metrics(self) -> str:
        """Prometheus text with vLLM's gauge names."""
        e, label = self.server.engine, f'{{model_name="{self.server.engine.cfg.model}"}}'
        rows = [
            (
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                e.running,
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                0,
            ),
            (
                "vllm:prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed.",
                e.prompt_tokens_total,
            ),
            (
                "vllm:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                e.generation_tokens_total,
            ),
        ]
        out = []
        for name, kind, help_text, value in rows:
            out += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} {kind}",
                f"{name}{label} {float(value)}",
            ]
        return "\n".join(out) + "\n"

    def _chat(self, raw: bytes) -> None:
        """Answer a chat completion, streamed or not."""
        engine = self.server.engine
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"JSON decode error: {e}", "BadRequestError") from None
        engine.check_alive()
        plan = plan_completion(body, engine.cfg)
        with engine.lock:
            engine.running += 1
        try:
            engine.wait_warm()
            if plan.stream:
                self._stream(plan)
            else:
                self._complete(plan)
        finally:
            with engine.lock:
                engine.running -= 1

    def _account(self, plan: Plan) -> dict[str, int]:
        """Count a finished completion; return its usage."""
        engine = self.server.engine
        completion = len(plan.reasoning) + len(plan.answer)
        with engine.lock:
            engine.served += 1
            engine.prompt_tokens_total += plan.prompt_tokens
            engine.generation_tokens_total += completion
        return {
            "prompt_tokens": plan.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": plan.prompt_tokens + completion,
        }

    def _complete(self, plan: Plan) -> None:
        """Generate the whole answer (taking as long as streaming would), then send it."""
        engine, cfg = self.server.engine, self.server.engine.cfg
        for _ in chunks(plan, cfg.tokens_per_chunk):
            time.sleep(cfg.chunk_delay)
            engine.check_alive()
        message = {
            "role": "assistant",
            # A thinking model cut off while reasoning has no content at all.
            "content": " ".join(plan.answer) if plan.answer else None,
            cfg.reasoning_field: " ".join(plan.reasoning) if plan.reasoning else None,
            "tool_calls": [],
        }
        usage = self._account(plan)
        self._json(
            200,
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": cfg.model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": plan.finish_reason,
                    }
                ],
                "usage": usage,
            },
        )

    def _stream(self, plan: Plan) -> None:
        """Stream the answer as server-sent events, the way vLLM does."""
        engine, cfg = self.server.engine, self.server.engine.cfg
        base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": cfg.model,
        }
        extra = {"usage": None} if plan.include_usage else {}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            pieces = chunks(plan, cfg.tokens_per_chunk)
            first = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            self._event({**base, "choices": [first], **extra})
            for i, (phase, text) in enumerate(pieces or [("content", "")]):
                time.sleep(cfg.chunk_delay)
                if engine.dead is not None:
                    err = {"message": engine.dead, "type": "InternalServerError", "code": 500}
                    self._event({"error": err})
                    break
                field = cfg.reasoning_field if phase == "reasoning" else "content"
                last = i == max(len(pieces), 1) - 1
                choice = {
                    "index": 0,
                    "delta": {field: text} if text else {},
                    "logprobs": None,
                    "finish_reason": plan.finish_reason if last else None,
                }
                self._event({**base, "choices": [choice], **extra})
            else:
                usage = self._account(plan)
                if plan.include_usage:
                    self._event({**base, "choices": [], "usage": usage})
            # vLLM ends even a failed stream with [DONE].
            self._event("[DONE]")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class EngineServer(ThreadingHTTPServer):
    """A threaded HTTP server that knows its engine."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: Engine) -> None:
        self.engine = engine
        super().__init__(address, Handler)


def main() -> int:
    """Boot the engine, then serve until killed."""

    def on_term(signum: int, _frame: object) -> None:
        """Exit at once; the kernel drops the ledger lock with the process."""
        log(f"INFO [launcher.py] shutting down on signal {signum}")
        os._exit(0)

    # As PID 1 in a container, the default action of SIGTERM would be to ignore it.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    cfg = Config.from_env(os.environ)
    engine = Engine(cfg)
    doomed = engine.start()
    try:
        server = EngineServer((cfg.host, cfg.port), engine)
    except OSError:
        traceback.print_exc()
        return 1
    log(f"INFO [launcher.py] Started server process [{os.getpid()}] on port {cfg.port}")
    log("INFO:     Application startup complete.")
    if doomed:
        timer = threading.Timer(cfg.dead_after, engine.die, ("simulated failure after restart",))
        timer.daemon = True
        timer.start()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
