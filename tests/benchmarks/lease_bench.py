"""How fast gpuswapd serves leases and status with a window open, and what it costs at rest.

    .venv/bin/python -m tests.benchmarks.lease_bench [--seconds 3] [--idle 60]

With a window READY on the test world (one lease held by the benchmark), over the real socket
with raw asyncio clients (one JSON line per request, the protocol of gpuswapd/protocol.py):

- acquire-join latency, 1 / 10 / 100 clients at once: connect, ``acquire`` (joins at once),
  reply; each client then releases its lease. Latency is connect → final reply, as a client sees it.
- ``status`` latency and throughput, 1 / 10 / 100 clients, each on one persistent connection
  sending requests back to back for ``--seconds``; and the same with a new connection per
  request (what every ``gpuswapctl status`` does).
- ``status`` latency for root while one non-root user (``nobody``) holds a flood of 2,000
  connections (new connection per request, as ``gpuswapctl status``): the caps refuse all but
  ``daemon.max_clients_per_uid`` of them at once, and root keeps its answer;
- the daemon's resident memory (VmRSS, VmHWM of /proc/PID/status) after that load, and the CPU
  seconds (utime + stime of /proc/PID/stat) it spends over ``--idle`` seconds with the window open,
  for the watch interval of the test world's config and for the shipped default.

The clients share this machine's CPUs with the daemon: on few cores they slow it down too.
Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import resource
import socket as socketlib
import sys
import time
from pathlib import Path
from typing import Any

from tests.benchmarks.report import measured, parser, percentile, table, write_results
from tests.stack.config import stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.world import Stack, StackError

CONCURRENCY = (1, 10, 100)
FLOOD = 2000
NOBODY = pwd.getpwnam("nobody")
TICKS = os.sysconf("SC_CLK_TCK")
TARGETS = {"join_p99_100_ms": 50.0, "status_rps": 2000.0, "rss_mb": 80.0, "idle_cpu_s_per_min": 0.5}


class ProtocolError(Exception):
    """gpuswapd answered with an error."""


async def _reply(reader: asyncio.StreamReader) -> dict[str, Any]:
    """Read lines until the final reply (skipping progress events)."""
    while True:
        line = await reader.readline()
        if not line:
            raise ProtocolError("gpuswapd closed the connection without a reply")
        data: dict[str, Any] = json.loads(line)
        if "event" not in data:
            if not data.get("ok"):
                raise ProtocolError(str(data.get("error")))
            return data


async def _send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


async def join_once(socket: str, holder: str) -> float:
    """Connect, join the open window, note the latency, then release the lease."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_unix_connection(socket)
    try:
        await _send(writer, {"op": "acquire", "for": 60, "holder": holder, "wait": False})
        lease = (await _reply(reader))["lease"]
        took = time.perf_counter() - started
        await _send(writer, {"op": "release", "lease": lease["id"]})
        await _reply(reader)
        return took
    finally:
        writer.close()
        await writer.wait_closed()


async def joins(socket: str, clients: int, samples: int) -> list[float]:
    """Run rounds of ``clients`` joins at once until there are ``samples`` latencies."""
    out: list[float] = []
    while len(out) < samples:
        out += await asyncio.gather(*(join_once(socket, f"join-{n}") for n in range(clients)))
    return out


async def status_loop(socket: str, until: float, persistent: bool) -> list[float]:
    """Send ``status`` back to back until ``until``; return each latency."""
    out: list[float] = []
    reader = writer = None
    try:
        while time.perf_counter() < until:
            started = time.perf_counter()
            if writer is None or not persistent:
                reader, writer = await asyncio.open_unix_connection(socket)
            assert reader is not None
            await _send(writer, {"op": "status"})
            await _reply(reader)
            out.append(time.perf_counter() - started)
            if not persistent:
                writer.close()
                await writer.wait_closed()
                writer = None
    finally:
        if writer is not None:
            writer.close()
            await writer.wait_closed()
    return out


async def statuses(socket: str, clients: int, seconds: float, persistent: bool) -> tuple[list[float], float]:
    """Run ``clients`` status loops at once for ``seconds``; return latencies and requests per second."""
    started = time.perf_counter()
    until = started + seconds
    per_client = await asyncio.gather(*(status_loop(socket, until, persistent) for _ in range(clients)))
    took = time.perf_counter() - started
    latencies = [x for one in per_client for x in one]
    return latencies, len(latencies) / took


def flooded_status(socket: str, connections: int, samples: int = 50) -> list[float]:
    """Measure root's status latency while ``nobody`` holds ``connections`` open to the daemon."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # nobody: open them, say so, hold them until the parent is done
        try:
            # Only the parent may hold the write end: its close is the child's EOF.
            os.close(done_w)
            os.close(ready_r)
            resource.setrlimit(resource.RLIMIT_NOFILE, (connections + 64, connections + 64))
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            held = []
            for _ in range(connections):
                s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
                s.connect(socket)
                held.append(s)
            os.write(ready_w, b"x")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)  # a child that fails before it is ready gives an EOF, not a hang
    os.close(done_r)
    try:
        if os.read(ready_r, 1) != b"x":
            raise RuntimeError(f"the flood of {connections} connections could not be opened")
        return asyncio.run(_status_samples(socket, samples))
    finally:
        os.close(done_w)
        os.waitpid(pid, 0)
        os.close(ready_r)


async def _status_samples(socket: str, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        reader, writer = await asyncio.open_unix_connection(socket)
        await _send(writer, {"op": "status"})
        await _reply(reader)
        writer.close()
        out.append(time.perf_counter() - started)
    return out


def proc_status(pid: int) -> dict[str, int]:
    """Read VmRSS and VmHWM (kB) from /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """Read utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def idle_cpu(daemon: RunningDaemon, seconds: float) -> float:
    """Return the CPU seconds the daemon spends over ``seconds`` of rest, scaled to one minute."""
    assert daemon.proc is not None
    before = cpu_seconds(daemon.proc.pid)
    time.sleep(seconds)
    return (cpu_seconds(daemon.proc.pid) - before) * 60.0 / seconds


def ms(values: list[float], p: float) -> float:
    """Return the ``p``-th percentile of seconds, in milliseconds."""
    return percentile(values, p) * 1000


def open_window(stack: Stack, name: str, **sections: dict[str, Any]) -> RunningDaemon:
    """Start gpuswapd and open a window held by this benchmark for 30 minutes."""
    config = stack_config(stack, name, **sections)
    daemon = RunningDaemon(stack, config, config.parent / "gpuswapd.sock").start()
    out = daemon.ctl("acquire", "--for", "30m", "--holder", "lease-bench")
    if out.returncode != 0:
        daemon.stop()
        raise StackError(f"the window did not open: {out.stderr}")
    return daemon


def run(seconds: float, idle: float) -> dict[str, Any]:
    """Run every measurement; return them."""
    stack = Stack()
    result: dict[str, Any] = {"join": {}, "status": {}, "status_new_connection": {}, "idle": {}}
    with stack.exclusive():
        stack.up()
        daemon = open_window(stack, "lease-bench")
        try:
            assert daemon.proc is not None
            pid, socket = daemon.proc.pid, str(daemon.socket)
            result["rss_kb_at_ready"] = proc_status(pid)
            for clients in CONCURRENCY:
                lat = asyncio.run(joins(socket, clients, samples=max(200, clients * 3)))
                result["join"][clients] = {"n": len(lat), "p50_ms": ms(lat, 50), "p99_ms": ms(lat, 99),
                                           "max_ms": max(lat) * 1000}
            for key, persistent in (("status", True), ("status_new_connection", False)):
                for clients in CONCURRENCY:
                    lat, rps = asyncio.run(statuses(socket, clients, seconds, persistent))
                    result[key][clients] = {"n": len(lat), "p50_ms": ms(lat, 50), "p99_ms": ms(lat, 99),
                                            "max_ms": max(lat) * 1000, "rps": rps}
            lat = flooded_status(socket, FLOOD)
            result["status_under_flood"] = {"connections": FLOOD, "n": len(lat), "p50_ms": ms(lat, 50),
                                            "p99_ms": ms(lat, 99), "max_ms": max(lat) * 1000}
            result["rss_kb_after_load"] = proc_status(pid)
            # Load must not disturb the window: a starved event loop fails the engine's health watch.
            window = daemon.status()["window"]
            result["after_load"] = {"phase": window["phase"], "restarts": window["restarts"]}
            watch = "1s"  # the test world's [window] watch_interval
            result["idle"][watch] = idle_cpu(daemon, idle)
        finally:
            daemon.ctl("release", "--holder", "lease-bench")
            daemon.wait_phase("IDLE")
            daemon.stop()
        # The shipped default watch_interval, for the daemon as installed.
        daemon = open_window(stack, "lease-bench-default", window={"watch_interval": "10s"})
        try:
            result["idle"]["10s"] = idle_cpu(daemon, idle)
        finally:
            daemon.ctl("release", "--holder", "lease-bench")
            daemon.wait_phase("IDLE")
            daemon.stop()
    return result


def print_report(r: dict[str, Any]) -> None:
    """Print the tables and the targets."""
    rows = []
    for kind, label in (("join", "acquire-join"), ("status", "status (persistent connection)"),
                        ("status_new_connection", "status (new connection each)")):
        for clients, s in r[kind].items():
            rows.append((label, clients, s["n"], s["p50_ms"], s["p99_ms"], s["max_ms"], s.get("rps")))
    flood = r["status_under_flood"]
    rows.append((f"status, {flood['connections']} connections of nobody open", 1, flood["n"], flood["p50_ms"],
                 flood["p99_ms"], flood["max_ms"], None))
    print(table("\nlease and status latency, window READY (ms)",
                ("request", "clients", "n", "p50", "p99", "max", "req/s"), rows))
    rss, hwm = r["rss_kb_after_load"]["VmRSS"] / 1024, r["rss_kb_after_load"]["VmHWM"] / 1024
    best_rps = max(s["rps"] for s in r["status"].values())
    join_p99 = r["join"][100]["p99_ms"]
    checks = [
        ("acquire-join p99, 100 clients (ms)", join_p99, f"< {TARGETS['join_p99_100_ms']:g}",
         join_p99 < TARGETS["join_p99_100_ms"]),
        ("status req/s (best, persistent)", best_rps, f">= {TARGETS['status_rps']:g}",
         best_rps >= TARGETS["status_rps"]),
        ("RSS after load (MB)", rss, f"< {TARGETS['rss_mb']:g}", rss < TARGETS["rss_mb"]),
        ("RSS peak, VmHWM (MB)", hwm, f"< {TARGETS['rss_mb']:g}", hwm < TARGETS["rss_mb"]),
    ]
    for watch, cpu in r["idle"].items():
        checks.append((f"idle CPU s/min (watch_interval {watch})", cpu, f"< {TARGETS['idle_cpu_s_per_min']:g}",
                       cpu < TARGETS["idle_cpu_s_per_min"]))
    verdicts = [(what, value, target, "yes" if met else "NO") for what, value, target, met in checks]
    print(table("\ntargets", ("measure", "value", "target", "met"), verdicts))
    print(f"RSS at READY before the load: {r['rss_kb_at_ready']['VmRSS'] / 1024:.1f} MB")
    after = r["after_load"]
    print(f"window after the load: {after['phase']}, engine restarts {after['restarts']}"
          + ("" if after["restarts"] == 0 else "  <- the load made gpuswapd restart a healthy engine"))


def main(argv: list[str] | None = None) -> int:
    """Run the lease benchmark."""
    cli = parser("lease_bench", __doc__)
    cli.add_argument("--seconds", type=float, default=3.0, help="length of each status run (default 3)")
    cli.add_argument("--idle", type=float, default=60.0, help="seconds of rest to measure CPU over (default 60)")
    args = cli.parse_args(argv)
    result = measured("lease_bench", run, args.seconds, args.idle, errors=(StackError, ProtocolError))
    if result is None:
        return 1
    print_report(result)
    print(f"\nresults: {write_results('lease', {**result, 'targets': TARGETS})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
