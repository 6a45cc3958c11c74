"""Wait until the GPU really has the memory free: the driver releases VRAM after a process exits."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from gpuswapd.adapters.gpu import GpuProbe, VramReading
from gpuswapd.blocking import blocking
from gpuswapd.errors import VramTimeout
from gpuswapd.logs import log
from gpuswapd.sizes import format_size

POLL_S = 0.02  # a read itself takes time (nvidia-smi ~30-60 ms): poll tightly


class UnitNamer(Protocol):
    """Names the systemd unit of a process."""

    def unit_of_pid(self, pid: int) -> str | None:
        """Name the unit of ``pid``, if any."""


class Vram:
    """Reads free VRAM and waits for enough of it."""

    def __init__(self, probe: GpuProbe | None, units: UnitNamer) -> None:
        self.probe = probe
        self._units = units

    async def read(self, processes: bool = True) -> VramReading | None:
        """Read the GPU's memory now; None when probing is off."""
        if self.probe is None:
            return None
        return await blocking(self.probe.read, processes)

    async def wait_free(self, need: int, timeout: float) -> float:
        """Wait until ``need`` bytes are free; return the seconds waited."""
        started = time.monotonic()
        reading = await self.read(processes=False)
        while reading is not None and reading.free_bytes < need:
            if time.monotonic() - started >= timeout:
                # Only now ask who holds it: listing processes costs a second query per poll.
                raise VramTimeout(await self.describe_shortfall(await self.read() or reading, need, timeout))
            await asyncio.sleep(POLL_S)
            reading = await self.read(processes=False)
        took = time.monotonic() - started
        if reading is not None:
            log.info("vram_free", free=format_size(reading.free_bytes), need=format_size(need), took_s=round(took, 3))
        return took

    async def describe_shortfall(self, reading: VramReading, need: int, waited: float) -> str:
        """Say who holds the VRAM that is missing, by process and unit."""
        holders = []
        for proc in sorted(reading.processes, key=lambda p: -p.used_bytes):
            unit = await blocking(self._units.unit_of_pid, proc.pid)
            holders.append(f"{format_size(proc.used_bytes)} by pid {proc.pid}" + (f" ({unit})" if unit else ""))
        held = "; ".join(holders) if holders else "no process listed (a process that just exited, or another container)"
        return (f"VRAM still held after {waited:g}s: {format_size(reading.used_bytes)} used, "
                f"{format_size(reading.free_bytes)} free, {format_size(need)} needed; held: {held}")
