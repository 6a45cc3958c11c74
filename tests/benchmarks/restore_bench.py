"""RESTORING with the prefetch of the resident's files and without, alternating in one run.

    .venv/bin/python -m tests.benchmarks.restore_bench [--cycles 10] [--lag S] [--stop-delay S] [--boot-delay S]

On the test world, strata serves a random-weight GGUF of over 2 GiB, written like the world's
other models (tests/stack/llama.py, kind "big", 2.27 GB, cached once). Two gpuswapd
configurations take turns on one socket and state, the daemon restarted between them:

- **prefetch**: ``[resident] prefetch = true`` (the default): the close reads the model file back
  into the page cache from its start, while the engine stops and the VRAM comes free.
- **none**: ``[resident] prefetch = false``: RESTORING's llama-server reads it from disk itself.

Each cycle runs each variant once, in turn: an acquire from a connected client (READY: the
resident is down, nothing maps its file), then the file is dropped from the page cache
(posix_fadvise DONTNEED, checked with mincore), then a release, timed until the running ``watch``
receives ``window_finished``. RESTORING (start the units, llama-server loads, the verifying
completion) comes from the window's record, with the prefetch's report (cached before and after,
bytes read, how long it read) and ``resident_s``; the ratio none / prefetch is taken per cycle.
While the window of "none" is open, the machine's cold read rate for the file is measured too:
dropped, then read in order (16 MiB reads), timed.

What bounds the result (constants of the simulated world and of this machine, not of gpuswapd):
  - the disk: the cold read rate (reported) decides what reading from RAM can save; on this VM a
    "cold" read may come from the host's own page cache, faster than a real disk;
  - how long the prefetch has before RESTORING: the engine's stop (the simulator exits at once on
    SIGTERM, or after --stop-delay, as a real vLLM takes seconds to free its memory) and the VRAM
    release lag (0.5 s, or --lag); what it has not read by then it reads beside llama-server;
  - llama-server's own work on the CPU (2 threads): mapping the file, the prompt and up to 4 tokens
    of the verifying completion (max_tokens 4), and llama-swap's 0.25 s health poll: paid by both.

Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from gpuswapd.adapters.pagecache import evict, measure_file
from tests.benchmarks.clients import Events, Ready, acquire, release
from tests.benchmarks.report import (
    SPREAD_HEADER,
    add_world_options,
    alternate,
    figure,
    measured,
    paired,
    parser,
    spread,
    spread_row,
    table,
    write_results,
)
from tests.benchmarks.swap_bench import engine_env, phase_times, status, world, world_constants
from tests.stack import llama
from tests.stack.config import stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.world import SIM_PYTHON, Stack, StackError

HOLDER = "restore-bench"
READ_CHUNK = 16 << 20
VARIANTS = ("prefetch", "none")


def cold_read(path: Path) -> float:
    """Drop the file from the page cache and read it in order; return the bytes per second."""
    evict(str(path))
    if measure_file(str(path)).ratio > 0.05:
        raise StackError(f"{path} stayed in the page cache after DONTNEED: a process maps it")
    fd = os.open(path, os.O_RDONLY)
    buf, total = bytearray(READ_CHUNK), 0
    started = time.monotonic()
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    took = time.monotonic() - started
    evict(str(path))
    return total / took


def stop_slowly(seconds: float) -> list[str]:
    """The engine's container command: the simulator, which on SIGTERM takes ``seconds`` to exit (VRAM held)."""
    sim = f"{SIM_PYTHON} /opt/engine/engine_sim.py"
    return ["/bin/sh", "-c", f"{sim} & child=$!; trap 'sleep {seconds:g}; kill -TERM $child' TERM; "
                             "wait $child; wait $child"]


class Bench:
    """The world with the big model, and the daemon of the variant now running."""

    def __init__(self, stack: Stack, configs: dict[str, Path], socket: Path, model: Path) -> None:
        self.stack, self.configs, self.socket, self.model = stack, configs, socket, model
        self.daemon: RunningDaemon | None = None
        self.events: Events | None = None
        self.variant = ""
        self.read_rates: list[float] = []

    def use(self, variant: str) -> None:
        """Make sure gpuswapd runs with this variant's configuration (restart it if not), at the baseline."""
        self.stack.wait_baseline()
        if self.variant != variant:
            self.stop()
            self.daemon = RunningDaemon(self.stack, self.configs[variant], self.socket).start()
            self.events = Events(self.socket)
            self.variant = variant
        if self.stack.docker("ps", "-aq").stdout.strip():
            raise StackError("a container is left over from the last window")

    def cycle(self, variant: str) -> dict[str, Any]:
        """Open a window, push the model out of the page cache, close it; return the close's figures."""
        assert self.daemon is not None and self.events is not None and self.variant == variant
        Ready(self.socket).send(acquire(HOLDER))
        if variant == "none":
            self.read_rates.append(cold_read(self.model))
        evict(str(self.model))
        before = measure_file(str(self.model)).ratio
        if before > 0.05:
            raise StackError(f"the model stayed in the page cache ({before:.0%}) while the resident was down")
        self.events.clear()
        released = time.monotonic()
        Ready(self.socket).send(release(HOLDER))
        finished, event = self.events.finished()
        last = status(self.socket)["last"]
        if last["id"] != event["window"] or last["outcome"] != "closed" or last["error"]:
            raise StackError(f"the window did not close cleanly: {last['outcome']} {last['error']}\n"
                             f"{self.daemon.tail()}")
        phases = phase_times(last)
        prefetch = last.get("prefetch") or {}
        if variant == "prefetch" and prefetch.get("outcome") not in ("done", "cancelled"):
            raise StackError(f"the close did not prefetch the model: {prefetch}\n{self.daemon.tail()}")
        if variant == "none" and last.get("prefetch") is not None:
            raise StackError(f"a close with prefetch = false read the files: {prefetch}")
        return {"close_s": finished - released, "restoring_s": phases.get("RESTORING", 0.0),
                "before_restoring_s": phases.get("CLOSING", 0.0) + phases.get("WAITING_VRAM#2", 0.0),
                "resident_s": last.get("resident_s"), "evicted_to": before, "prefetch": prefetch,
                "cached_after_close": measure_file(str(self.model)).ratio}

    def stop(self) -> None:
        """Stop the running gpuswapd (the window is closed: nothing is left)."""
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None
        self.variant = ""


def run(cycles: int, lag: float | None = None, stop_delay: float = 0.0,
        boot_delay: float | None = None) -> dict[str, Any]:
    """Put the big model under strata, then alternate the two variants."""
    stack = world(lag)
    result: dict[str, Any] = {}
    with stack.exclusive():
        stack.up()
        model_file = llama.ensure_model(stack.cache, "big")
        stack.use_model(model_file)
        try:
            stack.restart_resident()
            home = stack.paths.root / "gpuswapd" / "restore-bench"
            shared = {"socket": str(home / "gpuswapd.sock"), "state_dir": str(home / "state"), "linger": "0s"}
            container: dict[str, Any] = {"env": engine_env(boot_delay)}
            if stop_delay:
                container["command"] = stop_slowly(stop_delay)
            configs = {variant: stack_config(stack, f"restore-bench-{variant}", daemon=shared,
                                             window__container=container,
                                             resident={"prefetch": variant == "prefetch"},
                                             resident__verify={"max_tokens": 4, "prompt": "Say: ready"})
                       for variant in VARIANTS}
            bench = Bench(stack, configs, Path(shared["socket"]), stack.resident_model)
            try:
                env = engine_env(boot_delay)
                result["constants"] = {**world_constants(stack, env, 2), "stop_delay_s": stop_delay,
                                       "model_bytes": model_file.stat().st_size, "model": str(model_file)}
                result["variants"] = alternate(cycles, [(v, lambda v=v: bench.cycle(v)) for v in VARIANTS],
                                               before=bench.use)
                result["cold_read_bytes_per_s"] = bench.read_rates
                result["ooms"] = stack.ooms()
            except StackError as err:
                tail = bench.daemon.tail(15) if bench.daemon is not None else ""
                raise StackError(f"{err}\ngpuswapd's log:\n{tail}") from err
            finally:
                bench.stop()
        finally:
            with contextlib.suppress(StackError):  # never hide what failed above
                stack.reset()  # the tiny model under strata again
    return result


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Compute every figure; the ratio per cycle."""
    v = result["variants"]
    pre, none = v["prefetch"], v["none"]

    def of(cycles: list[dict[str, Any]], key: str) -> list[float]:
        return [float(c[key]) for c in cycles if c.get(key) is not None]

    series = {
        "restoring.prefetch": of(pre, "restoring_s"), "restoring.none": of(none, "restoring_s"),
        "restoring.ratio": paired(of(none, "restoring_s"), of(pre, "restoring_s"), lambda a, b: a / b),
        "restoring.saved": paired(of(none, "restoring_s"), of(pre, "restoring_s"), lambda a, b: a - b),
        "close.prefetch": of(pre, "close_s"), "close.none": of(none, "close_s"),
        "close.saved": paired(of(none, "close_s"), of(pre, "close_s"), lambda a, b: a - b),
        "resident.prefetch": of(pre, "resident_s"), "resident.none": of(none, "resident_s"),
        "before_restoring": of(pre + none, "before_restoring_s"),
        "prefetch.cached_before": [float(c["prefetch"].get("cached_before", 0.0)) for c in pre],
        "prefetch.cached_after": [float(c["prefetch"]["cached_after"]) for c in pre
                                  if c["prefetch"].get("cached_after") is not None],
        "prefetch.took": [float(c["prefetch"]["took_s"]) for c in pre if "took_s" in c["prefetch"]],
        "prefetch.read_gb": [c["prefetch"].get("read_bytes", 0) / 1e9 for c in pre],
        "cold_read_gb_per_s": [r / 1e9 for r in result["cold_read_bytes_per_s"]],
    }
    return {k: spread(values) for k, values in series.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the restore benchmark."""
    cli = parser("restore_bench", __doc__, cycles_of="a close with the prefetch and one without")
    add_world_options(cli)
    cli.add_argument("--stop-delay", type=float, default=0.0, metavar="SECONDS",
                     help="seconds the simulated engine takes to exit on SIGTERM, holding its VRAM (default 0)")
    args = cli.parse_args(argv)
    result = measured("restore_bench", run, args.cycles, args.lag, args.stop_delay, args.boot_delay)
    if result is None:
        return 1
    stats = analyse(result)
    rows = [spread_row(label, stats[key]) for key, label in (
        ("restoring.prefetch", "RESTORING, prefetch (s)"), ("restoring.none", "RESTORING, no prefetch (s)"),
        ("restoring.ratio", "no prefetch / prefetch, per cycle (x)"),
        ("restoring.saved", "no prefetch - prefetch, per cycle (s)"),
        ("resident.prefetch", "the resident's start to verified, prefetch (s)"),
        ("resident.none", "the resident's start to verified, no prefetch (s)"),
        ("close.prefetch", "close: release → window_finished, prefetch (s)"),
        ("close.none", "close: release → window_finished, no prefetch (s)"),
        ("close.saved", "close saved, per cycle (s)"),
        ("before_restoring", "CLOSING + WAITING_VRAM: the prefetch's head start (s)"),
        ("prefetch.took", "the prefetch's read (s)"), ("prefetch.read_gb", "the prefetch read (GB)"),
        ("prefetch.cached_before", "cached before the prefetch (fraction)"),
        ("prefetch.cached_after", "cached after the prefetch (fraction)"),
        ("cold_read_gb_per_s", "this machine's cold read of the model (GB/s)"))]
    k = result["constants"]
    print(table(f"\nRESTORING with and without the prefetch, {args.cycles} cycles, variants alternating; "
                f"model {k['model_bytes'] / 1e9:.2f} GB", SPREAD_HEADER, rows))
    print(f"\nby construction: VRAM release lag {k['release_lag_s']}s; the engine's stop {k['stop_delay_s']}s; "
          f"cold read of the model {figure(stats['cold_read_gb_per_s'], ' GB/s')}")
    if result.get("ooms"):
        print(f"WARNING: CUDA out-of-memory recorded by the ledger: {result['ooms']}")
    print(f"\nresults: {write_results('restore', {**result, 'stats': stats})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
