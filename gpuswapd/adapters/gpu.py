"""The GPU's memory, read through NVML (``nvidia-ml-py``) or the ``nvidia-smi`` command.

Both probes are synchronous and thread-safe: the asyncio core calls ``read`` from a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from gpuswapd import clock
from gpuswapd.config import GpuConfig
from gpuswapd.errors import GpuProbeError

_MiB = 1 << 20
_OTHER_PROBES = 'set [gpu] probe = "nvidia-smi" (or "none" to skip VRAM checks)'
_NO_PROBE = 'set [gpu] probe = "none" to skip VRAM checks'
# nvidia-smi prints these (in brackets) where a value is unknown, e.g. used_memory in a container.
_UNKNOWN = ("[N/A]", "[Not Supported]", "[Insufficient Permissions]", "[Unknown Error]")


@dataclass(frozen=True)
class GpuProcess:
    """A process that holds GPU memory."""

    pid: int
    used_bytes: int  # 0 when the driver does not say


@dataclass(frozen=True)
class VramReading:
    """The GPU's memory at one moment, and who holds it."""

    total_bytes: int
    used_bytes: int
    free_bytes: int
    processes: tuple[GpuProcess, ...]


class GpuProbe(Protocol):
    """Something that reads the GPU's memory."""

    def read(self, processes: bool = True) -> VramReading:
        """Read the GPU's memory now (and which processes hold it, unless told not to)."""
        ...


class _Nvml:
    """NVML, initialised once per process on first use."""

    _lock = threading.Lock()
    _ready = False

    @classmethod
    def init(cls) -> None:
        """Initialise NVML unless it already is (a failure is retried by the next call)."""
        with cls._lock:
            if not cls._ready:
                pynvml.nvmlInit()
                cls._ready = True


class NvmlProbe:
    """Read one GPU's memory through NVML."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._lock = threading.Lock()
        self._handle: Any = None

    def read(self, processes: bool = True) -> VramReading:
        """Read total/used/free memory and (unless told not to) the compute processes of the GPU."""
        try:
            handle = self._device()
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if processes else []
        except pynvml.NVMLError as err:
            with self._lock:
                self._handle = None  # a lost or reset GPU gets a fresh handle next time
            raise GpuProbeError(
                f"cannot read GPU {self.index} through NVML: {err}: is the NVIDIA driver loaded "
                f"(`nvidia-smi`)? Otherwise {_OTHER_PROBES}"
            ) from err
        return VramReading(
            total_bytes=int(memory.total),
            used_bytes=int(memory.used),
            free_bytes=int(memory.free),
            processes=tuple(GpuProcess(int(p.pid), int(p.usedGpuMemory or 0)) for p in running),
        )

    def _device(self) -> Any:
        with self._lock:
            if self._handle is None:
                _Nvml.init()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            return self._handle


class SmiProbe:
    """Read one GPU's memory by running ``nvidia-smi``."""

    def __init__(self, index: int, binary: str = "nvidia-smi", timeout: float = 10.0) -> None:
        self.index = index
        self.binary = binary
        self.timeout = timeout

    def read(self, processes: bool = True) -> VramReading:
        """Read total/used/free memory and (unless told not to) the compute processes of the GPU."""
        memory_query = "--query-gpu=memory.used,memory.total,memory.free"
        apps_query = "--query-compute-apps=pid,used_memory"
        # nvidia-smi answers one kind of query per run: the two run side by side, not one after the other.
        memory_proc = self._start(memory_query)
        try:
            apps_proc = self._start(apps_query) if processes else None
        except GpuProbeError:
            _kill_group(memory_proc)
            raise
        deadline = clock.monotonic() + self.timeout
        try:
            memory = self._finish(memory_proc, memory_query, deadline)
            apps = self._finish(apps_proc, apps_query, deadline) if apps_proc is not None else ""
        finally:
            for proc in (memory_proc, apps_proc):
                if proc is not None and proc.poll() is None:
                    _kill_group(proc)
        used, total, free = _memory_row(memory, self._describe(memory_query))
        return VramReading(
            total_bytes=total * _MiB,
            used_bytes=used * _MiB,
            free_bytes=free * _MiB,
            processes=_processes(apps, self._describe(apps_query)) if processes else (),
        )

    def _describe(self, query: str) -> str:
        return f"`{self.binary} -i {self.index} {query}`"

    def _start(self, query: str) -> subprocess.Popen[str]:
        """Start one query; failing to start it is a GpuProbeError."""
        argv = [self.binary, "-i", str(self.index), query, "--format=csv,noheader,nounits"]
        try:
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, errors="replace", start_new_session=True,
            )
        except FileNotFoundError as err:
            raise GpuProbeError(
                f"cannot run {self.binary!r}: not found; install the NVIDIA driver utilities, "
                f"set [gpu] nvidia_smi to its path, or {_NO_PROBE}"
            ) from err
        except OSError as err:
            raise GpuProbeError(f"cannot run {self.binary!r}: {err}; {_NO_PROBE}") from err

    def _finish(self, proc: subprocess.Popen[str], query: str, deadline: float) -> str:
        """Wait for one query until ``deadline`` and return its output; any failure is a GpuProbeError."""
        what = self._describe(query)
        try:
            out, err_text = proc.communicate(timeout=max(0.0, deadline - clock.monotonic()))
        except subprocess.TimeoutExpired as err:
            _kill_group(proc)
            raise GpuProbeError(
                f"{what} did not answer within {self.timeout:g}s: the driver may be hung "
                f"(check `dmesg`); {_NO_PROBE}"
            ) from err
        if proc.returncode != 0:
            # nvidia-smi prints its errors on stdout, other failures land on stderr.
            said = " ".join((err_text + " " + out).split()).rstrip(".") or "no output"
            raise GpuProbeError(
                f"{what} failed (exit {proc.returncode}): {said}; is the NVIDIA driver loaded? "
                f"Otherwise {_NO_PROBE}"
            )
        return out


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the timed-out command and anything it started, then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    # A command stuck in the driver (state D) outlives SIGKILL: don't block the worker on it.
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=1.0)


def _memory_row(out: str, what: str) -> tuple[int, int, int]:
    """Parse ``used, total, free`` (MiB) from a ``--query-gpu`` answer."""
    lines = [ln for ln in out.splitlines() if ln.strip()]
    cells = [c.strip() for c in lines[0].split(",")] if len(lines) == 1 else []
    if len(cells) != 3 or not all(c.isdigit() for c in cells):
        raise GpuProbeError(f"{what} printed something unreadable: {_clip(out)!r}")
    used, total, free = (int(c) for c in cells)
    return used, total, free


def _processes(out: str, what: str) -> tuple[GpuProcess, ...]:
    """Parse ``pid, used_memory`` rows (MiB) from a ``--query-compute-apps`` answer."""
    found = []
    for line in out.splitlines():
        if not line.strip() or line.strip() == "No running processes found":
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 2 or not cells[0].isdigit():
            raise GpuProbeError(f"{what} printed something unreadable: {_clip(line)!r}")
        used = 0 if cells[1] in _UNKNOWN else _mib(cells[1], line, what)
        found.append(GpuProcess(pid=int(cells[0]), used_bytes=used))
    return tuple(found)


def _mib(cell: str, line: str, what: str) -> int:
    if not cell.isdigit():
        raise GpuProbeError(f"{what} printed something unreadable: {_clip(line)!r}")
    return int(cell) * _MiB


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def make_probe(config: GpuConfig) -> GpuProbe | None:
    """Make the probe ``[gpu] probe`` names; None for "none"."""
    if config.probe == "nvml":
        return NvmlProbe(config.index)
    if config.probe == "nvidia-smi":
        return SmiProbe(config.index, config.nvidia_smi, config.probe_timeout)
    return None
