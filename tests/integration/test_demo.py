"""The README's demo runs a full window cycle on the test world."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.conftest import assert_resident_back
from tests.stack.probe import Probe
from tests.stack.world import REPO, Stack


def test_the_demo_runs_a_full_cycle(world: Stack, probe: Probe) -> None:
    out = subprocess.run([sys.executable, "-m", "tests.stack.demo", "--keep-world"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for step in ("gpuswapctl plan", "gpuswapctl acquire", "READY", "gpuswapctl release", "RESTORING",
                 "full cycle done"):
        assert step in out.stdout + out.stderr, step
    assert_resident_back(probe)
    history = [line for line in out.stdout.splitlines() if line.startswith("last window:")]
    assert history and "closed" in history[0]
