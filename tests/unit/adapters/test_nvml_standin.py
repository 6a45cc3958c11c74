"""The NVML stand-in of the test world (tests/stack/nvml.py): gpuswapd's real NVML probe reads the ledger."""

from __future__ import annotations

import os
from pathlib import Path

import pynvml
import pytest

from gpuswapd.adapters.gpu import NvmlProbe, _Nvml
from tests.stack import nvml
from tests.stack.standins import ledger

GiB = 1 << 30


def test_the_nvml_probe_reads_the_ledger_as_nvidia_smi_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nvmlInit", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMemoryInfo",
                 "nvmlDeviceGetComputeRunningProcesses"):
        monkeypatch.setattr(pynvml, name, getattr(pynvml, name))  # put back afterwards
    monkeypatch.setattr(_Nvml, "_ready", False)
    ledger.init(tmp_path, 24 * GiB, 0.5)
    fd = ledger.claim(tmp_path, "strata", 21 * GiB)
    nvml.install(str(tmp_path))
    reading = NvmlProbe(0).read()
    assert (reading.total_bytes, reading.used_bytes, reading.free_bytes) == (24 * GiB, 21 * GiB, 3 * GiB)
    assert [(p.pid, p.used_bytes) for p in reading.processes] == [(os.getpid(), 21 * GiB)]
    os.close(fd)  # the holder exits: its memory stays used for the lag, and is no longer listed
    lagging = NvmlProbe(0).read()
    assert lagging.used_bytes == 21 * GiB and lagging.processes == ()
