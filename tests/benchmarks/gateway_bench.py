"""What the gateway adds: latency, time to first token, tokens/s and concurrent streams, direct against through it.

    .venv/bin/python -m tests.benchmarks.gateway_bench [--cycles 10] [--requests 200] [--tokens 600]
                                                      [--streams 100] [--servers all] [--realtime]

No test world is needed: the upstreams are the world's engine simulator (tests/stack/standins/engine_sim.py,
run as plain processes on a ledger of their own), gpuswapd is a stand-in that grants the gateway's
leases at once (the window's own costs are the swap benchmark's) and whose status prices a swap at
0 s (so the gateway's schedule holds no tenant's card for a next request: what batching costs is
the schedule benchmark's), and the gateway is the real
``gpuswapd-gateway``. With ``--servers all`` the same application also runs under the alternatives:
uvicorn without its C parser and event loop (h11 on asyncio), and hypercorn. Every gateway runs for
the whole run, side by side; only the one being measured has work.

Two cores, pinned (sched_setaffinity) so that the gateway never competes with what it is measured
against: the gateways on CPU 1; the client, the upstreams and the stand-in on CPU 0, all at nice
-10 (as root), and with ``--realtime`` in SCHED_RR: on a machine whose two cores are shared (other
test runs), a neighbour's slice would otherwise show up as milliseconds of "added latency" on
whichever path it happened to interrupt (kernels with EEVDF preempt by deadline, which nice barely
moves).

Two phases, each of ``--cycles`` cycles; every cycle runs each variant once, in turn (direct,
uvicorn[, uvicorn-h11, hypercorn], then again), each from the same client: one kept-alive
``http.client`` connection for the sequential requests, one ``httpx.AsyncClient`` for the
concurrent streams, whichever the path.

- **Phase 1, a quiet pool** (the gateway's upstream pool holds a connection or two):
  ``--requests`` small non-streaming completions (4 tokens, no delay), one after another, the
  turn's p50 and p99; then one long stream of ``--tokens`` tokens: time to its first chunk (the
  role, no token yet), to its first token, and streamed tokens/s (completion_tokens of the final
  usage chunk over the time from the first token to the last).
  Then the new routes of issue 36: ``--requests``/4 multipart forms of a fixed small size
  (``FORM``, 2 KiB of "audio", routed by their ``model`` field) to ``/v1/audio/transcriptions``,
  their p50 and p99; and one Anthropic Messages stream (``/v1/messages``) of ``--tokens`` tokens,
  time to its first token and its tokens/s (output_tokens of ``message_delta`` over first to last
  text delta).
- **Phase 2, a burst**: ``--streams`` concurrent streams of half as many tokens (each must end with
  its usage chunk and [DONE]; a lost stream is counted), how long they all took; then at once the
  same small completions again. The gateway's upstream pool now keeps the burst's connections
  idle (``keepalive_expiry`` 30 s), and what each request costs with them is measured here.

For a gateway, its CPU time over its small completions (the run time of its threads, to the
nanosecond) is given per 1,000 requests. Added latency (p50, p99), added time to first token and
the ratio of tokens/s are taken per cycle, the gateway's turn against the direct turn of the same
cycle. The p50/p99 pooled over every cycle's requests are printed too. The gateway's RSS (VmRSS,
VmHWM) is read at the end.

What bounds the result (constants of the engine simulator, of this run and of this machine):
  - the direct latency is the simulator's own: a Python ThreadingHTTPServer answering 4 tokens with
    no chunk delay (ENGINE_CHUNK_DELAY=0); the added latency is the gateway's parse, route and
    second loopback hop on top of it, which the simulator does not bound;
  - tokens/s is set by the simulator's pace, 3 tokens a chunk every 5 ms (ENGINE_TOKENS_PER_CHUNK,
    ENGINE_CHUNK_DELAY): about 600 tokens/s whatever the path, so the ratio says whether the gateway
    keeps up with that pace, not how fast it could stream;
  - the first chunk (the role) is sent at once and the first token after one chunk delay (5 ms),
    on both paths: the added time to first token is the gateway's;
  - phase 2 depends on --streams: the burst's size is how many idle connections the gateway's
    upstream pool holds afterwards, for their keep-alive (30 s, gpuswapd/gateway/upstream.py);
  - the concurrent streams' time is bound by CPU 0, where the simulator's threads (one per stream)
    and the client share one core;
  - two cores, shared with other work on this machine: nice -10 and --realtime keep most of a
    neighbour's time out of the figures, not all of it.

Results: tables on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.benchmarks.lease_bench import proc_status
from tests.benchmarks.report import (
    SPREAD_HEADER,
    alternate,
    figure,
    paired,
    parser,
    percentile,
    spread,
    spread_row,
    table,
    write_results,
)
from tests.stack.daemon import BIN
from tests.stack.world import REPO, SIM_PYTHON

SIM = REPO / "tests" / "stack" / "standins"
TARGETS = {"added_p50_ms": 1.0, "added_p99_ms": 5.0, "tokens_per_s_ratio": 0.98, "lost_streams": 0}
SERVERS = ("uvicorn", "uvicorn-h11", "hypercorn")
SHIPPED = "uvicorn"
GATEWAY_CPU, OTHERS_CPU = 1, 0
BOOST = -10  # the nice value of everything measured (root only)
# --realtime: everything measured in SCHED_RR (priority 1), above any neighbour's ordinary work; the
# kernel's RT throttling (sched_rt_runtime_us) still leaves the others 5% of each second.
REALTIME = False
TOKENS_PER_CHUNK, CHUNK_DELAY_S = 3, 0.005
SMALL = {"model": "sim-small", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
BOUNDARY = "gpuswapd-bench"
FORM = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nsim-small\r\n"
        f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
        "Content-Type: audio/wav\r\n\r\n").encode() + bytes(2048) + f"\r\n--{BOUNDARY}--\r\n".encode()


def long_body(tokens: int) -> dict[str, Any]:
    """A streamed completion of ``tokens`` tokens, with its final usage chunk."""
    return {"model": "sim-long", "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "write"}]}


CONFIG = """
[daemon]
socket = "{socket}"
socket_group = ""
state_dir = "{root}/state"
[gpu]
probe = "none"
[resident]
units = ["strata.service"]
[resident.verify]
url = "http://127.0.0.1:1/v1/chat/completions"
model = "strata"
[window]
health_url = "http://127.0.0.1:{small}/health"
serves = ["sim-small"]
[window.container]
name = "sim-small"
image = "none"
[window.verify]
url = "http://127.0.0.1:{small}/v1/chat/completions"
model = "sim-small"
[profiles.long]
kind = "engine"
health_url = "http://127.0.0.1:{long}/health"
serves = ["sim-long"]
[profiles.long.container]
name = "sim-long"
image = "none"
[profiles.long.verify]
url = "http://127.0.0.1:{long}/v1/chat/completions"
model = "sim-long"
[gateway]
listen = "127.0.0.1:{gateway}"
resident = "http://127.0.0.1:1"
idle = "1h"
"""

# The gateway's app under another ASGI server (run as: python -c RUNNER SERVER CONFIG SOCKET PORT).
RUNNER = """
import asyncio, socket, sys
from gpuswapd.config import load_config
from gpuswapd.gateway.main import build
server, config, sock_path, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
app = build(load_config(config), sock_path, holder="bench-" + server)
if server == "hypercorn":
    from hypercorn.asyncio import serve
    from hypercorn.config import Config
    cfg = Config()
    cfg.bind = [f"127.0.0.1:{port}"]
    cfg.accesslog = None
    cfg.keep_alive_timeout = 75
    asyncio.run(serve(app, cfg))
else:
    import uvicorn
    uvicorn.run(app, host="127.0.0.1", port=port, loop="asyncio", http="h11", lifespan="on", log_level="warning",
                access_log=False, timeout_keep_alive=75)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StandIn:
    """gpuswapd as the gateway sees it while a window is open: every acquire is granted at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.acquires = 0

    def start(self) -> StandIn:
        ready = threading.Event()

        async def serve() -> None:
            self.server = await asyncio.start_unix_server(self._handle, str(self.path))
            ready.set()

        self.thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop)
        ready.wait(10)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ValueError):
            request = json.loads(await reader.readline())
            op = request.get("op")
            lease = {"id": f"bench-{self.acquires}", "holder": "gateway", "expires_at": time.time() + 3600}
            if op == "watch":
                writer.write(b'{"event": "subscribed"}\n')
            elif op == "status":
                # The card moves at once here, and says so as gpuswapd's status does (its medians): the
                # gateway's schedule then keeps no tenant waiting for the price of a swap.
                free = {"open_s": 0.0, "close_s": 0.0, "resident_restart_s": 0.0}
                writer.write(json.dumps({"ok": True, "phase": "READY", "window": None,
                                         "price": {"default": free, "long": free}}).encode() + b"\n")
            elif op == "acquire":
                self.acquires += 1
                writer.write(json.dumps({"ok": True, "lease": lease}).encode() + b"\n")
            else:
                writer.write(json.dumps({"ok": True, "lease": lease, "released": []}).encode() + b"\n")
            await writer.drain()
            if op in ("watch", "acquire"):  # kept: a watcher, a lease bound to its connection
                while await reader.read(4096):
                    pass
        writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def pin(pid: int, cpu: int) -> None:
    """Keep a process (and the threads it starts later) on one CPU, ahead of other work on it.

    On a shared machine other processes run on the same two cores; at nice -10 (root only) the
    scheduler lets them preempt what is measured far less often, so the figures say what the
    gateway adds rather than what a neighbour took.
    """
    if cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(pid, {cpu})
    if os.geteuid() == 0:
        os.setpriority(os.PRIO_PROCESS, pid, BOOST)
        if REALTIME:
            os.sched_setscheduler(pid, os.SCHED_RR, os.sched_param(1))


def pinned(cpu: int) -> Callable[[], None]:
    """Pin a child before it runs (its threads then inherit both the CPU and the priority)."""
    return lambda: pin(0, cpu)


def wait_http(port: int, path: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                conn.close()
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer on port {port} within 30s")


@contextlib.contextmanager
def upstreams(root: Path, tokens: int) -> Iterator[dict[str, int]]:
    """Two engine simulators: "sim-small" answers at once, "sim-long" streams ``tokens`` tokens."""
    gpu = root / "gpu"
    subprocess.run([SIM_PYTHON, str(SIM / "ledger.py"), "--dir", str(gpu), "init", "--total", "80GiB", "--lag", "0"],
                   check=True, capture_output=True, timeout=30)
    ports = {"small": free_port(), "long": free_port()}
    common = {"GPUSIM_DIR": str(gpu), "ENGINE_VRAM": "1GiB", "ENGINE_BOOT_DELAY": "0", "ENGINE_HOST": "127.0.0.1",
              "ENGINE_REASONING_TOKENS": "0", "ENGINE_TOKENS_PER_CHUNK": str(TOKENS_PER_CHUNK)}
    env = {
        "small": {"ENGINE_NAME": "sim-small", "ENGINE_MODEL": "sim-small", "ENGINE_ANSWER_TOKENS": "4",
                  "ENGINE_CHUNK_DELAY": "0"},
        "long": {"ENGINE_NAME": "sim-long", "ENGINE_MODEL": "sim-long", "ENGINE_ANSWER_TOKENS": str(tokens),
                 "ENGINE_CHUNK_DELAY": str(CHUNK_DELAY_S)},
    }
    procs = {}
    try:
        for name, port in ports.items():
            log = open(root / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
            with log:
                procs[name] = subprocess.Popen([SIM_PYTHON, str(SIM / "engine_sim.py")],
                                               env={**os.environ, **common, **env[name], "PORT": str(port)},
                                               stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                               preexec_fn=pinned(OTHERS_CPU))
        for name, port in ports.items():
            wait_http(port, "/health", procs[name], f"the {name} engine simulator")
        yield ports
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(10)


@contextlib.contextmanager
def gateways(servers: tuple[str, ...], config: Path, sock: Path, port: int,
             root: Path) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], int]]]:
    """Run the gateway under each server, side by side, all on the gateways' CPU: ``{server: (process, port)}``.

    The shipped one is ``gpuswapd-gateway`` itself, on ``port`` (the config's ``listen``); the
    others run the same app (RUNNER) on ports of their own.
    """
    running: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    try:
        for server in servers:
            if server == SHIPPED:
                at = port
                argv = [str(BIN / "gpuswapd-gateway"), "--config", str(config), "--socket", str(sock),
                        "--log-level", "warning"]
            else:
                at = free_port()
                argv = [sys.executable, "-c", RUNNER, server, str(config), str(sock), str(at)]
            with open(root / f"gateway-{server}.log", "ab") as log:
                running[server] = (subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                                    preexec_fn=pinned(GATEWAY_CPU)), at)
        for server, (proc, at) in running.items():
            wait_http(at, "/health", proc, f"the gateway under {server}")
            # The first requests take the leases (the stand-in grants them at once) and warm the pools.
            for body in (SMALL, long_body(3)):
                one_request(at, body)
        yield running
    finally:
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def one_request(port: int, body: dict[str, Any]) -> bytes:
    """POST one completion and read it whole (untimed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"POST to port {port}: HTTP {resp.status}: {data[:300]!r}")
    return data


def latencies(port: int, n: int) -> list[float]:
    """Time ``n`` small completions, one after another on one kept-alive connection (seconds)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps(SMALL).encode()
    headers = {"Content-Type": "application/json"}
    out = []
    try:
        for _ in range(n):
            started = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body, headers)
            resp = conn.getresponse()
            data = resp.read()
            out.append(time.perf_counter() - started)
            if resp.status != 200:
                raise RuntimeError(f"a small completion on port {port}: HTTP {resp.status}: {data[:300]!r}")
    finally:
        conn.close()
    return out


def forms(port: int, n: int) -> dict[str, Any]:
    """Time ``n`` small multipart forms (FORM) to /v1/audio/transcriptions, one after another on one connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    out = []
    try:
        for _ in range(n):
            started = time.perf_counter()
            conn.request("POST", "/v1/audio/transcriptions", FORM, headers)
            resp = conn.getresponse()
            data = resp.read()
            out.append(time.perf_counter() - started)
            if resp.status != 200:
                raise RuntimeError(f"a form on port {port}: HTTP {resp.status}: {data[:300]!r}")
    finally:
        conn.close()
    return {"form_p50_ms": percentile(out, 50) * 1000, "form_p99_ms": percentile(out, 99) * 1000}


def anthropic_stream(port: int, tokens: int) -> dict[str, float]:
    """One Anthropic Messages stream: time to its first text delta, tokens/s from message_delta's output_tokens."""
    body = {"model": "sim-long", "max_tokens": tokens, "stream": True, "messages": [{"role": "user", "content": "w"}]}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        started = time.perf_counter()
        conn.request("POST", "/v1/messages", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"an Anthropic stream on port {port}: HTTP {resp.status}: {resp.read()[:300]!r}")
        first = last = None
        used = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("type") == "content_block_delta":
                last = time.perf_counter()
                first = first or last
            elif event.get("type") == "message_delta":
                used = event["usage"]["output_tokens"]
    finally:
        conn.close()
    if first is None or last is None or last == first or not used:
        raise RuntimeError(f"the Anthropic stream on port {port} carried no tokens and usage ({used} tokens)")
    return {"a_ttft_ms": (first - started) * 1000, "a_tokens_per_s": used / (last - first)}


def stream(port: int, tokens: int) -> dict[str, float]:
    """One long stream: time to its first chunk and first token, tokens/s from the final usage (first token to last)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        started = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(long_body(tokens)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"a stream on port {port}: HTTP {resp.status}: {resp.read()[:300]!r}")
        chunk_at = first = last = None
        used = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            chunk_at = chunk_at or now
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    first = first or now
                    last = now
    finally:
        conn.close()
    if chunk_at is None or first is None or last is None or last == first or not used:
        raise RuntimeError(f"the stream on port {port} carried no tokens and usage ({used} tokens)")
    return {"first_chunk_ms": (chunk_at - started) * 1000, "ttft_ms": (first - started) * 1000,
            "tokens_per_s": used / (last - first)}


async def concurrent_streams(port: int, n: int, tokens: int) -> dict[str, Any]:
    """Run ``n`` streams at once; count those that end with their usage and [DONE]."""
    async def one(client: httpx.AsyncClient) -> bool:
        usage = done = False
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json=long_body(tokens)) as resp:
            if resp.status_code != 200:
                return False
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    usage = usage or bool(json.loads(line[6:]).get("usage"))
                done = done or line == "data: [DONE]"
        return usage and done

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(client) for _ in range(n)), return_exceptions=True)
        took = time.perf_counter() - started
    complete = sum(1 for r in results if r is True)
    errors = sorted({repr(r) for r in results if isinstance(r, BaseException)})
    return {"streams": n, "complete": complete, "lost": n - complete, "took_s": took, "errors": errors[:5]}


def run_time(pid: int) -> float:
    """The CPU seconds a process's threads have run so far (schedstat, to the nanosecond)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def small_completions(port: int, pid: int | None, requests: int) -> dict[str, Any]:
    """The turn's small completions: p50, p99 and (for a gateway) its CPU per 1,000 of them."""
    cpu_before = run_time(pid) if pid is not None else 0.0
    lat = latencies(port, requests)
    out: dict[str, Any] = {"p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
                           "latencies_s": lat}
    if pid is not None:
        out["cpu_s_per_1000"] = (run_time(pid) - cpu_before) / requests * 1000
    return out


def quiet_turn(small: int, long: int, pid: int | None, requests: int, tokens: int) -> dict[str, Any]:
    """A turn of the first phase: the small completions, then one long stream (one connection each at most)."""
    return {**small_completions(small, pid, requests), **stream(long, tokens), **forms(small, max(1, requests // 4)),
            **anthropic_stream(long, tokens)}


def burst_turn(small: int, long: int, pid: int | None, requests: int, tokens: int, streams: int) -> dict[str, Any]:
    """A turn of the second phase: the concurrent streams, then the small completions at once after them."""
    crowd = asyncio.run(concurrent_streams(long, streams, max(1, tokens // 2)))
    return {"crowd_took_s": crowd["took_s"], "crowd_complete": crowd["complete"], "crowd_lost": crowd["lost"],
            "crowd_errors": crowd["errors"], **small_completions(small, pid, requests)}


def run(cycles: int, requests: int, tokens: int, streams: int, servers: tuple[str, ...]) -> dict[str, Any]:
    """Start the upstreams, the stand-in and the gateways; run both phases' cycles, alternating the variants."""
    root = Path(tempfile.mkdtemp(prefix="gpuswapd-gateway-bench-", dir="/var/tmp"))
    result: dict[str, Any] = {"requests_per_turn": requests, "tokens": tokens, "streams": streams,
                              "servers": list(servers),
                              "constants": {"tokens_per_chunk": TOKENS_PER_CHUNK, "chunk_delay_s": CHUNK_DELAY_S},
                              "pinning": {"gateway_cpu": GATEWAY_CPU, "others_cpu": OTHERS_CPU,
                                          "nice": BOOST if os.geteuid() == 0 else 0, "sched_rr": REALTIME}}
    stand_in: StandIn | None = None
    try:
        with upstreams(root, tokens) as ports:
            sock = root / "gpuswapd.sock"
            stand_in = StandIn(sock).start()
            config = root / "gpuswapd.toml"
            gw_port = free_port()
            config.write_text(CONFIG.format(socket=sock, root=root, small=ports["small"], long=ports["long"],
                                            gateway=gw_port))
            with gateways(servers, config, sock, gw_port, root) as running:
                for port in (ports["small"], *(at for _, at in running.values())):
                    latencies(port, 50)  # warm every path
                paths = [("direct", ports["small"], ports["long"], None),
                         *((server, at, at, proc.pid) for server, (proc, at) in running.items())]
                result["quiet"] = alternate(cycles, [
                    (name, lambda s=small, lg=long, p=pid: quiet_turn(s, lg, p, requests, tokens))
                    for name, small, long, pid in paths])
                result["burst"] = alternate(cycles, [
                    (name, lambda s=small, lg=long, p=pid: burst_turn(s, lg, p, requests, tokens, streams))
                    for name, small, long, pid in paths])
                result["rss_kb"] = {server: proc_status(proc.pid) for server, (proc, _) in running.items()}
                result["acquires"] = stand_in.acquires
    finally:
        if stand_in is not None:
            stand_in.stop()
        shutil.rmtree(root, ignore_errors=True)
    return result


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Each variant's spread over the cycles, and each gateway against the same cycle's direct turn."""
    stats: dict[str, Any] = {}
    for phase in ("quiet", "burst"):
        v = result[phase]
        d = v["direct"]
        for name, turns in v.items():
            at = f"{phase}.{name}"
            for key in ("p50_ms", "p99_ms", "first_chunk_ms", "ttft_ms", "tokens_per_s", "crowd_took_s",
                        "cpu_s_per_1000", "form_p50_ms", "form_p99_ms", "a_ttft_ms", "a_tokens_per_s"):
                if key in turns[0]:
                    stats[f"{at}.{key}"] = spread([t[key] for t in turns])
            pooled = [x for t in turns for x in t["latencies_s"]]
            stats[f"{at}.pooled"] = {"n": len(pooled), "p50_ms": percentile(pooled, 50) * 1000,
                                     "p99_ms": percentile(pooled, 99) * 1000}
            if phase == "burst":
                stats[f"{at}.lost"] = sum(t["crowd_lost"] for t in turns)
                stats[f"{at}.streams"] = sum(t["crowd_complete"] + t["crowd_lost"] for t in turns)
            if name == "direct":
                continue

            def per_cycle(key: str, how: Callable[[float, float], float],
                          turns: list[dict[str, Any]] = turns, d: list[dict[str, Any]] = d) -> Any:
                return spread(paired([t[key] for t in turns], [t[key] for t in d], how))

            stats[f"{at}.added_p50_ms"] = per_cycle("p50_ms", lambda a, b: a - b)
            stats[f"{at}.added_p99_ms"] = per_cycle("p99_ms", lambda a, b: a - b)
            for key in ("p50_ms", "p99_ms"):
                stats[f"{at}.pooled_added_{key}"] = stats[f"{at}.pooled"][key] - stats[f"{phase}.direct.pooled"][key]
            if phase == "quiet":
                stats[f"{at}.added_first_chunk_ms"] = per_cycle("first_chunk_ms", lambda a, b: a - b)
                stats[f"{at}.added_ttft_ms"] = per_cycle("ttft_ms", lambda a, b: a - b)
                stats[f"{at}.tokens_per_s_ratio"] = per_cycle("tokens_per_s", lambda a, b: a / b)
                stats[f"{at}.added_form_p50_ms"] = per_cycle("form_p50_ms", lambda a, b: a - b)
                stats[f"{at}.added_form_p99_ms"] = per_cycle("form_p99_ms", lambda a, b: a - b)
                stats[f"{at}.added_a_ttft_ms"] = per_cycle("a_ttft_ms", lambda a, b: a - b)
                stats[f"{at}.a_tokens_per_s_ratio"] = per_cycle("a_tokens_per_s", lambda a, b: a / b)
            else:
                stats[f"{at}.crowd_ratio"] = per_cycle("crowd_took_s", lambda a, b: a / b)
    return stats


def targets(stats: dict[str, Any]) -> list[tuple[str, float, str, bool]]:
    """The issue's targets, judged on the shipped gateway's medians of paired cycles, in both phases."""
    q, b = f"quiet.{SHIPPED}", f"burst.{SHIPPED}"
    out = []
    for at, when in ((q, "quiet pool"), (b, "just after a burst")):
        p50, p99 = stats[f"{at}.added_p50_ms"]["median"], stats[f"{at}.added_p99_ms"]["median"]
        out += [(f"added p50, ms, {when} (median of cycles)", p50, f"<= {TARGETS['added_p50_ms']:g}",
                 p50 <= TARGETS["added_p50_ms"]),
                (f"added p99, ms, {when} (median of cycles)", p99, f"<= {TARGETS['added_p99_ms']:g}",
                 p99 <= TARGETS["added_p99_ms"])]
    ratio, lost = stats[f"{q}.tokens_per_s_ratio"]["median"], stats[f"{b}.lost"]
    a_ratio = stats[f"{q}.a_tokens_per_s_ratio"]["median"]
    f50, f99 = stats[f"{q}.added_form_p50_ms"]["median"], stats[f"{q}.added_form_p99_ms"]["median"]
    return [
        *out,
        ("added p50, ms, a small multipart form (median of cycles)", f50, f"<= {TARGETS['added_p50_ms']:g}",
         f50 <= TARGETS["added_p50_ms"]),
        ("added p99, ms, a small multipart form (median of cycles)", f99, f"<= {TARGETS['added_p99_ms']:g}",
         f99 <= TARGETS["added_p99_ms"]),
        ("tokens/s, gateway / direct (median of cycles)", ratio, f">= {TARGETS['tokens_per_s_ratio']:g}",
         ratio >= TARGETS["tokens_per_s_ratio"]),
        ("tokens/s, Anthropic stream, gateway / direct (median)", a_ratio, f">= {TARGETS['tokens_per_s_ratio']:g}",
         a_ratio >= TARGETS["tokens_per_s_ratio"]),
        (f"streams lost through the gateway, of {stats[f'{b}.streams']}", lost, "0", lost == TARGETS["lost_streams"]),
    ]


def _small_rows(stats: dict[str, Any], phase: str, g: str) -> list[tuple[Any, ...]]:
    return [spread_row("  direct p50", stats[f"{phase}.direct.p50_ms"]),
            spread_row("  gateway p50", stats[f"{phase}.{g}.p50_ms"]),
            spread_row("  added p50, per cycle", stats[f"{phase}.{g}.added_p50_ms"]),
            spread_row("  direct p99", stats[f"{phase}.direct.p99_ms"]),
            spread_row("  gateway p99", stats[f"{phase}.{g}.p99_ms"]),
            spread_row("  added p99, per cycle", stats[f"{phase}.{g}.added_p99_ms"]),
            spread_row("  gateway CPU s per 1,000 requests", stats[f"{phase}.{g}.cpu_s_per_1000"])]


def print_report(result: dict[str, Any], stats: dict[str, Any]) -> None:
    """Print the tables and the targets."""
    cycles, g = len(result["quiet"]["direct"]), SHIPPED
    n, tokens, crowd = result["requests_per_turn"], result["tokens"], result["streams"]
    q, b = f"quiet.{g}", f"burst.{g}"
    rows: list[tuple[Any, ...]] = [
        (f"phase 1, quiet pool: small completion, {n} a turn, one after another (ms)",) + (None,) * 6,
        *_small_rows(stats, "quiet", g),
        (f"phase 1: one stream of {tokens} tokens, {TOKENS_PER_CHUNK} a chunk every {CHUNK_DELAY_S * 1000:g} ms",)
        + (None,) * 6,
        spread_row("  direct: first chunk (ms)", stats["quiet.direct.first_chunk_ms"]),
        spread_row("  gateway: first chunk (ms)", stats[f"{q}.first_chunk_ms"]),
        spread_row("  added to the first chunk, per cycle (ms)", stats[f"{q}.added_first_chunk_ms"]),
        spread_row("  direct: first token (ms)", stats["quiet.direct.ttft_ms"]),
        spread_row("  gateway: first token (ms)", stats[f"{q}.ttft_ms"]),
        spread_row("  added to the first token, per cycle (ms)", stats[f"{q}.added_ttft_ms"]),
        spread_row("  direct tokens/s", stats["quiet.direct.tokens_per_s"]),
        spread_row("  gateway tokens/s", stats[f"{q}.tokens_per_s"]),
        spread_row("  tokens/s, gateway / direct, per cycle (x)", stats[f"{q}.tokens_per_s_ratio"]),
        (f"phase 1: a small multipart form ({len(FORM)} bytes) to /v1/audio/transcriptions (ms)",) + (None,) * 6,
        spread_row("  direct p50", stats["quiet.direct.form_p50_ms"]),
        spread_row("  added p50, per cycle", stats[f"{q}.added_form_p50_ms"]),
        spread_row("  direct p99", stats["quiet.direct.form_p99_ms"]),
        spread_row("  added p99, per cycle", stats[f"{q}.added_form_p99_ms"]),
        (f"phase 1: one Anthropic Messages stream of {tokens} tokens",) + (None,) * 6,
        spread_row("  added to the first token, per cycle (ms)", stats[f"{q}.added_a_ttft_ms"]),
        spread_row("  direct tokens/s", stats["quiet.direct.a_tokens_per_s"]),
        spread_row("  tokens/s, gateway / direct, per cycle (x)", stats[f"{q}.a_tokens_per_s_ratio"]),
        (f"phase 2: {crowd} concurrent streams of {max(1, tokens // 2)} tokens (s)",) + (None,) * 6,
        spread_row("  direct, all done", stats["burst.direct.crowd_took_s"]),
        spread_row("  gateway, all done", stats[f"{b}.crowd_took_s"]),
        spread_row("  gateway / direct, per cycle (x)", stats[f"{b}.crowd_ratio"]),
        (f"phase 2: small completion, {n} a turn, just after the streams (ms)",) + (None,) * 6,
        *_small_rows(stats, "burst", g),
    ]
    print(table(f"\ngpuswapd-gateway ({g}) against direct, {cycles} cycles a phase, variants alternating",
                SPREAD_HEADER, rows))
    for phase in ("quiet", "burst"):
        dp, gp = stats[f"{phase}.direct.pooled"], stats[f"{phase}.{g}.pooled"]
        print(f"pooled over every cycle of phase {1 if phase == 'quiet' else 2} ({gp['n']} requests each way): "
              f"p50 direct {dp['p50_ms']:.3f} ms, gateway {gp['p50_ms']:.3f} ms "
              f"(added {stats[f'{phase}.{g}.pooled_added_p50_ms']:.3f}); p99 direct {dp['p99_ms']:.3f} ms, "
              f"gateway {gp['p99_ms']:.3f} ms (added {stats[f'{phase}.{g}.pooled_added_p99_ms']:.3f})")
    for name in ("direct", *result["servers"]):
        print(f"concurrent streams, {name}: {stats[f'burst.{name}.streams'] - stats[f'burst.{name}.lost']} of "
              f"{stats[f'burst.{name}.streams']} complete with their usage and [DONE]")
        for turn_ in result["burst"][name]:
            for err in turn_["crowd_errors"]:
                print(f"  {err}")
    others = [s for s in result["servers"] if s != g]
    if others:
        orows = []
        for s in (g, *others):
            for key, label in (("quiet.{}.added_p50_ms", "added p50, quiet, ms"),
                               ("quiet.{}.added_p99_ms", "added p99, quiet, ms"),
                               ("quiet.{}.cpu_s_per_1000", "CPU s per 1,000, quiet"),
                               ("quiet.{}.tokens_per_s_ratio", "tokens/s ratio (x)"),
                               ("burst.{}.crowd_ratio", "streams' time ratio (x)"),
                               ("burst.{}.added_p50_ms", "added p50 after a burst, ms"),
                               ("burst.{}.cpu_s_per_1000", "CPU s per 1,000 after a burst")):
                orows.append(spread_row(f"{s}: {label}", stats[key.format(s)]))
        print(table("\nthe same gateway under each server, per cycle against direct", SPREAD_HEADER, orows))
    rss = result["rss_kb"]
    print("\nRSS at the end: " + ", ".join(f"{s} {rss[s]['VmRSS'] / 1024:.1f} MB (peak {rss[s]['VmHWM'] / 1024:.1f})"
                                            for s in result["servers"]))
    pin_ = result["pinning"]
    print(f"gateways on CPU {pin_['gateway_cpu']}, the rest on CPU {pin_['others_cpu']}, nice {pin_['nice']}"
          + (", SCHED_RR" if pin_["sched_rr"] else "") + f"; load average {os.getloadavg()[0]:.2f}; "
          f"cpus {os.cpu_count()}")
    print(table("\ntargets", ("measure", "value", "target", "met"),
                [(w, v, t, "yes" if met else "NO") for w, v, t, met in targets(stats)]))
    print(f"\nadded latency p50, quiet pool {figure(stats[f'{q}.added_p50_ms'], ' ms', 3)}; "
          f"just after a burst {figure(stats[f'{b}.added_p50_ms'], ' ms', 3)}")


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables."""
    p = parser("gateway_bench", __doc__, cycles_of="direct, then each server's gateway")
    p.add_argument("--requests", type=_count, default=200,
                   help="small completions each variant sends per cycle (default 200)")
    p.add_argument("--tokens", type=_count, default=600, help="tokens of the long stream (default 600)")
    p.add_argument("--streams", type=_count, default=100,
                   help="concurrent streams per cycle and variant, of half as many tokens (default 100)")
    p.add_argument("--servers", choices=["uvicorn", "all"], default="all",
                   help="the shipped server only, or the alternatives too (default all)")
    p.add_argument("--realtime", action="store_true",
                   help="run everything measured in SCHED_RR (root), so that a busy neighbour does not count")
    args = p.parse_args(argv)
    global REALTIME
    REALTIME = args.realtime and os.geteuid() == 0
    pin(os.getpid(), OTHERS_CPU)
    servers = SERVERS if args.servers == "all" else (SHIPPED,)
    try:
        result = run(args.cycles, args.requests, args.tokens, args.streams, servers)
    except (RuntimeError, OSError, httpx.HTTPError, subprocess.SubprocessError) as err:
        print(f"gateway_bench: {err}", file=sys.stderr)
        return 1
    stats = analyse(result)
    print_report(result, stats)
    met = {what: ok for what, _, _, ok in targets(stats)}
    path = write_results("gateway", {**result, "stats": stats, "targets": TARGETS, "met": met})
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
