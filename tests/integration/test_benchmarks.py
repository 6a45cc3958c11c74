"""Every benchmark of tests/benchmarks/ runs: one short cycle each, on the test world.

A benchmark that cannot run is found here, not when someone needs its figure. These runs assert
only that each completes and prints its figures (one cycle, short delays: the figures are not
read); the figures themselves come from full runs (README, "Measured").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack.world import REPO, Stack

pytestmark = pytest.mark.stack

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
}
RESULTS = {"swap_bench": "swap", "park_bench": "park", "switch_bench": "switch_bench", "lease_bench": "lease",
           "metrics_bench": "metrics", "restore_bench": "restore"}


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_the_benchmark_runs_one_cycle_and_prints_its_figures(name: str, world: Stack, tmp_path: Path) -> None:
    args, shown = SMOKE[name]
    out = subprocess.run([sys.executable, "-m", f"tests.benchmarks.{name}", "--cycles", "1", *args], cwd=REPO,
                         env={**os.environ, "GPUSWAPD_BENCH_DIR": str(tmp_path)}, capture_output=True, text=True,
                         timeout=420)  # restore_bench writes its 2.27 GB model once
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for text in shown:
        assert text in out.stdout, (text, out.stdout[-3000:])
    [path] = tmp_path.glob(f"{RESULTS[name]}-*.json")
    assert f"results: {path}" in out.stdout
    assert json.loads(path.read_text())["meta"]["cpus"] == os.cpu_count()
    world.wait_baseline()  # and the world is left as it was found


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_the_benchmarks_help_names_what_bounds_it(name: str) -> None:
    out = subprocess.run([sys.executable, "-m", f"tests.benchmarks.{name}", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "What bounds the result" in out.stdout
    assert "--cycles" in out.stdout and "(default 10)" in out.stdout
