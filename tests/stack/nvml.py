"""Run gpuswapd with NVML answered from the test world's VRAM ledger: the probe path of a real card.

gpuswapd's own ``NvmlProbe`` and pynvml's API run as they would on a card; only the four pynvml
calls it makes are answered in-process from the ledger (``ledger.snapshot``: a locked read of one
small JSON file and /proc/locks, about a millisecond, as libnvidia-ml answers), where the
world's ``nvidia-smi`` is a Python script that takes about 60 ms a read. The configuration must
say ``[gpu] probe = "nvml"``.

    python -m tests.stack.nvml --config FILE ...   (gpuswapd's arguments; $GPUSIM_DIR names the ledger)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

from tests.stack.standins import ledger


def install(directory: str) -> None:
    """Answer pynvml's init, device handle, memory and compute process calls from the ledger in ``directory``."""

    def init() -> None:
        ledger.snapshot(directory)  # no ledger: as a driver that cannot be reached
        return None

    def handle(index: int) -> int:
        return index

    def memory(card: int) -> Any:
        snap = ledger.snapshot(directory, card)
        return SimpleNamespace(total=snap["total_bytes"], used=snap["used_bytes"], free=snap["free_bytes"])

    def processes(card: int) -> list[Any]:
        # As nvidia-smi: the live holders whose pid is visible here (memory being freed is not listed).
        return [SimpleNamespace(pid=h["pid"], usedGpuMemory=h["bytes"])
                for h in ledger.snapshot(directory, card)["holders"] if h["pid"] and h["dead_at"] is None]

    pynvml.nvmlInit = init
    pynvml.nvmlDeviceGetHandleByIndex = handle
    pynvml.nvmlDeviceGetMemoryInfo = memory
    pynvml.nvmlDeviceGetComputeRunningProcesses = processes


# How RunningDaemon runs gpuswapd through this module (it takes gpuswapd's arguments after these).
PROGRAM = [sys.executable, "-m", "tests.stack.nvml"]
ENV = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def main() -> int:
    """Install the stand-in, then run gpuswapd with the arguments given."""
    install(os.environ[ledger.ENV_DIR])
    from gpuswapd.daemon import main as daemon_main

    return daemon_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
