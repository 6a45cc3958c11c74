"""Connections that cannot exhaust the gateway: a normal request's latency, quiet against under a flood, and memory.

    .venv/bin/python -m tests.benchmarks.gateway_flood_bench [--cycles 3] [--requests 200] [--slowloris 5000]
                                                            [--huge 64] [--huge-mib 64] [--bodies 256]
                                                            [--body-mib 32] [--flooder remote|peer]

The setting is gateway_bench.py's (the engine simulator as the upstream, gpuswapd's stand-in
granting leases at once, the real ``gpuswapd-gateway`` pinned to CPU 1, everything else to CPU
0). A flooder process (on CPU 0) keeps ``--slowloris`` connections that never finish their heads
(a header line every 2 s; a cut one comes back) and ``--huge`` clients each sending a head of
``--huge-mib`` MiB (a cut one comes back and sends again).

- **Flood**, ``--cycles`` cycles, alternating: ``--requests`` small completions one after another
  on a quiet gateway, then the same under the flood (once the flooder holds its connections);
  the per-cycle ratio of the flooded p50 and p99 to the quiet ones (target: within 2x).
- **Bodies**: ``--bodies`` clients at once each send a ``--body-mib`` MiB JSON body; what each got
  (200, or 503 with Retry-After past ``gateway.max_bodies``) is counted.

Each phase also times the same requests straight to the upstream (``direct``): what the flood
does to the client's and the upstreams' CPU alone, without the gateway.

What bounds the result:
  - two cores: the flooder shares CPU 0 with the client and the upstreams. A flood comes from
    machines of its own, so by default (``--flooder remote``) it runs in SCHED_IDLE there and gets
    only what they leave, which is nearly all of CPU 0; as their peer (``--flooder peer``) its
    churn (a slowloris connection closed as crowded comes back 0.2 s later) delays their wake-ups,
    and the direct path's p99 rises tenfold with it. The gateway on CPU 1 pays for every accept,
    head byte and cut either way;
  - the gateway's limits (guard.py): a head within 10 s and under 64 KiB, at most 1024 heads
    coming at once (so most of 5,000 slowloris connections are cut as crowded and come back);
  - gateway.max_bodies (128 MiB by default, a body counted twice): how many bodies are held;
  - a machine shared with other work: the load average is printed; nice -10 (root) keeps only part
    of a neighbour's time out of the figures.

Throughout, the gateway runs in a memory cgroup of its own and its peak (cgroup v2
``memory.peak``, v1 ``memory.max_usage_in_bytes``: what a spill to tmpfs would count too, not its
RSS) is read per phase (target: under 256 MB). Needs root (the cgroup). Results: tables on stdout,
JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.benchmarks.gateway_bench import (
    CONFIG,
    OTHERS_CPU,
    StandIn,
    free_port,
    gateways,
    latencies,
    pin,
    upstreams,
)
from tests.benchmarks.report import SPREAD_HEADER, alternate, paired, parser, percentile, spread, spread_row, table
from tests.benchmarks.report import write_results as write

TARGETS = {"flood_ratio": 2.0, "memory_mb": 256.0}
FLOODER = r"""
import asyncio, json, resource, sys, time
port, slow, huge, huge_mib = map(int, sys.argv[1:5])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
stats = {"slow_open": 0, "slow_cut": 0, "huge_cut": 0, "huge_mib_sent": 0.0, "refused": 0}

async def slowloris():
    while True:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            stats["refused"] += 1
            await asyncio.sleep(0.5)
            continue
        stats["slow_open"] += 1
        try:
            w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            while True:
                try:
                    await asyncio.wait_for(r.read(256), 2)
                    break  # an answer (408) or the end: cut
                except asyncio.TimeoutError:
                    w.write(b"X-a: b\r\n")
        except OSError:
            pass
        finally:
            stats["slow_open"] -= 1
            stats["slow_cut"] += 1
            w.close()
        await asyncio.sleep(0.2)

async def huge_head():
    piece = b"a" * 65536
    while True:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-big: ")
            for _ in range(huge_mib * 16):
                w.write(piece)
                await w.drain()
                stats["huge_mib_sent"] += 1 / 16
            w.close()
        except OSError:
            stats["huge_cut"] += 1
        await asyncio.sleep(0.05)

async def main():
    tasks = [asyncio.create_task(slowloris()) for _ in range(slow)]
    tasks += [asyncio.create_task(huge_head()) for _ in range(huge)]
    while True:
        print(json.dumps(stats), flush=True)
        await asyncio.sleep(1)

asyncio.run(main())
"""


class Cgroup:
    """A memory cgroup of the benchmark's own, under this process's (v2, or v1's memory controller)."""

    def __init__(self) -> None:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        if v2:
            rel = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
            base = Path("/sys/fs/cgroup") / rel.lstrip("/")
            self.peak_file, self.now_file = "memory.peak", "memory.current"
        else:
            rel = next(line.split(":", 2)[2] for line in lines if ":memory:" in line)
            base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            self.peak_file, self.now_file = "memory.max_usage_in_bytes", "memory.usage_in_bytes"
        self.path = base / f"gpuswapd-gateway-bench-{os.getpid()}"
        self.path.mkdir()
        self.v2 = v2
        if not v2:  # v1: the pages a process had are charged to its new group too (v2 does not move them)
            with contextlib.suppress(OSError):
                (self.path / "memory.move_charge_at_immigrate").write_text("3")

    def add(self, pid: int) -> None:
        """Move a process in."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def peak_mb(self) -> float:
        """The peak since the last reset (v2 without a reset: since the start), MB."""
        return int((self.path / self.peak_file).read_text()) / 1e6

    def reset(self) -> None:
        """Start the peak again (v1, and v2 kernels that take a write to memory.peak)."""
        with contextlib.suppress(OSError):
            (self.path / self.peak_file).write_text("0")

    def remove(self) -> None:
        """Remove it (its processes have ended)."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


@contextlib.contextmanager
def flooding(port: int, slow: int, huge: int, huge_mib: int) -> Iterator[dict[str, Any]]:
    """Run the flooder on the others' CPU until its slow connections are open (or 30 s); yield its last stats."""
    proc = subprocess.Popen([sys.executable, "-c", FLOODER, str(port), str(slow), str(huge), str(huge_mib)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, preexec_fn=_flooder_placed)
    seen: dict[str, Any] = {}
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the flooder exited with {proc.poll()}")
            seen.update(json.loads(line))
            if seen["slow_open"] >= 0.9 * slow and (not huge or seen["huge_mib_sent"] >= huge):
                break
        yield seen
    finally:
        proc.terminate()
        proc.wait(10)


FLOODER_AS = "remote"  # --flooder: "remote" (SCHED_IDLE), or "peer" (as the client and upstreams)


def _flooder_placed() -> None:
    """Pin the flooder to the others' CPU; as a remote flooder, let it run only when nothing measured wants that CPU.

    A flood comes over the network from machines of its own: on this one its process shares CPU 0
    with the client and the upstreams, and as their peer it delays their wake-ups, which the
    figures would count against the gateway. ``remote`` keeps it in SCHED_IDLE.
    """
    pin(0, OTHERS_CPU)
    if FLOODER_AS == "remote" and os.geteuid() == 0:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


async def bodies(port: int, n: int, mib: int) -> dict[str, int]:
    """Send ``n`` bodies of ``mib`` MiB at once (one buffer shared, written a MiB at a time); count the answers."""
    pad = b"x" * ((mib << 20) - 1024)  # the whole body just under gateway.max_body (its default is 32 MiB)
    head = b'{"model": "sim-small", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "pad": "'
    body_len = len(head) + len(pad) + 2
    view = memoryview(pad)

    async def one() -> str:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(body_len).encode() + b"\r\n\r\n" + head)
            for at in range(0, len(pad), 1 << 20):
                w.write(view[at:at + (1 << 20)])
                await w.drain()
            w.write(b'"}')
            status = await asyncio.wait_for(r.read(4096), 120)
            w.close()
        except (OSError, TimeoutError) as err:
            return f"error {type(err).__name__}"
        line = status.split(b"\r\n", 1)[0].decode(errors="replace")
        code = line.split(" ")[1] if " " in line else line
        return code + (" retry-after" if b"retry-after:" in status.lower() else "")

    results = await asyncio.gather(*(one() for _ in range(n)))
    counts: dict[str, int] = {}
    for r in results:
        counts[r] = counts.get(r, 0) + 1
    return counts


def run(cycles: int, requests: int, slow: int, huge: int, huge_mib: int, n_bodies: int,
        body_mib: int) -> dict[str, Any]:
    """Start the upstreams, the stand-in and the gateway (in its cgroup); run the phases."""
    root = Path(tempfile.mkdtemp(prefix="gpuswapd-flood-bench-", dir="/var/tmp"))
    result: dict[str, Any] = {"requests_per_turn": requests, "slowloris": slow, "huge": huge, "huge_mib": huge_mib,
                              "bodies": n_bodies, "body_mib": body_mib}
    group = Cgroup()
    stand_in: StandIn | None = None
    try:
        with upstreams(root, 60) as ports:
            sock = root / "gpuswapd.sock"
            stand_in = StandIn(sock).start()
            config = root / "gpuswapd.toml"
            gw = free_port()
            config.write_text(CONFIG.format(socket=sock, root=root, small=ports["small"], long=ports["long"],
                                            gateway=gw))
            with gateways(("uvicorn",), config, sock, gw, root) as running:
                proc, _ = running["uvicorn"]
                group.add(proc.pid)
                latencies(gw, 50)
                group.reset()
                flood_stats: list[dict[str, Any]] = []

                def figures() -> dict[str, Any]:
                    # The same requests straight to the upstream: what the client's and the upstream's CPU
                    # alone make of the flood, without the gateway.
                    lat, direct = latencies(gw, requests), latencies(ports["small"], requests)
                    return {"p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
                            "direct_p50_ms": percentile(direct, 50) * 1000,
                            "direct_p99_ms": percentile(direct, 99) * 1000}

                def flooded() -> dict[str, Any]:
                    with flooding(gw, slow, huge, huge_mib) as seen:
                        out = figures()
                        flood_stats.append(dict(seen))
                    return out

                def quiet() -> dict[str, Any]:
                    time.sleep(2)  # the flood's connections closed
                    return figures()

                result["flood"] = alternate(cycles, [("quiet", quiet), ("flooded", flooded)])
                result["flooder"] = flood_stats
                result["flood_peak_mb"] = group.peak_mb()
                group.reset()
                result["bodies_answers"] = asyncio.run(bodies(gw, n_bodies, body_mib))
                result["bodies_peak_mb"] = group.peak_mb()
                result["metrics"] = [line for line in _metrics(gw).splitlines()
                                     if line.startswith("gpuswapd_gateway_connections_cut_total")]
    finally:
        if stand_in is not None:
            stand_in.stop()
        shutil.rmtree(root, ignore_errors=True)
        time.sleep(0.5)
        group.remove()
    return result


def _metrics(port: int) -> str:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables."""
    global FLOODER_AS
    p = parser("gateway_flood_bench", __doc__, cycles_of="quiet, then flooded")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--slowloris", type=int, default=5000)
    p.add_argument("--huge", type=int, default=64)
    p.add_argument("--huge-mib", type=int, default=64)
    p.add_argument("--bodies", type=int, default=256)
    p.add_argument("--body-mib", type=int, default=32)
    p.add_argument("--flooder", choices=["peer", "remote"], default=FLOODER_AS,
                   help="the flooder's CPU on this machine: remote (default): in SCHED_IDLE, as if it came from "
                        "another machine; or peer: as the client's and the upstreams' peer")
    args = p.parse_args(argv)
    FLOODER_AS = args.flooder
    if os.geteuid() != 0:
        print("gateway_flood_bench: needs root (a memory cgroup of its own)", file=sys.stderr)
        return 1
    pin(os.getpid(), OTHERS_CPU)
    result = run(args.cycles, args.requests, args.slowloris, args.huge, args.huge_mib, args.bodies, args.body_mib)
    result["flooder_as"] = args.flooder
    q, f = result["flood"]["quiet"], result["flood"]["flooded"]
    stats = {key: spread(paired([t[key] for t in f], [t[key] for t in q], lambda a, b: a / b))
             for key in ("p50_ms", "p99_ms", "direct_p50_ms", "direct_p99_ms")}
    rows = [spread_row("quiet p50 (ms)", spread([t["p50_ms"] for t in q])),
            spread_row("flooded p50 (ms)", spread([t["p50_ms"] for t in f])),
            spread_row("flooded / quiet p50, per cycle (x)", stats["p50_ms"]),
            spread_row("quiet p99 (ms)", spread([t["p99_ms"] for t in q])),
            spread_row("flooded p99 (ms)", spread([t["p99_ms"] for t in f])),
            spread_row("flooded / quiet p99, per cycle (x)", stats["p99_ms"]),
            spread_row("direct: quiet p99 (ms)", spread([t["direct_p99_ms"] for t in q])),
            spread_row("direct: flooded p99 (ms)", spread([t["direct_p99_ms"] for t in f])),
            spread_row("direct: flooded / quiet p99 (x)", stats["direct_p99_ms"])]
    print(table(f"\na small completion, {args.requests} a turn, quiet and under {args.slowloris} slowloris "
                f"connections and {args.huge} clients sending {args.huge_mib} MiB heads", SPREAD_HEADER, rows))
    print(f"flooder ({args.flooder}) at the measurement: {result['flooder']}")
    print(f"{args.bodies} bodies of {args.body_mib} MiB at once: {result['bodies_answers']}")
    print("cuts: " + "; ".join(result["metrics"]))
    print(f"gateway cgroup peak: flood {result['flood_peak_mb']:.1f} MB, bodies {result['bodies_peak_mb']:.1f} MB; "
          f"load average {os.getloadavg()[0]:.2f}")
    met = {"p50 within 2x": stats["p50_ms"]["median"] <= TARGETS["flood_ratio"],
           "p99 within 2x": stats["p99_ms"]["median"] <= TARGETS["flood_ratio"],
           "memory under 256 MB": max(result["flood_peak_mb"], result["bodies_peak_mb"]) < TARGETS["memory_mb"]}
    print(f"targets: {met}")
    path = write("gateway_flood", {**result, "stats": stats, "targets": TARGETS, "met": met})
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
