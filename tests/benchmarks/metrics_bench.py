"""What watching gpuswapd costs at rest: CPU seconds per idle minute and RSS, with metrics on.

    .venv/bin/python -m tests.benchmarks.metrics_bench [--idle 60] [--scrape-every 15]

On the test world, gpuswapd runs with ``[metrics] listen`` and ``textfile`` set, one window is
opened and closed (so every histogram has series and the textfile has been written), and then,
with no window open:

- the daemon's CPU seconds (utime + stime of /proc/PID/stat) over ``--idle`` seconds, scaled to one
  minute, with Prometheus scraping ``/metrics`` every ``--scrape-every`` seconds (15 s is
  Prometheus's default; 0: no scrapes), and again with a ``gpuswapctl watch`` connected;
- its resident memory (VmRSS, VmHWM of /proc/PID/status) after that;
- what one scrape costs: latency over 200 scrapes, and the size of the exposition.

The same daemon with metrics off is measured alike, for the difference.
Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from tests.benchmarks.lease_bench import cpu_seconds, proc_status
from tests.benchmarks.report import measured, parser, percentile, table, write_results
from tests.stack.config import stack_config
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.world import Stack, StackError

TARGETS = {"idle_cpu_s_per_min": 0.5, "rss_mb": 80.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return bytes(resp.read())


def idle_cpu(daemon: RunningDaemon, seconds: float, port: int | None, every: float) -> float:
    """Return the CPU seconds the daemon spends over ``seconds`` at rest (scraped every ``every`` s), per minute."""
    assert daemon.proc is not None
    before = cpu_seconds(daemon.proc.pid)
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if port is not None and every > 0:
            scrape(port)
            time.sleep(min(every, max(0.0, end - time.monotonic())))
        else:
            time.sleep(left)
    return (cpu_seconds(daemon.proc.pid) - before) * 60.0 / seconds


def cycle(daemon: RunningDaemon) -> None:
    out = daemon.ctl("acquire", "--for", "1m", "--holder", "metrics-bench")
    if out.returncode != 0:
        raise StackError(f"the window did not open: {out.stderr}")
    daemon.ctl("release", "--holder", "metrics-bench")
    daemon.wait_phase("IDLE")


def measure(stack: Stack, name: str, idle: float, every: float, metrics: bool) -> dict[str, Any]:
    """Start gpuswapd (metrics on or off), run one window, then measure it at rest."""
    port = free_port() if metrics else None
    sections: dict[str, dict[str, Any]] = {}
    if metrics:
        directory = stack.paths.root / "gpuswapd" / name / "textfile"
        directory.mkdir(parents=True, exist_ok=True)
        sections["metrics"] = {"listen": f"127.0.0.1:{port}", "textfile": str(directory / "gpuswapd.prom")}
    config = stack_config(stack, name, **sections)
    daemon = RunningDaemon(stack, config, config.parent / "gpuswapd.sock").start()
    out: dict[str, Any] = {}
    try:
        assert daemon.proc is not None
        cycle(daemon)
        time.sleep(2)  # the close's last writes
        out["idle_cpu_s_per_min"] = idle_cpu(daemon, idle, port, every)
        if port is not None:
            watcher = subprocess.Popen([str(BIN / "gpuswapctl"), "watch", "--json"], env=daemon.env,
                                       stdout=subprocess.DEVNULL)
            try:
                out["idle_cpu_s_per_min_watched"] = idle_cpu(daemon, idle, port, every)
            finally:
                watcher.terminate()
                watcher.wait(10)
            lat = []
            for _ in range(200):
                started = time.perf_counter()
                size = len(scrape(port))
                lat.append(time.perf_counter() - started)
            out["scrape"] = {"bytes": size, "p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000}
        out["rss_kb"] = proc_status(daemon.proc.pid)
    finally:
        daemon.stop()
    return out


def run(idle: float, every: float) -> dict[str, Any]:
    """Measure gpuswapd with metrics on and off."""
    stack = Stack()
    with stack.exclusive():
        stack.up()
        return {"scrape_every_s": every, "idle_s": idle,
                "on": measure(stack, "metrics-bench-on", idle, every, metrics=True),
                "off": measure(stack, "metrics-bench-off", idle, 0.0, metrics=False)}


def print_report(r: dict[str, Any]) -> None:
    """Print the table and the targets."""
    on, off = r["on"], r["off"]
    rows = [
        (f"metrics on, scraped every {r['scrape_every_s']:g}s", on["idle_cpu_s_per_min"], on["rss_kb"]["VmRSS"] / 1024,
         on["rss_kb"]["VmHWM"] / 1024),
        ("metrics on, scraped, a watcher connected", on["idle_cpu_s_per_min_watched"], None, None),
        ("metrics off", off["idle_cpu_s_per_min"], off["rss_kb"]["VmRSS"] / 1024, off["rss_kb"]["VmHWM"] / 1024),
    ]
    print(table(f"\ngpuswapd at rest, IDLE, over {r['idle_s']:g}s", ("", "CPU s/min", "RSS MB", "VmHWM MB"), rows))
    s = on["scrape"]
    print(f"one scrape: {s['bytes']} bytes, p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms")
    rss = on["rss_kb"]["VmHWM"] / 1024
    checks = [("idle CPU s/min, metrics on and scraped", on["idle_cpu_s_per_min"],
               f"< {TARGETS['idle_cpu_s_per_min']:g}", on["idle_cpu_s_per_min"] < TARGETS["idle_cpu_s_per_min"]),
              ("RSS peak, VmHWM (MB)", rss, f"< {TARGETS['rss_mb']:g}", rss < TARGETS["rss_mb"])]
    print(table("\ntargets", ("measure", "value", "target", "met"),
                [(w, v, t, "yes" if met else "NO") for w, v, t, met in checks]))


def main(argv: list[str] | None = None) -> int:
    """Run the metrics benchmark."""
    cli = parser("metrics_bench", __doc__)
    cli.add_argument("--idle", type=float, default=60.0, help="seconds of rest to measure CPU over (default 60)")
    cli.add_argument("--scrape-every", type=float, default=15.0, help="seconds between scrapes (default 15)")
    args = cli.parse_args(argv)
    result = measured("metrics_bench", run, args.idle, args.scrape_every)
    if result is None:
        return 1
    print_report(result)
    print(f"\nresults: {write_results('metrics', {**result, 'targets': TARGETS})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
