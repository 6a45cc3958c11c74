"""A vLLM-like OpenAI server on the simulated GPU (runs in a container as its only process).

Configuration (environment)::

    PORT=8000  ENGINE_HOST=0.0.0.0      where to listen (after the boot delay)
    GPUSIM_DIR=/gpu                     ledger directory (bind-mounted into the container)
    GPUSIM_CARD=0                       the GPU it claims on (a box with several cards)
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
    ENGINE_FAULT_FILE=$GPUSIM_DIR/engine-fault.json
                                        {"failing_boots": N, "garbled_wakes": M} (both optional)
    VLLM_SERVER_DEV_MODE=1              enables /sleep, /wake_up, /is_sleeping (as in vLLM);
                                        without it the engine has no sleep mode (404)
    ENGINE_SLEEP_RESIDUAL_1=1GiB        VRAM still held asleep at level 1 (CUDA context, pools)
    ENGINE_SLEEP_RESIDUAL_2=0.5GiB      ... at level 2; a residual over ENGINE_VRAM: exit 1 at start
    ENGINE_SLEEP_DELAY=0.1              seconds /sleep takes (offloading)
    ENGINE_WAKE_DELAY_1=0.3             seconds /wake_up takes after level 1 (weights from RAM)
    ENGINE_WAKE_DELAY_2=1.0             ... after level 2 (weights reloaded)

A token is a whitespace-separated word: the text of a reply has exactly ``completion_tokens``
words (reasoning + answer); ``max_tokens`` is spent on reasoning first. The text depends only on
the request (and on whether the engine is garbled, below): the same request gets the same text.

Endpoints: ``GET /health`` (200, 503 once dead), ``GET /v1/models``, ``GET /metrics``,
``GET /version``, ``POST /v1/chat/completions`` (stream or not), as vLLM does Anthropic's
``POST /v1/messages`` (stream or not; the same words, reasoning and answer, as one text block)
and ``/v1/messages/count_tokens``, and OpenAI's Responses API ``POST /v1/responses`` (stream or
not: ``input`` a string or a list of messages), ``POST /v1/audio/transcriptions`` (a form, answered
with its size), sleep mode, and for tests
``POST /sim/die`` ``{"failing_boots": N}`` (die now; the next N boots die too: a boot counts
down the fault file, serves ENGINE_DEAD_AFTER seconds, then dies) and ``GET /sim/state``.
Every start adds one to ``$GPUSIM_DIR/engine-boots``. SIGTERM: exit 0 at once.

Sleep mode, as in vLLM: ``POST /sleep?level=1|2`` answers 200 once asleep (after
ENGINE_SLEEP_DELAY); level 1 offloads the weights to host RAM and drops the KV cache, level 2
drops the weights too. Asleep, the engine's ledger entry shrinks from ENGINE_VRAM to the level's
residual (same holder, same PID; the rest is free at once). ``GET /is_sleeping`` says
``{"is_sleeping": bool}``. ``POST /wake_up`` grows the entry back first (no room: 500 with a CUDA
out-of-memory error, still asleep), then answers 200 once awake (ENGINE_WAKE_DELAY_1 or _2).
Sleeping when asleep or waking when awake: 200, nothing changes; a level other than 1 or 2: 400.
A completion that reaches a sleeping engine (also one in flight when it falls asleep) crashes
it: 500, and the engine dies as by ``POST /sim/die``. ``/health``, ``/v1/models``, ``/version``,
``/metrics`` and ``/is_sleeping`` keep answering while asleep.

Fault ``"garbled_wakes": M`` in the fault file: each of the next M wakes (any level) counts M
down and leaves the engine garbled: every completion's words are replaced by fixed junk (still
200, as many tokens, still deterministic) until the next clean wake or cold boot.
``POST /sim/die`` sets ``failing_boots`` and keeps the other keys.
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
# What a garbled engine says instead: the kind of junk broken weights produce.
GARBLED_WORDS = ["!!!!", "ĠĠĠ", "<|endoftext|>", "的的的", "ilerilerile", "%%%%", "\ufffd\ufffd"]
SLEEP_LEVELS = (1, 2)
ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class Config:
    """The engine's settings, from the environment."""

    port: int
    host: str
    gpusim_dir: Path
    card: int
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
    sleep_residual_1: int
    sleep_residual_2: int
    sleep_delay: float
    wake_delay_1: float
    wake_delay_2: float

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        """Read the configuration from ``env``."""
        gpusim_dir = Path(env.get("GPUSIM_DIR", "/gpu"))
        return cls(
            port=int(env.get("PORT", "8000")),
            host=env.get("ENGINE_HOST", "0.0.0.0"),
            gpusim_dir=gpusim_dir,
            card=int(env.get("GPUSIM_CARD", "0")),
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
            sleep_residual_1=ledger.parse_size(env.get("ENGINE_SLEEP_RESIDUAL_1", "1GiB")),
            sleep_residual_2=ledger.parse_size(env.get("ENGINE_SLEEP_RESIDUAL_2", "0.5GiB")),
            sleep_delay=float(env.get("ENGINE_SLEEP_DELAY", "0.1")),
            wake_delay_1=float(env.get("ENGINE_WAKE_DELAY_1", "0.3")),
            wake_delay_2=float(env.get("ENGINE_WAKE_DELAY_2", "1.0")),
        )

    def validate(self) -> None:
        """Raise ValueError for settings no engine could run with."""
        for level in SLEEP_LEVELS:
            if self.residual(level) > self.vram:
                raise ValueError(
                    f"ENGINE_SLEEP_RESIDUAL_{level}={self.residual(level)} bytes is more than "
                    f"ENGINE_VRAM={self.vram} bytes"
                )

    def residual(self, level: int) -> int:
        """Bytes still held asleep at ``level``."""
        return self.sleep_residual_1 if level == 1 else self.sleep_residual_2

    def wake_delay(self, level: int) -> float:
        """Seconds a wake from ``level`` takes."""
        return self.wake_delay_1 if level == 1 else self.wake_delay_2


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


def read_faults(path: Path) -> dict[str, int]:
    """The counters of the fault file (empty when there is none or it is not a JSON object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    faults = {}
    for key, value in data.items() if isinstance(data, dict) else ():
        try:
            faults[key] = max(0, int(value))
        except (TypeError, ValueError):
            continue
    return faults


def read_failing_boots(path: Path) -> int:
    """Failing boots left in the fault file (0 when there is none)."""
    return read_faults(path).get("failing_boots", 0)


def set_fault(path: Path, key: str, count: int) -> None:
    """Set one counter of the fault file (atomically), keeping the others."""
    write_atomic(path, json.dumps({**read_faults(path), key: max(0, count)}) + "\n")


def take_fault(path: Path, key: str) -> bool:
    """Count one down from the fault file's ``key``; return whether there was one to take."""
    left = read_faults(path).get(key, 0)
    if left > 0:
        set_fault(path, key, left - 1)
    return left > 0


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
        # Sleep and wake take time: one at a time.
        self.mode_lock = threading.Lock()
        self.sleep_level: int | None = None
        self.wakes = 0
        self.garbled = False
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
            self.fd = ledger.claim(cfg.gpusim_dir, cfg.name, cfg.vram, cfg.card)
        except ledger.OutOfMemory as e:
            print(
                "ERROR [core.py] EngineCore failed to start.\n"
                "Traceback (most recent call last):\n"
                '  File "/opt/engine/engine_sim.py", in load_model\n'
                f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                f"{ledger.gib(e.wanted_bytes)}. GPU {cfg.card} has a total capacity of "
                f"{ledger.gib(e.total_bytes)} of which {ledger.gib(max(e.free_bytes, 0))} "
                "is free.\n"
                f"{e}\n"
                "RuntimeError: Engine core initialization failed. See root cause above.",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(1)
        doomed = take_fault(cfg.fault_file, "failing_boots")
        time.sleep(cfg.boot_delay)
        return doomed

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

    @property
    def sleeping(self) -> bool:
        """Whether the engine is asleep (at either level)."""
        return self.sleep_level is not None

    def check_alive(self) -> None:
        """Raise the error a request gets from a dead engine."""
        if self.dead is not None:
            raise ApiError(500, self.dead, "InternalServerError")

    def check_awake(self) -> None:
        """Fail a request that reaches the engine; one that finds it asleep crashes it first."""
        level = self.sleep_level
        if level is not None and self.dead is None:
            self.die(
                f"request while asleep (sleep level {level}): "
                "CUDA error: an illegal memory access was encountered"
            )
        self.check_alive()

    def wait_warm(self) -> None:
        """Delay requests that come while the kernels are still "compiling"."""
        with self.lock:
            if self.warm_until is None:
                self.warm_until = time.monotonic() + self.cfg.warm_delay
            remaining = self.warm_until - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def _resize(self, nbytes: int) -> None:
        """Resize the engine's ledger claim (same holder, same PID)."""
        if self.fd is None:
            raise ledger.LedgerError(f"{self.cfg.name}: no claim")
        ledger.resize(self.cfg.gpusim_dir, self.cfg.name, self.fd, nbytes)

    def sleep(self, level: int) -> None:
        """Fall asleep: offload (ENGINE_SLEEP_DELAY), then shrink the claim to the residual."""
        cfg = self.cfg
        with self.mode_lock:
            self.check_alive()
            if self.sleep_level is not None:
                log(
                    f"INFO [api_server.py] sleep level {level}: asleep already "
                    f"(level {self.sleep_level})"
                )
                return
            what = "weights offloaded to CPU" if level == 1 else "weights discarded"
            log(f"INFO [api_server.py] sleep level {level}: {what}, KV cache discarded")
            start = time.monotonic()
            time.sleep(cfg.sleep_delay)
            residual = cfg.residual(level)
            try:
                self._resize(residual)
            except ledger.LedgerError as e:
                raise ApiError(500, str(e), "InternalServerError") from None
            self.sleep_level = level
        freed = cfg.vram - residual
        log(
            f"INFO [gpu_worker.py] Sleep mode freed {ledger.gib(freed)} ({freed} bytes) memory, "
            f"{ledger.gib(residual)} ({residual} bytes) memory is still in use."
        )
        log(
            f"INFO [executor_base.py] It took {time.monotonic() - start:.2f} seconds "
            f"to fall asleep (level {level})."
        )

    def wake(self) -> None:
        """Wake up: grow the claim back (CUDA OOM when there is no room: still asleep), reload."""
        cfg = self.cfg
        with self.mode_lock:
            self.check_alive()
            level = self.sleep_level
            if level is None:
                log("INFO [api_server.py] wake up: awake already")
                return
            start = time.monotonic()
            try:
                self._resize(cfg.vram)
            except ledger.LedgerError as e:
                log(f"ERROR [gpu_worker.py] wake up from sleep level {level} failed: {e}")
                raise ApiError(500, str(e), "InternalServerError") from None
            time.sleep(cfg.wake_delay(level))
            garbled = take_fault(cfg.fault_file, "garbled_wakes")
            with self.lock:
                self.sleep_level, self.garbled = None, garbled
                self.wakes += 1
        log(
            f"INFO [executor_base.py] It took {time.monotonic() - start:.2f} seconds "
            f"to wake up from sleep level {level} ({cfg.vram - cfg.residual(level)} bytes back)."
        )
        if garbled:
            # vLLM says nothing here: only the answers tell. This line is for whoever reads logs.
            log("SIM garbled wake (fault file): completions are junk until a clean wake")

    def state(self) -> dict[str, Any]:
        """The counters for ``GET /sim/state``."""
        return {
            "pid": os.getpid(),
            "boot": self.boot,
            "boots": read_boots(self.cfg.gpusim_dir),
            "dead": self.dead is not None,
            "failing_boots": read_failing_boots(self.cfg.fault_file),
            "garbled_wakes": read_faults(self.cfg.fault_file).get("garbled_wakes", 0),
            "sleeping": self.sleeping,
            "sleep_level": self.sleep_level,
            "wakes": self.wakes,
            "garbled": self.garbled,
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


def garble(toks: list[str]) -> list[str]:
    """Fixed junk in place of every word, never the word itself (as many tokens)."""
    out = []
    for i, word in enumerate(toks):
        junk = GARBLED_WORDS[i % len(GARBLED_WORDS)]
        out.append(junk if junk != word else GARBLED_WORDS[(i + 1) % len(GARBLED_WORDS)])
    return out


def plan_completion(body: Any, cfg: Config, garbled: bool = False) -> Plan:
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
    if garbled:
        kept_reasoning, kept_answer = garble(kept_reasoning), garble(kept_answer)
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


def texts(plan: Plan, per_chunk: int) -> list[str]:
    """The output as pieces of one text (reasoning, then the answer, a space between them)."""
    return [text if i == 0 or text.startswith(" ") else " " + text
            for i, (_phase, text) in enumerate(chunks(plan, per_chunk))]


def sleep_level(query: str) -> int:
    """The ``level`` of a ``/sleep`` query (default 1, as in vLLM); 400 unless 1 or 2."""
    text = parse_qs(query).get("level", ["1"])[0]
    if text not in {str(level) for level in SLEEP_LEVELS}:
        raise ApiError(400, f"level must be 1 or 2, not {text!r}", "BadRequestError", "level")
    return int(text)


class Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 handler with vLLM's routes."""

    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as uvicorn (vLLM) and Go's net/http (llama-swap) set it: headers and body go out in
    # separate writes, and Nagle's algorithm would hold the body for the client's delayed ACK (40 ms).
    disable_nagle_algorithm = True
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
            elif url.path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
                self._other_api(url.path, raw)
            elif url.path == "/v1/audio/transcriptions":  # vLLM serves it for a speech model: the form, heard
                engine.check_alive()
                self._json(200, {"text": f"{len(raw)} bytes heard"})
            elif url.path == "/sleep" and cfg.dev_mode:
                engine.sleep(sleep_level(url.query))
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
        set_fault(self.server.engine.cfg.fault_file, "failing_boots", failing)
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
        plan = plan_completion(body, engine.cfg, engine.garbled)
        engine.check_awake()
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

    def _other_api(self, path: str, raw: bytes) -> None:
        """Answer Anthropic's Messages API or OpenAI's Responses API with the words a chat would get."""
        engine = self.server.engine
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"JSON decode error: {e}", "BadRequestError") from None
        if not isinstance(body, dict):
            raise ApiError(400, "Input should be a valid dictionary", "BadRequestError")
        if path == "/v1/responses":
            given = body.get("input")
            messages = [{"role": "user", "content": given}] if isinstance(given, str) else given
            if isinstance(body.get("instructions"), str):
                messages = [{"role": "system", "content": body["instructions"]}, *(messages or [])]
            limit = body.get("max_output_tokens")
        else:
            messages = body.get("messages")
            if isinstance(body.get("system"), str | list) and isinstance(messages, list):
                messages = [{"role": "system", "content": body["system"]}, *messages]
            limit = body.get("max_tokens")
        chat = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
        if limit is not None:
            chat["max_tokens"] = limit
        engine.check_alive()
        plan = plan_completion(chat, engine.cfg, engine.garbled)
        if path == "/v1/messages/count_tokens":
            self._json(200, {"input_tokens": plan.prompt_tokens})
            return
        engine.check_awake()
        with engine.lock:
            engine.running += 1
        try:
            engine.wait_warm()
            if path == "/v1/messages":
                self._anthropic(plan)
            else:
                self._responses(plan)
        finally:
            with engine.lock:
                engine.running -= 1

    def _pieces(self, plan: Plan) -> list[str]:
        """Generate the words piece by piece, as long as streaming takes; an engine put to sleep raises."""
        engine, cfg = self.server.engine, self.server.engine.cfg
        out = []
        for text in texts(plan, cfg.tokens_per_chunk):
            time.sleep(cfg.chunk_delay)
            engine.check_awake()
            out.append(text)
        return out

    def _named_event(self, name: str, obj: dict[str, Any]) -> None:
        """Write one server-sent event with its event name (Anthropic's and the Responses API's streams)."""
        self._chunk(f"event: {name}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode())

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _anthropic(self, plan: Plan) -> None:
        """Answer Anthropic's Messages API: one text block, streamed as its events or whole."""
        cfg = self.server.engine.cfg
        stop = "max_tokens" if plan.finish_reason == "length" else "end_turn"
        message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": cfg.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": plan.prompt_tokens, "output_tokens": 0}}
        if not plan.stream:
            text = "".join(self._pieces(plan))
            usage = self._account(plan)
            self._json(200, {**message, "content": [{"type": "text", "text": text}], "stop_reason": stop,
                             "usage": {"input_tokens": usage["prompt_tokens"],
                                       "output_tokens": usage["completion_tokens"]}})
            return
        self._start_stream()
        try:
            self._named_event("message_start", {"type": "message_start", "message": message})
            self._named_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                      "content_block": {"type": "text", "text": ""}})
            engine = self.server.engine
            for text in texts(plan, cfg.tokens_per_chunk):
                time.sleep(cfg.chunk_delay)
                try:
                    engine.check_awake()
                except ApiError as e:
                    self._named_event("error", {"type": "error", "error": {"type": "api_error", "message": e.message}})
                    self._chunk(b"")
                    return
                self._named_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                          "delta": {"type": "text_delta", "text": text}})
            usage = self._account(plan)
            self._named_event("content_block_stop", {"type": "content_block_stop", "index": 0})
            self._named_event("message_delta", {"type": "message_delta",
                                                 "delta": {"stop_reason": stop, "stop_sequence": None},
                                                 "usage": {"output_tokens": usage["completion_tokens"]}})
            self._named_event("message_stop", {"type": "message_stop"})
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _responses(self, plan: Plan) -> None:
        """Answer OpenAI's Responses API: one output message, streamed as its events or whole."""
        cfg = self.server.engine.cfg
        rid, mid = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        response: dict[str, Any] = {
            "id": rid, "object": "response", "created_at": int(time.time()), "model": cfg.model,
            "status": "in_progress", "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "error": None, "incomplete_details": None, "instructions": None, "metadata": {}, "temperature": 1.0,
            "top_p": 1.0, "usage": None}

        def done(text: str) -> dict[str, Any]:
            usage = self._account(plan)
            item = {"type": "message", "id": mid, "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}
            return {**response, "status": "completed", "output": [item],
                    "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                              "total_tokens": usage["total_tokens"],
                              "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}}}

        if not plan.stream:
            self._json(200, done("".join(self._pieces(plan))))
            return
        self._start_stream()
        n = 0

        def event(kind: str, **fields: Any) -> None:
            nonlocal n
            self._named_event(kind, {"type": kind, "sequence_number": n, **fields})
            n += 1

        try:
            event("response.created", response=response)
            event("response.output_item.added", output_index=0,
                  item={"type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []})
            event("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                  part={"type": "output_text", "text": "", "annotations": []})
            text = ""
            engine = self.server.engine
            for piece in texts(plan, cfg.tokens_per_chunk):
                time.sleep(cfg.chunk_delay)
                try:
                    engine.check_awake()
                except ApiError as e:
                    event("error", code=str(e.status), message=e.message, param=None)
                    self._chunk(b"")
                    return
                text += piece
                event("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=piece,
                      logprobs=[])
            final = done(text)
            event("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text, logprobs=[])
            event("response.content_part.done", item_id=mid, output_index=0, content_index=0,
                  part=final["output"][0]["content"][0])
            event("response.output_item.done", output_index=0, item=final["output"][0])
            event("response.completed", response=final)
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

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
            engine.check_awake()
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
                try:
                    engine.check_awake()
                except ApiError as e:
                    self._event({"error": {"message": e.message, "type": e.kind, "code": e.status}})
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
    # A burst of clients (a gateway letting its waiting requests through at once) must queue in
    # the kernel, as with a real server's backlog (uvicorn: 2048), not be refused at 5.
    request_queue_size = 1024

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
    try:
        cfg = Config.from_env(os.environ)
        cfg.validate()
    except ValueError as e:
        log(f"ERROR [arg_utils.py] invalid engine configuration: {e}")
        return 1
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
