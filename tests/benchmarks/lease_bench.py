"""How fast gpuswapd serves leases and status with a window open, and what it costs at rest.

    .venv/bin/python -m tests.benchmarks.lease_bench [--cycles 10] [--seconds 3] [--slice 10] [--flood 2000]

With a window READY on the test world (one lease held by the benchmark), over the real socket
with raw asyncio clients (one JSON line per request, the protocol of gpuswapd/protocol.py), every
cycle runs each of these once, in turn:

- acquire-join latency, 1 / 10 / 100 clients at once: connect, ``acquire`` (joins at once),
  reply; each client then releases its lease. Latency is connect → final reply, as a client sees it.
- ``status`` latency and throughput, 1 / 10 / 100 clients, each on one persistent connection
  sending requests back to back for ``--seconds``/cycles; and the same with a new connection per
  request (what every ``gpuswapctl status`` does).
- ``status`` latency for root while one non-root user (``nobody``) holds a flood of ``--flood``
  connections (new connection per request, as ``gpuswapctl status``): the caps refuse all but
  ``daemon.max_clients_per_uid`` of them at once, and root keeps its answer.
- the same while the flood arrives (``status_during_flood``): root's requests go back to back from
  the first of its connections to the last, so the slowest of them bounds the event loop's longest
  turn under the flood (each turn takes in at most server.ACCEPT_BATCH connections).

Each figure is given per cycle (its p50, p99, requests per second), with the spread over the
cycles, and pooled over every cycle's samples. Then the daemon's resident memory (VmRSS, VmHWM of
/proc/PID/status), and its CPU time at rest with the window open, for the test world's watch
interval (1 s) and the shipped default (10 s), alternating: gpuswapd is restarted with the other
interval between slices (``on_shutdown = "keep"``: the new one adopts the window), and each slice
of ``--slice`` seconds (10: the longer interval, so every slice holds as many of its probes
whatever its phase) is measured from the threads' run time (/proc/PID/task/*/schedstat,
nanoseconds, read every 0.25 s so that a thread that ends keeps its time), scaled to one minute.

What bounds the result: nothing of the simulator (the window is open and nothing changes); the
clients share this machine's CPUs with the daemon, and on few cores they slow it down too. The
idle CPU with a window open is mostly the engine's health watch (one HTTP GET to the simulated
engine per watch_interval).

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.benchmarks.report import (
    SPREAD_HEADER,
    alternate,
    measured,
    parser,
    percentile,
    spread,
    spread_row,
    table,
    write_results,
)
from tests.stack.config import stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.world import Stack, StackError

CONCURRENCY = (1, 10, 100)
FLOOD = 2000
NOBODY = pwd.getpwnam("nobody")
TICKS = os.sysconf("SC_CLK_TCK")
TARGETS = {"join_p99_100_ms": 50.0, "status_rps": 2000.0, "rss_mb": 80.0, "idle_cpu_s_per_min": 0.5,
           "flood_turn_ms": 50.0}


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


def flooded_status(socket: str, connections: int, failed: list[str], samples: int = 50) -> list[float]:
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
        return asyncio.run(_status_samples(socket, samples, failed))
    finally:
        os.close(done_w)
        os.waitpid(pid, 0)
        os.close(ready_r)


async def _status_samples(socket: str, samples: int, failed: list[str]) -> list[float]:
    """Time root's status requests; a request that gets no answer goes to ``failed`` (a figure too)."""
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        try:
            reader, writer = await asyncio.open_unix_connection(socket)
            try:
                await _send(writer, {"op": "status"})
                await _reply(reader)
            finally:
                writer.close()
        except (ConnectionError, ProtocolError) as err:
            failed.append(f"{time.strftime('%H:%M:%S')}: {err!r}")
            continue
        out.append(time.perf_counter() - started)
    return out


def status_while_flooding(socket: str, connections: int, failed: list[str]) -> list[float]:
    """Measure root's status latency while ``nobody`` opens ``connections`` to the daemon as fast as it can.

    The requests go out back to back from the moment the flood begins until it is all connected:
    every accept burst the daemon takes in falls between two of them, so the slowest says how long
    the event loop's longest turn under the flood was (plus one request's own time).
    """
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # nobody: connect as fast as possible, say so by closing the pipe, hold them a moment
        try:
            os.close(done_r)
            resource.setrlimit(resource.RLIMIT_NOFILE, (connections + 64, connections + 64))
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            held = []
            for _ in range(connections):
                s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
                s.connect(socket)
                held.append(s)
            os.close(done_w)
            time.sleep(0.2)
        finally:
            os._exit(0)
    os.close(done_w)
    try:
        return asyncio.run(_status_until_closed(socket, done_r, failed))
    finally:
        os.waitpid(pid, 0)
        os.close(done_r)


async def _status_until_closed(socket: str, done: int, failed: list[str]) -> list[float]:
    """Time root's status requests back to back until ``done`` reads EOF (the flood is all connected)."""
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()
    loop.add_reader(done, finished.set)
    out: list[float] = []
    try:
        while not finished.is_set() or not out:
            started = time.perf_counter()
            try:
                reader, writer = await asyncio.open_unix_connection(socket)
                try:
                    await _send(writer, {"op": "status"})
                    await _reply(reader)
                finally:
                    writer.close()
            except (ConnectionError, ProtocolError) as err:
                failed.append(f"{time.strftime('%H:%M:%S')}: {err!r}")
                continue
            out.append(time.perf_counter() - started)
    finally:
        loop.remove_reader(done)
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
    """Read utime + stime of a process, in seconds (ticks of 1/CLK_TCK: 10 ms here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _thread_times(pid: int) -> dict[str, int]:
    """Each thread's run time so far, in nanoseconds (schedstat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[task.name] = int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # it ended meanwhile
    return out


def cpu_over(pids: list[int], seconds: float, every: float = 0.25,
             during: Callable[[], object] | None = None) -> list[float]:
    """Return the CPU seconds each process's threads run over ``seconds``, to the nanosecond.

    Finer than ``cpu_seconds`` (10 ms ticks), so a slice of a few seconds at rest can be measured.
    The threads are read every ``every`` seconds: a thread that ends meanwhile keeps the time it was
    last seen with (it loses at most its last ``every``), one that starts counts from zero.
    ``during`` runs once the first reading is taken (a scrape, say).
    """
    first = [_thread_times(pid) for pid in pids]
    if not all(first):
        raise StackError(f"cannot read the threads' run time of {pids} in /proc/PID/task/*/schedstat")
    last = [dict(f) for f in first]
    started = time.monotonic()
    if during is not None:
        during()
    while (left := started + seconds - time.monotonic()) > 0:
        time.sleep(min(every, left))
        for seen, pid in zip(last, pids, strict=True):
            seen.update(_thread_times(pid))
    return [sum(ns - f.get(tid, 0) for tid, ns in seen.items()) / 1e9 for f, seen in zip(first, last, strict=True)]


def idle_cpu(pid: int, seconds: float) -> float:
    """Return the CPU seconds the process spends over ``seconds`` of rest, scaled to one minute."""
    return cpu_over([pid], seconds)[0] * 60.0 / seconds


def ms(values: list[float], p: float) -> float:
    """Return the ``p``-th percentile of seconds, in milliseconds."""
    return percentile(values, p) * 1000


def latency(lat: list[float], **more: Any) -> dict[str, Any]:
    """One run's latency figures, in milliseconds."""
    if not lat:
        return {"n": 0, **more}
    return {"n": len(lat), "p50_ms": ms(lat, 50), "p99_ms": ms(lat, 99), "max_ms": max(lat) * 1000, **more}


def open_window(stack: Stack, name: str, **sections: dict[str, Any]) -> RunningDaemon:
    """Start gpuswapd and open a window held by this benchmark for 30 minutes."""
    config = stack_config(stack, name, **sections)
    daemon = RunningDaemon(stack, config, config.parent / "gpuswapd.sock").start()
    out = daemon.ctl("acquire", "--for", "30m", "--holder", "lease-bench")
    if out.returncode != 0:
        daemon.stop()
        raise StackError(f"the window did not open: {out.stderr}")
    return daemon


def load_variants(socket: str, seconds: float, flood: int) -> list[tuple[str, Any]]:
    """Every latency measurement, as variants of one cycle."""
    variants: list[tuple[str, Any]] = []
    for clients in CONCURRENCY:
        variants.append((f"join/{clients}", lambda c=clients: latency(
            asyncio.run(joins(socket, c, samples=max(20, c))))))
    for kind, persistent in (("status", True), ("status_new_connection", False)):
        for clients in CONCURRENCY:
            def one(c: int = clients, keep: bool = persistent) -> dict[str, float]:
                lat, rps = asyncio.run(statuses(socket, c, seconds, keep))
                return latency(lat, rps=rps)
            variants.append((f"{kind}/{clients}", one))
    def flooded() -> dict[str, float]:
        failed: list[str] = []
        lat = flooded_status(socket, flood, failed, samples=20)
        return latency(lat, failed=len(failed), errors=failed)

    variants.append(("status_under_flood", flooded))

    def flooding() -> dict[str, float]:
        failed: list[str] = []
        lat = status_while_flooding(socket, flood, failed)
        return latency(lat, failed=len(failed), errors=failed)

    variants.append(("status_during_flood", flooding))
    return variants


def _restart(stack: Stack, daemon: RunningDaemon, config: Path) -> RunningDaemon:
    """Stop gpuswapd leaving the window (on_shutdown = "keep"); start it on ``config``, which adopts it."""
    daemon.stop()
    new = RunningDaemon(stack, config, daemon.socket).start()
    window = new.status()["window"]
    if window is None or window["phase"] != "READY":
        raise StackError(f"the window was not adopted: {window}\n{new.tail()}")
    return new


def run(cycles: int, seconds: float, slice_s: float, flood: int) -> dict[str, Any]:
    """Run every measurement; return them."""
    stack = Stack()
    result: dict[str, Any] = {"flood": flood}
    with stack.exclusive():
        stack.up()
        # Both configs share one socket and state: each gpuswapd adopts the window the other left.
        home = stack.paths.root / "gpuswapd" / "lease-bench"
        shared = {"socket": str(home / "gpuswapd.sock"), "state_dir": str(home / "state"), "on_shutdown": "keep"}
        configs = {"1s": stack_config(stack, "lease-bench", daemon=shared),
                   "10s": stack_config(stack, "lease-bench-10s", daemon=shared, window={"watch_interval": "10s"})}
        daemon = open_window(stack, "lease-bench", daemon=shared)
        try:
            assert daemon.proc is not None
            socket = str(daemon.socket)
            result["rss_kb_at_ready"] = proc_status(daemon.proc.pid)
            result["load"] = alternate(cycles, load_variants(socket, seconds / cycles, flood))
            result["rss_kb_after_load"] = proc_status(daemon.proc.pid)
            # Load must not disturb the window: a starved event loop fails the engine's health watch.
            window = daemon.status()["window"]
            result["after_load"] = {"phase": window["phase"], "restarts": window["restarts"]}
            current = {"name": "1s"}

            def settle(name: str) -> None:
                nonlocal daemon
                if current["name"] != name:
                    daemon = _restart(stack, daemon, configs[name])
                    current["name"] = name
                time.sleep(1.0)  # its start-up's work is done

            def slice_of(name: str) -> float:
                assert daemon.proc is not None and current["name"] == name
                return idle_cpu(daemon.proc.pid, slice_s)

            result["idle"] = alternate(cycles, [(name, lambda n=name: slice_of(n)) for name in configs],
                                       before=settle)
            assert daemon.proc is not None
            result["rss_kb_at_rest"] = {current["name"]: proc_status(daemon.proc.pid)}
        finally:
            daemon.ctl("release", "--holder", "lease-bench")
            daemon.wait_phase("IDLE")
            daemon.stop()
    return result


def analyse(r: dict[str, Any]) -> dict[str, Any]:
    """Spread of each per-cycle figure; the idle CPU per slice and pooled."""
    stats: dict[str, Any] = {}
    for name, runs in r["load"].items():
        for key in ("p50_ms", "p99_ms", "max_ms", "rps"):
            values = [x[key] for x in runs if key in x]
            if values:
                stats[f"{name}.{key}"] = spread(values)
        stats[f"{name}.samples"] = sum(x["n"] for x in runs)
        if any("failed" in x for x in runs):
            stats[f"{name}.failed"] = sum(x["failed"] for x in runs)
            stats[f"{name}.errors"] = [e for x in runs for e in x["errors"]]
    for name, slices in r["idle"].items():
        stats[f"idle.{name}"] = spread(slices)
    return stats


def print_report(r: dict[str, Any], stats: dict[str, Any]) -> None:
    """Print the tables and the targets."""
    rows = []
    for name in r["load"]:
        for key in ("p50_ms", "p99_ms", "rps", *(("max_ms",) if "flood" in name else ())):
            if f"{name}.{key}" in stats:
                rows.append(spread_row(f"{name} {key} ({stats[f'{name}.samples']} samples)", stats[f"{name}.{key}"]))
    cycles = len(next(iter(r["load"].values())))
    print(table(f"\nlease and status with a window READY, per cycle, {cycles} cycles (ms; rps: requests/s); "
                f"flood: {r['flood']} connections of nobody", SPREAD_HEADER, rows))
    for name, when in (("status_under_flood", "under the flood"), ("status_during_flood", "while the flood arrived")):
        if f"{name}.samples" not in stats:
            continue
        failed = stats.get(f"{name}.failed", 0)
        print(f"root's status requests {when} that got no answer: {failed} of "
              f"{failed + stats[f'{name}.samples']}" + "".join(f"\n  {e}" for e in stats.get(f"{name}.errors", [])))
    print(table("\ngpuswapd at rest with the window open: CPU seconds per minute, per slice",
                SPREAD_HEADER, [spread_row(f"watch_interval {name}", stats[f"idle.{name}"]) for name in r["idle"]]))
    rss, hwm = r["rss_kb_after_load"]["VmRSS"] / 1024, r["rss_kb_after_load"]["VmHWM"] / 1024
    best_rps = max(stats[f"status/{c}.rps"]["median"] for c in CONCURRENCY)
    join_p99 = stats["join/100.p99_ms"]["median"]
    checks = [
        ("acquire-join p99, 100 clients (ms, median of cycles)", join_p99, f"< {TARGETS['join_p99_100_ms']:g}",
         join_p99 < TARGETS["join_p99_100_ms"]),
        ("status req/s (best, persistent, median of cycles)", best_rps, f">= {TARGETS['status_rps']:g}",
         best_rps >= TARGETS["status_rps"]),
        ("RSS after load (MB)", rss, f"< {TARGETS['rss_mb']:g}", rss < TARGETS["rss_mb"]),
        ("RSS peak, VmHWM (MB)", hwm, f"< {TARGETS['rss_mb']:g}", hwm < TARGETS["rss_mb"]),
    ]
    if "status_during_flood.max_ms" in stats:  # the event loop's longest turn while the flood arrives
        turn = stats["status_during_flood.max_ms"]["median"]
        checks.append(("slowest root status while the flood arrives (ms, median of cycles)", turn,
                       f"< {TARGETS['flood_turn_ms']:g}", turn < TARGETS["flood_turn_ms"]))
    for name in r["idle"]:
        cpu = stats[f"idle.{name}"]["median"]
        checks.append((f"idle CPU s/min (watch_interval {name}, median of slices)", cpu,
                       f"< {TARGETS['idle_cpu_s_per_min']:g}", cpu < TARGETS["idle_cpu_s_per_min"]))
    verdicts = [(what, value, target, "yes" if met else "NO") for what, value, target, met in checks]
    print(table("\ntargets", ("measure", "value", "target", "met"), verdicts))
    print(f"RSS at READY before the load: {r['rss_kb_at_ready']['VmRSS'] / 1024:.1f} MB; "
          f"after the load {rss:.1f} MB (peak {hwm:.1f} MB); at rest: "
          + ", ".join(f"{k} {v['VmRSS'] / 1024:.1f} MB" for k, v in r["rss_kb_at_rest"].items()))
    after = r["after_load"]
    print(f"window after the load: {after['phase']}, engine restarts {after['restarts']}"
          + ("" if after["restarts"] == 0 else "  <- the load made gpuswapd restart a healthy engine"))


def main(argv: list[str] | None = None) -> int:
    """Run the lease benchmark."""
    cli = parser("lease_bench", __doc__, cycles_of="every latency measurement, then a slice at rest per interval")
    cli.add_argument("--seconds", type=float, default=3.0,
                     help="length of each kind of status run, over all cycles (default 3)")
    cli.add_argument("--slice", type=float, default=10.0,
                     help="seconds of rest to measure CPU over, per watch interval and cycle (default 10)")
    cli.add_argument("--flood", type=int, default=FLOOD, help=f"connections of the flood (default {FLOOD})")
    args = cli.parse_args(argv)
    result = measured("lease_bench", run, args.cycles, args.seconds, args.slice, args.flood,
                      errors=(StackError, ProtocolError))
    if result is None:
        return 1
    stats = analyse(result)
    print_report(result, stats)
    print(f"\nresults: {write_results('lease', {**result, 'stats': stats, 'targets': TARGETS})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
