"""Wait until the GPU really has the memory free: the driver releases VRAM after a process exits."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gpuswapd import clock
from gpuswapd.adapters.gpu import GpuProbe, VramReading
from gpuswapd.errors import GpuswapError, VramTimeout
from gpuswapd.logs import log
from gpuswapd.outside import Outside
from gpuswapd.sizes import format_size

# The driver's release usually lands within 0.5-1.5 s of the exit (Ollama's measure): poll tightly
# through that, then as Ollama does, every 250 ms (a read itself takes time: nvidia-smi ~30-60 ms).
POLL_S = 0.02
TIGHT_S = 1.5
POLL_SLOW_S = 0.25
UNLESS_EVERY_S = 1.0  # how often a wait asks whether it is still needed (a D-Bus read, say)

# Why a wait for memory may end early, and how to tell: (what to log, an async question).
Unless = tuple[str, Callable[[], Awaitable[bool]]]


class UnitNamer(Protocol):
    """Names the systemd unit of a process."""

    def unit_of_pid(self, pid: int) -> str | None:
        """Name the unit of ``pid``; None only when it is gone (every live process is in some unit)."""


class Vram:
    """Reads free VRAM and waits for enough of it."""

    def __init__(self, probe: GpuProbe | None, units: UnitNamer, outside: Outside) -> None:
        self.probe = probe
        self._units = units
        self.outside = outside
        self.last: VramReading | None = None  # the last reading, whoever asked for it

    async def read(self, processes: bool = True) -> VramReading | None:
        """Read the GPU's memory now; None when probing is off."""
        if self.probe is None:
            return None
        self.last = await self.outside.gpu.call("read", self.probe.read, processes)
        return self.last

    async def unit_of(self, pid: int) -> str | None:
        """Name the unit of a process that holds VRAM (None if unknown or systemd does not say)."""
        try:
            return await self.unit_of_strictly(pid)
        except GpuswapError:
            return None

    async def unit_of_strictly(self, pid: int) -> str | None:
        """Name the unit of a process (None: it has none); raise when systemd cannot say."""
        return await self.outside.systemd.call("unit_of_pid", self._units.unit_of_pid, pid)

    async def wait_free(self, need: int, timeout: float, unless: Unless | None = None) -> float:
        """Wait until ``need`` bytes are free; return the seconds waited.

        ``unless``: a reason the wait is no longer needed, and how to tell, asked every
        ``UNLESS_EVERY_S`` while it waits: when it says so, the wait ends there (``vram_wait_ended``).
        """
        started = clock.monotonic()
        asked = started
        reading = await self.read(processes=False)
        while reading is not None and reading.free_bytes < need:
            if clock.monotonic() - started >= timeout:
                # Only now ask who holds it: listing processes costs a second query per poll.
                raise VramTimeout(await self.describe_shortfall(await self.read() or reading, need, timeout))
            if unless is not None and clock.monotonic() - asked >= UNLESS_EVERY_S:
                asked = clock.monotonic()
                if await unless[1]():
                    took = clock.monotonic() - started
                    log.info("vram_wait_ended", why=unless[0], free=format_size(reading.free_bytes),
                             need=format_size(need), took_s=round(took, 3))
                    return took
            await asyncio.sleep(POLL_S if clock.monotonic() - started < TIGHT_S else POLL_SLOW_S)
            reading = await self.read(processes=False)
        took = clock.monotonic() - started
        if reading is not None:
            log.info("vram_free", free=format_size(reading.free_bytes), need=format_size(need), took_s=round(took, 3))
        return took

    async def describe_shortfall(self, reading: VramReading, need: int, waited: float) -> str:
        """Say who holds the VRAM that is missing, by process and unit."""
        holders = []
        for proc in sorted(reading.processes, key=lambda p: -p.used_bytes):
            holders.append(Holder(proc.pid, proc.used_bytes, await self.unit_of(proc.pid)).describe())
        held = "; ".join(holders) if holders else "no process listed (a process that just exited, or another container)"
        return (f"VRAM still held after {waited:g}s: {format_size(reading.used_bytes)} used, "
                f"{format_size(reading.free_bytes)} free, {format_size(need)} needed; held: {held}")


@dataclass(frozen=True)
class Holder:
    """A process holding VRAM, and the unit it belongs to."""

    pid: int
    used_bytes: int
    unit: str | None

    def describe(self) -> str:
        """Say it for a person: size, pid, unit."""
        return f"{format_size(self.used_bytes)} by pid {self.pid}" + (f" ({self.unit})" if self.unit else "")


@dataclass(frozen=True)
class Fit:
    """What the card would have free once the window has stopped the units it stops.

    Memory of gpuswapd's own engines that are being taken down (``ours``) comes free too, however
    long the driver still lists it: only the others' processes stay.
    """

    total_bytes: int
    free_bytes: int
    freed_bytes: int  # held by processes of the units the window stops, or of gpuswapd's engines going
    others: tuple[Holder, ...]  # everyone else's processes
    unknown: tuple[Holder, ...] = ()  # whose unit systemd could not say: never blamed

    @property
    def held_by_others(self) -> int:
        """Sum what processes outside the stopped units hold."""
        return sum(h.used_bytes for h in self.others)

    @property
    def free_after_stop(self) -> int:
        """Predict the free memory once the units have stopped."""
        return self.free_bytes + self.freed_bytes

    def fits(self, need: int) -> bool:
        """Tell whether ``need`` can come free at all: what others hold stays held."""
        return self.total_bytes - self.held_by_others >= need

    def misfit(self, need: int, units: list[str]) -> str:
        """Explain why ``need`` cannot fit, naming the processes in the way."""
        stopping = ", ".join(units) or "no units"
        held = "; ".join(h.describe() for h in sorted(self.others, key=lambda h: -h.used_bytes))
        return (f"the window cannot fit: it needs {format_size(need)} of the card's {format_size(self.total_bytes)}, "
                f"but processes outside the units it stops ({stopping}) hold {format_size(self.held_by_others)}: "
                f"{held}; stop them, or lower gpu.window_needs")


async def predict_fit(vram: Vram, reading: VramReading, units: list[str], ours: frozenset[int] = frozenset(),
                      stays: dict[int, str] | None = None) -> Fit:
    """Split the card's users into what comes free (the units the window stops, ``ours``) and everyone else.

    ``stays``: pids known to keep their memory (a parked engine the window would run beside), by
    what they are: counted as held without asking systemd whose they are.
    """
    freed, others, unknown = 0, [], []
    for proc in reading.processes:
        if proc.pid in ours:
            freed += proc.used_bytes
            continue
        if stays and proc.pid in stays:
            others.append(Holder(proc.pid, proc.used_bytes, stays[proc.pid]))
            continue
        try:
            unit = await vram.unit_of_strictly(proc.pid)
        except GpuswapError:
            unknown.append(Holder(proc.pid, proc.used_bytes, None))
            continue
        # A process in no unit at all has exited: the driver lists it until its memory is free.
        if unit is None or unit in units:
            freed += proc.used_bytes
        else:
            others.append(Holder(proc.pid, proc.used_bytes, unit))
    return Fit(reading.total_bytes, reading.free_bytes, freed, tuple(others), tuple(unknown))
