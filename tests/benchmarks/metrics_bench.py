"""What watching gpuswapd costs at rest: CPU seconds per idle minute and RSS, with metrics on and off.

    .venv/bin/python -m tests.benchmarks.metrics_bench [--cycles 10] [--scrape-every 15]

On the test world, two gpuswapd run side by side, IDLE, each with a socket and a state of its
own: one with ``[metrics] listen`` and ``textfile`` set, one with metrics off. Each first opens
and closes one window (so every histogram has series and the textfile has been written). Then
every cycle runs each variant once, in turn, as a slice of ``--scrape-every`` seconds:

- **scraped**: Prometheus's scrape of ``/metrics`` once a slice (15 s is Prometheus's default);
- **scraped and watched**: the same, with a ``gpuswapctl watch`` connected to the metrics daemon
  for the slice.

In every slice both daemons' CPU time is measured (the run time of their threads, to the
nanosecond, read every 0.25 s), so the metrics daemon's cost is compared with the plain one's in the same slice:
the difference, per slice, is what metrics (and a watcher) cost. Each cycle then times 20 scrapes.
RSS (VmRSS, VmHWM of /proc/PID/status) is read at the end.

What bounds the result: nothing of the simulator (no window is open); the machine's other load
shows in both daemons' slices alike.

Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from tests.benchmarks.lease_bench import cpu_over, proc_status
from tests.benchmarks.report import (
    SPREAD_HEADER,
    alternate,
    measured,
    paired,
    parser,
    percentile,
    spread,
    spread_row,
    table,
    write_results,
)
from tests.stack.config import stack_config
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.world import Stack, StackError

TARGETS = {"idle_cpu_s_per_min": 0.5, "rss_mb": 80.0}
SCRAPES_PER_CYCLE = 20


def free_port() -> int:
    """Pick a free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> bytes:
    """GET /metrics once."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return bytes(resp.read())


def cycle(daemon: RunningDaemon) -> None:
    """Open and close one window."""
    out = daemon.ctl("acquire", "--for", "1m", "--holder", "metrics-bench")
    if out.returncode != 0:
        raise StackError(f"the window did not open: {out.stderr}")
    daemon.ctl("release", "--holder", "metrics-bench")
    daemon.wait_phase("IDLE")


def start(stack: Stack, name: str, port: int | None) -> RunningDaemon:
    """Start gpuswapd with metrics (on ``port``) or without, and run one window."""
    sections: dict[str, dict[str, Any]] = {}
    if port is not None:
        directory = stack.paths.root / "gpuswapd" / name / "textfile"
        directory.mkdir(parents=True, exist_ok=True)
        sections["metrics"] = {"listen": f"127.0.0.1:{port}", "textfile": str(directory / "gpuswapd.prom")}
    config = stack_config(stack, name, **sections)
    daemon = RunningDaemon(stack, config, config.parent / "gpuswapd.sock").start()
    cycle(daemon)
    return daemon


def measure_slice(on: RunningDaemon, off: RunningDaemon, port: int, seconds: float, watched: bool) -> dict[str, float]:
    """One slice at rest: both daemons' CPU per minute, the metrics daemon scraped (and watched)."""
    assert on.proc is not None and off.proc is not None
    watcher = subprocess.Popen([str(BIN / "gpuswapctl"), "watch", "--json"], env=on.env,
                               stdout=subprocess.DEVNULL) if watched else None
    try:
        if watcher is not None:
            time.sleep(1.0)  # connected and subscribed before the slice
        on_s, off_s = cpu_over([on.proc.pid, off.proc.pid], seconds, during=lambda: scrape(port) if port else None)
        return {"on": on_s * 60 / seconds, "off": off_s * 60 / seconds}
    finally:
        if watcher is not None:
            watcher.terminate()
            watcher.wait(10)


def scrapes(port: int) -> dict[str, Any]:
    """Time SCRAPES_PER_CYCLE scrapes back to back."""
    lat, size = [], 0
    for _ in range(SCRAPES_PER_CYCLE):
        started = time.perf_counter()
        size = len(scrape(port))
        lat.append(time.perf_counter() - started)
    return {"bytes": size, "latencies_s": lat}


def run(cycles: int, every: float) -> dict[str, Any]:
    """Measure gpuswapd with metrics on and off, side by side."""
    stack = Stack()
    with stack.exclusive():
        stack.up()
        port = free_port()
        on = start(stack, "metrics-bench-on", port)
        try:
            off = start(stack, "metrics-bench-off", None)
            try:
                time.sleep(2)  # the closes' last writes
                slices = alternate(cycles, [
                    ("scraped", lambda: measure_slice(on, off, port, every, watched=False)),
                    ("scraped_watched", lambda: measure_slice(on, off, port, every, watched=True)),
                    ("scrapes", lambda: scrapes(port))])
                assert on.proc is not None and off.proc is not None
                return {"scrape_every_s": every, "slices": slices,
                        "rss_kb": {"on": proc_status(on.proc.pid), "off": proc_status(off.proc.pid)}}
            finally:
                off.stop()
        finally:
            on.stop()


def analyse(r: dict[str, Any]) -> dict[str, Any]:
    """Spread per variant, and the metrics daemon's extra CPU over the plain one's, per slice."""
    stats: dict[str, Any] = {}
    for name in ("scraped", "scraped_watched"):
        s = r["slices"][name]
        on, off = [x["on"] for x in s], [x["off"] for x in s]
        stats[f"{name}.on"] = spread(on)
        stats[f"{name}.off"] = spread(off)
        stats[f"{name}.extra"] = spread(paired(on, off, lambda a, b: a - b))
    lat = [x for c in r["slices"]["scrapes"] for x in c["latencies_s"]]
    stats["scrape"] = {"bytes": r["slices"]["scrapes"][-1]["bytes"], "n": len(lat),
                       "p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
                       "per_cycle_p50_ms": spread([percentile(c["latencies_s"], 50) * 1000
                                                   for c in r["slices"]["scrapes"]])}
    return stats


def print_report(r: dict[str, Any], stats: dict[str, Any]) -> None:
    """Print the table and the targets."""
    rows = [
        spread_row(f"metrics on, scraped every {r['scrape_every_s']:g}s", stats["scraped.on"]),
        spread_row("  metrics off, same slices", stats["scraped.off"]),
        spread_row("  on - off, per slice", stats["scraped.extra"]),
        spread_row("metrics on, scraped, a watcher connected", stats["scraped_watched.on"]),
        spread_row("  metrics off, same slices", stats["scraped_watched.off"]),
        spread_row("  on - off, per slice", stats["scraped_watched.extra"]),
    ]
    cycles = len(r["slices"]["scraped"])
    print(table(f"\ngpuswapd at rest, IDLE: CPU seconds per minute, {cycles} cycles of "
                f"{r['scrape_every_s']:g}s slices, variants alternating", SPREAD_HEADER, rows))
    s = stats["scrape"]
    print(f"one scrape: {s['bytes']} bytes, p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms over {s['n']} "
          f"(p50 per cycle: {s['per_cycle_p50_ms']['median']:.2f} ms median, "
          f"{s['per_cycle_p50_ms']['min']:.2f}-{s['per_cycle_p50_ms']['max']:.2f})")
    rss = {k: (v["VmRSS"] / 1024, v["VmHWM"] / 1024) for k, v in r["rss_kb"].items()}
    print(f"RSS: metrics on {rss['on'][0]:.1f} MB (peak {rss['on'][1]:.1f}), off {rss['off'][0]:.1f} MB "
          f"(peak {rss['off'][1]:.1f})")
    cpu = stats["scraped.on"]["median"]
    checks = [("idle CPU s/min, metrics on and scraped (median)", cpu, f"< {TARGETS['idle_cpu_s_per_min']:g}",
               cpu < TARGETS["idle_cpu_s_per_min"]),
              ("RSS peak, VmHWM (MB)", rss["on"][1], f"< {TARGETS['rss_mb']:g}", rss["on"][1] < TARGETS["rss_mb"])]
    print(table("\ntargets", ("measure", "value", "target", "met"),
                [(w, v, t, "yes" if met else "NO") for w, v, t, met in checks]))


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError(text)
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the metrics benchmark."""
    cli = parser("metrics_bench", __doc__, cycles_of="a scraped slice, a scraped and watched one, 20 scrapes")
    cli.add_argument("--scrape-every", type=_positive, default=15.0,
                     help="seconds between scrapes, and the length of a slice (default 15)")
    args = cli.parse_args(argv)
    result = measured("metrics_bench", run, args.cycles, args.scrape_every)
    if result is None:
        return 1
    stats = analyse(result)
    print_report(result, stats)
    print(f"\nresults: {write_results('metrics', {**result, 'stats': stats, 'targets': TARGETS})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
