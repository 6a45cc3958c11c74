"""simulation_bench runs: one short cycle of a handful of seeds, in worker processes (its smoke run).

It asserts only that the benchmark completes and prints its figures, as the other benchmarks'
smoke runs do (tests/integration/test_benchmarks.py, which also checks its --help); the figures
come from full runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The simulation runs the daemon itself (pydbus and the rest); makepkg's check() on a bare system
# Python has none of them, as test_simulation.py says.
pytest.importorskip("gpuswapd.daemon", exc_type=ImportError)

REPO = Path(__file__).resolve().parents[2]


def test_the_simulation_benchmark_runs_one_cycle_and_prints_its_figures(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tests.benchmarks.simulation_bench", "--cycles", "1",
                          "--seeds", "4", "--events", "20", "--jobs", "1"], cwd=REPO,
                         env={**os.environ, "GPUSWAPD_BENCH_DIR": str(tmp_path)}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for text in ("1 cycles of 4 histories of 20 events, 1 worker process(es)", "histories per second",
                 "virtual hours simulated per cycle", "4 histories of 20 events in", "invariants violated: 0"):
        assert text in out.stdout, (text, out.stdout[-3000:])
    [path] = tmp_path.glob("simulation-*.json")
    assert f"results: {path}" in out.stdout
    result = json.loads(path.read_text())
    assert result["meta"]["cpus"] == os.cpu_count()
    assert [c["histories"] for c in result["cycles"]] == [4]
