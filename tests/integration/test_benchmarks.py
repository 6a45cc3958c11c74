"""Every benchmark of tests/benchmarks/ runs: one short cycle each, on the test world or without it.

A benchmark that cannot run is found here, not when someone needs its figure. These runs assert
only that each completes and prints its figures (one cycle, short delays: the figures are not
read); the figures themselves come from full runs (docs/measured.md). The benchmarks of SMOKE
need the test world; those of WORLDLESS start what they measure themselves and run outside the
world's group (on the other xdist worker); simulation_bench's smoke run is in the fast layer
(tests/unit/test_simulation_bench.py). Every benchmark's --help is checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack.world import REPO, Stack

# Each benchmark with one cycle and its delays short, and what its output must show.
SMOKE = {
    "swap_bench": (["--lag", "0.1", "--boot-delay", "0.2"],
                   ["GPU swap, 1 cycles", "overhead = gpuswapd - direct", "naive / gpuswapd", "where the time goes"]),
    "park_bench": (["--lag", "0.1", "--boot-delay", "0.2"],
                   ["re-open from park against cold, 1 cycles", "cold / warm, per cycle", "warm open overhead"]),
    "switch_bench": (["--lag", "0.1", "--boot-delay", "0.2"],
                     ["direct switch against closing to the resident, 1 cycles", "the direct switch saves"]),
    "lease_bench": (["--seconds", "0.3", "--slice", "1", "--flood", "200"],
                    ["join/100 p99_ms", "status_under_flood", "status_during_flood max_ms", "watch_interval 10s",
                     "targets"]),
    "metrics_bench": (["--scrape-every", "1"], ["metrics on, scraped every 1s", "one scrape:", "targets"]),
    "restore_bench": (["--lag", "0.1", "--boot-delay", "0.2", "--stop-delay", "0.5"],
                      ["RESTORING with and without the prefetch, 1 cycles", "no prefetch / prefetch, per cycle",
                       "cold read of the model", "cached after the prefetch"]),
    "soak_bench": (["--policies", "new", "--minutes", "0.3", "--every", "5-8", "--lag", "0.1", "--boot-delay", "0.2"],
                   ["soak, new:", "cut by a gateway kill", "after both daemons stopped: resident and timers back"]),
    "warm_bench": (["--lag", "0.1", "--boot-delay", "0.2", "--words", "600"],
                   ["An agent's turn after a window, slots kept and not, 1 cycles", "kept after / before, per cycle",
                    "llama-server's save (MiB/s)", "the seed's agent: 29000 tokens"]),
}
# Benchmarks that need no test world: they start the engine simulator (and a stand-in gpuswapd) themselves.
WORLDLESS = {
    "gateway_bench": (["--requests", "20", "--tokens", "60", "--streams", "10"],
                      ["gpuswapd-gateway (uvicorn) against direct, 1 cycles a phase", "added p50, per cycle",
                       "tokens/s, gateway / direct, per cycle", "just after the streams",
                       "concurrent streams, uvicorn: 10 of 10 complete", "hypercorn: added p50", "targets",
                       "a small multipart form", "one Anthropic Messages stream"]),
    "schedule_bench": (["--minutes", "0.2", "--boot", "1", "--back", "0.5", "--hold", "30"],
                       ["== agent ==", "== alternate ==", "== burst ==", "wait_p99"]),
    "gateway_flood_bench": (["--requests", "20", "--slowloris", "50", "--huge", "2", "--huge-mib", "1",
                             "--bodies", "8", "--body-mib", "1"],
                            ["quiet and under 50 slowloris connections", "flooded / quiet p50, per cycle",
                             "8 bodies of 1 MiB at once", "gateway cgroup peak", "targets"]),
}
# Benchmarks whose smoke run is in the fast layer, and where.
FAST = {"simulation_bench": Path(__file__).parents[1] / "unit" / "test_simulation_bench.py"}
RESULTS = {"swap_bench": "swap", "park_bench": "park", "switch_bench": "switch_bench", "lease_bench": "lease",
           "metrics_bench": "metrics", "gateway_bench": "gateway", "restore_bench": "restore",
           "schedule_bench": "schedule", "soak_bench": "soak",
           "warm_bench": "warm", "gateway_flood_bench": "gateway_flood"}
EVERY = sorted({*SMOKE, *WORLDLESS, *FAST})


def smoke(name: str, args: list[str], shown: list[str], results: Path) -> None:
    """Run one cycle of a benchmark; check that it printed its figures and wrote its results."""
    out = subprocess.run([sys.executable, "-m", f"tests.benchmarks.{name}", "--cycles", "1", *args], cwd=REPO,
                         env={**os.environ, "GPUSWAPD_BENCH_DIR": str(results)}, capture_output=True, text=True,
                         timeout=420)  # restore_bench writes its 2.27 GB model once
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for text in shown:
        assert text in out.stdout, (text, out.stdout[-3000:])
    [path] = results.glob(f"{RESULTS[name]}-*.json")
    assert f"results: {path}" in out.stdout
    assert json.loads(path.read_text())["meta"]["cpus"] == os.cpu_count()


@pytest.mark.stack
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_the_benchmark_runs_one_cycle_and_prints_its_figures(name: str, world: Stack, tmp_path: Path) -> None:
    args, shown = SMOKE[name]
    smoke(name, args, shown, tmp_path)
    world.wait_baseline()  # and the world is left as it was found


@pytest.mark.parametrize("name", sorted(WORLDLESS))
def test_the_benchmark_without_the_world_runs_one_cycle_and_prints_its_figures(name: str, tmp_path: Path) -> None:
    args, shown = WORLDLESS[name]
    smoke(name, args, shown, tmp_path)


def test_every_benchmark_has_a_smoke_run() -> None:
    benchmarks = sorted(p.stem for p in (REPO / "tests" / "benchmarks").glob("*_bench.py"))
    assert benchmarks == EVERY, "a benchmark without a smoke run (add it to SMOKE, WORLDLESS or FAST)"
    for name, test in FAST.items():
        assert f"tests.benchmarks.{name}" in test.read_text(), f"{test} does not run {name}"


@pytest.mark.parametrize("name", EVERY)
def test_the_benchmarks_help_names_what_bounds_it(name: str) -> None:
    out = subprocess.run([sys.executable, "-m", f"tests.benchmarks.{name}", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "What bounds the result" in out.stdout
    assert "--cycles" in out.stdout and "(default 10)" in out.stdout
